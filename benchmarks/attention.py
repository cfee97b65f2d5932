"""Sparse decode attention on the GPU: the shipped kernel against the XLA path (the pure-JAX
reference, which the decode step runs with kernels off), in the same run: GPU time of the op
from profiler traces (kernels + copies, median of interleaved rounds), the error against
the reference, and the share of the op's roofline: max(bytes / HBM ceiling, flops / dense
BF16 tensor ceiling), both ceilings measured first (benchmarks/common.py).

    python3 benchmarks/attention.py
    python3 benchmarks/attention.py --cases flash:csa:64:131072,pro:hca:32:131072 \
        --variants mosaic,mosaic+double_k,triton,xla --rounds 3

A case is model:mode:B:context (model flash = 64 heads, top-512; pro = 128 heads,
top-1024; mode csa = top-k ids over the 4:1 pool, hca = every entry of the 128:1 pool).
A variant is mosaic (as the decode step calls it: ids_prefix, in-kernel HCA ids),
mosaic+seesaw / mosaic+double_k (that kernel instead of the rule), +sN (N key splits),
triton (the portable kernel) or xla.
"""
import argparse
import functools
import statistics

import numpy as np
import jax
import jax.numpy as jnp

from benchmarks.common import hbm_bandwidth, tensor_peak
from benchmarks.common import profile_times
from pallas_kernels.sparse_decode_attention import (AttentionTuning, hca_indices,
                                                    sparse_decode_attention,
                                                    sparse_decode_attention_reference)

MODELS = {"flash": (64, 512), "pro": (128, 1024)}     # heads, CSA top-k
DEFAULT_CASES = ("flash:csa:1:131072,flash:csa:8:131072,flash:csa:64:131072,"
                 "pro:csa:32:131072,flash:hca:64:131072,pro:hca:32:131072")


def random_e4m3(key, shape):
    """Random finite e4m3 values from random bytes (0x7F / 0xFF are NaN: nudged down)."""
    u = jax.random.bits(key, shape, jnp.uint8)
    u = jnp.where((u & 0x7F) == 0x7F, u - 1, u)
    return jax.lax.bitcast_convert_type(u, jnp.float8_e4m3fn)


def make_case(key, B, H, ctx, topk, mode):
    """Random cache for B requests near context ctx: window ring, pool of B * ctx/128 blocks
    in random order, and the id list (CSA: topk distinct visible ids, -1 when fewer are
    visible; HCA: all visible ids, hca_indices)."""
    EPB, ratio = (32, 4) if mode == "csa" else (1, 128)
    MAXB = ctx // 128
    NB = B * MAXB
    ks = jax.random.split(key, 10)
    q = jax.random.normal(ks[0], (B, H, 512), jnp.bfloat16)
    win = (random_e4m3(ks[1], (B, 128, 448)),
           jax.random.randint(ks[7], (B, 128, 8), 118, 126).astype(jnp.uint8),
           jax.random.normal(ks[8], (B, 128, 64), jnp.bfloat16))
    t = (ctx - 1 - jax.random.randint(ks[2], (B,), 0, 64)).astype(jnp.int32)
    slots = jnp.arange(128)[None]
    pos = (t[:, None] - ((t[:, None] - slots) % 128)).astype(jnp.int32)
    cmp = (random_e4m3(ks[3], (NB, EPB, 448)),
           jax.random.randint(ks[9], (NB, EPB, 8), 118, 126).astype(jnp.uint8),
           jax.random.normal(ks[6], (NB, EPB, 64), jnp.bfloat16))
    bt = jax.random.permutation(ks[4], NB).reshape(B, MAXB).astype(jnp.int32)
    n_vis = (t + 1) // ratio
    if mode == "csa":
        u = jax.random.uniform(ks[5], (B, MAXB * EPB))
        u = jnp.where(jnp.arange(MAXB * EPB)[None] < n_vis[:, None], u, -1.0)
        val, idx = jax.lax.top_k(u, topk)
        idx = jnp.where(val >= 0, idx, -1).astype(jnp.int32)
    else:
        idx = hca_indices(t, MAXB)
    sink = jax.random.normal(ks[6], (H,), jnp.float32)
    return q, (*win, pos), cmp, bt, idx, t, sink


