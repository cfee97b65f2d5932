"""Seesaw probe (session 33): is q.k once a block faster than q.k in both consumers?

The decode attention kernel (pallas_kernels/sparse_decode_attention, `_attn_call_dk`) runs
two consumer warpgroups that each own half of the output columns, so both compute the full
scores of every key block: 1.5x the algorithm's tensor work. FlashMLA's "seesaw" has
consumer i % 2 own block i instead: it scores the block, runs the softmax with the running
statistics after block i-1 (published by the other consumer), publishes P_i (bf16) and
(m_i, alpha_i, l_i) through SMEM, and both consumers rescale their half and add P_i V_i
(the owner's P from registers, the other's from SMEM). The roundings are the same as the
duplicated form's, so the outputs must be bit-identical.

This is a toy of the protocol alone: bf16 keys of one request copied by TMA into two K
tiles (no paged gather, no FP8 dequant, no sink, no splits), q [64 heads, 512], keys
[N, 512], softmax(q k^T / sqrt(512)) k with P rounded to bf16 per 64-key block as the
reference. Both forms share everything else (producer, tiles, softmax code, the final
store), so their time difference is the protocol's. Before building the seesaw into the
real kernel (MOSAIC_GPU_NOTES.md: it needs ~3 KB of SMEM the kernel lacks, and its tile
refills land on the serial chain), this measures what the protocol alone buys.

    python benchmarks/seesaw_probe.py               # GPU: bit-identity + timing table
    python benchmarks/seesaw_probe.py --interpret   # CPU: tiny shapes, interpreter
"""
from __future__ import annotations

import argparse
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# the attention kernel's shapes, layouts and online-softmax step, so both forms here run
# its arithmetic: heads a CTA (the wgmma M), head width, keys a block
# (HALF: the output columns a consumer owns)
from pallas_kernels.sparse_decode_attention.kernel import BLK, D, HALF, _online_update
from pallas_kernels.sparse_decode_attention.merge import HT, ROW, TILED, WG

FORMS = ("dup", "seesaw", "seesaw_nest")


def reference(q_BHD, k_BND):
    """float64 softmax(q k^T / sqrt(512)) k -> [B, 64, 512] (no roundings)."""
    q = np.asarray(q_BHD, np.float64)
    k = np.asarray(k_BND, np.float64)
    s = np.einsum("bhd,bnd->bhn", q, k) / math.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhn,bnd->bhd", p / p.sum(-1, keepdims=True), k)


def _online(s, m, l, acc):
    """The kernel's online-softmax step (_online_update) for scores s [64, 64] with the
    statistics (m, l) after the previous block -> (P f32, m, l, alpha, acc rescaled); alpha
    (the rescale applied, published by the seesaw's owner for the other consumer) is the
    one _online_update applied, so both consumers rescale by the same bits."""
    m_new = jnp.maximum(m, s.max(axis=1))
    p, l, acc, alpha = _online_update(s, m_new, m, l, acc)
    return p, m_new, l, alpha, acc


