"""Checkpoint errors: one type per failure so callers (and tests) can tell them apart.

Every message names the file and/or tensor at fault.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """Base class of everything the checkpoint tools raise on bad input."""


class CorruptHeaderError(CheckpointError):
    """A safetensors header is unreadable or inconsistent (bad JSON, overlapping offsets,
    byte length that does not match dtype * shape)."""


class TruncatedShardError(CheckpointError):
    """A safetensors file is shorter than its header says (an interrupted download/copy)."""


class IndexMismatchError(CheckpointError):
    """`model.safetensors.index.json` disagrees with the shards on disk."""


class ForeignCheckpointError(CheckpointError):
    """The directory holds some other model (config or tensor names are not DeepSeek-V4)."""


class UnknownKeyError(CheckpointError):
    """A tensor name that the parameter description does not account for."""


class MissingKeyError(CheckpointError):
    """A tensor the parameter description needs is absent."""


class DtypeMismatchError(CheckpointError):
    """A tensor is stored with a different dtype than its format requires."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape disagrees with the config (checkpoint and config do not match)."""


class IncompleteCheckpointError(CheckpointError):
    """An orbax output directory without its final manifest (interrupted conversion), or
    one whose manifest, part or chunk files are missing or unreadable."""


class MemoryBudgetError(CheckpointError):
    """The memory budget is too small for the largest single array to be streamed."""


class NonFiniteError(CheckpointError):
    """A tensor holds NaN/inf values (for e8m0 scales: the NaN byte 0xFF)."""


class DrafterMismatchError(CheckpointError):
    """The checkpoint's mtp.* tensors are one drafter layout (a base-V4 MTP block, or the
    DSpark drafter of V4-Flash-0731) and its config.json declares the other."""
