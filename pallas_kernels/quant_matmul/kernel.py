"""Weight-streaming grouped quantised matmul for decode, Pallas Mosaic-GPU (Hopper, sm_90a).

    y_GMN[g, m, n] = sum_k x_GMK[g, m, k] * dequant(w)[expert_G[g], n, k]      (f32 acc)

Decode is memory bound: each CTA streams one weight tile column over (part of) K exactly
as stored (e4m3 bytes, or packed e2m1 nibbles + e8m0 bytes), dequantises it in registers
to bf16 (exact: the scales are powers of two) and multiplies it with the few activation
rows. A and B are swapped so the weight tile is the wgmma M side:

    per CTA (group g, weight rows n0:n0+tn, K range of split s), per K step of 128:
      W tile e4m3 [tn, 128 k]  --TMA-->  SMEM (STAGES deep)           x tile bf16 [M, 128 k]
      -> registers, * 2^(scale-127), -> bf16 [tn, 128 k] in SMEM
      -> acc^T [tn, M] += W_tile @ x_tile^T                            (wgmma, f32)
    out[s, g, n0:n0+tn, :] = acc^T                                     (TMA store)
  then in XLA: y_GMN = (out[0] + out[1] + ...).transpose(0, 2, 1)   (f32 [S, G, N, M],
  small; written as adds so the sum fuses into the consumer)

Empty groups (expert id outside [0, E)) issue no weight copies and store zeros.

FP4 (e2m1, packed 2 per byte, element 2k in the low nibble, one e8m0 per 32 along K):
x is de-interleaved in XLA (fp4_x_layout), so y = W_lo @ x_even + W_hi @ x_odd and the
nibbles never need reordering. Per step: packed tile uint8 [tn, tkp B] (2 tkp k); the
CTA's scales uint8 [tn, nk * tkp/16] are loaded once. Each 16-byte column chunk (one
scale block) is decoded with integer arithmetic (Hopper has no e2m1 casts: the 3
magnitude bits placed under the f16 exponent give e2m1 * 2^-14 exactly) into its own
bf16 tile [tn, 16] per nibble half (registers with reg_a, else SMEM), multiplied with the
matching x chunk [M, 16].

Dequantise code (`decode`): "cvt" goes through float conversions (~10 instructions per
FP4 weight: nibble masks and shifts into f16 bits, f16 -> f32, * f32 scale, -> bf16);
"swar" builds the bf16 bits with 32-bit integer ops on two weights at once and applies
the scale with two exact bf16x2 multiplies (~3.5 instructions per weight, inline PTX:
FP4_SWAR_PTX); "swar-shfl" (FP4 default) also fetches each row's scale words with one
lane shuffle. H100, M = 8, FP4 experts: 30 -> 45% of the copy bandwidth at G = 6 and
40 -> 73% at G = 64 (benchmarks/results/quant_matmul.md). The FP4 swar program
($DSV4_QMM_FP4_PTX, FP4_SWAR_FORMS) is "place" since session 26: sign-replicate prmt, one
bf16x2 multiply a weight pair (~2.25 instructions a weight), the B = 64 experts at 86% of
the ceiling (H100). FP8 keeps "cvt": its "swar" form measured no faster (it is not bound
by the conversions).
"""
import os

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector

from pallas_kernels.formats import Fp4Weight, Fp8Weight

# Defaults from the H100 sweep (benchmarks/results/quant_matmul.md)
TN = 128          # FP8 weight rows (n) per CTA: the wgmma M side (64 when M > 128)
TK = 128          # k per FP8 pipeline step (one FP8 scale block)
TKP = 64          # packed bytes per FP4 pipeline step (2 k per byte) unless fp4_tiles says
STAGES = 2        # weight tiles in flight per CTA (fewer, smaller CTAs per SM measured faster)
CTAS_PER_SM = {"fp8": 2, "fp4": 3}   # K-split target
NUM_SMS = 132     # H100 SXM
WG = plgpu.Layout.WGMMA
# Default of the `reg_a` knob (dequantised rows into the wgmma from registers): on since the
# H100 A/B of 2026-11-22 (4-10% less kernel time, 4 Flash layers 1.65 -> 1.60 ms pipelined);
# DSV4_REG_A=0 turns it off process-wide for A/B runs without code changes.
REG_A = os.environ.get("DSV4_REG_A", "1") == "1"
# Default of the `decode` knob per format: "cvt" (float conversions: e4m3 -> f16 -> f32, or
# e2m1 bits under the f16 exponent -> f32; * f32 scale; -> bf16), "swar" (bf16 bits built
# with 32-bit integer ops two weights at a time, scaled by exact bf16x2 multiplies; inline
# PTX, see FP4_SWAR_PTX) or "swar-shfl" (FP4: "swar" whose per-row scale words come from
# the neighbour lane by one shuffle instead of a masked row sum, when a step holds 8 scale
# blocks, i.e. tkp = 128; FP8: same as "swar"). H100 runs of 2026-11-22, FP4 experts M = 8,
# G = 64: cvt 238 us, swar 155 us, swar-shfl 130 us (73% of the copy bandwidth); FP8
# "swar" no faster (within 2%), so FP8 stays "cvt". $DSV4_QMM_DECODE overrides both.
DECODE = {"fp8": "cvt", "fp4": "swar-shfl"}
if os.environ.get("DSV4_QMM_DECODE"):
    DECODE = dict.fromkeys(DECODE, os.environ["DSV4_QMM_DECODE"])


