"""Tokenizers: the checkpoint's `tokenizer.json` (HF `tokenizers`), or a byte-level fallback.

`load_tokenizer(path, vocab_size)` returns an object with
    encode(text) -> list[int]     never adds BOS; chat prompts already start with chat.BOS
    decode(ids) -> str            special tokens are kept as text (so completions can be parsed)
    bos_id, eos_id, stop_ids, vocab_size, special_ids ({token string: id})
    source                        what it was loaded from (a path, or "byte-level")

Byte-level fallback (synthetic checkpoints without tokenizer.json), ids:
    0 .. 15      reserved for chat.SPECIAL_TOKENS in order (BOS=0, EOS=1, <｜User｜>=2,
                 <｜Assistant｜>=3, <think>=4, </think>=5, ...); unused slots stay empty
    16 .. 271    the 256 UTF-8 byte values (id = 16 + byte)
    272 ..       unused; a model may still sample them
Any text round-trips exactly. Ids with no meaning (empty reserved slots, ids >= 272, or ids a
tokenizer.json does not know) decode to the visible placeholder "<|id=N|>" instead of raising.
Byte runs that are not valid UTF-8 decode with U+FFFD replacement characters.
"""

from __future__ import annotations

import os
import re

from dsv4_jax import chat

NUM_RESERVED = 16
BYTE_OFFSET = NUM_RESERVED
MIN_BYTE_VOCAB = BYTE_OFFSET + 256
UNKNOWN_ID_FORMAT = "<|id={}|>"

# Tokens the model's chat format cannot do without: each must be one id in tokenizer.json.
REQUIRED_SPECIALS = (chat.BOS, chat.EOS, chat.USER, chat.ASSISTANT)

assert len(chat.SPECIAL_TOKENS) <= NUM_RESERVED


def _check_ids(ids) -> list[int]:
    out = []
    for i in ids:
        i = int(i)
        if i < 0:
            raise ValueError(f"token id must be non-negative, got {i}")
        out.append(i)
    return out


class ByteTokenizer:
    """Deterministic byte-level tokenizer with the chat special tokens as single ids."""

    source = "byte-level (built in)"

    def __init__(self, vocab_size: int):
        if vocab_size < MIN_BYTE_VOCAB:
            raise ValueError(
                f"vocab_size {vocab_size} is too small for the byte-level tokenizer: it needs "
                f"{MIN_BYTE_VOCAB} ids ({NUM_RESERVED} reserved special + 256 bytes)")
        self.vocab_size = vocab_size
        self.special_ids = {s: i for i, s in enumerate(chat.SPECIAL_TOKENS)}
        self._id_to_special = {i: s for s, i in self.special_ids.items()}
        # Longest first so that no special token is cut by a shorter one that prefixes it.
        alts = sorted(chat.SPECIAL_TOKENS, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(map(re.escape, alts)) + ")")
        self.bos_id = self.special_ids[chat.BOS]
        self.eos_id = self.special_ids[chat.EOS]
        self.stop_ids = [self.eos_id, self.special_ids[chat.USER]]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids: list[int] = []
        for k, piece in enumerate(self._split_re.split(text)):
            if k % 2:  # odd pieces are the captured special tokens
                ids.append(self.special_ids[piece])
            else:
                ids.extend(BYTE_OFFSET + b for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in _check_ids(ids):
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                buf.append(i - BYTE_OFFSET)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            out.append(self._id_to_special.get(i, UNKNOWN_ID_FORMAT.format(i)))
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """Wraps a `tokenizers.Tokenizer` loaded from a checkpoint's tokenizer.json."""

    def __init__(self, tok, vocab_size: int, source: str = "tokenizer.json"):
        self._tok = tok
        self.vocab_size = vocab_size
        self.source = source
        self.special_ids = {}
        for s in chat.SPECIAL_TOKENS:
            i = tok.token_to_id(s)
            if i is None:
                continue
            enc = tok.encode(s, add_special_tokens=False).ids
            if enc != [i]:
                raise ValueError(f"{source}: special token {s!r} encodes to {enc}, not the single id {i}")
            self.special_ids[s] = i
        missing = [s for s in REQUIRED_SPECIALS if s not in self.special_ids]
        if missing:
            raise ValueError(f"{source}: missing chat special tokens {missing}")
        n_tok = tok.get_vocab_size(with_added_tokens=True)
        too_big = {s: i for s, i in self.special_ids.items() if i >= vocab_size}
        if too_big:
            raise ValueError(f"{source}: special token ids {too_big} >= model vocab_size {vocab_size}")
        if n_tok > vocab_size:
            raise ValueError(f"{source}: tokenizer has {n_tok} tokens but the model vocab_size is {vocab_size}")
        self.bos_id = self.special_ids[chat.BOS]
        self.eos_id = self.special_ids[chat.EOS]
        self.stop_ids = [self.eos_id, self.special_ids[chat.USER]]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        # Decode runs of known ids together (merges bytes/word pieces); unknown ids (e.g. the
        # padding rows of the embedding beyond the tokenizer) become visible placeholders.
        out: list[str] = []
        run: list[int] = []
        for i in _check_ids(ids):
            if self._tok.id_to_token(i) is not None:
                run.append(i)
                continue
            if run:
                out.append(self._tok.decode(run, skip_special_tokens=False))
                run = []
            out.append(UNKNOWN_ID_FORMAT.format(i))
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int):
    """Tokenizer for a checkpoint.

    path: a checkpoint directory, a tokenizer.json file, or None. A directory without
      tokenizer.json (synthetic checkpoints) and None give the ByteTokenizer.
    vocab_size: the model's vocabulary (embedding rows); every id must fit below it.
    """
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if path is None:
        return ByteTokenizer(vocab_size)
    path = os.fspath(path)
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            return ByteTokenizer(vocab_size)
    elif os.path.isfile(path):
        file = path
    else:
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    import tokenizers  # only needed for real checkpoints

    try:
        tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the Rust library raises a bare Exception for a bad file
        raise ValueError(f"{file}: not a tokenizer.json the tokenizers library reads "
                         f"({str(e).strip()[:200]})") from None
    return HFTokenizer(tok, vocab_size, source=file)
