"""The sparse decode attention kernel on Blackwell (sm_100a): tcgen05 MMA with the scores
and the output accumulator in tensor memory (TMEM).

The same inputs (inputs.prepare_inputs), outputs (o [NS, B, HP, 512] bf16 and lse
[NS, B, HP] f32, merged by merge.py), row gather (gather.py, cp.async) and dequant
(consumer.dequant) as double_k.py. What differs:
- wgmma does not exist on sm_100. tcgen05.mma at M = 64 (the head tile) puts each
  accumulator in TMEM; loaded, it comes back in the WGMMA register layout, so the online
  softmax (consumer.py's layouts) is unchanged.
- Scores over 128 keys (two 64-key blocks) an MMA: 1-CTA M = 64 splits N over two lane
  groups, and a 128-byte-swizzled K tile needs N / 2 >= 64. The K tile is [128, 512]
  (both blocks), so a step is a block pair; an odd last block pairs with a zeroed,
  masked half.
- P V accumulates in TMEM (o [64, 512] f32 as two [64, 256] halves, 256 of the 512 TMEM
  columns): no accumulator registers, so one consumer warpgroup takes the whole head
  tile (double_k splits the columns over two for registers). The online softmax's
  rescale is a TMEM load, multiply, store of o before each step's P V.
- P goes through SMEM (tcgen05 takes A from SMEM or, at M = 128 only, TMEM), in the
  FP8 staging slot's place (a RefUnion: q 64 KB + K 128 KB + staging 28 KB fill the
  CTA's SMEM): the producer refills the slot once the step's P V is done.
- Two warpgroups: the consumer (wg 0: dequant, MMA issue, softmax) and the producer
  (wg 1: the gather). Nothing here has been timed; the Hopper kernels' overlap of the
  dequant with the P V (double_k, seesaw) is not reproduced.

Step i (blocks 2i, 2i+1 of the CTA's n_load):
  consumer: wait block 2i, dequantise it into K[0:64], release the slot (free) if block
  2i+1 exists; wait block 2i+1, dequantise into K[64:128] (or zero K[64:128]); S = q K^T
  (TMEM) -> registers; softmax; P -> SMEM; o *= alpha (TMEM); o += P K (TMEM); release
  the slot and K (free) if block 2i+2 exists.
  producer, block j: wait free (j >= 1), copy its FP8 rows + meta into the slot and its
  rope rows into K[64 (j % 2):].
Interpreted, the copies are gather.ref_rows (the interpreter runs no inline PTX).
"""
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention import consumer as C
from pallas_kernels.sparse_decode_attention import gather as G
from pallas_kernels.sparse_decode_attention.layout import (BLK, D, HT, NCH, ROW, SWZ64, TILED,
                                                           WG, compiler_params, out_types)

HALF = D // 2


class _PairRows:
    """K tile [128, 512] addressed as gather.ref_rows writes it: k[slot, rows, cols] is
    rows 64 slot + rows (the interpreter's stand-in for the GPU gather's addressing, which
    is the same for [2, 64, 512] and [128, 512] tiled (8, 64))."""

    def __init__(self, ref):
        self.ref = ref

    def __setitem__(self, idx, value):
        slot, rows, cols = idx
        self.ref[pl.ds(slot * BLK + rows.start, rows.size), cols] = value


