"""FP4 weight decode of the weight-streaming kernel: inline PTX on whole registers, and the
jnp form the Mosaic GPU interpreter runs instead (it runs no inline PTX).

One WGMMA-layout register holds two packed bytes of one row, B0 (column 2j) and B1
(column 2j + 1); the matching bf16 operands hold the same two columns as one bf16x2 word.
A nibble s|m placed as (m << 6) | (s << 15) in a 16-bit lane is bf16 e2m1(m) * 2^-126
exactly (m = 1 lands on the bf16 subnormal 2^-127: the e2m1 subnormal); bf16x2 multiplies
by scale words then give the weights. These multiplies must keep subnormal inputs (PTX
mul.rn.bf16x2 has no .ftz; sm_90). Each row's scale words come from the lane holding its
column by one shuffle (a step holds 8 scale blocks) instead of a masked row sum: FP4
experts, M = 8, G = 64 on an H100: float-conversion decode 238 us, integer decode with
masked row sums 155 us, with the shuffle 130 us.

Programs (PTX text, so that tests run them on a numpy model of the instructions):
  "place" (the default): prmt's sign-replicate mode places both nibbles of a byte, one
    bf16x2 multiply a weight pair by SA = 2^(e - 65) (place_scale_word): the weights come
    * 2^-64 and the accumulator is * 2^64 before its store (exact: powers of two). 9
    instructions for 4 weights. Exact for e8m0 scale bytes 59..192 (PLACE_MAX_SCALE_BYTE;
    bytes >= 193 read as inf) while the tensor cores' products w x 2^-64 stay f32 normals
    (|w x| >= 2^-62; smaller ones may flush, each moving the sum by < 2^-62). No trained
    weight is near either edge; loading warns about larger scale bytes. H100: the B = 64
    w13 call 727.7 -> 703.3 us, the 4-layer B = 64 step 6.23 -> 6.07 ms against "mad".
  "mad" (exact_fp4=True): the sign lifted by a multiply-add, two bf16x2 multiplies by SA
    = 2^(min(e, 128) - 1) and SB = 2^(max(e, 128) - 128) (swar_scale_words): exact for
    every scale byte 0..254.
"""
import numpy as np

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

WG = plgpu.Layout.WGMMA

FP4_MAD_PTX = """{
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

# prmt selector 0x9180 puts each byte in a 16-bit lane with its sign bit repeated above it,
# so a nibble in a byte's high half has its magnitude on bits 4-6 and its sign on bit 13
# (and 15): << 2 and one mask make the bf16 bits (e2m1 * 2^-126); the low nibbles first
# move up 4.
FP4_PLACE_PTX = "\n".join([
    "{", ".reg .b32 t, a, b;", "shl.b32 t, $2, 4;",
    "prmt.b32 a, t, 0, 0x9180;", "prmt.b32 b, $2, 0, 0x9180;",
    "shl.b32 a, a, 2;", "and.b32 a, a, 0x81C081C0;", "mul.rn.bf16x2 $0, a, $3;",
    "shl.b32 b, b, 2;", "and.b32 b, b, 0x81C081C0;", "mul.rn.bf16x2 $1, b, $3;", "}"])
# $0 <- low nibbles (even k); $1 <- high nibbles (odd k); $2 = B0 | B1 << 8; $3 = SA.
FP4_PROGRAMS = {"mad": FP4_MAD_PTX, "place": FP4_PLACE_PTX}
PLACE_LOG2 = 64   # the "place" weights come * 2^-64; the accumulator takes it back
# The largest e8m0 scale byte "place" decodes (its SA exponent field e + 126 - PLACE_LOG2
# stays <= 254): 192.
PLACE_MAX_SCALE_BYTE = 254 - 126 + PLACE_LOG2


def fp4_swar_form(exact_fp4=False):
    """The FP4 decode program's name: "place" (exact for e8m0 scale bytes 59..192) or, with
    exact_fp4, "mad" (exact for every scale byte 0..254)."""
    return "mad" if exact_fp4 else "place"


def place_scale_word(e):
    """int32 e8m0 bytes -> the "place" program's SA: 2^(e - 1 - PLACE_LOG2) as a bf16x2 word
    (int32); normal for e <= PLACE_MAX_SCALE_BYTE, inf (exponent 255) above."""
    return (jnp.minimum(e + 126 - PLACE_LOG2, 255) << 7) * 0x10001


def swar_scale_words(e, split=128, off=-1):
    """int32 e8m0 bytes -> the "mad" program's (SA, SB) bf16x2 words (int32) with SA * SB =
    2^(e - 1), each factor a normal bf16 for every e in 0..254."""
    fa = jnp.minimum(e, split) + off + 127           # biased exponent of SA
    fb = jnp.maximum(e, split) - split + 127         # biased exponent of SB
    return (fa << 7) * 0x10001, (fb << 7) * 0x10001


def scale_words(e, form):
    """int32 e8m0 bytes -> the program's (SA, SB or None) words."""
    return (place_scale_word(e), None) if form == "place" else swar_scale_words(e)


