"""The seesaw attention kernel: q.k once a key block (FlashMLA's protocol; double_k computes
the full scores in both consumers, 1.5x the tensor work). What runs for Pro's two head
tiles and for B <= SEESAW_MAX_BATCH (__init__.use_seesaw).

Consumer c owns blocks c, c + 2, ... (K tile c): it scores its block, runs the softmax from
the statistics after the other's block, publishes P (bf16, p_s) and (m, alpha, l) (x_s),
and adds P V of its output half from registers; the other consumer rescales its half by
alpha and adds P V with P from SMEM. Same operands, order and roundings as double_k, so
the same output bit for bit (GPU tests). Block i, consumer c = i % 2, o = 1 - c:
  A  (the K tile free: block i-2's P V done by both) dequantise chunks 0-3 of block i;
  B  the other's block i-1: wait pub[o], rescale, P V from p_s, release its tile;
  C  wait kfull[c] (chunks 0-3 by c, 4-6 by o) and rbar[c] (rope rows);
  D  scores (q nope from SMEM, q rope from registers);
  E  softmax, publish; F  P V of its half from registers, release tile c; under it, chunks
     4-6 of block i+1 into the other tile (once block i-1's P V are done by both). Under
     the scores instead, their 32 accumulator registers live beside the dequant's: spills,
     1-4% slower.
Chunks 4-6 of block 0: consumer 1 before its first block. The producer, per block j:
chunks 0-3 + meta (after chunks 0-3 of j-1 are dequantised), chunks 4-6 (after those of
j-1), rope rows into tile j % 2 (after block j-2's P V); each part is one cp.async group,
announced (landA / landB / rbar) once the next part is issued. (Announcing chunks 4-6 as
soon as they land, before the rope's gate, was no faster.)

SMEM (~223 KB of 227): a P buffer (8 KB) only fits with q's rope columns in registers (+16
a consumer thread). The tile ids are read back from SMEM every block (t_s): as constant
addresses ptxas hoisted the 28 wgmma descriptors out of the block loop and spilled (812 B
-> 176).

Where it loses (Flash B = 64): one FP8 staging slot gives a region's copy about one
block's chain minus a dequant to land (double_k's about twice that), so the shorter chain
exposes the row gathers' latency, which Pro's second head tile (the same rows again, from
L2) and a lightly loaded GPU hide. SMEM has no room for a second slot.
"""
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention import consumer as C
from pallas_kernels.sparse_decode_attention import gather as G
from pallas_kernels.sparse_decode_attention.double_k import launch
from pallas_kernels.sparse_decode_attention.layout import (BLK, D, HALF, HT, NCH, NOPE, ROPE,
                                                           ROW, SWZ64, TILED, WG,
                                                           set_registers)

# The FP8 staging slot's two regions: chunks 0-3 (the block's owner dequantises them
# before its scores), chunks 4-6 (the previous block's owner, under its P V).
REG_A, REG_B = (0, 4), (4, NCH)
# meta slots: 4 blocks may be in flight between a meta copy and the last read of that
# slot's previous block
META_SLOTS = 4


