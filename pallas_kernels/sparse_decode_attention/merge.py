"""The merge of the key splits (flash-decoding): in XLA (merge_splits) or as one Mosaic-GPU
kernel (merge_splits_kernel), chosen by __init__: the kernel from MERGE_KERNEL_MIN_BATCH
requests up to MAX_SPLITS splits, XLA's merge otherwise.

XLA makes two fusions of merge_splits: the weights [B, HP] (exp of each split's lse against
the running max, the sink in the denominator) and the weighted sum over the splits' bf16
partials [NS, B, HP, 512]. The second is at the HBM ceiling already; the first is a whole
kernel launch for a few KB. Here one CTA per (request, 64 heads, 64 output columns) loads its
splits' partial tiles and log-sum-exps by TMA, computes the weights of its 64 rows in
registers and writes the merged tile: one launch, the partials read once.

Same formula and order as merge_splits: m = max(..max(max(sink, lse_0), lse_1).., lse_{NS-1}),
w_s = exp(lse_s - m), den = (exp(sink - m) + w_0) + w_1 + .., out = ((w_0 o_0 + w_1 o_1) + ..)
/ den, in f32 until the final bf16 rounding."""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.interpret import gpu_interpret_params
from pallas_kernels.sparse_decode_attention.layout import HT, ROW, SMEM_BYTES, TILED, WG

CW = 64          # output columns a merge CTA: one 128-byte swizzled tile of bf16 (TILED)
# Every split's [64, 64] bf16 tile and its 64 lse are staged at once (+ the sink's 64):
# 27 splits fill the SMEM. default_splits stays far below (<= ~10 measured).
MAX_SPLITS = (SMEM_BYTES - HT * 4) // (HT * CW * 2 + HT * 4)
# The merge kernel from this batch on, instead of XLA's two fusions (the weights [B, HP],
# then the weighted sum, at the HBM ceiling already: the first is a whole launch for a few
# KB). H100, 128K, op GPU us, xla -> kernel: Flash CSA B=64 33.6 -> 32.0, Pro CSA B=32
# 47.9 -> 46.4, Flash HCA B=64 46.0 -> 44.6, Flash CSA B=8 13.2 -> 13.0; but Flash CSA B=1
# at 32K 9.9 -> 11.7 (XLA fuses the whole merge into one 1.8 us kernel there; the merge
# kernel's floor is ~3.5 us).
MERGE_KERNEL_MIN_BATCH = 8


def merge_splits(o, lse, sink):
    """Flash-decoding merge of the splits' normalised outputs o [NS, B, HP, 512] and
    log-sum-exps lse [NS, B, HP], with the sink in the denominator -> [B, HP, 512] bf16.
    Written as a sum over the (few) splits so XLA makes two fusions of it, not three."""
    ls = [lse[s] for s in range(lse.shape[0])]
    m = functools.reduce(jnp.maximum, ls, sink[None, :])                       # [B, HP]
    ws = [jnp.exp(x - m) for x in ls]
    den = functools.reduce(jnp.add, ws, jnp.exp(sink[None, :] - m))
    acc = functools.reduce(jnp.add, [w[..., None] * o[s].astype(jnp.float32)
                                     for s, w in enumerate(ws)])
    return (acc / den[..., None]).astype(jnp.bfloat16)


def merge_splits_kernel(o, lse, sink, *, interpret=False):
    """o [NS, B, HP, 512] bf16 (each split's normalised partial), lse [NS, B, HP] f32 (its
    log-sum-exp, -inf where it saw no key), sink [HP] f32 -> [B, HP, 512] bf16.
    HP a multiple of 64 (the attention kernels pad heads to their 64-head tiles).
    interpret: False, True or a plgpu.InterpretGPUParams (the GPU interpreter)."""
    NS, B, HP, D = o.shape
    if lse.shape != (NS, B, HP) or sink.shape != (HP,):
        raise ValueError(f"merge: o {o.shape}, lse {lse.shape} (want {(NS, B, HP)}), sink "
                         f"{sink.shape} (want {(HP,)})")
    if HP % HT or D % CW:
        raise ValueError(f"merge: heads {HP} must be a multiple of {HT} and width {D} of {CW}")
    if NS > MAX_SPLITS:
        raise ValueError(f"merge: {NS} splits exceed the kernel's {MAX_SPLITS} (every split's "
                         f"tile is staged in SMEM at once); merge them in XLA (merge_splits)")
    if o.dtype != jnp.bfloat16:
        raise ValueError(f"merge: partials must be bf16, got {o.dtype}")
    lse = lse.astype(jnp.float32)
    sink = sink.astype(jnp.float32)

    def kernel(o_g, lse_g, sink_g, out_g, o_s, l_s, k_s, bar):
        b, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
        heads, cols = pl.ds(h * HT, HT), pl.ds(c * CW, CW)
        for s in range(NS):
            plgpu.copy_gmem_to_smem(o_g.at[s, b, heads, cols], o_s.at[s], bar)
            plgpu.copy_gmem_to_smem(lse_g.at[s, b, heads], l_s.at[s], bar)
        plgpu.copy_gmem_to_smem(sink_g.at[heads], k_s, bar)
        plgpu.barrier_wait(bar)
        sk = plgpu.load(k_s, layout=ROW)
        ls = [plgpu.load(l_s.at[s], layout=ROW) for s in range(NS)]
        m = functools.reduce(jnp.maximum, ls, sk)
        ws = [jnp.exp(x - m) for x in ls]
        den = functools.reduce(jnp.add, ws, jnp.exp(sk - m))
        acc = functools.reduce(jnp.add, [
            lax.broadcast_in_dim(w, (HT, CW), [0])
            * plgpu.load(o_s.at[s], layout=WG).astype(jnp.float32)
            for s, w in enumerate(ws)])
        out = acc / lax.broadcast_in_dim(den, (HT, CW), [0])
        o_s[0] = out.astype(jnp.bfloat16)      # split 0's tile is read: reuse it
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[0], out_g.at[b, heads, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, HP, D), jnp.bfloat16),
        grid=(B, HP // HT, D // CW), grid_names=("b", "h", "c"),
        scratch_types=dict(
            o_s=plgpu.SMEM((NS, HT, CW), jnp.bfloat16, transforms=TILED),
            l_s=plgpu.SMEM((NS, HT), jnp.float32),
            k_s=plgpu.SMEM((HT,), jnp.float32),
            bar=plgpu.Barrier(num_arrivals=2 * NS + 1)),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=gpu_interpret_params(interpret),
    )(o, lse, sink)
