"""Key dequantisation helpers of the indexer's scoring kernel (Mosaic GPU, sm_90a).

Hopper has no e2m1 conversion, so the fp4 / nvfp4 keys' nibbles become bf16 by placing
their bits ("place"): a nibble s e1 e0 m goes to bf16 bit 15 (s), exponent bits 8..7
(e1 e0) and mantissa bit 6 (m). That is the e2m1 value * 2^-126 exactly, zero and the
0.5 code (a bf16 subnormal) included: both formats' subnormals are linear. The block
scale's multiply then takes 2^(126 - PLACE_LOG2) back and the head weights the other
2^PLACE_LOG2. Hopper's bf16 multiply keeps subnormal inputs (PTX mul.rn.bf16 has no .ftz).

Per register of two code bytes b0 | b1 << 8 (nibbles lo0 hi0 lo1 hi1) the program is 7
instructions for 4 values (PLACE_PROGRAM): prmt's sign-replicate mode (selector 0x9180)
puts each byte in a 16-bit lane with its sign bit repeated above it, so a high nibble's
sign lands on bit 13 and its magnitude on bits 4-6; << 2 and one mask make the bf16
pair; the low nibbles first shift up 4. On an H100 this replaced prmt lookup tables
(e2m1 -> bf16 / e4m3 pairs), a hardware e4m3 re-packing and integer bit building: the
fp4 scoring kernel took 92.3 us against 100.4 with the best table form (B = 64, 128K).

Key order "words": the wgmma's k order is permuted within each 16-dim group so that the
code bytes a thread needs are whole 32-bit words of a row. In the WGMMA bf16 layout thread
t holds k indices 16 c + 8 a + 2 t + e (c = the k16 step, a, e in {0, 1}); in
WGMMA_LAYOUT_8BIT it holds the code bytes 16 c + 4 t + j. So k index w reads the byte
(and dims) WORDS_PERM[w] = 16 c + 4 t + 2 a + e, and q's dims are permuted the same way
(words_q): the same products, summed in another order. The scale blocks (32 dims: fp4,
16: nvfp4) are unions of 16-dim groups, so each k index keeps its block. The words come by
ldmatrix and the low nibbles are shifted once a word: 831 -> 781 SASS loop instructions
per two chunks (fp4), 1-4% less time on an H100.

The Mosaic GPU interpreter runs no inline PTX and XLA on CPU flushes subnormal inputs, so
interpreted kernels take the jnp forms here (`interpret=True`): the nibbles' exact e2m1
values, and the block factor * 2^-126 applied in f32 (place_scale): the same keys, bit for
bit, while the keys are f32 normals (fp4 scale bytes >= 66; every nvfp4 scale).
"""
import numpy as np

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64        # entries per kernel step: the wgmma M tile

PLACE_PROGRAM = "\n".join([
    "{", ".reg .b32 t, a, b;",
    "shl.b32 t, $2, 4;",                 # low nibbles into the bytes' high halves
    "prmt.b32 a, t, 0, 0x9180;",         # [lo0 << 4, sign(lo0) x8, lo1 << 4 | hi0, sign(lo1) x8]
    "prmt.b32 b, $2, 0, 0x9180;",        # [b0, sign(hi0) x8, b1, sign(hi1) x8]
    "shl.b32 a, a, 2;",
    "and.b32 $0, a, 0x81C081C0;",        # bf16 pair of lo0, lo1: s e1 e0 m at bits 15, 8-6
    "shl.b32 b, b, 2;",
    "and.b32 $1, b, 0x81C081C0;",        # bf16 pair of hi0, hi1
    "}"])

# One word of four code bytes b0..b3 (bytes j of WGMMA_LAYOUT_8BIT) -> four bf16 pairs: the
# low nibbles of (b0, b1) and (b2, b3), the high nibbles of the same (PLACE_PROGRAM with
# bytes 2 and 3 taken by the selector 0xB3A2 and one shift of the low nibbles a word).
PLACE_WORDS_PROGRAM = "\n".join([
    "{", ".reg .b32 t, a;",
    "shl.b32 t, $4, 4;",
    "prmt.b32 a, t, 0, 0x9180;", "shl.b32 a, a, 2;", "and.b32 $0, a, 0x81C081C0;",
    "prmt.b32 a, t, 0, 0xB3A2;", "shl.b32 a, a, 2;", "and.b32 $1, a, 0x81C081C0;",
    "prmt.b32 a, $4, 0, 0x9180;", "shl.b32 a, a, 2;", "and.b32 $2, a, 0x81C081C0;",
    "prmt.b32 a, $4, 0, 0xB3A2;", "shl.b32 a, a, 2;", "and.b32 $3, a, 0x81C081C0;",
    "}"])

# The keys are made k * 2^-64, so that their factor 2^(E - 65) = 2^(E - 127) * 2^126 / 2^64
# stays a bf16 normal for every scale in use: exact for e8m0 exponents E in [59, 192]
# (scales 2^-68 .. 2^65; E >= 193 reads as inf). The scores come * 2^-64 from the f32
# accumulator (a power of two: the same roundings) and the head weights take 2^64 back,
# once a CTA.
PLACE_LOG2 = 64

