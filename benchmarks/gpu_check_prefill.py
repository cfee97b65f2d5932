"""GPU check of the prefill kernels (issue 49), one run, ~3 minutes on an H100 / H200:
correctness against their references and timings against the XLA path each replaces.

    PYTHONPATH=. python3 -m benchmarks.gpu_check_prefill [--quick] [--what matmul|attention]

1. grouped_expert_matmul (FP4 and FP8 experts, Flash widths: the merged w13 [256, 4096,
   4096] and w2 [256, 4096, 2048]) on 8192 tokens x 6 experts routed uniformly, sorted
   into 128-row tiles: rel. error vs the pure-JAX tiled reference on a sample of tiles
   (float64 numpy), GPU time of the kernel (tm 128 and 64), its TFLOP/s (useful rows only)
   and its share of the measured dense BF16 ceiling (common.tensor_peak), against the XLA
   paths the model had: the loop over all experts with a combine mask (what prefill ran)
   and a dequantise-then-lax.ragged_dot (the best XLA form, for reference).
2. sparse_prefill_attention (Flash: 64 heads of 512, window 128, CSA top-512 ids and HCA
   prefixes) on 2048 query rows at a 16K-token context: rel. error vs the blocked
   reference, GPU time against the blocked XLA reference and the model's dense chunk
   attention (layers.attend over the [T, W + T + n] mask; skipped past its memory).
"""
from __future__ import annotations

import argparse
import functools
import math

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp

from benchmarks.common import gpu_seconds, tensor_peak
from pallas_kernels.formats import Fp4Weight, Fp8Weight, dequant_bf16
from pallas_kernels.grouped_expert_matmul import (Tuning, grouped_expert_matmul,
                                                  tile_layout, tiled_reference, to_tiles)
from pallas_kernels.sparse_prefill_attention import sparse_prefill_attention, window_table