def dense_attention(q_BHD, k_BND, *, form="seesaw", reuse=False, interpret=None):
    """q bf16 [B, 64, 512], k bf16 [B, N, 512] (N a multiple of 64) -> bf16 [B, 64, 512].
    reuse: only blocks 0 and 1 are copied; block j reuses K tile j % 2 as it stands (right
    only for keys that repeat every 128, see make_inputs): no HBM traffic after the first
    two blocks, so the time is the consumers' chain alone.
    form "dup": both consumers score every block; "seesaw": consumer i % 2 owns block i
    and handles the other's block i-1 before issuing its scores; "seesaw_nest": the same,
    with block i-1 handled while the scores' wgmma runs (both accumulators live at once).
    interpret: plgpu.InterpretGPUParams (CPU); the interpreter takes no register A operand
    and no in-place accumulator, so there P always goes through SMEM and P V is added to
    the output accumulator after the wgmma (the same in both forms)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    B, H, Dq = q_BHD.shape
    N = k_BND.shape[1]
    if H != HT or Dq != D or k_BND.shape[2] != D or N % BLK or N < BLK:
        raise ValueError(f"need q [B, {HT}, {D}] and k [B, N, {D}] with N a multiple of {BLK}, "
                         f"got {q_BHD.shape} and {k_BND.shape}")
    n = N // BLK
    gpu = interpret is None
    nest = form == "seesaw_nest"
    scale = 1.0 / math.sqrt(D)

    def kernel(q_g, k_g, o_g):
        b = lax.axis_index("b")
        wg = lax.axis_index("wg")

        def scoped(q_s, k_s, p_s, x_s, t_s, qbar, kfull, kfree, pub, done):
            def pv_from(p_val, p_ref, tile, c, acc):
                """acc + P V[:, half c] of K tile `tile`: P from registers (p_val, GPU only)
                or from SMEM (p_ref)."""
                cols = pl.ds(c * HALF, HALF)
                a = p_ref if p_val is None else p_val
                if gpu:
                    def mma(acc_ref):
                        plgpu.wgmma(acc_ref, a, k_s.at[tile, :, cols])
                    return pl.run_state(mma)(plgpu.ACC.init(acc))

                def fresh(acc_ref):
                    plgpu.wgmma(acc_ref, p_ref, k_s.at[tile, :, cols])
                    return acc_ref[...]
                return acc + pl.run_scoped(fresh, plgpu.ACC((HT, HALF), jnp.float32))

            def init():
                m = plgpu.layout_cast(jnp.full((HT,), -jnp.inf, jnp.float32), ROW)
                l = plgpu.layout_cast(jnp.full((HT,), 0.0, jnp.float32), ROW)
                acc = plgpu.layout_cast(jnp.full((HT, HALF), 0.0, jnp.float32), WG)
                return acc, m, l

            def consumer_dup(c):
                """Both consumers score block i (tile i % 2), each adds P V of its half."""
                def body(i, carry):
                    acc, m, l = carry
                    s = lax.rem(i, 2)
                    plgpu.barrier_wait(kfull.at[s])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_s, k_s.at[s].T)
                        return acc_ref[...]
                    sc = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32)) * scale
                    p, m, l, _, acc = _online(sc, m, l, acc)
                    pb = p.astype(jnp.bfloat16)
                    if not gpu:
                        p_s[c] = pb
                        plgpu.commit_smem()
                    acc = pv_from(pb if gpu else None, p_s.at[c], s, c, acc)
                    plgpu.barrier_arrive(kfree.at[s])
                    return acc, m, l
                return lax.fori_loop(0, n, body, init())

            def consumer_seesaw(c):
                """Consumer c owns blocks c, c + 2, ...: always K tile c, P buffer c and
                statistics row c. Before (or, nested, under) its scores of block i it
                handles the other's block i-1 (wait the publish, rescale, P V from SMEM).
                The tile ids are read back from SMEM every block: as compile-time
                constants ptxas hoists every wgmma descriptor out of the loop and spills
                (~1 KB, sm_90a), as session 24 saw in the attention kernel."""
                t_s[c] = jnp.int32(c)

                def ids():
                    tc = t_s[c]
                    return tc, 1 - tc

                def other(acc):
                    """The other's latest block (tile o): -> acc, m, l after it."""
                    _, o = ids()
                    plgpu.barrier_wait(pub.at[o])
                    alpha = plgpu.load(x_s.at[o, 1], layout=ROW)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    acc = pv_from(None, p_s.at[o], o, c, acc)
                    plgpu.barrier_arrive(kfree.at[o])
                    return (acc, plgpu.load(x_s.at[o, 0], layout=ROW),
                            plgpu.load(x_s.at[o, 2], layout=ROW))

                def own(carry, prev):
                    acc, m, l = carry
                    if not nest:   # the other's block i-1 first, then the scores
                        acc, m, l = other(acc) if prev else (acc, m, l)
                    tc, _ = ids()
                    plgpu.barrier_wait(kfull.at[tc])

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_s, k_s.at[tc].T)
                        # nest: the other's block i-1 while the scores run (its statistics
                        # are the ones block i's softmax starts from)
                        st = (other(acc) if prev else (acc, m, l)) if nest else (acc, m, l)
                        return (acc_ref[...],) + st
                    sc, acc, m, l = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32))
                    p, m, l, alpha, acc = _online(sc * scale, m, l, acc)
                    pb = p.astype(jnp.bfloat16)
                    # p_s[c] and x_s[c] were last read by the other's P V of block i-2,
                    # done before it published block i-1, which this consumer waited for
                    p_s[tc] = pb
                    x_s[tc, 0] = m
                    x_s[tc, 1] = alpha
                    x_s[tc, 2] = l
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(pub.at[tc])
                    acc = pv_from(pb if gpu else None, p_s.at[tc], tc, c, acc)
                    plgpu.barrier_arrive(kfree.at[tc])
                    return acc, m, l

                carry = init()
                n_own = (n - c + 1) // 2
                if c == 0:   # block 0 has no block before it
                    carry = own(carry, prev=False)
                carry = lax.fori_loop(1 - c, n_own, lambda j, cr: own(cr, prev=True), carry)
                if (n - 1) % 2 != c:   # the last block is the other's
                    carry = other(carry[0])
                return carry

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(56, action="decrease")
                plgpu.copy_gmem_to_smem(q_g.at[b], q_s, qbar)

                @pl.loop(0, n)
                def _(j):
                    s = lax.rem(j, 2)

                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[s])    # both P V of block j-2 done
                        if reuse:   # the tile already holds block j's keys
                            plgpu.barrier_arrive(kfull.at[s])
                    copy = (lambda: plgpu.copy_gmem_to_smem(
                        k_g.at[b, pl.ds(j * BLK, BLK)], k_s.at[s], kfull.at[s]))
                    if reuse:
                        pl.when(j < 2)(copy)
                    else:
                        copy()

                # every phase of a barrier is observed by the warpgroups that use it (the
                # interpreter checks): q's, and the last two blocks' releases
                plgpu.barrier_wait(qbar)
                for j in range(max(n - 2, 0), n):
                    plgpu.barrier_wait(kfree.at[j % 2])

            for c in (0, 1):
                @pl.when(wg == c)
                def _consumer(c=c):
                    plgpu.set_max_registers(224, action="increase")
                    plgpu.barrier_wait(qbar)
                    acc, _, l = (consumer_dup if form == "dup" else consumer_seesaw)(c)
                    # both consumers are done reading q_s before it stages the output
                    plgpu.barrier_arrive(done)
                    plgpu.barrier_wait(done)
                    out = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
                    q_s[:, pl.ds(c * HALF, HALF)] = out.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    for r in range(HT // 8):   # 8-row strips: contiguous in the tiled SMEM
                        plgpu.copy_smem_to_gmem(q_s.at[pl.ds(r * 8, 8), pl.ds(c * HALF, HALF)],
                                                o_g.at[b, pl.ds(r * 8, 8), pl.ds(c * HALF, HALF)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((HT, D), jnp.bfloat16, transforms=TILED),        # q_s (then the output)
            plgpu.SMEM((2, BLK, D), jnp.bfloat16, transforms=TILED),    # k_s: two K tiles
            plgpu.SMEM((2, HT, BLK), jnp.bfloat16, transforms=TILED),   # p_s: P a consumer
            plgpu.SMEM((2, 3, HT), jnp.float32),                        # x_s: m, alpha, l
            plgpu.SMEM((2,), jnp.int32),                                # t_s: tile ids
            plgpu.Barrier(num_arrivals=1),                              # qbar
            plgpu.Barrier(num_arrivals=1, num_barriers=2),              # kfull[s]: K landed
            plgpu.Barrier(num_arrivals=2, num_barriers=2),              # kfree[s]: both P V
            plgpu.Barrier(num_arrivals=1, num_barriers=2),              # pub[c]: P, stats
            plgpu.Barrier(num_arrivals=2),                              # done: q_s free
            collective_axes="wg",
        )

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  approx_math=True, unsafe_no_auto_barriers=True,
                                  reduction_scratch_bytes=0)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((B, HT, D), jnp.bfloat16),
                        num_threads=3, thread_name="wg", grid=(B,), grid_names=("b",),
                        compiler_params=params, interpret=interpret)(q_BHD, k_BND)


