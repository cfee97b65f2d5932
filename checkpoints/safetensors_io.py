"""A small raw safetensors reader/writer (numpy + ml_dtypes).

Why not the `safetensors` package: its numpy loader cannot build F8_E8M0 arrays, and we want
single-tensor reads into preallocated buffers (bounded memory, no mmap pages counted in RSS)
plus full header validation (truncation shows up as offsets past the end of the file).

File layout: u64 little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data
buffer; offsets are relative to the buffer and must tile it exactly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import CorruptHeaderError, TruncatedShardError

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 256 << 20  # a 69k-tensor header is ~10 MB; anything this big is garbage


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """np.empty with the data pointer aligned to `align` bytes: jax on CPU then wraps the
    buffer without copying (device_put / from_dlpack alias aligned host memory)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def dtype_name(dt) -> str:
    try:
        return DTYPE_NAMES[np.dtype(dt)]
    except KeyError:
        raise ValueError(f"dtype {dt} has no safetensors name") from None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _parse_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TruncatedShardError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CorruptHeaderError(f"{path}: header length {n} is not plausible "
                                     "(not a safetensors file?)")
        if 8 + n > size:
            raise TruncatedShardError(f"{path}: header needs {8 + n} bytes, file has {size}")
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptHeaderError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(hdr, dict):
        raise CorruptHeaderError(f"{path}: header is not a JSON object")
    meta = hdr.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptHeaderError(f"{path}: __metadata__ must map strings to strings")
    base, data_size = 8 + n, size - 8 - n
    infos: dict[str, TensorInfo] = {}
    for name, e in hdr.items():
        try:
            dt, shape, (b, t) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CorruptHeaderError(f"{path}: tensor {name!r} has a malformed entry {e!r}") from None
        if dt not in DTYPES:
            raise CorruptHeaderError(f"{path}: tensor {name!r} has unknown dtype {dt!r}")
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CorruptHeaderError(f"{path}: tensor {name!r} has invalid shape {list(shape)}")
        if not (isinstance(b, int) and isinstance(t, int) and 0 <= b <= t):
            raise CorruptHeaderError(f"{path}: tensor {name!r} has invalid offsets {[b, t]}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if t - b != want:
            raise CorruptHeaderError(f"{path}: tensor {name!r} spans {t - b} bytes but "
                                     f"{dt}{list(shape)} needs {want}")
        infos[name] = TensorInfo(name, dt, shape, base + b, base + t)
    # offsets must tile the data buffer: no overlap, no hole
    pos = 0
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start - base != pos:
            raise CorruptHeaderError(f"{path}: tensor {info.name!r} starts at "
                                     f"{info.start - base}, expected {pos} (overlap or hole)")
        pos = info.end - base
        if pos > data_size:
            raise TruncatedShardError(
                f"{path}: truncated: tensor {info.name!r} ends at byte {info.end} but the file "
                f"has {size} bytes ({8 + n + pos - size} missing at least)")
    if pos != data_size:
        raise CorruptHeaderError(f"{path}: {data_size - pos} trailing bytes after the last tensor")
    return infos, meta


class SafetensorsFile:
    """Header of one .safetensors file (validated on open); tensor data read on demand with
    positional reads, never mapped, so only the bytes asked for enter host memory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.infos, self.metadata = _parse_header(self.path)

    def keys(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The whole tensor; written into `out` (same shape/dtype, C-contiguous) if given."""
        i = self.info(name)
        if out is None:
            out = aligned_empty(i.shape, i.np_dtype)
        elif out.shape != i.shape or out.dtype != i.np_dtype or not out.flags.c_contiguous:
            raise ValueError(f"{name}: out buffer {out.dtype}{list(out.shape)} does not match "
                             f"{i.dtype}{list(i.shape)}")
        self._read_into(i.start, i.nbytes, out)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) along axis 0 (e.g. one device's vocab shard)."""
        i = self.info(name)
        if not (i.shape and 0 <= start <= stop <= i.shape[0]):
            raise ValueError(f"{name}: rows [{start}, {stop}) outside shape {list(i.shape)}")
        row = i.nbytes // i.shape[0] if i.shape[0] else 0
        out = np.empty((stop - start, *i.shape[1:]), i.np_dtype)
        self._read_into(i.start + start * row, (stop - start) * row, out)
        return out

    def _read_into(self, offset: int, nbytes: int, out: np.ndarray):
        buf = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            got = 0
            while got < nbytes:
                k = f.readinto(buf[got:nbytes])
                if not k:
                    raise TruncatedShardError(f"{self.path}: file ended while reading "
                                              f"(offset {offset + got}, wanted {nbytes - got} more)")
                got += k


# ---------------------------------------------------------------------------------------
# Writer: header first (all shapes are known up front), then tensors streamed in order
# ---------------------------------------------------------------------------------------
def header_bytes(entries, metadata: dict[str, str] | None = None) -> bytes:
    """entries: [(name, dtype_name, shape)] in file order -> padded header incl. length."""
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = metadata
    pos = 0
    for name, dt, shape in entries:
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        hdr[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes one .safetensors file tensor by tensor, in the declared order, into
    `path.tmp`; `close()` checks every tensor arrived and renames to `path` (so a crash
    never leaves a file that looks complete)."""

    def __init__(self, path: str | os.PathLike, entries, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.entries = [(n, dt, tuple(s)) for n, dt, s in entries]
        self._next = 0
        self._rows = 0
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._f = open(self._tmp, "wb")
        self._f.write(header_bytes(self.entries, metadata))

    def write(self, name: str, arr: np.ndarray):
        n, dt, shape = self.entries[self._next]
        if name != n:
            raise ValueError(f"{self.path}: expected tensor {n!r} next, got {name!r}")
        if tuple(arr.shape) != shape or np.dtype(arr.dtype) != DTYPES[dt]:
            raise ValueError(f"{self.path}: {name} is {arr.dtype}{list(arr.shape)}, "
                             f"declared {dt}{list(shape)}")
        self._f.write(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))
        self._next += 1

    def write_rows(self, name: str, rows: np.ndarray, last: bool):
        """Consecutive rows (axis 0) of tensor `name`; `last` closes the tensor, checking
        that exactly its declared bytes arrived."""
        n, dt, shape = self.entries[self._next]
        if name != n or np.dtype(rows.dtype) != DTYPES[dt] or tuple(rows.shape[1:]) != shape[1:]:
            raise ValueError(f"{self.path}: rows {rows.dtype}{list(rows.shape)} of {name!r} do not "
                             f"match the entry {n!r} {dt}{list(shape)}")
        self._f.write(memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8)))
        self._rows += rows.shape[0] if rows.ndim else 1
        if last:
            want = shape[0] if shape else 1
            if self._rows != want:
                raise ValueError(f"{self.path}: {name} got {self._rows} rows, declared {want}")
            self._rows = 0
            self._next += 1

    def close(self):
        if self._next != len(self.entries):
            self.abort()
            raise ValueError(f"{self.path}: only {self._next} of {len(self.entries)} tensors written")
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self):
        self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.abort()