def rand_weight(key, fmt, E, N, K):
    """Trained-like magnitudes: e4m3 / e2m1 codes with e8m0 scales around 2^-8."""
    k1, k2 = jax.random.split(key)
    if fmt == "fp8":
        b = jax.random.randint(k1, (E, N, K), 0, 256, jnp.int32).astype(jnp.uint8)
        b = jnp.where((b & 0x7F) == 0x7F, b ^ 1, b)
        sc = jax.random.randint(k2, (E, N // 128, K // 128), 118, 122, jnp.int32)
        return Fp8Weight(jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn),
                         jax.lax.bitcast_convert_type(sc.astype(jnp.uint8), jnp.float8_e8m0fnu))
    p = jax.random.randint(k1, (E, N, K // 2), -128, 128, jnp.int32).astype(jnp.int8)
    sc = jax.random.randint(k2, (E, N, K // 32), 118, 124, jnp.int32)
    return Fp4Weight(p, jax.lax.bitcast_convert_type(sc.astype(jnp.uint8), jnp.float8_e8m0fnu))


def dense_loop(x_TD, comb_TE, w):
    """The model's former prefill MoE matmul: every expert over every token, masked."""
    E = w.shape[0]

    def one(e, acc):
        We, _ = dequant_bf16(jax.tree.map(lambda a: a[e], w))
        y = jnp.einsum("td,nd->tn", x_TD, We, preferred_element_type=jnp.float32)
        return acc + y * comb_TE[:, e:e + 1]
    return jax.lax.fori_loop(0, E, one, jnp.zeros((x_TD.shape[0], w.shape[1]), jnp.float32))


def ragged_xla(x_PK, sizes_E, w):
    W, _ = dequant_bf16(w)
    return jax.lax.ragged_dot(x_PK, W.transpose(0, 2, 1), sizes_E,
                              preferred_element_type=jnp.float32)


def check_matmul(peak, T, k, E, quick):
    print(f"\n== grouped_expert_matmul: {T} tokens x {k} experts of {E}, uniform routing ==")
    rng = np.random.default_rng(0)
    key = jax.random.key(1)
    P = T * k
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    e = idx.reshape(-1)
    order = np.argsort(e, kind="stable")
    sizes = jnp.asarray(np.bincount(e, minlength=E), jnp.int32)
    x_T = jax.random.normal(jax.random.key(2), (T, 4096), jnp.float32).astype(jnp.bfloat16)
    for fmt, N, K in (("fp4", 4096, 4096), ("fp4", 4096, 2048), ("fp8", 4096, 4096)):
        w = rand_weight(key, fmt, E, N, K)
        x_P = jnp.asarray(np.asarray(x_T[:, :K].astype(jnp.float32))[order // k], jnp.bfloat16)
        flops = 2.0 * P * N * K
        for tm in (128, 64):
            lay = tile_layout(sizes, P, tm)
            X = to_tiles(x_P, lay)
            te = lay.tile_expert_S
            f = jax.jit(functools.partial(grouped_expert_matmul, tuning=Tuning(tm=tm)))
            y = np.asarray(f(X, te, w))
            # the reference on a sample of tiles (its memory: S x N x K bf16)
            s = np.unique(np.concatenate([np.arange(4), np.asarray(te >= 0).nonzero()[0][-4:],
                                          rng.integers(0, int((te >= 0).sum()), 8)]))
            rows = (s[:, None] * tm + np.arange(tm)[None]).reshape(-1)
            ref = np.asarray(tiled_reference(X.reshape(-1, tm, K)[s].reshape(-1, K), te[s], w, tm))
            err = np.abs(y[rows] - ref).max() / np.abs(ref).max()
            empty = np.asarray(te) < 0
            zero_ok = bool((y.reshape(-1, tm, N)[empty] == 0).all())
            t = gpu_seconds(f, (X, te, w))
            print(f"{fmt} N={N} K={K} tm={tm}: rel err {err:.2e} ({'OK' if err < 1e-5 and zero_ok else 'FAIL'}), "
                  f"{t * 1e6:.0f} us, {flops / t / 1e12:.0f} TFLOP/s useful "
                  f"({100 * flops / t / peak:.0f}% of the dense BF16 ceiling), "
                  f"{len(te)} tiles ({int((~empty).sum())} used)", flush=True)
        # the XLA form materialises a dequantised [E, N, K] bf16 (and XLA's autotuner a
        # broadcast of the rows over E): run only where that fits a third of the memory
        need = 2 * E * N * K + 2 * P * E * K
        have = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
        if need > have / 3:
            line = (f"  XLA dequant + ragged_dot: not run (needs ~{need / 2**30:.0f} GiB of "
                    f"{have / 2**30:.0f})")
        else:
            try:
                t_r = gpu_seconds(jax.jit(ragged_xla), (x_P, sizes, w))
                line = (f"  XLA dequant + ragged_dot: {t_r * 1e6:.0f} us "
                        f"({flops / t_r / 1e12:.0f} TFLOP/s)")
            except jax.errors.JaxRuntimeError as e:
                line = f"  XLA dequant + ragged_dot: not run ({str(e).splitlines()[0][:80]})"
        if not quick:
            comb = jnp.zeros((T, E), jnp.float32).at[np.arange(T)[:, None], idx].set(0.5)
            t_d = gpu_seconds(jax.jit(dense_loop), (x_T[:, :K], comb, w), n=2)
            line += f"; former dense loop over all experts: {t_d * 1e6:.0f} us"
        print(line, flush=True)


# the attention kernel against its reference (p rounded to bf16 in both, summed apart)
ATTN_TOL = 4e-3


def where_wrong(name, y, ref, tol=ATTN_TOL):
    """Which query rows, heads and output columns of a failing [R, H, 512] output are
    off (relative to the reference's largest magnitude; NaN counts), and the magnitudes."""
    e, s = np.abs(y - ref), np.abs(ref).max()
    parts = []
    for what, keep in (("rows", 0), ("heads", 1), ("cols", 2)):
        bad = np.flatnonzero(~(e.max(tuple(a for a in range(3) if a != keep)) / s <= tol))  # NaN: bad
        parts.append(f"{what} {len(bad)}/{e.shape[keep]} (first {bad[:8].tolist()})")
    print(f"  {name}: rel {e.max() / s:.2e}; bad {', '.join(parts)}; max |y| "
          f"{np.abs(y).max():.3f}, |ref| {s:.3f}, NaN {int(np.isnan(y).sum())}", flush=True)


def check_attention(T, ctx, quick):
    print(f"\n== sparse_prefill_attention: {T} query rows at context {ctx}, 64 heads ==")
    H, W, L = 64, 128, 512
    rng = np.random.default_rng(3)
    ks = jax.random.split(jax.random.key(4), 4)
    bf = lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.3).astype(jnp.bfloat16)
    pos0 = ctx - T
    q, ring, kv = bf(ks[0], (T, H, 512)), bf(ks[1], (W, 512)), bf(ks[2], (T, 512))
    rp = pos0 - W + np.arange(W)
    ring_pos = np.full(W, -1)
    ring_pos[rp % W] = rp
    win, wb = window_table(ring, jnp.asarray(ring_pos, jnp.int32), kv, pos0, T)
    tpos = pos0 + np.arange(T)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    woff, coff = jnp.arange(T, dtype=jnp.int32) + 1, jnp.zeros(T, jnp.int32)
    for kind, ratio in (("CSA", 4), ("HCA", 128)):
        NE = ctx // ratio
        ents = bf(ks[3], (NE, 512))
        nvis = (tpos + 1) // ratio
        if kind == "CSA":
            nc = np.minimum(L, nvis)
            ids = np.stack([rng.choice(n, L, replace=n < L) if n else np.zeros(L, int)
                            for n in nvis]).astype(np.int32)
            ids = jnp.asarray(np.where(np.arange(L)[None] < nc[:, None], ids, -1))
        else:
            nc, ids = nvis, None
        args = (q, win, wb, ents, ids, jnp.asarray(nc, jnp.int32), woff, coff, sink)
        f = jax.jit(sparse_prefill_attention)
        g = jax.jit(functools.partial(sparse_prefill_attention, impl="xla"))
        y, ref = np.asarray(f(*args)), np.asarray(g(*args))
        err = np.abs(y - ref).max() / np.abs(ref).max()
        if not err < ATTN_TOL:
            where_wrong(kind, y, ref)
            zero = jnp.zeros(T, jnp.int32)   # the window band alone: no compressed block
            a0 = (q, win, wb, ents, ids, zero, woff, coff, sink)
            where_wrong(f"{kind} window only", np.asarray(f(*a0)), np.asarray(g(*a0)))
        keys = W + (np.minimum(nvis, L) if kind == "CSA" else nvis)
        flops = float((4 * H * 512 * keys).sum())        # QK and PV, useful keys
        t = gpu_seconds(f, args)
        t_x = gpu_seconds(g, args)
        print(f"{kind}: rel err {err:.2e} ({'OK' if err < ATTN_TOL else 'FAIL'}), kernel {t * 1e3:.2f} ms "
              f"({flops / t / 1e12:.0f} TFLOP/s useful, QK^T counted once), blocked XLA "
              f"reference {t_x * 1e3:.2f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the slow dense-loop baseline")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--what", choices=("all", "matmul", "attention"), default="all")
    a = ap.parse_args()
    dev = jax.devices()[0]
    peak = tensor_peak()
    print(f"device {dev.device_kind}; dense BF16 ceiling (jnp.dot 8192^3) {peak / 1e12:.0f} TFLOP/s")
    if a.what in ("all", "matmul"):
        check_matmul(peak, a.tokens, 6, 256, a.quick)
    if a.what in ("all", "attention"):
        check_attention(2048, 16384, a.quick)


if __name__ == "__main__":
    main()