_w = np.arange(64)
WORDS_PERM = 16 * (_w // 16) + 4 * ((_w // 2) % 4) + 2 * ((_w // 8) % 2) + _w % 2
del _w


def words_q(q_BHD):
    """q [..., 128] -> q with each 64-dim half in the "words" k order (q[..., WORDS_PERM])."""
    perm = np.concatenate([WORDS_PERM, 64 + WORDS_PERM])
    return q_BHD[..., perm]


def _e2m1_values(nib):
    """e2m1 codes (integers 0..15) -> their values as bf16, exact (jnp)."""
    mag = nib & 7
    # magnitude m: 0, .5 for m < 2; else (2 + (m & 1)) * 2^((m >> 1) - 2)
    v = jnp.where(mag < 2, mag.astype(jnp.float32) * 0.5,
                  (2 + (mag & 1)).astype(jnp.float32)
                  * lax.bitcast_convert_type(((mag >> 1) + 125) << 23, jnp.float32))
    return jnp.where((nib & 8) != 0, -v, v).astype(jnp.bfloat16)


def e2m1_place(byte_WG, *, interpret=False):
    """u8 [64, n] code bytes (WGMMA layout) -> (lo, hi): bf16 [64, n] of the low / high
    nibbles' e2m1 values * 2^-126, exact (PLACE_PROGRAM). interpret: the values themselves
    (jnp; see place_scale)."""
    if interpret:
        b = byte_WG.astype(jnp.uint32)
        return _e2m1_values(b & 15), _e2m1_values(b >> 4)
    return _nibble_pairs(byte_WG, PLACE_PROGRAM)


def e2m1_place_words(codes_L8, *, interpret=False):
    """u8 [64, 64] code bytes (WGMMA_LAYOUT_8BIT) -> (lo, hi): bf16 [64, 64] (WGMMA layout)
    of the low / high nibbles' e2m1 values * 2^-126, k index w holding byte WORDS_PERM[w]
    (key order "words"). interpret: the values themselves, bytes permuted in jnp."""
    if interpret:   # codes[:, WORDS_PERM]: in each 16-byte group, byte 4 t + 2 a + e -> 8 a + 2 t + e
        R = codes_L8.shape[0]
        perm = codes_L8.reshape(R, 4, 4, 2, 2).transpose(0, 1, 3, 2, 4).reshape(R, 64)
        return e2m1_place(perm, interpret=True)
    out = plgpu.ShapeDtypeStruct((CHUNK, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,), return_type=(out, out))
    def convert(ctx, x):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        regs = x.registers                   # [1, 4 k16 steps c, 1, 1, 2 row halves, 1...]
        assert regs.shape[1] == 4 and regs.shape[4] == 2 and regs.size == 8, regs.shape
        shape = mgpu.WGMMA_LAYOUT.registers_shape((CHUNK, 64))   # [1, 8 = 2 c + a, 1, 1, 2, ..]
        lo_regs, hi_regs = np.empty(shape, dtype=object), np.empty(shape, dtype=object)
        for idx, reg in np.ndenumerate(regs):
            c = idx[1]
            res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [mu.bitcast(reg, i32)],
                                  PLACE_WORDS_PROGRAM, "=r,=r,=r,=r,r")
            for k in range(4):
                half, a = divmod(k, 2)
                v = mu.bitcast(llvm.extractvalue(i32, res, [k]),
                               ir.VectorType.get((2,), ir.BF16Type.get()))
                (hi_regs if half else lo_regs)[(idx[0], 2 * c + a) + idx[2:]] = v
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT,
                                          _is_signed=None) for r in (lo_regs, hi_regs))

    return convert(codes_L8)


def place_scale(v, factor, *, interpret=False):
    """Placed values (e2m1_place / e2m1_place_words) * their bf16 block factor -> the bf16
    keys, exact. interpret: v holds the e2m1 values, and factor * 2^-126 joins in f32."""
    if interpret:
        f = factor.astype(jnp.float32) * jnp.float32(2.0 ** -126)
        return (v.astype(jnp.float32) * f).astype(jnp.bfloat16)
    return v * factor


def _nibble_pairs(byte_WG, program):
    """Runs `program` (PTX: $2 = two code bytes b0 | b1 << 8; $0 / $1 = the low / high
    nibbles' bf16x2 words) on every register of u8 [64, n] code bytes (WGMMA layout) ->
    (lo, hi) bf16 [64, n]."""
    out = plgpu.ShapeDtypeStruct(byte_WG.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(out, out))
    def convert(ctx, x):
        del ctx
        i16, i32 = (ir.IntegerType.get_signless(n) for n in (16, 32))
        lo_regs, hi_regs = np.empty_like(x.registers), np.empty_like(x.registers)
        for idx, reg in np.ndenumerate(x.registers):
            w = arith.extui(i32, mu.bitcast(reg, i16))        # bytes b0 | b1 << 8
            res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [w], program,
                                  "=r,=r,r")
            for k, regs in enumerate((lo_regs, hi_regs)):
                regs[idx] = mu.bitcast(llvm.extractvalue(i32, res, [k]),
                                       ir.VectorType.get((2,), ir.BF16Type.get()))
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=x.layout, _is_signed=None)
                     for r in (lo_regs, hi_regs))

    return convert(byte_WG)


def e4m3_bits_to_f32(x_u32, scale=1.0):
    """e4m3 value of the low byte of each u32, times `scale` (f32, exact for power-of-two
    scales): the byte viewed as e4m3 and converted, by the hardware's e4m3 -> f16 on a GPU
    (the NaN byte stays NaN, as in the reference). Building the f32 bits with integer ops
    instead cost ~12 ops a value (nvfp4 chunk loop 602 -> 486 SASS instructions)."""
    e4 = lax.bitcast_convert_type((x_u32 & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
    v = e4.astype(jnp.float32)
    return v if scale == 1.0 else v * jnp.float32(scale)


def wg_barrier(*, interpret=False):
    """bar.sync over this warpgroup (Mosaic GPU's warpgroup_barrier). The interpreter runs a
    CTA as one thread: nothing to wait for."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        mu.warpgroup_barrier()

    sync()