def op_cost(args):
    """(n_valid, bytes, flops) of one attention op on make_case's args: n_valid = attended
    cache entries (the window slots inside the last 128 positions + the valid ids); bytes =
    584 a cache entry (448 FP8 nope + 8 scale bytes + 128 rope) + q and the bf16 output;
    flops = the algorithm's tensor work, 2 * H * n_valid * (512 for q.k + 512 for p.v)
    (the kernel's two consumers each compute all of q.k: it issues 1.5x this)."""
    q, win, _, _, idx, t, _ = args
    B, H, _ = q.shape
    pos = win[3][:B]
    n_valid = int(jnp.sum(idx >= 0)) + int(jnp.sum(
        (pos >= 0) & (pos <= t[:, None]) & (pos >= t[:, None] - 127)))
    return n_valid, n_valid * 584 + 2 * B * H * 512 * 2, 2.0 * H * n_valid * 1024


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def build(variant, args, mode):
    """-> (jitted program on args, its output)."""
    if variant == "xla":
        f = jax.jit(sparse_decode_attention_reference)
        return f, jax.block_until_ready(f(*args))
    backend, *opts = variant.split("+")
    if backend not in ("mosaic", "triton"):
        raise SystemExit(f"unknown variant {variant!r}")
    seesaw = True if "seesaw" in opts else False if "double_k" in opts else None
    splits = next((int(o[1:]) for o in opts if o[:1] == "s" and o[1:].isdigit()), None)
    kw = dict(backend=backend, tuning=AttentionTuning(splits=splits, seesaw=seesaw))
    if mode == "hca":   # the decode step's HCA call: the ids derived from t (idx unread)
        K = args[4].shape[1]
        f = jax.jit(lambda q, win, cmp, bt, idx, t, sink: sparse_decode_attention(
            q, win, cmp, bt, None, t, sink, hca_entries=K, **kw))
    else:
        f = jax.jit(functools.partial(sparse_decode_attention, ids_prefix=True, **kw))
    return f, jax.block_until_ready(f(*args))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--variants", default="mosaic,xla")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    bw, peak = hbm_bandwidth()["ceiling"], tensor_peak()
    print(f"{jax.devices()[0].device_kind}: HBM ceiling {bw / 1e9:.0f} GB/s, dense BF16 "
          f"tensor ceiling {peak / 1e12:.0f} TFLOP/s (measured)", flush=True)
    print("| case | variant | GPU us (median; min-max) | rel err | MB | GFLOP | bound | "
          "roofline us | % of roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        model, mode, B, ctx = case.split(":")
        B, ctx = int(B), int(ctx)
        H, topk = MODELS[model]
        args = make_case(jax.random.key(0), B, H, ctx, topk if mode == "csa" else ctx // 128,
                         mode)
        ref = np.asarray(sparse_decode_attention_reference(*args)).astype(np.float32)
        _, nbytes, flops = op_cost(args)
        t_mem, t_mma = nbytes / bw, flops / peak
        t_roof = max(t_mem, t_mma)
        progs, errs = [], {}
        for v in a.variants.split(","):
            f, out = build(v, args, mode)
            errs[v] = rel_err(np.asarray(out).astype(np.float32), ref)
            progs.append((v, lambda x, f=f: f(*x), args))
        ts = {v: [] for v, _, _ in progs}
        for _ in range(a.rounds):
            r = profile_times(progs, n=3)
            for v in ts:
                ts[v].append(r[v]["busy"] * 1e6)
        for v, t in ts.items():
            med = statistics.median(t)
            print(f"| {case} | {v} | {med:.1f} ({min(t):.1f}-{max(t):.1f}) | {errs[v]:.2e} | "
                  f"{nbytes / 1e6:.1f} | {flops / 1e9:.2f} | "
                  f"{'HBM' if t_mem >= t_mma else 'tensor'} | {t_roof * 1e6:.1f} | "
                  f"{100 * t_roof * 1e6 / med:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