def make_inputs(seed, B, N, reuse=False):
    """Random q [B, 64, 512], k [B, N, 512] (bf16); reuse: k repeats every 2 blocks."""
    kq, kk = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (B, HT, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (B, min(N, 2 * BLK) if reuse else N, D), jnp.float32)
    if reuse:
        k = jnp.tile(k, (1, -(-N // k.shape[1]), 1))[:, :N]
    return q, k.astype(jnp.bfloat16)


def check(q, k, interpret=None, reuse=False):
    """Every form against the float64 reference (bf16 P and output: rel err < 1e-2) and
    against "dup" (bit for bit) -> the rel errs in FORMS order."""
    ref = reference(q, k)
    outs = {f: np.asarray(jax.jit(lambda a, b, f=f: dense_attention(
        a, b, form=f, reuse=reuse, interpret=interpret))(q, k), np.float32) for f in FORMS}
    errs = tuple(float(np.linalg.norm(outs[f] - ref) / np.linalg.norm(ref)) for f in FORMS)
    if max(errs) > 1e-2:
        raise AssertionError(f"relative error vs the float64 reference {errs}")
    for f in FORMS[1:]:
        if not np.array_equal(outs["dup"], outs[f]):
            raise AssertionError(f"{f} differs from dup: max abs diff "
                                 f"{np.abs(outs['dup'] - outs[f]).max():.3g}")
    return errs


def check_interpreted(B, N, seed=None, reuse=False):
    """check() in the GPU interpreter with its race detector on; a race found is an error."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()
    seed = B * 7 + N if seed is None else seed
    errs = check(*make_inputs(seed, B, N, reuse), reuse=reuse,
                 interpret=plgpu.InterpretGPUParams(detect_races=True))
    if ipc.get_races().races_found:
        raise AssertionError("the interpreter's race detector found a race")
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--cases", default="128:320,64:640,132:640",
                    help="B:N pairs (N keys a CTA; 128:320 is the Flash CSA B=64 grid: "
                         "128 CTAs of 5 blocks)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.interpret:
        for B, N, reuse in ((1, 192, False), (2, 256, False), (1, 320, True)):
            print(f"interpreted B={B} N={N} reuse={reuse}: rel err {' / '.join(FORMS)} "
                  f"{check_interpreted(B, N, reuse=reuse)}; bit-identical, no race found")
        return
    from benchmarks.attention_decode import profile_times
    from benchmarks.common import hbm_bandwidth, tensor_peak
    bw, peak = hbm_bandwidth(), tensor_peak()
    dev = jax.devices()[0].device_kind
    print(f"device {dev}; HBM ceiling {bw['ceiling'] / 1e9:.0f} GB/s; bf16 tensor peak "
          f"{peak / 1e12:.0f} TFLOP/s (cuBLAS 8192^3)")
    print("| B (CTAs) | keys a CTA | keys copied | form | GPU us (median; min-max) | "
          "algorithm TFLOP/s | % of tensor peak | issued TFLOP/s | bytes GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    log = open(os.path.join(a.out, "seesaw_probe.jsonl"), "a")
    for case, reuse in [(c, r) for c in a.cases.split(",") for r in (False, True)]:
        B, N = map(int, case.split(":"))
        q, k = make_inputs(B + N, B, N, reuse)
        errs = check(q, k, reuse=reuse)
        progs = [(f, jax.jit(lambda x, f=f: dense_attention(*x, form=f, reuse=reuse)), (q, k))
                 for f in FORMS]
        for _, f, x in progs:
            jax.block_until_ready(f(x))
        rounds = [profile_times(progs, n=3) for _ in range(a.rounds)]
        flops = 4.0 * B * HT * N * D                     # q.k + p.v, once
        nbytes = B * ((min(N, 2 * BLK) if reuse else N) * D + 2 * HT * D) * 2
        for f in FORMS:
            ts = sorted(r[f]["busy"] for r in rounds)
            t = ts[len(ts) // 2]
            issued = flops * (1.5 if f == "dup" else 1.0)
            row = dict(B=B, N=N, reuse=reuse, form=f, gpu_us=t * 1e6, tflops=flops / t / 1e12,
                       pct_peak=100 * flops / t / peak, issued_tflops=issued / t / 1e12,
                       GBs=nbytes / t / 1e9, rel_err=errs[FORMS.index(f)], device=dev)
            log.write(json.dumps(row) + "\n")
            print(f"| {B} | {N} | {'blocks 0-1' if reuse else 'all'} | {f} | {t * 1e6:.1f} ({ts[0] * 1e6:.1f}-{ts[-1] * 1e6:.1f}) | "
                  f"{row['tflops']:.0f} | {row['pct_peak']:.1f} | {row['issued_tflops']:.0f} | "
                  f"{row['GBs']:.0f} |")
    print("outputs bit-identical between the forms in every case; rel err vs float64 "
          "< 1e-2")


if __name__ == "__main__":
    main()
