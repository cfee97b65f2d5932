"""The model that ships inside the package: `dsv4-small-stdlib`, a 6.0M-parameter
DeepSeek-V4 (mHC, SWA + CSA + HCA layers, hash and score-routed MoE, the MTP block) trained
by `python -m training all` on the Python standard library's source (docs/TRAINING.md).

It is stored as the official release stores a model (FP8 block-scaled linears, FP4 experts,
e8m0 scales, config.json, tokenizer.json), so it loads through the same path as a real
checkpoint: `dsv4_jax.load(embedded_checkpoint())`. `dsv4 generate`, `dsv4 serve` and the
notebooks use it when no --checkpoint is given; `--preset tiny` is the random-weight model
the tests use.
"""
from __future__ import annotations

from pathlib import Path

EMBEDDED_NAME = "dsv4-small-stdlib"


def embedded_checkpoint() -> Path:
    """The directory of the embedded checkpoint (inside the installed package)."""
    path = Path(__file__).resolve().parent / "models" / EMBEDDED_NAME
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the embedded checkpoint is missing from the install: {path} "
                                "(reinstall dsv4-jax, or pass --checkpoint DIR)")
    return path
