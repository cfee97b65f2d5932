"""double_k: the warp-specialised attention kernel with two bf16 K tiles (what runs for
Flash's one head tile at B > 8; the seesaw kernel elsewhere, see __init__.use_seesaw).

One CTA per (request, key split, 64-head tile), three warpgroups: a producer (wg 2) copies
the selected rows (gather.py); two consumers (wg 0 / 1) each own an output column half
[64, 256], dequantise half of every K tile and compute the same full scores. With two K
tiles, block i+1's dequant runs under block i's P V wgmma. Under the scores instead, the
dequant's SMEM traffic meets the scores' (q and K read by both consumers) and the FP8 rows
(one staging slot) have less time to land: slower on an H100 at every shape measured.

SMEM (221 KB of 227): q [64, 512] bf16 64 KB + K 2 x 64 KB + one FP8 staging slot 28 KB +
meta 1 KB. What makes the second K tile fit: P goes to P V from registers (no P tile), the
FP8 rows have one staging slot, and the producer copies the rope rows straight into the K
tile (no rope staging).

Block i (K tile s = i % 2), consumer c:
  wait kfull (both dequants of block i done, both score wgmma of block i-1 done) and
  rbar[s] (its rope rows landed); bias from m_s[s]; S = q K[s]^T; softmax; P V from
  registers, and under it: wait block i+1's FP8 rows, dequantise half c of them into
  K[1-s] (the columns only this consumer's P V reads), arrive `free` (the FP8 slot may be
  refilled); arrive kfree[s]; then kfull (block i+1).
The producer, for block j: wait free (block j-1 dequantised) -> FP8 rows + meta of block
j; wait kfree[j % 2] (block j-2's P V done by both) -> rope rows of block j into K[j % 2].
Each lands a block ahead of its use.
"""
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention import consumer as C
from pallas_kernels.sparse_decode_attention import gather as G
from pallas_kernels.sparse_decode_attention.layout import (BLK, D, HT, NCH, SWZ64, TILED,
                                                           compiler_params, out_types,
                                                           set_registers)


