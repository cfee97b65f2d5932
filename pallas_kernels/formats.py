"""Storage formats shared by the model and the kernels (the one low-level module: it
imports neither). Pure JAX / numpy quantise and dequantise, exact against each other.

Weights, logical shape [..., out, in] (leading axes e.g. stacked experts):
  Fp8Weight    e4m3 values [.., out, in] + ue8m0 scale per 128x128 block
  Fp4Weight    packed e2m1 int8 [.., out, in/2] (element 2k in the low nibble) + ue8m0 per 32
  NvFp4Weight  packed e2m1 uint8 [.., out, in/2] + e4m3 scale per 16 + fp32 global scale
  plain array  bf16 / f32
  WeightRows   rows [start, stop) of any of these (a view: params.merge_x_proj)

The KV cache (docs/KV_CACHE.md):
Main KV entry (window ring and compressed pools), 512 dims -> 584 bytes:
  nope  float8_e4m3fn [..., 448]  dims 0..447, value = nope * 2^(scale_e - 127)
  scale uint8         [..., 8]    e8m0 exponent per 64-dim block (7 used, byte 7 = 127)
  rope  bfloat16      [..., 64]   dims 448..511, stored as is

Indexer keys (128 dims), three formats (`fmt`):
  "fp4"   idx_codes uint8 [..., 64] (e2m1, split-half packed), idx_scale uint8 [..., 4]
          (e8m0 per 32 dims, amax floor 6 * 2^-126)          -- the reference numerics
  "nvfp4" idx_codes uint8 [..., 64], idx_scale_lo / idx_scale_hi float8_e4m3fn [..., 4]
          (e4m3(amax / 6) per 16 dims: lo for dims 0..63, the low nibbles; hi for 64..127;
          two fields so that a kernel reads each half's four scales as one word per key;
          with no per-tensor scale its range is about |x| in [6 * 2^-10, 6 * 448 = 2688]:
          blocks below underflow to zero, values above clip)
  "fp8"   idx_keys float8_e4m3fn [..., 128], idx_scale float32 [..., 1] (amax / 448 per key)

Split-half packing: byte j holds element j in the low nibble and element j + n/2 in the
high nibble (easy to produce and consume on Hopper, which has no FP4 casts).

Power-of-two scales are computed with exact integer arithmetic on the f32 bits of
y = amax / max_code (ceil(log2(y)) = exponent + (mantissa != 0)), not with a float log2,
whose rounding near powers of two would move the scale by a factor of 2. The same bit
recipe runs inside the Pallas kernels, so kernel and reference agree byte for byte.

`fp8_block_sim` / `fp4_block_sim` are the model's activation simulation
(ARCHITECTURE.md section 10) expressed as dequantize(quantize(x)); they are defined here
so the model's own simulation (dsv4_jax/quant.py) can be checked against them bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# amax / 448 and amax / 6 are computed as amax * f32(1/448), amax * f32(1/6): XLA rewrites a
# division by a constant into exactly this multiply, so writing it out keeps every path
# (jnp on CPU/GPU, the kernels, numpy tests) identical. The power-of-two exponents do not
# depend on it (checked in tests), the fp8/nvfp4 index-key scales do in the last bit.
INV_E4M3_MAX = np.float32(1.0 / 448.0)
INV_E2M1_MAX = np.float32(1.0 / 6.0)
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126

KV_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
KV_BLOCK = 64  # dims per e8m0 scale of the nope part
KV_SCALES = 8  # 7 used + 1 padding byte (=127, i.e. 2^0)
INDEX_DIM = 128
INDEX_FORMATS = ("fp4", "nvfp4", "fp8")

# e2m1 code (low 3 bits = magnitude, bit 3 = sign) -> value.
E2M1_TABLE = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ----------------------------------------------------------------------------- helpers
def pow2_ceil_exponent(y_f32):
    """Biased exponent e (int32) with 2^(e-127) = 2^ceil(log2(y)), for normal positive f32 y."""
    bits = jax.lax.bitcast_convert_type(y_f32.astype(jnp.float32), jnp.int32)
    exp = (bits >> 23) & 0xFF
    return exp + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def exp2_biased(e_i32):
    """2^(e - 127) as f32 for a biased exponent 1 <= e <= 254 (exact, built from bits)."""
    return jax.lax.bitcast_convert_type(e_i32.astype(jnp.int32) << 23, jnp.float32)


def _check_last(x, n, what):
    if x.shape[-1] != n:
        raise ValueError(f"{what}: last dim must be {n}, got shape {x.shape}")


def _blocks(x, block, what):
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"{what}: last dim {n} is not a multiple of block {block}")
    return x.reshape(*x.shape[:-1], n // block, block)


def e4m3_encode(v_f32):
    """f32 -> float8_e4m3fn, round to nearest even; clamps to +-448 first (NaN-free)."""
    return jnp.clip(v_f32, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def e2m1_encode(v_f32):
    """f32 -> e2m1 code (uint8 0..15), round to nearest even, saturating at +-6.

    Threshold arithmetic (what the Hopper kernel does; there is no FP4 cast on sm_90).
    Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4. The sign bit follows the f32 sign bit (so -0.1 -> -0, like ml_dtypes).
    """
    v = v_f32.astype(jnp.float32)
    a = jnp.abs(v)
    mag = ((a > 0.25).astype(jnp.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    neg = jax.lax.bitcast_convert_type(v, jnp.int32) < 0
    return (mag + jnp.where(neg, 8, 0)).astype(jnp.uint8)


def e2m1_decode(codes_u8):
    return jnp.asarray(E2M1_TABLE)[codes_u8.astype(jnp.int32)]


def pack_split_half(codes_u8):
    """codes uint8 [..., n] (values < 16) -> bytes uint8 [..., n/2]: lo = j, hi = j + n/2."""
    n = codes_u8.shape[-1]
    if n % 2:
        raise ValueError(f"pack_split_half: last dim {n} must be even")
    c = codes_u8.astype(jnp.int32)
    return (c[..., : n // 2] | (c[..., n // 2:] << 4)).astype(jnp.uint8)


def unpack_split_half(packed_u8):
    p = packed_u8.astype(jnp.int32)
    return jnp.concatenate([p & 0xF, (p >> 4) & 0xF], axis=-1).astype(jnp.uint8)


# ------------------------------------------------------ block quantisers (generic width)
# Blocks' amax of arrays up to this many elements (decode-sized activations) as a tree of
# elementwise maxima over halves, not a reduce: XLA then fuses it into the quantisation's
# own kernel (and that into its producer or consumer) instead of launching a reduction
# kernel for it. Max is exact in any order: the same bits either way.
AMAX_TREE_MAX_ELEMS = 1 << 16


def block_amax(xb):
    """max |xb| over the last axis (the blocks of `_blocks`)."""
    a = jnp.abs(xb)
    if a.size > AMAX_TREE_MAX_ELEMS:
        return jnp.max(a, axis=-1)
    while a.shape[-1] > 1:
        h = -(-a.shape[-1] // 2)   # odd widths: the halves overlap by one (max is idempotent)
        a = jnp.maximum(a[..., :h], a[..., a.shape[-1] - h:])
    return a[..., 0]


def fp8_block_quantize(x, block):
    """x [..., n] -> (e4m3 [..., n], biased e8m0 exponents int32 [..., n/block])."""
    xb = _blocks(x.astype(jnp.float32), block, "fp8_block_quantize")
    amax = jnp.maximum(block_amax(xb), FP8_AMAX_FLOOR)
    e = pow2_ceil_exponent(amax * INV_E4M3_MAX)
    q = e4m3_encode(xb * exp2_biased(254 - e)[..., None])  # x / s, exact (s = 2^k)
    return q.reshape(x.shape), e


def fp8_block_dequantize(q, e, block):
    qb = _blocks(q.astype(jnp.float32), block, "fp8_block_dequantize")
    return (qb * exp2_biased(e)[..., None]).reshape(q.shape)


def fp8_block_sim(x, block=128):
    """FP8 activation simulation: e4m3 with ue8m0 scale per `block` dims (amax floor 1e-4).
    Returns x.dtype (the result is exactly representable in bf16 and f32)."""
    q, e = fp8_block_quantize(x, block)
    return fp8_block_dequantize(q, e, block).astype(x.dtype)


def fp4_block_quantize(x, block=32):
    """x [..., n] -> (e2m1 codes uint8 [..., n] unpacked, biased e8m0 exponents int32)."""
    xb = _blocks(x.astype(jnp.float32), block, "fp4_block_quantize")
    amax = jnp.maximum(block_amax(xb), FP4_AMAX_FLOOR)
    e = pow2_ceil_exponent(amax * INV_E2M1_MAX)
    codes = e2m1_encode(xb * exp2_biased(254 - e)[..., None])
    return codes.reshape(x.shape), e


def fp4_block_dequantize(codes, e, block=32):
    vb = _blocks(e2m1_decode(codes), block, "fp4_block_dequantize")
    return (vb * exp2_biased(e)[..., None]).reshape(codes.shape)


def fp4_block_sim(x, block=32):
    """FP4 simulation: e2m1 with ue8m0 scale per `block` dims (amax floor 6 * 2^-126)."""
    codes, e = fp4_block_quantize(x, block)
    return fp4_block_dequantize(codes, e, block).astype(x.dtype)


# ------------------------------------------------------------------ main KV entry
def quantize_kv(x):
    """kv row(s) [..., 512] (bf16; other dtypes are rounded to bf16 first, as the reference
    stores bf16 activations) -> (nope e4m3 [..., 448], scale uint8 [..., 8], rope bf16 [..., 64])."""
    _check_last(x, KV_DIM, "quantize_kv")
    xb = x.astype(jnp.bfloat16)
    nope, e = fp8_block_quantize(xb[..., :NOPE_DIM], KV_BLOCK)
    pad = jnp.full((*e.shape[:-1], KV_SCALES - e.shape[-1]), 127, jnp.int32)
    scale = jnp.concatenate([e, pad], axis=-1).astype(jnp.uint8)
    return nope, scale, xb[..., NOPE_DIM:]


def dequantize_kv(nope, scale, rope, dtype=jnp.bfloat16):
    """(nope, scale, rope) -> [..., 512] in `dtype` (bf16 is exact: e4m3 * 2^k fits bf16)."""
    _check_last(nope, NOPE_DIM, "dequantize_kv nope")
    _check_last(scale, KV_SCALES, "dequantize_kv scale")
    _check_last(rope, ROPE_DIM, "dequantize_kv rope")
    e = scale[..., : NOPE_DIM // KV_BLOCK].astype(jnp.int32)
    x = fp8_block_dequantize(nope, e, KV_BLOCK)
    return jnp.concatenate([x.astype(dtype), rope.astype(dtype)], axis=-1)


def kv_sim(x):
    """dequantize_kv(quantize_kv(x)) in bf16: the window/compressed KV simulation."""
    return dequantize_kv(*quantize_kv(x))


# ------------------------------------------------------------------ indexer keys
def index_key_fields(fmt):
    """{field: (suffix shape, dtype)} of one indexer key in format `fmt`."""
    if fmt == "fp4":
        return {"idx_codes": ((64,), jnp.uint8), "idx_scale": ((4,), jnp.uint8)}
    if fmt == "nvfp4":
        return {"idx_codes": ((64,), jnp.uint8), "idx_scale_lo": ((4,), E4M3),
                "idx_scale_hi": ((4,), E4M3)}
    if fmt == "fp8":
        return {"idx_keys": ((128,), E4M3), "idx_scale": ((1,), jnp.float32)}
    raise ValueError(f"unknown indexer key format {fmt!r}; expected one of {INDEX_FORMATS}")


def nvfp4_quantize(x, block=16):
    """x [..., n] -> (codes uint8 [..., n] unpacked, e4m3 scales [..., n/block]).
    s = e4m3(amax * f32(1/6)) (clamped to 448); code = e2m1(x / f32(s)); s == 0 gives code 0."""
    xb = _blocks(x.astype(jnp.float32), block, "nvfp4_quantize")
    amax = block_amax(xb)
    s = e4m3_encode(amax * INV_E2M1_MAX)
    sf = s.astype(jnp.float32)[..., None]
    safe = jnp.where(sf > 0, sf, 1.0)
    codes = jnp.where(sf > 0, e2m1_encode(xb / safe), jnp.uint8(0))
    return codes.reshape(x.shape), s


def nvfp4_dequantize(codes, s, block=16):
    vb = _blocks(e2m1_decode(codes), block, "nvfp4_dequantize")
    return (vb * s.astype(jnp.float32)[..., None]).reshape(codes.shape)


def quantize_index_key(k, fmt="fp4"):
    """indexer key(s) f32 [..., 128] -> dict of stored fields (see index_key_fields)."""
    _check_last(k, INDEX_DIM, "quantize_index_key")
    k = k.astype(jnp.float32)
    if fmt == "fp4":
        codes, e = fp4_block_quantize(k, 32)
        return {"idx_codes": pack_split_half(codes), "idx_scale": e.astype(jnp.uint8)}
    if fmt == "nvfp4":
        codes, s = nvfp4_quantize(k, 16)
        return {"idx_codes": pack_split_half(codes), "idx_scale_lo": s[..., :4],
                "idx_scale_hi": s[..., 4:]}
    if fmt == "fp8":
        amax = block_amax(k)[..., None]
        scale = amax * INV_E4M3_MAX
        safe = jnp.where(scale > 0, scale, 1.0)
        keys = jnp.where(scale > 0, e4m3_encode(k / safe), jnp.zeros((), E4M3))
        return {"idx_keys": keys, "idx_scale": scale}
    index_key_fields(fmt)  # raises with the list of formats


def dequantize_index_key(fields, fmt="fp4"):
    """dict of stored fields -> f32 [..., 128]."""
    if fmt == "fp4":
        return fp4_block_dequantize(unpack_split_half(fields["idx_codes"]),
                                    fields["idx_scale"].astype(jnp.int32), 32)
    if fmt == "nvfp4":
        s = jnp.concatenate([fields["idx_scale_lo"], fields["idx_scale_hi"]], axis=-1)
        return nvfp4_dequantize(unpack_split_half(fields["idx_codes"]), s, 16)
    if fmt == "fp8":
        return fields["idx_keys"].astype(jnp.float32) * fields["idx_scale"]
    index_key_fields(fmt)


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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"],
                   meta_fields=["start", "stop"])
@dataclasses.dataclass
class WeightRows:
    """Rows [start, stop) of a stored weight w [..., out, in] (plain or quantised, leading
    dims: stacked experts), as a weight [..., stop - start, in] of its own: how the layer
    code sees one of the weights stored concatenated in `attn.x_proj_merged` or a
    params.ROW_MERGES weight (params.merge_x_proj). `f32_dot_bf16` multiplies x by ALL of w
    and slices the output columns, so the views of one weight read with the same x in one
    program are the same dot, which XLA's CSE computes once (w is read once per step, and
    no concatenation is ever made)."""
    w: jax.Array
    start: int
    stop: int

    @property
    def shape(self):
        return (*self.w.shape[:-2], self.stop - self.start, self.w.shape[-1])

    @property
    def dtype(self):
        return self.w.dtype


def is_quantized(w) -> bool:
    return isinstance(w, QUANT_TYPES)


def dequant(w, dtype=jnp.float32):
    return w.dequant(dtype) if is_quantized(w) else w.astype(dtype)


def dequant_bf16(w):
    """Weight -> (bf16 [..., out, in], f32 post-scale or None), exactly: e4m3 / e2m1 values
    times power-of-two or e4m3 block scales fit bf16's 8 significant bits; NVFP4's fp32
    global scale is returned separately to multiply the matmul's output."""
    if isinstance(w, NvFp4Weight):
        v = unpack_e2m1(w.packed) * jnp.repeat(w.scale.astype(jnp.float32), 16, axis=-1)
        return v.astype(jnp.bfloat16), w.scale2.astype(jnp.float32)
    return dequant(w, jnp.bfloat16), None


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
    e = _np_pow2_exponent(amax, E4M3_MAX, 2.0 ** -100)
    s = np.ldexp(1.0, e)
    q = np.clip(blk / s[..., :, None, :, None], -E4M3_MAX, E4M3_MAX)
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
    e = _np_pow2_exponent(np.abs(blk).max(-1), E2M1_MAX, 2.0 ** -100)
    v = np.clip(blk / np.ldexp(1.0, e)[..., None], -E2M1_MAX, E2M1_MAX).reshape(W.shape)
    packed = pack_e2m1_np(_e2m1_codes_np(v)).view(np.int8)
    return packed, (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def encode_nvfp4_np(W: np.ndarray):
    """f32 [..., out, in] -> (packed uint8, e4m3 scale per 16, f32 global scale)."""
    import ml_dtypes
    amax_all = np.abs(W).max(axis=(-2, -1)).astype(np.float32)
    g = np.maximum(amax_all, 1e-12) / (E2M1_MAX * E4M3_MAX)
    blk = W.reshape(*W.shape[:-1], W.shape[-1] // 16, 16)
    gb = np.asarray(g)[..., None, None]
    s = (np.abs(blk).max(-1) / E2M1_MAX / gb).astype(ml_dtypes.float8_e4m3fn)
    sf = s.astype(np.float32) * gb
    v = np.where(sf[..., None] > 0, blk / np.where(sf > 0, sf, 1)[..., None], 0)
    v = np.clip(v, -E2M1_MAX, E2M1_MAX).reshape(W.shape)
    return pack_e2m1_np(_e2m1_codes_np(v)), s, np.asarray(g, np.float32)
