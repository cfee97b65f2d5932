"""Sparse prefill attention, Pallas Mosaic-GPU (Hopper, sm_90a): many query rows, each
attending its own window band plus its own compressed entries (CSA: the indexer's top-k
ids; HCA: every visible entry), with the sink. Semantics: reference.py.

One CTA per (query row r, 64-head tile, output half c): heads are the wgmma M rows, and
the f32 output [64, 512] is too big for one warpgroup's registers, so the two halves of a
row are two CTAs (each scores every block: QK^T twice, the P.V once; their key copies
meet in L2). Per key block of 64:

    64 key rows [64, 2, 256] bf16 (any rows: window band, top-k ids, HCA prefix)
        --row TMAs-->  staging SMEM                + the block's window bias [64] f32
    staging -> registers -> K tile [2 halves, 64, 256] bf16 (tiled, swizzled: wgmma's);
    the next block's copies are issued now, overlapping this block's math
    S [64 heads, 64] = Q K^T / sqrt(512) + bias       (wgmma per half, f32)
    online softmax (running max m, sum l of the unrounded p), P -> bf16 -> SMEM
    acc [64, 256] = acc * alpha + P @ K[:, half c]    (wgmma, in place)
  out = acc * exp(m - mm) / (l exp(m - mm) + exp(sink - mm)), mm = max(m, sink)

Blocks: W / 64 window blocks, then ceil(ncmp[r] / 64) compressed ones (valid ids first,
so nothing past them is read). No [R, R] or [R, all entries] array exists anywhere.

The window bias is gathered per row before the kernel (wb_RB [R, W + 64] f32: row r's
wbias[woff[r] : woff[r] + W], then 64 zeros for the compressed blocks), so each bias copy
starts at a multiple of 64 floats. A TMA's innermost start coordinate must be a multiple
of 16 bytes (Hopper stops the kernel with CUDA_ERROR_ILLEGAL_INSTRUCTION otherwise; the
interpreter does not check it): copied straight from wbias at woff[r] + 64 b (woff[r] =
r + 1 in the model), three rows in four started off that alignment.
"""
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention.consumer import mma_into, online_update
from pallas_kernels.sparse_decode_attention.layout import COL, ROW, TILED, WG

D = 512
HALF = D // 2
HT = 64          # heads a CTA (wgmma M)
BLK = 64         # keys a block
SCALE = 1.0 / math.sqrt(D)


