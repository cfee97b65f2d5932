"""The training text: the Python standard library's source as shipped with the interpreter
(its .py files: code, comments and docstrings), read offline and reproducibly.

Source and licence: CPython's `Lib/` directory, under the Python Software Foundation
License (PSF-2.0, a permissive, GPL-compatible licence); the interpreter's own copy of the
licence (`<stdlib>/LICENSE.txt`) is copied next to the manifest.

`prepare(out, ...)` writes into `out`:
  manifest.json        source, licence, interpreter version, every file with its size,
                       sha256 and split, the sha256 of the whole corpus
  LICENSE.txt          the stdlib's licence text, verbatim (when the install has it)
  tokenizer.json       byte-level BPE with the DSV4 chat special tokens (training/tokenizer.py)
  train.npy, heldout.npy   uint16 token streams: per file BOS + tokens + EOS
The file list is sorted by relative path; a file's split is fixed by a hash of its path,
so it does not move when other files come or go.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sysconfig
from pathlib import Path

import numpy as np

LICENCE = "PSF-2.0 (Python Software Foundation License Version 2)"
SOURCE = "CPython standard library source (.py files under sysconfig stdlib)"
HELDOUT_PER_MILLE = 50  # 5% of files (~100 of the stdlib's ~1700), chosen by path hash
MAX_FILE_BYTES = 1 << 20  # a few generated tables are larger; they teach nothing
MANIFEST = "manifest.json"
TEST_DIRS = ("test", "tests", "idle_test")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, include_tests: bool = True) -> list[str]:
    """Relative POSIX paths of the corpus' .py files, sorted: site-packages, caches and
    (unless include_tests) test directories are left out."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"--stdlib {root}: not a directory")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")
                       and (include_tests or d not in TEST_DIRS)]
        out += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(out)


def split_of(relpath: str, heldout_per_mille: int = HELDOUT_PER_MILLE) -> str:
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "little")
    return "heldout" if h % 1000 < heldout_per_mille else "train"


def read_corpus(root: Path, include_tests: bool = True,
                heldout_per_mille: int = HELDOUT_PER_MILLE) -> tuple[dict, dict[str, list[str]]]:
    """-> (manifest dict, {split: [file texts in manifest order]}). Files that are not UTF-8
    or larger than MAX_FILE_BYTES are listed as skipped (with their reason)."""
    root = Path(root)
    files, skipped = [], []
    texts: dict[str, list[str]] = {"train": [], "heldout": []}
    corpus = hashlib.sha256()
    for rel in list_files(root, include_tests):
        data = (root / rel).read_bytes()
        if len(data) > MAX_FILE_BYTES:
            skipped.append({"path": rel, "reason": f"larger than {MAX_FILE_BYTES} bytes"})
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append({"path": rel, "reason": "not UTF-8"})
            continue
        sha = hashlib.sha256(data).hexdigest()
        split = split_of(rel, heldout_per_mille)
        files.append({"path": rel, "bytes": len(data), "sha256": sha, "split": split})
        corpus.update(f"{rel}\0{sha}\n".encode())
        texts[split].append(text)
    lic = root / "LICENSE.txt"
    manifest = {
        "source": SOURCE,
        "licence": LICENCE,
        "licence_file": "LICENSE.txt" if lic.exists() else None,
        "licence_sha256": hashlib.sha256(lic.read_bytes()).hexdigest() if lic.exists() else None,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "include_tests": include_tests,
        "heldout_rule": f"sha256(path)[:4] as little-endian int % 1000 < {heldout_per_mille}",
        "corpus_sha256": corpus.hexdigest(),  # over "path\0sha256\n" of every file, in order
        "files": files,
        "skipped": skipped,
        "totals": {s: {"files": sum(f["split"] == s for f in files),
                       "bytes": sum(f["bytes"] for f in files if f["split"] == s)}
                   for s in ("train", "heldout")},
    }
    return manifest, texts


def encode_docs(tok, texts: list[str], bos: int, eos: int) -> np.ndarray:
    """Every text as BOS + tokens + EOS, concatenated -> uint16 [n]."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def prepare(out: str | os.PathLike, vocab_size: int, root: str | os.PathLike | None = None,
            include_tests: bool = True, heldout_per_mille: int = HELDOUT_PER_MILLE,
            log=print) -> dict:
    """Corpus manifest + tokenizer + token streams into `out` (see the module docstring).
    -> the manifest dict (with the token counts added)."""
    from . import tokenizer as T
    from dsv4_jax import chat

    root = Path(root) if root is not None else stdlib_dir()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--data {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    manifest, texts = read_corpus(root, include_tests, heldout_per_mille)
    if not texts["train"] or not texts["heldout"]:
        raise ValueError(f"--stdlib {root}: too few .py files for a train and a held-out "
                         f"split ({manifest['totals']})")
    log(f"corpus: {manifest['totals']['train']['files']} train files "
        f"({manifest['totals']['train']['bytes'] / 1e6:.1f} MB), "
        f"{manifest['totals']['heldout']['files']} held out, sha256 "
        f"{manifest['corpus_sha256'][:16]}...")
    tok = T.train_tokenizer(texts["train"], vocab_size)
    tok.save(str(out / "tokenizer.json"))
    bos, eos = tok.token_to_id(chat.BOS), tok.token_to_id(chat.EOS)
    counts = {}
    for split in ("train", "heldout"):
        ids = encode_docs(tok, texts[split], bos, eos)
        np.save(out / f"{split}.npy", ids)
        counts[split] = int(ids.size)
    manifest["tokens"] = counts
    manifest["tokenizer_sha256"] = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    if manifest["licence_file"]:
        shutil.copyfile(root / "LICENSE.txt", out / "LICENSE.txt")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    log(f"tokens: {counts['train']} train, {counts['heldout']} held out "
        f"({manifest['totals']['train']['bytes'] / max(counts['train'], 1):.2f} bytes/token)")
    return manifest


def load_split(data: str | os.PathLike, split: str) -> np.ndarray:
    p = Path(data) / f"{split}.npy"
    if not p.exists():
        raise FileNotFoundError(f"--data {data}: no {split}.npy (run `python -m training "
                                "prepare` first)")
    return np.load(p, mmap_mode="r")


class Batches:
    """Random windows of seq_len + 2 tokens (inputs, next and next-next targets) from a
    token stream, seeded: the same seed gives the same batches."""

    def __init__(self, ids: np.ndarray, batch: int, seq_len: int, seed: int):
        if ids.size < seq_len + 2:
            raise ValueError(f"token stream of {ids.size} tokens is shorter than one window "
                             f"({seq_len + 2})")
        self.ids, self.batch, self.seq_len = ids, batch, seq_len
        self.rng = np.random.default_rng(seed)

    def __next__(self) -> np.ndarray:
        starts = self.rng.integers(0, self.ids.size - self.seq_len - 1, self.batch)
        return np.stack([self.ids[s:s + self.seq_len + 2] for s in starts]).astype(np.int32)

    def __iter__(self):
        return self


def eval_windows(ids: np.ndarray, batch: int, seq_len: int, n_batches: int) -> list[np.ndarray]:
    """Fixed held-out batches: consecutive windows spread evenly over the stream."""
    n = batch * n_batches
    span = ids.size - seq_len - 2
    if span < 0:
        raise ValueError(f"held-out stream of {ids.size} tokens is shorter than one window "
                         f"({seq_len + 2})")
    starts = np.linspace(0, span, n).astype(np.int64)
    w = np.stack([ids[s:s + seq_len + 2] for s in starts]).astype(np.int32)
    return [w[i * batch:(i + 1) * batch] for i in range(n_batches)]