def buffers():
    """q_s [64 heads, 512] bf16, k_s two bf16 K tiles, n_s one FP8 staging slot (7
    chunk-major [64, 64] chunks), m_s [2, 8, 64] meta (scale exponents + validity byte),
    v_s [64] f32 (the sink, then the lse)."""
    return (plgpu.SMEM((HT, D), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((2, BLK, D), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((1, NCH, BLK, 64), jnp.float8_e4m3fn, transforms=SWZ64),
            plgpu.SMEM((2, 8, BLK), jnp.uint8),
            plgpu.SMEM((HT,), jnp.float32))


def launch(kernel, NS, B, HP, interpret=False):
    """Three warpgroups a CTA (two consumers, the producer), one CTA per (request, split,
    64-head tile)."""
    return plgpu.kernel(kernel, out_type=out_types(NS, B, HP), num_threads=3,
                        thread_name="wg", compiler_params=compiler_params(),
                        grid=(B, NS, HP // HT), grid_names=("b", "s", "h"),
                        interpret=interpret)


def attention(q, wn, wr, cn, cr, *args, NS, epb, used_from_t=False, implicit=0,
              interpret=False):
    """-> (o [NS, B, HP, 512] bf16, lse [NS, B, HP] f32). q [B, HP, 512] bf16; wn / cn the
    FP8 rows as 64-byte chunks [rows * 7, 64], wr / cr the rope rows [rows, 64]; args =
    (idx, block_table, win_scale, cmp_scale, win_pos, t, used, sink) (inputs.prepare).
    epb: compressed entries per pool block. used_from_t: `used` is t (ids_prefix).
    implicit = K > 0: HCA ids derived in-kernel. interpret: run in the GPU interpreter,
    with gather.ref_rows for the cp.async copies and consumer.mma_into's stand-ins."""
    B, HP, _ = q.shape
    keys = args[:-2]
    kp, bps = G.key_blocks(keys, implicit, NS)

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, *refs):
        *key_g, nb_g, sink_g, o_g, lse_g = refs
        b, s_id, ht = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        g0 = s_id * bps
        n_load = G.split_load(nb_g[b], g0, bps, kp, epb, used_from_t)

        def scoped(q_s, k_s, n_s, m_s, v_s, qbar, wbar, cbar, rbar, free, kfull, kfree,
                   *stage_s):
            @pl.when(wg == 2)
            def _producer():
                set_registers(consumer=False)
                g_refs = (wn_g, wr_g, cn_g, cr_g, *key_g)
                s_refs = (n_s, k_s, m_s)
                nope = G.issuer(b, g_refs, s_refs, epb, implicit, "n", interpret)
                rope = G.issuer(b, g_refs, s_refs, epb, implicit, "r", interpret)
                plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(ht * HT, HT)], q_s, qbar)
                plgpu.copy_gmem_to_smem(sink_g.at[pl.ds(ht * HT, HT)], v_s, qbar)

                @pl.loop(0, n_load)
                def _(j):
                    s = lax.rem(j, 2)

                    @pl.when(j >= 1)
                    def _():
                        plgpu.barrier_wait(free)            # block j-1 dequantised
                    nope(g0 + j, s, wbar, cbar)

                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[s])     # block j-2's P V done
                    rope(g0 + j, s, rbar, rbar)

                plgpu.barrier_wait(qbar)
                if interpret:
                    C.observe_final_phases(n_load, (free,), kfree)

            @pl.when(wg < 2)
            def _consumer():
                set_registers(consumer=True)
                c = wg
                stage = stage_s[0].at[c] if interpret else None

                def dequant(i):
                    """Half c of block i's FP8 rows -> K tile i % 2, with the scale
                    exponents of m_s[i % 2]; then the FP8 slot is released."""
                    s = lax.rem(i, 2)
                    G.wait_block(g0 + i, s, wbar, cbar)
                    for h, chunks in ((0, range(4)), (1, range(4, NCH))):
                        @pl.when(c == h)
                        def _():
                            C.dequant(n_s, m_s, k_s.at[s], s, chunks)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(free)

                def body(i, carry):
                    acc, m, l = carry
                    s = lax.rem(i, 2)
                    plgpu.barrier_wait(kfull)
                    plgpu.barrier_wait(rbar.at[s])
                    bias = C.bias(m_s, s)

                    def deq_next():
                        @pl.when(i + 1 < n_load)
                        def _():
                            dequant(i + 1)

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_s, k_s.at[s].T)
                        return acc_ref[...]
                    sc = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32))
                    sc = sc * C.SCALE + lax.broadcast_in_dim(bias, sc.shape, [1])
                    m_new = jnp.maximum(m, sc.max(axis=1))
                    p, l, acc, _ = C.online_update(sc, m_new, m, l, acc)
                    p = p.astype(jnp.bfloat16)

                    def half(h):
                        return lambda a: C.mma_into(
                            a, p, k_s.at[s, :, pl.ds(h * (D // 2), D // 2)], deq_next,
                            interpret, stage)
                    acc = lax.cond(c == 0, half(0), half(1), acc)
                    plgpu.barrier_arrive(kfree.at[s])

                    @pl.when(i + 1 < n_load)
                    def _():
                        plgpu.barrier_arrive(kfull)
                    return acc, m_new, l

                plgpu.barrier_wait(qbar)

                @pl.when(n_load > 0)
                def _():
                    dequant(0)
                    plgpu.barrier_arrive(kfull)
                acc, m, l = lax.fori_loop(0, n_load, body, C.init_carry())
                # both consumers are done reading q_s (their last scores) before either
                # stages its output through it
                plgpu.barrier_arrive(kfull)
                plgpu.barrier_wait(kfull)
                C.finish(acc, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, c, NS == 1)

        pl.run_scoped(
            scoped,
            *buffers(),
            plgpu.Barrier(num_arrivals=2),                    # qbar
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # wbar: FP8 rows + meta landed
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # cbar
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # rbar: rope rows in K[s]
            plgpu.Barrier(num_arrivals=2),                    # free: the FP8 slot
            plgpu.Barrier(num_arrivals=2),                    # kfull
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # kfree: K[s] read by P V
            *C.staging(interpret),
            collective_axes="wg",
        )

    return launch(kernel, NS, B, HP, interpret)(q, wn, wr, cn, cr, *args)