def _call(q_RHD, kt_K2H, wbias_K, ids_RL, ncmp_R, woff_R, coff_R, sink_H, *, window,
          interpret):
    R, HP, _ = q_RHD.shape
    NW = window // BLK
    NK = kt_K2H.shape[0]
    implicit = ids_RL is None            # HCA: entries coff .. coff + ncmp - 1
    L = 0 if implicit else ids_RL.shape[1]
    # each row's window bias (jnp indexing: clamped, as the reference's), then a block of
    # zeros: every bias copy starts at a multiple of 64 floats (TMA: 16-byte aligned)
    wi = woff_R[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
    wb_RB = jnp.pad(wbias_K.astype(jnp.float32)[jnp.clip(wi, 0, wbias_K.shape[0] - 1)],
                    ((0, 0), (0, BLK)))

    def kernel(*refs, bar, qbar):
        if implicit:
            q_g, kt_g, wb_g, nc_g, wo_g, co_g, sk_g, o_g = refs
            id_g = None
        else:
            q_g, kt_g, wb_g, id_g, nc_g, wo_g, co_g, sk_g, o_g = refs
        c = lax.axis_index("c")
        ht = lax.axis_index("h")
        r = lax.axis_index("r")
        nc = nc_g[r]
        woff = wo_g[r]
        coff = co_g[r]
        nblk = NW + (nc + BLK - 1) // BLK
        heads = pl.ds(ht * HT, HT)

        def body_scope(q_s, st_s, bias_s, k_s, p_s, sk_s, ids_s=None):
            def issue(b):
                cb = b - NW
                for j in range(BLK):
                    if implicit:
                        cj = jnp.minimum(cb * BLK + j, NK - 1)
                    else:
                        cj = coff + jnp.maximum(ids_s[jnp.clip(cb * BLK + j, 0, L - 1)], 0)
                    row = jnp.where(b < NW, woff + b * BLK + j,
                                    jnp.clip(coff + cj if implicit else cj, 0, NK - 1))
                    plgpu.copy_gmem_to_smem(kt_g.at[pl.ds(row, 1)], st_s.at[pl.ds(j, 1)], bar)
                start = jnp.where(b < NW, b, NW) * BLK       # NW * BLK: the zeros
                plgpu.copy_gmem_to_smem(wb_g.at[r, pl.ds(start, BLK)], bias_s, bar)

            for h in range(2):
                plgpu.copy_gmem_to_smem(q_g.at[r, heads, pl.ds(h * HALF, HALF)], q_s.at[h],
                                        qbar)
            plgpu.copy_gmem_to_smem(sk_g.at[heads], sk_s, qbar)
            if not implicit:
                for a in range(0, L, 256):          # (a TMA box is at most 256 wide)
                    n = min(256, L - a)
                    plgpu.copy_gmem_to_smem(id_g.at[r, pl.ds(a, n)], ids_s.at[pl.ds(a, n)],
                                            qbar)
            plgpu.barrier_wait(qbar)
            issue(0)
            col = plgpu.broadcasted_iota(jnp.int32, (BLK,), 0, layout=COL)

            def block(b, carry):
                acc, m, l = carry
                plgpu.barrier_wait(bar)
                for h in range(2):              # staging -> the swizzled K tile halves
                    for q4 in range(HALF // 64):
                        cols = pl.ds(q4 * 64, 64)
                        k_s[h, :, cols] = plgpu.load(st_s.at[:, h, cols], layout=WG,
                                                     optimized=False)
                bias = plgpu.load(bias_s, layout=COL)
                plgpu.commit_smem()

                @pl.when(b + 1 < nblk)
                def _():
                    issue(b + 1)

                def scores(s_ref):
                    for h in range(2):
                        plgpu.wgmma(s_ref, q_s.at[h], k_s.at[h].T)
                    plgpu.wgmma_wait(0)
                    return s_ref[...]
                s = pl.run_scoped(scores, plgpu.ACC((HT, BLK), jnp.float32))
                ok = (b < NW) | (col < nc - (b - NW) * BLK)
                bias = jnp.where(ok, bias, -jnp.inf)
                s = s * SCALE + lax.broadcast_in_dim(bias, s.shape, [1])
                m_new = jnp.maximum(m, s.max(axis=1))
                p, l, acc, _ = online_update(s, m_new, m, l, acc)
                p_s[...] = p.astype(jnp.bfloat16)
                plgpu.commit_smem()
                # V = K: this CTA's output half of the keys
                acc = mma_into(acc, p_s, k_s.at[c], interpret=interpret is not None)
                plgpu.wgmma_wait(0)
                return acc, m_new, l

            m0 = plgpu.layout_cast(jnp.full((HT,), -jnp.inf, jnp.float32), ROW)
            l0 = plgpu.layout_cast(jnp.full((HT,), 0.0, jnp.float32), ROW)
            a0 = plgpu.layout_cast(jnp.full((HT, HALF), 0.0, jnp.float32), WG)
            acc, m, l = lax.fori_loop(0, nblk, block, (a0, m0, l0))
            sk = plgpu.load(sk_s, layout=ROW)
            mm = jnp.maximum(m, sk)
            den = l * jnp.exp(m - mm) + jnp.exp(sk - mm)
            return acc * lax.broadcast_in_dim(jnp.exp(m - mm) / den, acc.shape, [0])

        bufs = dict(q_s=plgpu.SMEM((2, HT, HALF), jnp.bfloat16, transforms=TILED),
                    st_s=plgpu.SMEM((BLK, 2, HALF), jnp.bfloat16),
                    bias_s=plgpu.SMEM((BLK,), jnp.float32),
                    k_s=plgpu.SMEM((2, BLK, HALF), jnp.bfloat16, transforms=TILED),
                    p_s=plgpu.SMEM((HT, BLK), jnp.bfloat16, transforms=TILED),
                    sk_s=plgpu.SMEM((HT,), jnp.float32))
        if not implicit:
            bufs["ids_s"] = plgpu.SMEM((L,), jnp.int32)
        out = pl.run_scoped(body_scope, **bufs)

        def store(o_s):
            o_s[...] = out
            plgpu.commit_smem()
            for h in range(2):
                @pl.when(c == h)
                def _():
                    plgpu.copy_smem_to_gmem(o_s, o_g.at[r, heads, pl.ds(h * HALF, HALF)])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((HT, HALF), jnp.float32))

    args = [q_RHD, kt_K2H, wb_RB] + ([] if implicit else [ids_RL]) + [
        ncmp_R, woff_R, coff_R, sink_H]
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((R, HP, D), jnp.float32),
        # the two halves of a row next to each other: their key copies share L2
        grid=(2, HP // HT, R), grid_names=("c", "h", "r"),
        scratch_types=dict(bar=plgpu.Barrier(num_arrivals=BLK + 1),
                           qbar=plgpu.Barrier(num_arrivals=3 + -(-L // 256))),
        interpret=interpret,
    )(*args)
