"""Tokenizers: byte-level fallback and a tokenizer.json trained here with `tokenizers`."""

import random

import pytest

from dsv4_jax import chat
from dsv4_jax import tokenizer as tk

SEED = 47


def rand_unicode(rng, n):
    # Code points from every plane in use (skip surrogates, which are not valid text).
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            cp = rng.randint(0x20, 0x7E)
        elif r < 0.6:
            cp = rng.randint(0x80, 0x7FF)
        elif r < 0.85:
            cp = rng.choice([rng.randint(0x800, 0xD7FF), rng.randint(0xE000, 0xFFFF)])
        else:
            cp = rng.randint(0x10000, 0x10FFFF)
        out.append(chr(cp))
    return "".join(out)


def rand_text_with_specials(rng, n_pieces=12):
    pieces = []
    for _ in range(n_pieces):
        pieces.append(rng.choice(chat.SPECIAL_TOKENS) if rng.random() < 0.3 else rand_unicode(rng, rng.randint(0, 30)))
    return "".join(pieces)


# ---- byte-level fallback -------------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [tk.MIN_BYTE_VOCAB, 1024, 4096, 129280])
def test_byte_round_trip_random_unicode(vocab_size):
    rng = random.Random(SEED)
    tok = tk.load_tokenizer(None, vocab_size)
    assert isinstance(tok, tk.ByteTokenizer) and tok.vocab_size == vocab_size
    for _ in range(50):
        text = rand_text_with_specials(rng)
        ids = tok.encode(text)
        assert all(0 <= i < vocab_size for i in ids)
        assert tok.decode(ids) == text
        # Independent count: one id per special token occurrence plus one per UTF-8 byte of the rest.
        n_special = sum(1 for i in ids if i < tk.NUM_RESERVED)
        rest = text
        for s in sorted(chat.SPECIAL_TOKENS, key=len, reverse=True):
            rest = rest.replace(s, "")
        assert len(ids) - n_special == len(rest.encode("utf-8"))


def test_byte_special_tokens_single_ids():
    tok = tk.load_tokenizer(None, 1024)
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.stop_ids == [tok.eos_id, tok.encode(chat.USER)[0]]
    seen = set()
    for s in chat.SPECIAL_TOKENS:
        ids = tok.encode(s)
        assert len(ids) == 1 and ids[0] == tok.special_ids[s] and ids[0] < tk.NUM_RESERVED
        assert tok.decode(ids) == s
        seen.add(ids[0])
    assert len(seen) == len(chat.SPECIAL_TOKENS)
    # A chat prompt: BOS first, generation prompt last, exact round trip.
    prompt = chat.encode_messages([{"role": "system", "content": "Sé útil 🙂"},
                                   {"role": "user", "content": "你好"}], "thinking")
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id
    assert ids[-2:] == [tok.special_ids[chat.ASSISTANT], tok.special_ids[chat.THINK_START]]
    assert tok.decode(ids) == prompt


def test_byte_decode_any_id_and_errors():
    rng = random.Random(SEED)
    tok = tk.load_tokenizer(None, 1024)
    ids = [rng.randrange(1024) for _ in range(2000)]
    text = tok.decode(ids)  # random model output: must not crash
    assert isinstance(text, str)
    assert tok.decode([tk.MIN_BYTE_VOCAB + 5]) == tk.UNKNOWN_ID_FORMAT.format(tk.MIN_BYTE_VOCAB + 5)
    unused_slot = len(chat.SPECIAL_TOKENS)
    assert tok.decode([unused_slot]) == tk.UNKNOWN_ID_FORMAT.format(unused_slot)
    # A lone continuation byte is invalid UTF-8 -> replacement char, not an exception.
    assert tok.decode([tk.BYTE_OFFSET + 0x80]) == "\ufffd"
    with pytest.raises(ValueError, match="non-negative"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="too small"):
        tk.load_tokenizer(None, tk.MIN_BYTE_VOCAB - 1)
    with pytest.raises(ValueError, match="vocab_size"):
        tk.load_tokenizer(None, 0)


def test_dir_without_tokenizer_json_and_missing_path(tmp_path):
    assert isinstance(tk.load_tokenizer(tmp_path, 1024), tk.ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tk.load_tokenizer(tmp_path / "nope", 1024)


# ---- tokenizer.json through the `tokenizers` library -----------------------------------
def train_bpe(rng, specials, vocab_target=400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [rand_unicode(rng, 60) + " the quick brown fox " + rand_unicode(rng, 20) for _ in range(200)]
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tok")
    tok = train_bpe(random.Random(SEED), chat.SPECIAL_TOKENS)
    tok.save(str(d / "tokenizer.json"))
    return d, tok


def test_hf_tokenizer_loads_and_round_trips(hf_dir):
    d, ref = hf_dir
    n = ref.get_vocab_size(with_added_tokens=True)
    tok = tk.load_tokenizer(d, n + 64)
    assert isinstance(tok, tk.HFTokenizer)
    assert tok.bos_id == ref.token_to_id(chat.BOS) and tok.eos_id == ref.token_to_id(chat.EOS)
    assert tok.stop_ids == [tok.eos_id, ref.token_to_id(chat.USER)]
    for s in chat.SPECIAL_TOKENS:
        assert tok.encode(s) == [ref.token_to_id(s)]
    rng = random.Random(SEED)
    for _ in range(30):
        text = rand_text_with_specials(rng)
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    prompt = chat.encode_messages([{"role": "user", "content": rand_unicode(rng, 20)}], "chat")
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and ids[-1] == ref.token_to_id(chat.THINK_END)
    assert tok.decode(ids) == prompt
    # Ids the tokenizer does not know (model vocab padding) decode to placeholders.
    assert tok.decode([tok.bos_id, n + 3]) == chat.BOS + tk.UNKNOWN_ID_FORMAT.format(n + 3)
    # Also accepts the file path itself.
    assert tk.load_tokenizer(d / "tokenizer.json", n).encode(prompt) == ids


def test_hf_tokenizer_errors(hf_dir, tmp_path):
    d, ref = hf_dir
    n = ref.get_vocab_size(with_added_tokens=True)
    with pytest.raises(ValueError, match="vocab_size"):
        tk.load_tokenizer(d, n - 1)
    no_user = train_bpe(random.Random(SEED), [chat.BOS, chat.EOS, chat.ASSISTANT], vocab_target=300)
    no_user.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="missing chat special tokens"):
        tk.load_tokenizer(tmp_path, 10_000)


def test_source_is_named_and_a_broken_file_is_a_value_error(hf_dir, tmp_path):
    d, ref = hf_dir
    n = ref.get_vocab_size(with_added_tokens=True)
    assert tk.load_tokenizer(d, n).source == str(d / "tokenizer.json")
    assert "byte-level" in tk.load_tokenizer(tmp_path, 1024).source
    junk = tmp_path / "tokenizer.json"
    junk.write_text('{"model": ')
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        tk.load_tokenizer(junk, 10_000)
