"""Host-side (numpy) format changes used by the converter: dequantisation and the lossless
FP4 -> FP8 re-blocking. Each works on one 2-D tensor [out, in] (one expert at a time), and
matches `quant.py`'s jnp dequantisation bit for bit (same f32 products, same rounding).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv4_jax.quant import E2M1_TABLE

from .errors import CheckpointError

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_KMIN = -15  # lowest 32-group exponent offset (below the block max) the table covers


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """int8/uint8 [..., n/2] -> e2m1 codes uint8 [..., n] (element 2k in the low nibble)."""
    b = packed.view(np.uint8)
    out = np.empty((*b.shape[:-1], b.shape[-1] * 2), np.uint8)
    out[..., 0::2] = b & 0xF
    out[..., 1::2] = b >> 4
    return out


def _rep(x: np.ndarray, r: int, axis: int) -> np.ndarray:
    return np.repeat(x, r, axis=axis)


def dequant_fp8(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    o, i = w.shape[-2:]
    s = _rep(_rep(scale.astype(np.float32), 128, -2)[..., :o, :], 128, -1)[..., :i]
    return w.astype(np.float32) * s


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return E2M1_TABLE[unpack_codes(packed)] * _rep(scale.astype(np.float32), 32, -1)


def dequant_nvfp4(packed: np.ndarray, scale: np.ndarray, scale2: np.ndarray) -> np.ndarray:
    v = E2M1_TABLE[unpack_codes(packed)] * _rep(scale.astype(np.float32), 16, -1)
    return v * np.asarray(scale2, np.float32)[..., None, None]


def dequant(fmt: str, fields: dict) -> np.ndarray:
    if fmt == "fp8":
        return dequant_fp8(fields["w"], fields["scale"])
    if fmt == "fp4":
        return dequant_fp4(fields["packed"], fields["scale"])
    if fmt == "nvfp4":
        return dequant_nvfp4(fields["packed"], fields["scale"], fields["scale2"])
    return fields["value"].astype(np.float32)


def _fp8_table() -> np.ndarray:
    """uint8 [(-_KMIN + 1) * 16]: e4m3 byte of e2m1(code) * 2^(k + 6) for k in [_KMIN, 0],
    0x7F (NaN) where that product is not exactly representable."""
    rows = []
    for k in range(_KMIN, 1):
        v = (E2M1_TABLE * np.float32(2.0 ** (k + 6))).astype(np.float32)
        q = v.astype(_E4M3)
        exact = q.astype(np.float32) == v
        rows.append(np.where(exact, q.view(np.uint8), np.uint8(0x7F)))
    return np.concatenate(rows).astype(np.uint8)


_TABLE = _fp8_table()


def fp4_to_fp8(packed: np.ndarray, scale: np.ndarray, name: str = "tensor"):
    """Lossless FP4 (e2m1 + ue8m0 per 32) -> FP8 (e4m3 + ue8m0 per 128x128 block) of one
    [out, in] tensor: each block takes its largest 32-group scale / 2^6 and every value is
    rescaled by its group's offset (6 * 2^6 = 384 < 448). Raises if some value would leave
    e4m3's range (groups more than 2^14 below their block's largest)."""
    o, i = packed.shape[0], packed.shape[1] * 2
    if o % 128 or i % 128:
        raise CheckpointError(f"{name}: FP4 -> FP8 needs out and in multiples of 128, got {o}x{i}")
    s = scale.view(np.uint8).astype(np.int32)  # biased exponents [o, i/32]
    if (s == 255).any():
        raise CheckpointError(f"{name}: NaN (0xFF) in the FP4 scales")
    sb = s.reshape(o // 128, 128, i // 128, 4).max(axis=(1, 3))  # [o/128, i/128]
    if (sb < 6).any():
        raise CheckpointError(f"{name}: block scale below 2^-121; FP8 scale would underflow")
    k = s - _rep(_rep(sb, 128, 0), 4, 1)  # <= 0
    codes = unpack_codes(packed).reshape(o, i // 32, 32).astype(np.int32)
    idx = (np.maximum(k, _KMIN) - _KMIN)[..., None] * 16 + codes
    q = _TABLE[idx].reshape(o, i)
    nz = (codes & 7) != 0
    if ((q.reshape(o, i // 32, 32) & 0x7F) == 0x7F).any() or ((k < _KMIN)[..., None] & nz).any():
        raise CheckpointError(f"{name}: FP4 -> FP8 would not be lossless (32-group scales span "
                              "more than 2^14 inside a 128x128 block); use --dtype bf16")
    return q.view(_E4M3), (sb - 6).astype(np.uint8).view(_E8M0)


def encode_bf16(v: np.ndarray) -> np.ndarray:
    return v.astype(ml_dtypes.bfloat16)


# Non-finite values by bit pattern: (unsigned view, exponent mask). A value is NaN/inf (for
# e8m0: the NaN byte 0xFF; e4m3fn has NaN but no inf) when all its mask bits are set. Bit
# tests need no float conversion, so a check costs one small temporary per slice.
NONFINITE_BITS: dict[np.dtype, tuple[type, int]] = {
    np.dtype(ml_dtypes.float8_e8m0fnu): (np.uint8, 0xFF),
    _E4M3: (np.uint8, 0x7F),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, 0x7C),
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
}
NONFINITE_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
CHECK_SLICE_BYTES = 32 << 20  # bytes of one array checked at a time (bounds the temporaries)


def nonfinite_count(a: np.ndarray) -> int:
    """Entries of `a` that are NaN/inf (0xFF for e8m0); 0 for integer dtypes. Works through
    the array in slices of CHECK_SLICE_BYTES, so the temporaries stay small."""
    kind = NONFINITE_BITS.get(np.dtype(a.dtype))
    if kind is None or a.size == 0:
        return 0
    view, mask = kind
    flat = np.ascontiguousarray(a).reshape(-1).view(view)
    step = max(1, CHECK_SLICE_BYTES // flat.itemsize)
    return sum(int(np.count_nonzero((flat[i:i + step] & view(mask)) == view(mask)))
               for i in range(0, flat.size, step))