def buffers():
    """q_s [1, 64, 448] bf16 (q's nope columns; its rope columns live in registers), k_s two
    bf16 K tiles, n_s one FP8 staging slot (two regions), m_s [4, 8, 64] meta, v_s [64]
    f32 (sink, then the lse), p_s [64, 64] bf16 (q's rope columns until both consumers
    loaded them, then the published P), x_s [3, 64] f32 (m, alpha, l after the published
    block), t_s [2] i32 (the tile ids)."""
    return (plgpu.SMEM((1, HT, NOPE), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((2, BLK, D), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((1, NCH, BLK, 64), jnp.float8_e4m3fn, transforms=SWZ64),
            plgpu.SMEM((META_SLOTS, 8, BLK), jnp.uint8),
            plgpu.SMEM((HT,), jnp.float32),
            plgpu.SMEM((HT, BLK), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((3, HT), jnp.float32),
            plgpu.SMEM((2,), jnp.int32))


def attention(q, wn, wr, cn, cr, *args, NS, epb, used_from_t=False, implicit=0,
              interpret=False):
    """Same arguments and outputs as double_k.attention."""
    B, HP, _ = q.shape
    keys = args[:-2]
    kp, bps = G.key_blocks(keys, implicit, NS)
    ms = META_SLOTS

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, *refs):
        *key_g, nb_g, sink_g, o_g, lse_g = refs
        b, s_id, ht = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        g0 = s_id * bps
        n = G.split_load(nb_g[b], g0, bps, kp, epb, used_from_t)

        def scoped(q_s, k_s, n_s, m_s, v_s, p_s, x_s, t_s, qbar, landA, landB, rbar, freeA,
                   freeB, kfull, kfree, pub, done, *stage_s):
            @pl.when(wg == 2)
            def _producer():
                set_registers(consumer=False)
                g_refs = (wn_g, wr_g, cn_g, cr_g, *key_g)
                s_refs = (n_s, k_s, m_s)
                heads = pl.ds(ht * HT, HT)
                plgpu.copy_gmem_to_smem(q_g.at[b, heads, pl.ds(0, NOPE)], q_s.at[0], qbar)
                plgpu.copy_gmem_to_smem(q_g.at[b, heads, pl.ds(NOPE, ROPE)], p_s, qbar)
                plgpu.copy_gmem_to_smem(sink_g.at[heads], v_s, qbar)
                part = lambda parts, chunks, meta: G.part_issuer(
                    b, g_refs, s_refs, epb, implicit, parts, chunks, meta, interpret)
                part_a, part_b, part_r = part("n", REG_A, True), part("n", REG_B, False), \
                    part("r", (0, 0), False)
                retire = lambda pending, fence=False: G.retire(pending, fence, interpret)

                @pl.loop(0, n)
                def _(j):
                    s = lax.rem(j, 2)

                    @pl.when(j >= 1)
                    def _():
                        plgpu.barrier_wait(freeA)          # chunks 0-3 of j-1 dequantised
                    part_a(g0 + j, lax.rem(j, ms))

                    @pl.when(j >= 1)
                    def _():
                        retire(1, fence=True)              # block j-1's rope rows
                        plgpu.barrier_arrive(rbar.at[1 - s])
                        plgpu.barrier_wait(freeB)          # chunks 4-6 of j-1 dequantised
                    part_b(g0 + j, lax.rem(j, ms))
                    retire(1)
                    plgpu.barrier_arrive(landA.at[s])

                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[s])    # block j-2's P V done by both
                    part_r(g0 + j, s)
                    retire(1)
                    plgpu.barrier_arrive(landB.at[s])

                @pl.when(n >= 1)
                def _():
                    retire(0, fence=True)
                    plgpu.barrier_arrive(rbar.at[lax.rem(n - 1, 2)])
                plgpu.barrier_wait(qbar)
                if interpret:
                    C.observe_final_phases(n, (freeA, freeB), kfree)

            def consumer(c):
                o = 1 - c
                cols = pl.ds(c * HALF, HALF)
                set_registers(consumer=True)
                stage = stage_s[0].at[c] if interpret else None
                t_s[c] = jnp.int32(c)

                def ids():   # (own tile, other tile), read back from SMEM every block
                    tc = t_s[c]
                    return tc, 1 - tc

                plgpu.barrier_wait(qbar)
                q_rope = plgpu.load(p_s, (), layout=WG)   # [64 heads, 64] bf16

                def dequant(i, tile, chunks, land, free, full):
                    plgpu.barrier_wait(land)
                    C.dequant(n_s, m_s, k_s.at[tile], lax.rem(i, ms), range(*chunks))
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(free)
                    plgpu.barrier_arrive(full)

                def other(carry):
                    """The other's latest block (tile to): -> acc, m, l after it."""
                    acc = carry[0]
                    _, to = ids()
                    plgpu.barrier_wait(pub.at[o])
                    alpha = plgpu.load(x_s.at[1], (), layout=ROW)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    acc = C.mma_into(acc, p_s, k_s.at[to, :, cols], interpret=interpret)
                    plgpu.barrier_arrive(kfree.at[to])
                    return (acc, plgpu.load(x_s.at[0], (), layout=ROW),
                            plgpu.load(x_s.at[2], (), layout=ROW))

                def own(i, carry, prev):
                    tc, to = ids()

                    @pl.when(i >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[tc])   # block i-2's P V done by both
                    dequant(i, tc, REG_A, landA.at[c], freeA, kfull.at[c])
                    if prev:
                        carry = other(carry)
                    acc, m, l = carry
                    plgpu.barrier_wait(kfull.at[c])
                    plgpu.barrier_wait(rbar.at[c])
                    bias = C.bias(m_s, lax.rem(i, ms))

                    def deq_next():
                        @pl.when(i + 1 < n)
                        def _():
                            if prev:
                                plgpu.barrier_wait(kfree.at[to])   # block i-1's P V
                            dequant(i + 1, to, REG_B, landB.at[o], freeB, kfull.at[o])

                    def qk(acc_ref):
                        # q_s's index read back too (0): its 28 descriptors stay in the loop
                        plgpu.wgmma(acc_ref, q_s.at[tc - c], k_s.at[tc, :, pl.ds(0, NOPE)].T)
                        C.wgmma(acc_ref, q_rope, k_s.at[tc, :, pl.ds(NOPE, ROPE)].T, stage)
                        return acc_ref[...]
                    sc = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32))
                    sc = sc * C.SCALE + lax.broadcast_in_dim(bias, sc.shape, [1])
                    m_new = jnp.maximum(m, sc.max(axis=1))
                    # alpha: the rescale applied here, for the other consumer
                    p, l, acc, alpha = C.online_update(sc, m_new, m, l, acc)
                    p = p.astype(jnp.bfloat16)
                    # p_s / x_s were last read by this consumer's P V of block i-1
                    p_s[...] = p
                    x_s[0] = m_new
                    x_s[1] = alpha
                    x_s[2] = l
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(pub.at[c])
                    acc = C.mma_into(acc, p, k_s.at[tc, :, cols], deq_next, interpret, stage)
                    plgpu.barrier_arrive(kfree.at[tc])
                    return acc, m_new, l

                carry = C.init_carry()
                one = lambda x: x.astype(jnp.int32)
                if c == 0:
                    # block 0 (0 or 1 times), blocks 2, 4, ..., then block n-1 if it is odd
                    carry = lax.fori_loop(0, jnp.minimum(n, 1),
                                          lambda _, cr: own(0, cr, prev=False), carry)
                    carry = lax.fori_loop(1, (n + 1) // 2,
                                          lambda k, cr: own(2 * k, cr, prev=True), carry)
                    carry = lax.fori_loop(0, one((n >= 2) & (n % 2 == 0)),
                                          lambda _, cr: other(cr), carry)
                else:
                    @pl.when(n >= 1)
                    def _():   # chunks 4-6 of block 0 (into tile 0)
                        _, to = ids()
                        dequant(0, to, REG_B, landB.at[0], freeB, kfull.at[0])
                    carry = lax.fori_loop(0, n // 2,
                                          lambda k, cr: own(2 * k + 1, cr, prev=True), carry)
                    carry = lax.fori_loop(0, n % 2, lambda _, cr: other(cr), carry)
                acc, m, l = carry
                # both consumers are past their last wgmma: tile 0 stages the output
                plgpu.barrier_arrive(done)
                plgpu.barrier_wait(done)
                if interpret:
                    C.observe_final_phases(n, (), kfree)
                C.finish(acc, m, l, k_s.at[0], v_s, o_g, lse_g, s_id, b, ht, jnp.int32(c),
                         NS == 1)

            for cc in (0, 1):
                @pl.when(wg == cc)
                def _(cc=cc):
                    consumer(cc)

        pl.run_scoped(
            scoped,
            *buffers(),
            plgpu.Barrier(num_arrivals=3),                    # qbar: q nope, q rope, sink
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # landA[c]: chunks 0-3 + meta
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # landB[j % 2]: chunks 4-6
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # rbar[c]: rope rows in K[c]
            plgpu.Barrier(num_arrivals=1),                    # freeA: chunks 0-3 free
            plgpu.Barrier(num_arrivals=1),                    # freeB: chunks 4-6 free
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # kfull[c]: both regions
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # kfree[s]: both P V
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # pub[c]: P, statistics
            plgpu.Barrier(num_arrivals=2),                    # done
            *C.staging(interpret),
            collective_axes="wg",
        )

    return launch(kernel, NS, B, HP, interpret)(q, wn, wr, cn, cr, *args)
