"""A byte-level BPE tokenizer (HF `tokenizers`) trained on the corpus, with the DSV4 chat
special tokens as single ids first, in `chat.SPECIAL_TOKENS` order: BOS = 0, EOS = 1
(the model config's bos/eos ids), <｜User｜> = 2, <｜Assistant｜> = 3, ...
Any text round-trips (byte-level: every byte has a token)."""
from __future__ import annotations

from dsv4_jax import chat


def train_tokenizer(texts, vocab_size: int):
    """-> tokenizers.Tokenizer with at most vocab_size tokens (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    n_special = len(chat.SPECIAL_TOKENS)
    if vocab_size < n_special + 256:
        raise ValueError(f"--vocab-size must be at least {n_special + 256} (the special "
                         f"tokens and the 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(chat.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    for i, s in enumerate(chat.SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok
