"""Shapes, SMEM layouts and compiler settings shared by the attention kernels (Hopper,
sm_90a; Pallas Mosaic GPU).

A key (window slot or compressed entry) is stored as 448 FP8 e4m3 nope bytes, 8 scale
exponent bytes (7 used: one per 64 dims) and 64 BF16 rope values. The kernels dequantise
it in SMEM into a bf16 K row of 512: e4m3 * 2^(e - 127) (exact in bf16) | rope; V = K.
"""
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

WINDOW = 128          # window ring slots a request
D = 512               # head dim (K = V = the dequantised entry)
NOPE = 448            # FP8 dims of a stored row
ROPE = 64             # BF16 rope dims of a stored row
NCH = NOPE // 64      # 64-byte chunks of a stored nope row (one scale exponent each)
BLK = 64              # keys per step (the reference's online-softmax block)
NW = WINDOW // BLK    # window key blocks; the compressed blocks follow them
HALF = D // 2         # output columns a consumer warpgroup owns
HT = 64               # heads a CTA: the wgmma M rows (the WGMMA layout's 64 rows)
BLOCK_TOKENS = 128    # tokens a compressed pool block covers (EPB entries of 128 / EPB each)

WG = plgpu.Layout.WGMMA
ROW, COL = WG.reduce(1), WG.reduce(0)
# bf16 tiles read by wgmma: tiled (8, 64), 128-byte swizzled
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# the FP8 staging rows: chunk-major [7 chunks, 64 keys, 64 B], tiled (8, 64) and 64-byte
# swizzled, so the dequant's loads are free of bank conflicts (7-way without the swizzle)
SWZ64 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
SMEM_BYTES = 227 * 1024   # what a Hopper CTA may take

# Registers a thread of the warp-specialised kernels: producer / consumer warpgroups.
# setmaxnreg moves registers within what the CTA was launched with (ptxas' count, 168, for
# 384 threads), so P_REGS + 2 C_REGS <= 504; 64 / 224 hangs (the consumers wait for
# registers that never come). 56 / 224 keeps the consumers' P V accumulator ([64, 256]
# f32, accumulated in place) and the dequant free of spills, and measured 1-2% faster
# than 40 / 232 on an H200.
P_REGS, C_REGS = 56, 224


def set_registers(consumer):
    """The calling warpgroup's register budget: C_REGS (consumer) or P_REGS (producer)."""
    if consumer:
        plgpu.set_max_registers(C_REGS, action="increase")
    else:
        plgpu.set_max_registers(P_REGS, action="decrease")


def compiler_params():
    """Lane lowering (SMEM exactly as declared). Barriers are placed by hand (commit_smem,
    mbarriers): the automatic ones would add a warpgroup barrier before every copy and
    around every SMEM store. No reduction scratch: the only reductions are within warps
    (rows of the WGMMA layout), and the kernels need those 2 KB of SMEM.
    approx_math: exp(x) as ex2.approx.ftz(x * log2 e) (2 instructions instead of the precise
    expf's ~9; the softmax phase of a block 577 -> 371 instructions a consumer thread) and
    log as lg2.approx; its error (~2^-22 relative) is far below the bf16 rounding of P."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                approx_math=True,
                                unsafe_no_auto_barriers=True, reduction_scratch_bytes=0)




def out_types(NS, B, HP):
    """The kernels' outputs: o [NS, B, HP, 512] bf16 (each split's output, normalised by its
    own softmax sum; final with the sink when NS == 1) and lse [NS, B, HP] f32."""
    return (jax.ShapeDtypeStruct((NS, B, HP, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((NS, B, HP), jnp.float32))