def attention(q, wn, wr, cn, cr, *args, NS, epb, used_from_t=False, implicit=0,
              interpret=None):
    """-> (o [NS, B, HP, 512] bf16, lse [NS, B, HP] f32): double_k.attention's contract.
    interpret: None or plgpu.InterpretGPUParams."""
    B, HP, _ = q.shape
    keys = args[:-2]
    kp, bps = G.key_blocks(keys, implicit, NS)
    interp = interpret is not None

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, *refs, q_s, k_s, u_s, m_s, v_s, s_t, o_t0,
               o_t1, qbar, wbar, cbar, free, mbar, tbar):
        *key_g, nb_g, sink_g, o_g, lse_g = refs
        n_s, p_s = u_s
        o_t = (o_t0, o_t1)
        b, s_id, ht = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        g0 = s_id * bps
        n_load = G.split_load(nb_g[b], g0, bps, kp, epb, used_from_t)
        n_steps = lax.div(n_load + 1, 2)

        @pl.when(wg == 1)
        def _producer():
            g_refs = (wn_g, wr_g, cn_g, cr_g, *key_g)
            s_refs = (n_s, _PairRows(k_s) if interp else k_s, m_s)
            issue = G.issuer(b, g_refs, s_refs, epb, implicit, "nr", interp)
            plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(ht * HT, HT)], q_s, qbar)
            plgpu.copy_gmem_to_smem(sink_g.at[pl.ds(ht * HT, HT)], v_s, qbar)

            @pl.loop(0, n_load)
            def _(j):
                @pl.when(j >= 1)
                def _():
                    plgpu.barrier_wait(free)   # the slot (and K half j % 2) is free
                issue(g0 + j, lax.rem(j, 2), wbar, cbar)
            plgpu.barrier_wait(qbar)

        @pl.when(wg == 0)
        def _consumer():
            plgpu.barrier_wait(qbar)

            def tmem_sync():
                """Every thread's TMEM accesses are done before the next MMA."""
                plgpu.barrier_arrive(tbar)
                plgpu.barrier_wait(tbar)

            def body(i, carry):
                m, l = carry
                j0 = 2 * i
                pair = j0 + 1 < n_load
                G.wait_block(g0 + j0, 0, wbar, cbar)
                C.dequant(n_s, m_s, k_s.at[pl.ds(0, BLK)], 0, range(NCH))
                plgpu.commit_smem()

                @pl.when(pair)
                def _():
                    plgpu.barrier_arrive(free)
                    G.wait_block(g0 + j0 + 1, 1, wbar, cbar)
                    C.dequant(n_s, m_s, k_s.at[pl.ds(BLK, BLK)], 1, range(NCH))

                @pl.when(~pair)
                def _():   # the odd last block's partner: zeros, masked below
                    for c in range(D // 64):
                        k_s[pl.ds(BLK, BLK), pl.ds(64 * c, 64)] = plgpu.layout_cast(
                            jnp.zeros((BLK, 64), jnp.bfloat16), WG)
                plgpu.commit_smem()
                bias = (C.bias(m_s, 0),
                        jnp.where(pair, C.bias(m_s, 1), -jnp.inf).astype(jnp.float32))
                plgpu.tcgen05_mma(s_t, q_s, k_s.T, mbar, accumulate=False)
                plgpu.barrier_wait(mbar)
                s = plgpu.async_load_tmem(s_t, layout=WG)             # [64 h, 128 keys]
                plgpu.wait_load_tmem()
                sc = [s[:, 64 * h:64 * (h + 1)] * C.SCALE
                      + lax.broadcast_in_dim(bias[h], (HT, BLK), [1]) for h in range(2)]
                m_new = jnp.maximum(m, jnp.maximum(sc[0].max(axis=1), sc[1].max(axis=1)))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # all masked so far
                alpha = jnp.exp(m - m_safe)
                p = [jnp.exp(x - lax.broadcast_in_dim(m_safe, x.shape, [0])) for x in sc]
                l = l * alpha + p[0].sum(axis=1) + p[1].sum(axis=1)
                for h in range(2):
                    p_s[:, pl.ds(64 * h, 64)] = p[h].astype(jnp.bfloat16)

                @pl.when(i > 0)
                def _():   # the online softmax's rescale of o, in TMEM
                    for h in range(2):
                        o = plgpu.async_load_tmem(o_t[h], layout=WG)
                        plgpu.wait_load_tmem()
                        plgpu.async_store_tmem(
                            o_t[h], o * lax.broadcast_in_dim(alpha, o.shape, [0]))
                    plgpu.commit_tmem()
                tmem_sync()
                plgpu.commit_smem()
                for h in range(2):
                    plgpu.tcgen05_mma(o_t[h], p_s, k_s.at[:, pl.ds(h * HALF, HALF)],
                                      mbar if h == 1 else None, accumulate=i > 0)
                plgpu.barrier_wait(mbar)

                @pl.when(j0 + 2 < n_load)
                def _():
                    plgpu.barrier_arrive(free)
                return m_new, l

            m0 = plgpu.layout_cast(jnp.full((HT,), -jnp.inf, jnp.float32), ROW)
            l0 = plgpu.layout_cast(jnp.full((HT,), 0.0, jnp.float32), ROW)
            m, l = lax.fori_loop(0, n_steps, body, (m0, l0))
            for h in range(2):
                o = plgpu.async_load_tmem(o_t[h], layout=WG)
                plgpu.wait_load_tmem()
                o = jnp.where(n_load > 0, o, 0.0)    # no step ran: o was never written
                C.finish(o, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, h, NS == 1)

    return plgpu.kernel(
        kernel, out_type=out_types(NS, B, HP), num_threads=2, thread_name="wg",
        compiler_params=compiler_params(), grid=(B, NS, HP // HT),
        grid_names=("b", "s", "h"),
        scratch_types=dict(
            q_s=plgpu.SMEM((HT, D), jnp.bfloat16, transforms=TILED),
            k_s=plgpu.SMEM((2 * BLK, D), jnp.bfloat16, transforms=TILED),
            u_s=plgpu.RefUnion(plgpu.SMEM((1, NCH, BLK, 64), jnp.float8_e4m3fn,
                                          transforms=SWZ64),
                               plgpu.SMEM((HT, 2 * BLK), jnp.bfloat16, transforms=TILED)),
            m_s=plgpu.SMEM((2, 8, BLK), jnp.uint8),
            v_s=plgpu.SMEM((HT,), jnp.float32),
            s_t=plgpu.TMEM((HT, 2 * BLK), jnp.float32),
            o_t0=plgpu.TMEM((HT, HALF), jnp.float32),
            o_t1=plgpu.TMEM((HT, HALF), jnp.float32),
            qbar=plgpu.Barrier(num_arrivals=2),                   # q and the sink
            wbar=plgpu.Barrier(num_arrivals=1, num_barriers=2),   # a window block landed
            cbar=plgpu.Barrier(num_arrivals=1, num_barriers=2),   # a compressed one
            free=plgpu.Barrier(num_arrivals=1),                   # the slot (and K half)
            mbar=plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
            tbar=plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        ),
        interpret=interpret,
    )(q, wn, wr, cn, cr, *args)