def fp4_tiles(decode, M):
    """FP4 (weight rows per CTA, packed bytes per step), from the H100 runs of 2026-11-22
    (benchmarks/results/quant_matmul.md): the "cvt" decode is ALU bound and wants small
    CTAs, many per SM; with the cheaper "swar" decodes 128 B steps win (and "swar-shfl"
    needs them), with 128-row tiles at M = 8 (G = 64 experts 163.5 -> 156.1 us) and M = 64
    (42.2 -> 39.2 us) but 64-row tiles at M = 32 (29.1 -> 27.6 us; equal with swar-shfl).
    M = 16-24 and 40-128 are not measured."""
    if decode == "cvt":
        return 64, 64
    return (64, 128) if 8 < M <= 32 else (128, 128)


def check_inputs(x_GMK, expert_G, w, for_kernel=True):
    """Shape / dtype validation with errors that name the problem (`for_kernel`: also the
    kernel's tiling constraints)."""
    if not isinstance(w, (Fp8Weight, Fp4Weight)):
        raise TypeError(f"w must be an Fp8Weight or Fp4Weight (pallas_kernels.formats), got {type(w).__name__}")
    if x_GMK.ndim != 3:
        raise ValueError(f"x_GMK must be [G, M, K], got shape {x_GMK.shape}")
    if x_GMK.dtype != jnp.bfloat16:
        raise ValueError(f"x_GMK must be bfloat16, got {x_GMK.dtype}")
    G, M, K = x_GMK.shape
    if M % 8 or not 8 <= M <= 256:
        raise ValueError(f"M (rows per group) must be a multiple of 8 in [8, 256], got {M}")
    if expert_G.shape != (G,) or not jnp.issubdtype(expert_G.dtype, jnp.integer):
        raise ValueError(f"expert_G must be an integer array of shape ({G},), got "
                         f"{expert_G.dtype} {expert_G.shape}")
    if len(w.shape) != 3:
        raise ValueError(f"w must be stacked experts [E, N, K], got logical shape {w.shape}")
    E, N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"K mismatch: x has K={K}, w has K={Kw}")
    if for_kernel and (N % TN or K % TK):
        raise ValueError(f"N and K must be multiples of {TN} and {TK} for the kernel, "
                         f"got N={N}, K={K} (use impl='xla')")
    if isinstance(w, Fp8Weight):
        nb, kb = -(-N // 128), -(-K // 128)
        if w.w.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"Fp8Weight.w must be float8_e4m3fn, got {w.w.dtype}")
        if w.scale.shape != (E, nb, kb) or w.scale.dtype != jnp.float8_e8m0fnu:
            raise ValueError(f"Fp8Weight.scale must be float8_e8m0fnu {(E, nb, kb)}, "
                             f"got {w.scale.dtype} {w.scale.shape}")
    else:
        if w.packed.dtype not in (jnp.int8, jnp.uint8):
            raise ValueError(f"Fp4Weight.packed must be int8/uint8, got {w.packed.dtype}")
        if K % 32 or w.scale.shape != (E, N, K // 32) or w.scale.dtype != jnp.float8_e8m0fnu:
            raise ValueError(f"Fp4Weight.scale must be float8_e8m0fnu {(E, N, K // 32)}, "
                             f"got {w.scale.dtype} {w.scale.shape}")


def _steps(fmt, K, tkp=TKP):
    return K // TK if fmt == "fp8" else K // (2 * tkp)


def _valid_split(fmt, K, s, tkp=TKP):
    """FP4 CTAs load their scales [tn, nk*tkp/16] with one TMA: a 16-byte multiple, at
    most 256 wide."""
    KT = _steps(fmt, K, tkp)
    if KT % s:
        return False
    nsc = KT // s * (tkp // 16)
    return fmt == "fp8" or (nsc % 16 == 0 and nsc <= 256)


def default_splits(fmt, G, N, K, tn=TN, tkp=TKP, num_sms=NUM_SMS):
    """K splits per (group, n tile): the most that keep the grid within CTAS_PER_SM."""
    ok = [s for s in range(1, _steps(fmt, K, tkp) + 1) if _valid_split(fmt, K, s, tkp)]
    if not ok:
        raise ValueError(f"no valid K split for {fmt} K={K}")
    fits = [s for s in ok if G * (N // tn) * s <= CTAS_PER_SM[fmt] * num_sms]
    return max(fits) if fits else min(ok)


SMEM_BUDGET = 225 * 1024


def _smem_bytes(fmt, tn, M, stages, nk, tkp=TKP, reg_a=False):
    """Stream buffers of one CTA (the output tile reuses them after the stream)."""
    if fmt == "fp8":
        per_stage = tn * TK + M * TK * 2
        wb = tn * TK * 2                                  # dequantised bf16 tile
        fixed = 0
    else:
        per_stage = tn * tkp + M * tkp * 2 * 2
        wb = tn * tkp * 2 * 2
        fixed = tn * nk * (tkp // 16)                     # the CTA's scales
    return per_stage * stages + fixed + (0 if reg_a else wb)


def choose_stages(fmt, tn, M, nk, max_stages=STAGES, tkp=TKP, reg_a=False):
    """Pipeline depth: up to `max_stages` weight tiles in flight, within the SMEM budget
    (with `reg_a` the dequantised tile never goes to SMEM, so it is not counted)."""
    st = max(1, min(max_stages, nk))
    while st > 1 and _smem_bytes(fmt, tn, M, st, nk, tkp, reg_a) > SMEM_BUDGET:
        st -= 1
    if _smem_bytes(fmt, tn, M, st, nk, tkp, reg_a) > SMEM_BUDGET:
        raise ValueError(f"{fmt} tiles for M={M} do not fit in shared memory")
    return st


def _u8(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


# ---- "swar" decode: bf16 bits from integer ops, two weights per 32-bit op -------------
# One WGMMA-layout register holds two packed bytes of one row, B0 (column 2j) and B1
# (column 2j + 1); the matching bf16 operands hold the same two columns as one bf16x2
# word. y = [B0, 0, B1, 0] (prmt) puts each byte in its own 16-bit lane; then per lane:
#   FP4 nibble s|m (m = 2a + b): (m << 6) | (s << 15) is bf16 e2m1(m) * 2^-126 exactly
#     (a = 0, i.e. m = 1, lands on the bf16 subnormal 2^-127: the e2m1 subnormal), so
#     w = bits * 2^(e - 1), done as two exact bf16x2 multiplies by SA = 2^(min(e,128) - 1)
#     and SB = 2^(max(e,128) - 128) so that every e8m0 byte 0..254 stays in range.
#   FP8 byte s|eeee|mmm: ((b & 0x7f) << 4) | (s << 15) is bf16 e4m3 * 2^-120 exactly
#     (e4m3 subnormals land on bf16 subnormals), times SA = 2^(min(e,134) - 7) and
#     SB = 2^(max(e,134) - 134).
# The sign moves with the magnitude bits (n << k puts it 6 bits short of bit 15) and a
# multiply-add lifts it: s * (2^15 - 2^(15-6)) added to the shifted word.
# Needs subnormal-preserving bf16 multiplies (PTX mul.rn.bf16x2 has no .ftz; sm_90).
# The Mosaic-GPU interpreter (XLA on CPU flushes subnormals) cannot run PTX, so interpret
# mode runs the "cvt" decode; tests execute these exact PTX strings on a small numpy model
# of the instructions (tests/test_quant_matmul.py) and on the GPU against the reference.
FP4_SWAR_PTX = """{
.reg .b32 y, n, s;
prmt.b32 y, $2, 0, 0x4140;
and.b32 n, y, 0x000F000F;
and.b32 s, y, 0x00080008;
shl.b32 n, n, 6;
mad.lo.u32 n, s, 4032, n;
mul.rn.bf16x2 n, n, $3;
mul.rn.bf16x2 $0, n, $4;
and.b32 n, y, 0x00F000F0;
and.b32 s, y, 0x00800080;
shl.b32 n, n, 2;
mad.lo.u32 n, s, 252, n;
mul.rn.bf16x2 n, n, $3;
mul.rn.bf16x2 $1, n, $4;
}"""
# $0 <- low nibbles of B0, B1 (even k); $1 <- high nibbles (odd k); $2 = B0 | B1 << 8;
# $3, $4 = SA, SB as bf16x2 words (the same value in both halves).

# The same values with the sign moved by prmt's sign-replicate mode (the indexer's "place"
# program, GPU-proven there in session 24): selector 0x9180 puts each byte in a 16-bit lane
# with its sign bit repeated above it, so a nibble in a byte's high half has its
# magnitude on bits 4-6 and its sign on bit 13 (and 15): << 2 and one mask make the bf16
# bits (e2m1 * 2^-126); the low nibbles first move up 4. 11 instructions for 4 weights
# instead of 13 (4 of them prmt / and on the ALU pipe instead of 5; no mad). Selected by
# $DSV4_QMM_FP4_PTX=prmt; GPU-tested (session 26, H100), 2-3% faster than "mad".
def _prmt_program(multiplies):
    """The sign-replicate FP4 program with `multiplies` bf16x2 scale multiplies a pair (2:
    by SA then SB, "prmt"; 1: by SA only, "place")."""
    mul = lambda dst, r: ([f"mul.rn.bf16x2 {dst}, {r}, $3;"] if multiplies == 1 else
                          [f"mul.rn.bf16x2 {r}, {r}, $3;", f"mul.rn.bf16x2 {dst}, {r}, $4;"])
    return "\n".join(["{", ".reg .b32 t, a, b;", "shl.b32 t, $2, 4;",
                      "prmt.b32 a, t, 0, 0x9180;", "prmt.b32 b, $2, 0, 0x9180;",
                      "shl.b32 a, a, 2;", "and.b32 a, a, 0x81C081C0;", *mul("$0", "a"),
                      "shl.b32 b, b, 2;", "and.b32 b, b, 0x81C081C0;", *mul("$1", "b"), "}"])


FP4_SWAR_PTX_PRMT = _prmt_program(2)

# "place": the prmt program with ONE multiply a weight pair instead of two. SA = 2^(e - 65)
# (place_scale_word) gives the weights * 2^-64, and the accumulator is * 2^64 before its
# store (exact: powers of two). 9 instructions for 4 weights instead of 11, and no SB word
# to build or shuffle. bf16(e2m1 * 2^(e - 127)) exactly for e8m0 bytes e in [59, 192]
# (the weights the wgmma sees are normal bf16 for e >= 66, subnormal for 59..65); e >= 193
# (scales above 2^65) reads as inf. The matmul equals the default's while the tensor cores'
# products w x 2^-64 stay f32 normals (|w x| >= 2^-62; smaller ones may flush, each moving
# the sum by < 2^-62). Real checkpoints' expert scales lie far inside (a weight block of
# scale 2^65 or 2^-61 is no trained weight; load()'s numerics check warns about scale
# bytes > 192). The default since session 26 (H100: the B = 64 w13 call 727.7 -> 703.3 us,
# the 4-layer B = 64 step 6.23 -> 6.07 ms against "mad", which stays selectable as
# $DSV4_QMM_FP4_PTX=mad: exact for every scale byte).
FP4_SWAR_PTX_PLACE = _prmt_program(1)
# $0 <- low nibbles (even k); $1 <- high nibbles (odd k); $2 = B0 | B1 << 8; $3 = SA.
PLACE_LOG2 = 64   # the "place" weights come * 2^-64; the accumulator takes it back
# The largest e8m0 scale byte "place" decodes (its SA exponent field e + 126 - PLACE_LOG2
# stays <= 254): 192. load()'s numerics check warns about larger ones.
PLACE_MAX_SCALE_BYTE = 254 - 126 + PLACE_LOG2
FP4_SWAR_FORMS = {"mad": FP4_SWAR_PTX, "prmt": FP4_SWAR_PTX_PRMT, "place": FP4_SWAR_PTX_PLACE}


def fp4_swar_form():
    """The FP4 decode program's name, $DSV4_QMM_FP4_PTX (read when a kernel is traced):
    "place" (default; exact for e8m0 scale bytes 59..192), "prmt" or "mad" (both exact for
    every scale byte 0..254)."""
    form = os.environ.get("DSV4_QMM_FP4_PTX", "place")
    if form not in FP4_SWAR_FORMS:
        raise ValueError(f"DSV4_QMM_FP4_PTX must be one of {sorted(FP4_SWAR_FORMS)}, got "
                         f"{form!r}")
    return form


def place_scale_word(e):
    """int32 e8m0 bytes -> the "place" program's SA: 2^(e - 1 - PLACE_LOG2) as a bf16x2 word
    (int32); normal for e <= PLACE_MAX_SCALE_BYTE, inf (exponent 255) above."""
    return (jnp.minimum(e + 126 - PLACE_LOG2, 255) << 7) * 0x10001

FP8_SWAR_PTX = """{
.reg .b32 y, n, s;
prmt.b32 y, $1, 0, 0x4140;
and.b32 s, y, 0x00800080;
shl.b32 n, y, 4;
mad.lo.u32 n, s, 240, n;
mul.rn.bf16x2 n, n, $2;
mul.rn.bf16x2 $0, n, $3;
}"""
# $0 <- bf16x2 of B0, B1; $1 = B0 | B1 << 8; $2, $3 = SA, SB.

SWAR_SPLIT = {"fp4": (128, -1), "fp8": (134, -7)}   # (split exponent, SA exponent offset)


def swar_scale_words(fmt, e):
    """int32 e8m0 bytes -> (SA, SB) bf16x2 words (int32) with SA * SB = 2^(e - 1) (FP4) or
    2^(e - 7) (FP8), each factor a normal bf16 for every e in 0..254."""
    split, off = SWAR_SPLIT[fmt]
    fa = jnp.minimum(e, split) + off + 127           # biased exponent of SA
    fb = jnp.maximum(e, split) - split + 127         # biased exponent of SB
    return (fa << 7) * 0x10001, (fb << 7) * 0x10001


def _pair_i32(reg):
    """vector<2 x 8 bit> register -> i32 holding the two bytes in its low half."""
    i16 = ir.IntegerType.get_signless(16)
    i8 = ir.IntegerType.get_signless(8)
    if ir.VectorType(reg.type).element_type != i8:
        reg = vector.bitcast(ir.VectorType.get((2,), i8), reg)
    return arith.extui(ir.IntegerType.get_signless(32), mgpu.utils.bitcast(reg, i16))


def _first_lane(reg):
    """Element 0 of a register (vector<2 x f32 / i32>) as i32."""
    if isinstance(reg.type, ir.VectorType):
        reg = vector.extract(reg, dynamic_position=[],
                             static_position=ir.DenseI64ArrayAttr.get([0]))
    i32 = ir.IntegerType.get_signless(32)
    return reg if reg.type == i32 else arith.bitcast(i32, reg)


def _shfl_column(reg, c):
    """Column c (0..7) of an [R, 8] WGMMA-layout 32-bit tile, for this thread's row of
    `reg`: the 4 lanes of a row group hold columns (0, 1), (2, 3), (4, 5), (6, 7)."""
    i32 = ir.IntegerType.get_signless(32)
    v = vector.extract(reg, dynamic_position=[],
                       static_position=ir.DenseI64ArrayAttr.get([c & 1]))
    v = v if v.type == i32 else arith.bitcast(i32, v)
    return mgpu.utils.inline_ptx(f"shfl.sync.idx.b32 $0, $1, {c >> 1}, 0x1C1F, 0xFFFFFFFF;",
                                 v, result_types=i32, convergent=True)


def fp4_swar_decode(b_u8, sa, sb, col=None, *, form):
    """Packed e2m1 bytes uint8 [R, C] (WGMMA layout) -> (even-k, odd-k) bf16 [R, C]
    weights, exact. GPU only (inline PTX). The scale words (bf16x2 bits, int32 or f32):
    col=None: sa, sb [R, C], constant along each row; col=c: the step's [R, 8] word tiles,
    block c's words fetched from the lane of the row group that holds column c (one
    shuffle per row and word instead of a masked row sum). form: the program
    (FP4_SWAR_FORMS); "place" takes SA = place_scale_word(e) and sb=None, and its weights
    come * 2^-PLACE_LOG2."""
    R, C = b_u8.shape
    out = plgpu.ShapeDtypeStruct((R, C), jnp.bfloat16, layout=WG)
    ptx = FP4_SWAR_FORMS[form]
    if (form == "place") != (sb is None):
        raise ValueError(f"form {form!r} takes {'no' if form == 'place' else 'an'} SB word")
    scales = (sa,) if sb is None else (sa, sb)

    @plgpu.inline_mgpu(arg_types=(WG,) * (1 + len(scales)), return_type=(out, out))
    def dec(ctx, w, sa, sb=None):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        lo = np.empty_like(w.registers)
        hi = np.empty_like(w.registers)
        rows = {}

        words_in = (sa,) if sb is None else (sa, sb)

        def words(idx):
            if col is None:
                return tuple(_first_lane(v.registers[idx]) for v in words_in)
            # registers are indexed (row tile, column tile of 8, ...): same rows, column 0
            key = idx[:1] + (0,) + idx[2:]
            if key not in rows:
                rows[key] = tuple(_shfl_column(v.registers[key], col) for v in words_in)
            return rows[key]

        if col is not None:
            assert sa.shape == (R, 8) and sa.registers.shape[1] == 1, sa.registers.shape
        for idx, reg in np.ndenumerate(w.registers):
            r0, r1 = mgpu.utils.inline_ptx(
                ptx, _pair_i32(reg), *words(idx), result_types=[i32, i32])
            lo[idx] = mgpu.utils.bitcast(r0, bf2)
            hi[idx] = mgpu.utils.bitcast(r1, bf2)
        mk = lambda r: mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT,
                                            _is_signed=None)
        return mk(lo), mk(hi)

    return dec(b_u8, *scales)


def fp8_swar_decode(b_u8, sa_i32, sb_i32):
    """e4m3 bytes uint8 [R, C] (WGMMA layout) and the step's two scale words (int32
    scalars broadcast to [R, C], splat layout) -> bf16 [R, C], exact. GPU only."""
    R, C = b_u8.shape
    splat = plgpu.Layout.WG_SPLAT((R, C))

    @plgpu.inline_mgpu(arg_types=(WG, splat, splat),
                       return_type=plgpu.ShapeDtypeStruct((R, C), jnp.bfloat16, layout=WG))
    def dec(ctx, w, sa, sb):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        a, b = _first_lane(sa.registers.flat[0]), _first_lane(sb.registers.flat[0])
        regs = np.empty_like(w.registers)
        for idx, reg in np.ndenumerate(w.registers):
            r = mgpu.utils.inline_ptx(FP8_SWAR_PTX, _pair_i32(reg), a, b, result_types=i32)
            regs[idx] = mgpu.utils.bitcast(r, bf2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    return dec(b_u8, lax.broadcast(sa_i32, (R, C)), lax.broadcast(sb_i32, (R, C)))


def fp4_x_layout(x_GMK):
    """bf16 [G, M, K] -> [G, 2, K/32, M, 16]: x[g, m, 32c + 2i + h] at [g, h, c, m, i], i.e.
    de-interleaved (h = 0: even k, the low nibbles) in chunks of 16 packed columns (one
    e8m0 scale block), each chunk an [M, 16] wgmma operand."""
    G, M, K = x_GMK.shape
    return x_GMK.reshape(G, M, K // 32, 16, 2).transpose(0, 4, 2, 1, 3)


def _stream_call(fmt, x, ex_G, w, sc, *, G, M, N, K, tn, splits, stages, interpret, tkp=TKP,
                 reg_a=False, decode="cvt"):
    """f32 partials [S, G, N, M] (transposed outputs, one per K split).

    fmt "fp8": x bf16 [G, M, K], w e4m3 [E, N, K] (uint8 view for decode "swar"),
               sc uint8 [E, N/128, K/128].
    fmt "fp4": x bf16 fp4_x_layout [G, 2, K/32, M, 16], w uint8 [E, N, K/2],
               sc uint8 [E, N, K/32]."""
    E = w.shape[0]
    nk = _steps(fmt, K, tkp) // splits             # K steps per CTA
    form = fp4_swar_form() if fmt == "fp4" and decode.startswith("swar") else None
    place = form == "place"
    NC = tkp // 16                                 # FP4 scale blocks per step
    tr8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    tr16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tr32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    if fmt == "fp8":
        bufs = dict(w_s=plgpu.SMEM((stages, tn, TK), w.dtype, transforms=tr8),
                    x_s=plgpu.SMEM((stages, M, TK), jnp.bfloat16, transforms=tr16))
        wb = plgpu.SMEM((tn, TK), jnp.bfloat16, transforms=tr16)
    else:
        trw = (plgpu.TilingTransform((8, tkp)), plgpu.SwizzleTransform(tkp))
        bufs = dict(w_s=plgpu.SMEM((stages, tn, tkp), jnp.uint8, transforms=trw),
                    x_s=plgpu.SMEM((stages, 2, NC, M, 16), jnp.bfloat16, transforms=tr32),
                    sc_s=plgpu.SMEM((tn, nk * NC), jnp.uint8))
        wb = plgpu.SMEM((2, NC, tn, 16), jnp.bfloat16, transforms=tr32)
    if not reg_a:  # dequantised bf16 rows staged for the wgmma
        bufs["wb_s"] = wb

    identity = ex_G is None   # group g uses expert g (no id operand to build per call)

    def kernel(*refs, bar, sbar):
        x_g, ex_g, w_g, sc_g, o_g = refs[:1] + (None,) + refs[1:] if identity else refs
        g = lax.axis_index("g")
        nt = lax.axis_index("n")
        sp = lax.axis_index("s")
        e = g if identity else ex_g[g]
        valid = (e >= 0) & (e < E)             # empty group: no copies, zero output
        e = jnp.where(valid, e, 0)
        k0 = sp * nk
        rows = pl.ds(nt * tn, tn)

        def stream(w_s, x_s, wb_s=None, sc_s=None):
            def issue(j, slot):
                if fmt == "fp8":
                    kk = pl.ds((k0 + j) * TK, TK)
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, kk], w_s.at[slot], bar.at[slot])
                    plgpu.copy_gmem_to_smem(x_g.at[g, :, kk], x_s.at[slot], bar.at[slot])
                else:
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, pl.ds((k0 + j) * tkp, tkp)],
                                            w_s.at[slot], bar.at[slot])
                    for h in range(2):     # (one 5-D copy would exceed the TMA's dims)
                        plgpu.copy_gmem_to_smem(x_g.at[g, h, pl.ds((k0 + j) * NC, NC)],
                                                x_s.at[slot, h], bar.at[slot])

            def fp8_step(acc_ref, j, slot, sc_raw):
                if decode.startswith("swar"):
                    sa, sb = swar_scale_words("fp8", sc_raw.astype(jnp.int32))
                    for r in range(tn // 64):
                        r64 = pl.ds(64 * r, 64)
                        wv = fp8_swar_decode(plgpu.load(w_s.at[slot, r64], layout=WG), sa, sb)
                        if reg_a:
                            plgpu.wgmma(acc_ref.at[r64], wv, x_s.at[slot].T)
                        else:
                            wb_s[r64] = wv
                    if not reg_a:
                        plgpu.commit_smem()
                        plgpu.wgmma(acc_ref, wb_s, x_s.at[slot].T)
                    return
                # 2^(e-127) splat (built as a vector: scalar bitcasts do not lower)
                s = lax.bitcast_convert_type(
                    lax.broadcast(sc_raw.astype(jnp.int32) << 23, (64, TK)), jnp.float32)
                if reg_a:  # dequantised rows go from registers straight into the wgmma
                    for r in range(tn // 64):
                        r64 = pl.ds(64 * r, 64)
                        wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                        plgpu.wgmma(acc_ref.at[r64], (wv * s).astype(jnp.bfloat16),
                                    x_s.at[slot].T)
                    return
                for r in range(tn // 64):           # 64 rows at a time: register pressure
                    r64 = pl.ds(64 * r, 64)
                    wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                    wb_s[r64] = (wv * s).astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, wb_s, x_s.at[slot].T)

            def fp4_step(acc_ref, j, slot):
                # The 8 scale columns [tn, 8] holding this step's NC blocks; one per-row
                # vector per scale block by a masked row sum (a strided SMEM column load
                # does not lower).
                c0 = j * NC
                scl = plgpu.load(sc_s.at[:, pl.ds(c0 - lax.rem(c0, 8), 8)], layout=WG,
                                 optimized=False).astype(jnp.int32)
                col = plgpu.broadcasted_iota(jnp.int32, (tn, 8), 1, layout=WG) - lax.rem(c0, 8)
                b_all = plgpu.load(w_s.at[slot], layout=WG)                      # [tn, tkp]
                shfl = decode == "swar-shfl" and NC == 8   # the 8 columns are this step's
                words = ((lambda e: (place_scale_word(e), None)) if place else
                         (lambda e: swar_scale_words("fp4", e)))
                if shfl:
                    sa_all, sb_all = words(scl)                                   # [tn, 8]
                elif decode.startswith("swar"):
                    e_all = scl.astype(jnp.float32)           # (exact small integers)
                else:  # f32 multipliers 2^(e-127) * 2^14 (undoing the f16 bias trick below)
                    mult_all = lax.bitcast_convert_type((scl + 14) << 23, jnp.float32)

                def decode_block(c):
                    """(even-k, odd-k) bf16 [tn, 16] of scale block c."""
                    if shfl:
                        return fp4_swar_decode(b_all[:, 16 * c:16 * (c + 1)], sa_all, sb_all,
                                               col=c, form=form)
                    if decode.startswith("swar"):
                        e = jnp.where(col == c, e_all, 0.0).sum(axis=1).astype(jnp.int32)
                        sa, sb = (None if v is None else lax.broadcast_in_dim(v, (tn, 16), [0])
                                  for v in words(e))
                        return fp4_swar_decode(b_all[:, 16 * c:16 * (c + 1)], sa, sb,
                                               form=form)
                    b = b_all[:, 16 * c:16 * (c + 1)].astype(jnp.int32)           # [tn, 16]
                    mult = jnp.where(col == c, mult_all, 0.0).sum(axis=1)         # [tn]
                    mult = lax.broadcast_in_dim(mult, (tn, 16), [0])
                    # e2m1 magnitude bits m under the f16 exponent (m << 9) encode exactly
                    # e2m1(m) * 2^-14 (m = 1 is an f16 subnormal, kept by the cvt to f32);
                    # the sign goes to bit 15. Low nibble: bits 0-3, high: bits 4-7.
                    out = []
                    for f16 in (((b & 7) << 9) | ((b & 8) << 12),
                                ((b & 0x70) << 5) | ((b & 0x80) << 8)):
                        f16 = lax.bitcast_convert_type(f16.astype(jnp.int16), jnp.float16)
                        out.append((f16.astype(jnp.float32) * mult).astype(jnp.bfloat16))
                    return out

                for c in range(NC):                 # 16 packed bytes = one scale block
                    for h, wb in enumerate(decode_block(c)):
                        if reg_a:  # straight from registers into the wgmma
                            plgpu.wgmma(acc_ref, wb, x_s.at[slot, h, c].T)
                        else:
                            wb_s[h, c] = wb
                if reg_a:
                    return
                plgpu.commit_smem()
                for h in range(2):
                    for c in range(NC):
                        plgpu.wgmma(acc_ref, wb_s.at[h, c], x_s.at[slot, h, c].T)

            def mma(acc_ref):
                @pl.when(valid)
                def _():
                    if fmt == "fp4":
                        plgpu.copy_gmem_to_smem(sc_g.at[e, rows, pl.ds(k0 * NC, nk * NC)],
                                                sc_s, sbar)
                    for j in range(stages):
                        issue(j, j)
                    if fmt == "fp4":
                        plgpu.barrier_wait(sbar)

                    def body(j, sc_raw):
                        slot = lax.rem(j, stages)
                        if fmt == "fp8":
                            # next step's scale byte, loaded early so its latency hides
                            sc_next = sc_g[e, (nt * tn) // 128, k0 + jnp.minimum(j + 1, nk - 1)]
                        plgpu.barrier_wait(bar.at[slot])
                        if fmt == "fp8":
                            fp8_step(acc_ref, j, slot, sc_raw)
                        else:
                            fp4_step(acc_ref, j, slot)
                        plgpu.wgmma_wait(0)          # frees wb_s and this stage's slot

                        @pl.when(j + stages < nk)
                        def _():
                            issue(j + stages, slot)
                        return sc_next if fmt == "fp8" else sc_raw

                    init = sc_g[e, (nt * tn) // 128, k0] if fmt == "fp8" else jnp.int32(0)
                    lax.fori_loop(0, nk, body, init)
                return acc_ref[...]

            return pl.run_scoped(mma, plgpu.ACC((tn, M), jnp.float32))

        acc = pl.run_scoped(stream, **bufs)      # the stream buffers are freed here

        def store(o_s):
            # "place": the weights came * 2^-64 (exact power of two either way)
            o_s[...] = acc * jnp.float32(2.0 ** PLACE_LOG2) if place else acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[sp, g, rows])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((tn, M), jnp.float32))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, G, N, M), jnp.float32),
        grid=(G, N // tn, splits), grid_names=("g", "n", "s"),
        scratch_types=dict(
            bar=plgpu.Barrier(num_arrivals=2 if fmt == "fp8" else 3, num_barriers=stages),
            sbar=plgpu.Barrier(num_arrivals=1),
        ),
        interpret=interpret,
    )(*((x, w, sc) if identity else (x, ex_G, w, sc)))


def grouped_matmul_pallas(x_GMK, expert_G, w, *, splits=None, stages=None, tn=None,
                          tkp=None, reg_a=None, decode=None, rows=None, interpret=None):
    """The kernel path: f32 [G, M, N]. See the module docstring. `splits` (K splits per
    output tile), `stages` (pipeline depth), `tn` (64 or 128 weight rows per CTA) and
    `tkp` (FP4: 64 or 128 packed bytes per step) are tuning knobs; the defaults are the
    best measured on the H100. `reg_a`: feed the dequantised weight rows to the wgmma from
    registers instead of storing them to SMEM first (default $DSV4_REG_A, on; GPU-tested
    against the reference). The Mosaic-GPU interpreter cannot run a register lhs, so in
    interpret mode the SMEM path runs whatever `reg_a` says. `decode`: "cvt", "swar" or
    "swar-shfl" (default DECODE[fmt]: FP4 "swar-shfl", FP8 "cvt"), see DECODE and
    FP4_SWAR_PTX; interpret mode runs "cvt" (the interpreter cannot run inline PTX) with
    the tiling `decode` implies. `rows`: return only the first `rows` rows of each group
    (f32 [G, rows, N]), the real ones of a zero-padded x; they are sliced off before the
    split sum and the transpose, which then become elementwise and fuse into the consumer
    (with all 8 rows they were a transpose kernel of their own after most calls)."""
    check_inputs(x_GMK, jax.ShapeDtypeStruct(x_GMK.shape[:1], jnp.int32)
                 if expert_G is None else expert_G, w)
    G, M, K = x_GMK.shape
    E, N, _ = w.shape
    if expert_G is None and G > E:
        raise ValueError(f"expert_G=None (group g uses expert g) needs G <= E, got G={G}, "
                         f"E={E}")
    fmt = "fp8" if isinstance(w, Fp8Weight) else "fp4"
    if fmt == "fp4" and K % 512:
        raise ValueError(f"the FP4 kernel needs K % 512 == 0 (scale rows in 16-byte "
                         f"units), got K={K}")
    decode = decode or DECODE[fmt]
    if decode not in ("cvt", "swar", "swar-shfl"):
        raise ValueError(f"decode must be 'cvt', 'swar' or 'swar-shfl', got {decode!r}")
    reg_a = not interpret and (REG_A if reg_a is None else reg_a)
    # acc [tn, M] f32 lives in registers: 64 rows when M > 128
    fp4_tn, fp4_tkp = fp4_tiles(decode, M)
    tn = tn or (64 if M > 128 else fp4_tn if fmt == "fp4" else TN)
    if tn not in (64, 128) or N % tn:
        raise ValueError(f"tn must be 64 or 128 and divide N={N}, got {tn}")
    tkp = tkp or fp4_tkp
    if tkp not in (64, 128):
        raise ValueError(f"tkp must be 64 or 128, got {tkp}")
    S = splits or default_splits(fmt, G, N, K, tn, tkp)
    if not _valid_split(fmt, K, S, tkp):
        raise ValueError(f"splits={S} is not a valid K split for {fmt} K={K}")
    nk = _steps(fmt, K, tkp) // S
    decode = "cvt" if interpret else decode   # the interpreter cannot run inline PTX
    st = choose_stages(fmt, tn, M, nk, tkp=tkp, reg_a=reg_a,
                       **({"max_stages": stages} if stages else {}))
    ex = None if expert_G is None else expert_G.astype(jnp.int32)
    if fmt == "fp8":
        args = (x_GMK, ex, _u8(w.w) if decode != "cvt" else w.w, _u8(w.scale))
    else:
        args = (fp4_x_layout(x_GMK), ex, _u8(w.packed), _u8(w.scale))
    part = _stream_call(fmt, *args, G=G, M=M, N=N, K=K, tn=tn, splits=S, stages=st,
                        interpret=interpret, tkp=tkp, reg_a=reg_a, decode=decode)
    if rows is not None:
        if not 1 <= rows <= M:
            raise ValueError(f"rows must be in [1, M={M}], got {rows}")
        part = part[..., :rows]
    # The split sum as adds of static slices (not a reduce): XLA fuses elementwise adds into
    # the consumer's fusion, where a reduce would be a kernel of its own after every call.
    y = part[0]
    for i in range(1, S):
        y = y + part[i]
    return y.transpose(0, 2, 1)
