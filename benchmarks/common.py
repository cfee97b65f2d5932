"""Shared by the benchmark scripts: the HBM ceiling every result is judged against."""
from __future__ import annotations

import math
import os
import statistics
import time

import jax
import jax.numpy as jnp


def with_env(env: dict, call):
    """call() with the environment variables in env set, then restored (the kernels read
    their knobs when a call is traced: trace and compile inside)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return call()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def median_seconds(call, iters: int = 10) -> float:
    """Median wall time of `call()` (blocked until its results are ready) over `iters` runs,
    after one warm-up run."""
    jax.block_until_ready(call())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def hbm_bandwidth(nbytes: int = 1 << 30, calls: int = 10, rounds: int = 3,
                  warm_s: float = 0.5) -> dict:
    """The HBM ceiling, measured three ways on the default device -> {name: bytes/s}:
    "copy" (jnp.copy, bytes read + written), "a+1" (elementwise f32 pass, read + written),
    "read" (a max-reduction: bytes read). Each: `warm_s` of back-to-back calls first (clocks
    ramp up: a cold first measurement read 2.2 TB/s on an H200 whose copies reach 3.2-4.3),
    then `rounds` rounds of `calls` calls enqueued back to back and blocked once (the host's
    dispatch hides behind the device); the best round counts. "ceiling" is the largest."""
    x = jax.random.normal(jax.random.key(7), (nbytes // 4 // 4096, 4096), jnp.float32)
    passes = (("copy", jnp.copy, 2), ("a+1", lambda a: a + 1.0, 2), ("read", jnp.max, 1))
    out = {}
    for name, fn, n_io in passes:
        f = jax.jit(fn)
        jax.block_until_ready(f(x))
        t_end = time.perf_counter() + warm_s
        while time.perf_counter() < t_end:
            jax.block_until_ready([f(x) for _ in range(4)])
        best = math.inf
        for _ in range(rounds):
            t0 = time.perf_counter()
            y = None
            for _ in range(calls):
                y = f(x)
            jax.block_until_ready(y)
            best = min(best, (time.perf_counter() - t0) / calls)
        out[name] = n_io * x.nbytes / best
    out["ceiling"] = max(out.values())
    return out


def tensor_peak(n: int = 8192, calls: int = 10, rounds: int = 3, warm_s: float = 0.5) -> float:
    """The dense BF16 tensor-core ceiling, measured (flop/s): an [n, n] @ [n, n] bf16 matmul
    (f32 accumulation, as the kernels' wgmma) timed as hbm_bandwidth times its passes. An
    H100 SXM's datasheet says 989 TFLOP/s; cuBLAS reaches less, and that is what counts."""
    ka, kb = jax.random.split(jax.random.key(11))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    jax.block_until_ready(f(a, b))
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        jax.block_until_ready(f(a, b))
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        y = None
        for _ in range(calls):
            y = f(a, b)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2.0 * n ** 3 / best


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """The ceiling of hbm_bandwidth (bytes/s): what every "% of bandwidth" divides by."""
    return hbm_bandwidth(nbytes)["ceiling"]


def legacy_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 10) -> float:
    """The measurement used up to 2026-11-25 (median of 10 synchronised `a + 1` calls after
    one warm-up): kept only to compare against hbm_bandwidth in benchmarks/bandwidth.py."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / median_seconds(lambda: f(x), iters)
