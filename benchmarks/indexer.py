"""The lightning indexer at decode (scoring kernel + top-k selection kernel) against the
pure-JAX path (gather + dequantise + einsum + lax.top_k), on one GPU.

    PYTHONPATH=. python benchmarks/indexer.py [--fmt fp4 nvfp4 fp8] [--batch 1 8 64]
                                              [--context 131072] [--topk 512]

Per (format, batch): GPU time a call (profiler traces: the kernels and copies
of a call, not the host's dispatch; the mean of calls after a
warm-up), the bytes the kernel must read (every eligible entry's key + scale, q, head
weights, block table) and their share of the HBM ceiling measured in the same run
(benchmarks/common.hbm_bandwidth), and the XLA path's time. Requests are full (t = context
- 1), the pool holds B * context / 128 blocks in a shuffled table.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, gpu_seconds
from pallas_kernels import formats as kf
from pallas_kernels.indexer_decode import indexer_topk_reference, topk_keys


def case(fmt, B, context, seed=0):
    rng = np.random.default_rng(seed)
    MAXB = context // 128
    NB = B * MAXB
    k = jax.random.normal(jax.random.key(seed), (NB, 32, 128), jnp.float32)
    keys = jax.jit(functools.partial(kf.quantize_index_key, fmt=fmt))(k)
    q = kf.fp4_block_sim(jax.random.normal(jax.random.key(seed + 1), (B, 64, 128)))
    w = jax.random.normal(jax.random.key(seed + 2), (B, 64)) * 0.1
    bt = jnp.asarray(rng.permutation(NB).reshape(B, MAXB).astype(np.int32))
    t = jnp.full((B,), context - 1, jnp.int32)
    nbytes = sum(a.nbytes for a in keys.values()) + q.size * 2 + w.nbytes + bt.nbytes
    return (q, w, keys, bt, t), nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", nargs="+", default=["fp4", "nvfp4", "fp8"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--topk", type=int, default=512)
    a = ap.parse_args()
    ceiling = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; HBM ceiling {ceiling / 1e12:.2f} TB/s")
    print("fmt    B   context  kernel_us  share  xla_us  speedup")
    for fmt in a.fmt:
        for B in a.batch:
            args, nbytes = case(fmt, B, a.context)
            kern = jax.jit(functools.partial(topk_keys, topk=a.topk, fmt=fmt))
            xla = jax.jit(functools.partial(indexer_topk_reference, topk=a.topk, fmt=fmt))
            tk = gpu_seconds(kern, args)
            tx = gpu_seconds(xla, args, n=3)
            print(f"{fmt:6s} {B:3d} {a.context:8d} {tk * 1e6:10.1f} "
                  f"{nbytes / tk / ceiling:6.1%} {tx * 1e6:7.1f} {tx / tk:7.2f}x")


if __name__ == "__main__":
    main()
