"""Where a decode step's kernels come from: compile the step on the device and count the
kernels of its optimised HLO (fusions, library GEMMs, custom calls) by source op, then time
it. Decode at batch 1 is bound by kernel count as much as by bytes: every tiny fusion costs
a few microseconds however little it moves.

    PYTHONPATH=. python benchmarks/step_anatomy.py --ratios 0 4 128 [--matmul xla|pallas]
"""
from __future__ import annotations

import argparse
import functools
import re
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import config as C, params as P
from dsv4_jax.cache import CacheSpec, cache_structs
from dsv4_jax.decode import step
from dsv4_jax.quant import Numerics

KERNEL_OPS = ("fusion", "custom-call", "dot", "scatter", "gather", "copy", "sort")


def kernels_by_source(hlo_text: str) -> tuple[int, Counter]:
    """(number of kernel-launching instructions in ENTRY, Counter of their source ops)."""
    entry = hlo_text[hlo_text.index("ENTRY"):]
    count, src = 0, Counter()
    for line in entry.splitlines():
        m = re.search(r"= \S+ ([\w-]+)\(", line)
        if not m or m.group(1) not in KERNEL_OPS:
            continue
        count += 1
        name = re.search(r'op_name="([^"]+)"', line)
        parts = [p for p in (name.group(1) if name else "?").split("/") if not p.startswith("jit(")]
        src[f"{m.group(1)}: " + "/".join(parts[-2:])[:80]] += 1
    return count, src


def sinkhorn_variants(iters=20, eps=1e-6):
    """Kernels and time of the mHC Sinkhorn loop [1, 1, 4, 4] written three ways: with
    reductions (as in layers.hc_weights), with slice adds, with 16 scalar arrays."""
    def reduce_sums(c):
        c = c / (c.sum(-2, keepdims=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdims=True) + eps)
            c = c / (c.sum(-2, keepdims=True) + eps)
        return c

    def slice_sums(c):
        def ss(a, ax):
            out = jax.lax.slice_in_dim(a, 0, 1, axis=ax)
            for i in range(1, a.shape[ax]):
                out = out + jax.lax.slice_in_dim(a, i, i + 1, axis=ax)
            return out
        c = c / (ss(c, -2) + eps)
        for _ in range(iters - 1):
            c = c / (ss(c, -1) + eps)
            c = c / (ss(c, -2) + eps)
        return c

    def scalars(c):
        n = c.shape[-1]
        e = [[c[..., i, j] for j in range(n)] for i in range(n)]
        col = lambda e: [[e[i][j] / (sum(e[k][j] for k in range(1, n)) + e[0][j] + eps)
                          for j in range(n)] for i in range(n)]
        row = lambda e: [[e[i][j] / (sum(e[i][k] for k in range(1, n)) + e[i][0] + eps)
                          for j in range(n)] for i in range(n)]
        e = col(e)
        for _ in range(iters - 1):
            e = col(row(e))
        return jnp.stack([jnp.stack(r, -1) for r in e], -2)

    c = jax.random.uniform(jax.random.key(0), (1, 1, 4, 4)) + 0.1
    ref = reduce_sums(c)
    for f in (reduce_sums, slice_sums, scalars):
        comp = jax.jit(f).lower(c).compile()
        n, _ = kernels_by_source(comp.as_text())
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            comp(c).block_until_ready()
            ts.append(time.perf_counter() - t0)
        err = float(jnp.abs(comp(c) - ref).max())
        print(f"sinkhorn {f.__name__}: {n} kernels, {1e6 * float(np.median(ts)):.0f} us, "
              f"max diff {err:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--ratios", type=int, nargs="+", default=[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--matmul", default="xla")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sinkhorn", action="store_true", help="also compare Sinkhorn forms")
    a = ap.parse_args()
    if a.sinkhorn:
        sinkhorn_variants()
    cfg = C.get_preset(a.preset)
    cfg = cfg.replace(num_hidden_layers=len(a.ratios), compress_ratios=tuple(a.ratios) + (0,),
                      num_hash_layers=0)
    nm = Numerics(True, "bfloat16", matmul=a.matmul)
    B, mb = a.batch, 33
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb)
    f = jax.jit(functools.partial(step, cfg=cfg, cs=cs, nm=nm), donate_argnums=(1,))
    params = P.init_params_device(cfg, 0)
    from benchmarks.decode_bench import random_cache
    cache = random_cache(cfg, cs, B, 4000, jax.random.key(0))
    i32 = lambda v, *s: jnp.full(s, v, jnp.int32)
    table = jnp.arange(B * mb, dtype=jnp.int32).reshape(B, mb)
    args = (i32(7, B, 1), jnp.arange(B, dtype=jnp.int32), i32(4000, B), i32(1, B), table)
    compiled = f.lower(params, cache, *args).compile()
    n, src = kernels_by_source(compiled.as_text())
    print(f"{jax.devices()[0].device_kind}: ratios {a.ratios} B={B} matmul={a.matmul}: "
          f"{n} kernels in the step")
    for k, v in src.most_common(a.top):
        print(f"  {v:4d}  {k}")
    ts = []
    for i in range(12):
        t0 = time.perf_counter()
        lg, cache = compiled(params, cache, *args)
        lg.block_until_ready()
        ts.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(ts[2:]))
    print(f"step {ms:.3f} ms -> {1e3 * ms / n:.1f} us per kernel on average")


if __name__ == "__main__":
    main()
