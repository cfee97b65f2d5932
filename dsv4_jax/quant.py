"""Quantised weight types (pytrees) with one matmul entry point, and the activation
quantisation the checkpoints were trained for (ARCHITECTURE.md section 10).

Weight formats, logical shape [..., out, in] (leading axes e.g. stacked experts):
  Fp8Weight    e4m3 values [.., out, in] + ue8m0 scale per 128x128 block
  Fp4Weight    packed e2m1 int8 [.., out, in/2] (element 2k in the low nibble) + ue8m0 per 32
  NvFp4Weight  packed e2m1 uint8 [.., out, in/2] + e4m3 scale per 16 + fp32 global scale
  plain array  bf16 / f32
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ---------------------------------------------------------------------------------------
# Numerics switch
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Numerics:
    """How activations are computed. `act_quant`: simulate the FP8/FP4 activation, KV and
    indexer rounding the checkpoint was trained with. `dtype`: activation dtype between ops
    (bf16 like the reference; f32 for tight comparisons)."""
    act_quant: bool = True
    dtype: str = "bfloat16"

    @property
    def jdtype(self):
        return jnp.dtype(self.dtype)


# ---------------------------------------------------------------------------------------
# Block-scaled simulation (quantise + dequantise), power-of-two (ue8m0) scales
# ---------------------------------------------------------------------------------------
def fp8_block_sim(x, block: int = 128):
    """Per-`block` e4m3 quantise-dequantise with power-of-two (ue8m0) scales, amax floored
    at 1e-4; returns x's dtype. One implementation with the cache format (kvformat)."""
    from .kvformat import fp8_block_sim as sim
    return sim(x, block)


def fp4_block_sim(x, block: int = 32):
    """Per-`block` e2m1 quantise-dequantise with power-of-two scales, amax floored at
    6 * 2^-126; returns x's dtype."""
    from .kvformat import fp4_block_sim as sim
    return sim(x, block)


# ---------------------------------------------------------------------------------------
# Weight types
# ---------------------------------------------------------------------------------------
def _register(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
    return cls


@_register
@dataclasses.dataclass
class Fp8Weight:
    w: jax.Array  # float8_e4m3fn [..., out, in]
    scale: jax.Array  # float8_e8m0fnu [..., ceil(out/128), ceil(in/128)]

    @property
    def shape(self):
        return self.w.shape

    def dequant(self, dtype=jnp.float32):
        *_, o, i = self.w.shape
        s = self.scale.astype(jnp.float32)
        s = jnp.repeat(jnp.repeat(s, 128, axis=-2)[..., :o, :], 128, axis=-1)[..., :i]
        return (self.w.astype(jnp.float32) * s).astype(dtype)


def unpack_e2m1(packed):
    """uint8/int8 [..., n/2] with element 2k in the low nibble -> f32 [..., n]."""
    b = packed.astype(jnp.uint8).astype(jnp.int32)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return jnp.asarray(E2M1_TABLE)[codes]


@_register
@dataclasses.dataclass
class Fp4Weight:
    packed: jax.Array  # int8 [..., out, in/2]
    scale: jax.Array  # float8_e8m0fnu [..., out, in/32]

    @property
    def shape(self):
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequant(self, dtype=jnp.float32):
        v = unpack_e2m1(self.packed)
        s = jnp.repeat(self.scale.astype(jnp.float32), 32, axis=-1)
        return (v * s).astype(dtype)


@_register
@dataclasses.dataclass
class NvFp4Weight:
    packed: jax.Array  # uint8 [..., out, in/2]
    scale: jax.Array  # float8_e4m3fn [..., out, in/16]
    scale2: jax.Array  # float32 [...] global scale (kept separate: never folded)

    @property
    def shape(self):
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequant(self, dtype=jnp.float32):
        v = unpack_e2m1(self.packed)
        s = jnp.repeat(self.scale.astype(jnp.float32), 16, axis=-1)
        g = self.scale2.astype(jnp.float32)[..., None, None]
        return (v * s * g).astype(dtype)


QUANT_TYPES = (Fp8Weight, Fp4Weight, NvFp4Weight)


def is_quantized(w) -> bool:
    return isinstance(w, QUANT_TYPES)


def dequant(w, dtype=jnp.float32):
    return w.dequant(dtype) if is_quantized(w) else w.astype(dtype)


def linear(x, w, nm: Numerics, *, out_dtype=None):
    """y = x @ W.T for any weight format. Quantised weights get the FP8 activation
    simulation (per token per 128 channels) when `nm.act_quant`; fp32 accumulation."""
    out_dtype = out_dtype or nm.jdtype
    if is_quantized(w) and nm.act_quant:
        x = fp8_block_sim(x, 128)
    W = dequant(w, jnp.float32)
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), W,
                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------