def _pair_i32(reg):
    """vector<2 x 8 bit> register -> i32 holding the two bytes in its low half."""
    i16 = ir.IntegerType.get_signless(16)
    i8 = ir.IntegerType.get_signless(8)
    if ir.VectorType(reg.type).element_type != i8:
        reg = vector.bitcast(ir.VectorType.get((2,), i8), reg)
    return arith.extui(ir.IntegerType.get_signless(32), mgpu.utils.bitcast(reg, i16))


def _shfl_column(reg, c):
    """Column c (0..7) of an [R, 8] WGMMA-layout 32-bit tile, for this thread's row of
    `reg`: the 4 lanes of a row group hold columns (0, 1), (2, 3), (4, 5), (6, 7)."""
    i32 = ir.IntegerType.get_signless(32)
    v = vector.extract(reg, dynamic_position=[],
                       static_position=ir.DenseI64ArrayAttr.get([c & 1]))
    v = v if v.type == i32 else arith.bitcast(i32, v)
    return mgpu.utils.inline_ptx(f"shfl.sync.idx.b32 $0, $1, {c >> 1}, 0x1C1F, 0xFFFFFFFF;",
                                 v, result_types=i32, convergent=True)


def fp4_decode(b_u8, sa, sb, col, *, form):
    """Packed e2m1 bytes uint8 [R, 16] (WGMMA layout, scale block `col` of the step) and the
    step's [R, 8] scale word tiles -> (even-k, odd-k) bf16 [R, 16] weights, exact ("place":
    * 2^-PLACE_LOG2). GPU only (inline PTX): the words of block col come from the lane of
    the row group that holds that column."""
    R, C = b_u8.shape
    out = plgpu.ShapeDtypeStruct((R, C), jnp.bfloat16, layout=WG)
    ptx = FP4_PROGRAMS[form]
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
            # registers are indexed (row tile, column tile of 8, ...): same rows, column 0
            key = idx[:1] + (0,) + idx[2:]
            if key not in rows:
                rows[key] = tuple(_shfl_column(v.registers[key], col) for v in words_in)
            return rows[key]

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


def _e2m1_values(nib):
    """e2m1 codes (integers 0..15) -> their values, f32, exact."""
    mag = nib & 7
    v = jnp.where(mag < 2, mag.astype(jnp.float32) * 0.5,
                  (2 + (mag & 1)).astype(jnp.float32)
                  * lax.bitcast_convert_type(((mag >> 1) + 125) << 23, jnp.float32))
    return jnp.where((nib & 8) != 0, -v, v)


def fp4_decode_jnp(b_u8, e, *, form):
    """fp4_decode's values in jnp, for the interpreter: bytes uint8 [R, 16], their block's
    e8m0 bytes int32 [R] -> (even-k, odd-k) bf16 [R, 16]. The same bf16 values as the PTX
    while the scale 2^(e - 127) ("place": 2^(e - 191)) is an f32 normal (XLA on CPU
    flushes subnormals): bytes 2..254 ("place": 66..192)."""
    shift = 127 + (PLACE_LOG2 if form == "place" else 0)
    s = lax.bitcast_convert_type((e[:, None] + 127 - shift) << 23, jnp.float32)   # [R, 1]
    b = b_u8.astype(jnp.int32)
    return tuple((_e2m1_values(n) * s).astype(jnp.bfloat16) for n in (b & 15, b >> 4))
