"""The key splits' merge as one Mosaic-GPU kernel (the XLA merge, kernel.merge_splits, is its
reference and the path interpreted / CPU calls keep).

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

# Shared with kernel.py (which imports this module, so they live here): heads a CTA (the
# WGMMA layout's rows), the layouts, a bf16 tile's 64-column, 128-byte swizzled transform.
HT = 64
CW = 64          # output columns a merge CTA: one 128-byte swizzled tile of bf16
TILED = (plgpu.TilingTransform((8, CW)), plgpu.SwizzleTransform(128))
WG = plgpu.Layout.WGMMA
ROW, COL = WG.reduce(1), WG.reduce(0)
SMEM_BYTES = 227 * 1024   # what a Hopper CTA may take
# Every split's [64, 64] bf16 tile and its 64 lse are staged at once (+ the sink's 64):
# 27 splits fill the SMEM. default_splits stays far below (<= ~10 measured).
MAX_SPLITS = (SMEM_BYTES - HT * 4) // (HT * CW * 2 + HT * 4)


def merge_splits_kernel(o, lse, sink, *, interpret=None):
    """o [NS, B, HP, 512] bf16 (each split's normalised partial), lse [NS, B, HP] f32 (its
    log-sum-exp, -inf where it saw no key), sink [HP] f32 -> [B, HP, 512] bf16.
    HP a multiple of 64 (the attention kernels pad heads to their 64-head tiles)."""
    NS, B, HP, D = o.shape
    if lse.shape != (NS, B, HP) or sink.shape != (HP,):
        raise ValueError(f"merge: o {o.shape}, lse {lse.shape} (want {(NS, B, HP)}), sink "
                         f"{sink.shape} (want {(HP,)})")
    if HP % HT or D % CW:
        raise ValueError(f"merge: heads {HP} must be a multiple of {HT} and width {D} of {CW}")
    if NS > MAX_SPLITS:
        raise ValueError(f"merge: {NS} splits exceed the kernel's {MAX_SPLITS} (every split's "
                         f"tile is staged in SMEM at once); merge them in XLA (merge='xla')")
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
        interpret=interpret,
    )(o, lse, sink)