# Encoders (numpy, host side): used by random init, the synthetic checkpoint writer and
# the converter. All exact with respect to the formats above.
# ---------------------------------------------------------------------------------------
def _np_pow2_exponent(amax, qmax, floor):
    a = np.maximum(amax, floor) / qmax
    m, e = np.frexp(a.astype(np.float64))
    return np.where(m == 0.5, e - 1, e).astype(np.int32)


def encode_fp8_np(W: np.ndarray):
    """f32 [..., out, in] -> (e4m3 values, e8m0 block scales) per 128x128 block."""
    import ml_dtypes
    *lead, o, i = W.shape
    po, pi = -o % 128, -i % 128
    Wp = np.pad(W, [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    blk = Wp.reshape(*lead, (o + po) // 128, 128, (i + pi) // 128, 128)
    amax = np.abs(blk).max(axis=(-3, -1))
    e = _np_pow2_exponent(amax, FP8_MAX, 2.0 ** -100)
    s = np.ldexp(1.0, e)
    q = np.clip(blk / s[..., :, None, :, None], -FP8_MAX, FP8_MAX)
    q = q.reshape(Wp.shape)[..., :o, :i].astype(ml_dtypes.float8_e4m3fn)
    return q, (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def _e2m1_codes_np(v):
    import ml_dtypes
    f = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    idx = np.searchsorted(E2M1_TABLE[:8], np.abs(f))
    return (idx + 8 * np.signbit(f)).astype(np.uint8)


def pack_e2m1_np(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def encode_fp4_np(W: np.ndarray):
    """f32 [..., out, in] -> (packed int8 [.., in/2], e8m0 scales per 32)."""
    import ml_dtypes
    blk = W.reshape(*W.shape[:-1], W.shape[-1] // 32, 32)
    e = _np_pow2_exponent(np.abs(blk).max(-1), FP4_MAX, 2.0 ** -100)
    v = np.clip(blk / np.ldexp(1.0, e)[..., None], -FP4_MAX, FP4_MAX).reshape(W.shape)
    packed = pack_e2m1_np(_e2m1_codes_np(v)).view(np.int8)
    return packed, (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def encode_nvfp4_np(W: np.ndarray):
    """f32 [..., out, in] -> (packed uint8, e4m3 scale per 16, f32 global scale)."""
    import ml_dtypes
    amax_all = np.abs(W).max(axis=(-2, -1)).astype(np.float32)
    g = np.maximum(amax_all, 1e-12) / (FP4_MAX * FP8_MAX)
    blk = W.reshape(*W.shape[:-1], W.shape[-1] // 16, 16)
    gb = np.asarray(g)[..., None, None]
    s = (np.abs(blk).max(-1) / FP4_MAX / gb).astype(ml_dtypes.float8_e4m3fn)
    sf = s.astype(np.float32) * gb
    v = np.where(sf[..., None] > 0, blk / np.where(sf > 0, sf, 1)[..., None], 0)
    v = np.clip(v, -FP4_MAX, FP4_MAX).reshape(W.shape)
    return pack_e2m1_np(_e2m1_codes_np(v)), s, np.asarray(g, np.float32)
