"""Shared by the benchmark scripts: the HBM ceiling every result is judged against."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


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


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes read + written per second of an elementwise pass `a + 1` over `nbytes` of f32
    on the default device (median of `iters` after a warm-up)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / median_seconds(lambda: f(x), iters)
