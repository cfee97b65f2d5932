"""The weight-streaming grouped matmul at DeepSeek-V4-Flash decode shapes against the XLA
path (gather + exact bf16 dequantisation + einsum), on one GPU.

    PYTHONPATH=. python benchmarks/quant_matmul.py [--rows 8 64] [--exact-fp4]

Per weight (FP8 dense linears, FP4 experts with G groups of M token rows): GPU time a
call (profiler traces: the call's kernels and copies, not the host's dispatch, after a
warm-up; the expert calls rotate over
enough expert sets, >= 200 MB, that the 50 MB L2 cannot serve repeats), the stored bytes
of the used experts (FP8: 1 B a weight + scales; FP4: 0.5 B + 1 B per 32) and their share
of the HBM ceiling measured in the same run, and the XLA path's time.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, gpu_seconds
from pallas_kernels.formats import Fp4Weight, Fp8Weight
from pallas_kernels.quant_matmul import grouped_matmul

SHAPES = [  # (name, fmt, E, G, N, K)
    ("wq_a", "fp8", 1, 1, 1024, 4096), ("wq_b", "fp8", 1, 1, 32768, 1024),
    ("wo_b", "fp8", 1, 1, 4096, 8192), ("shared w1/w3", "fp8", 1, 1, 2048, 4096),
    ("expert w1/w3 (G=6)", "fp4", 256, 6, 2048, 4096), ("expert w2 (G=6)", "fp4", 256, 6, 4096, 2048),
    ("expert w1/w3 (G=64)", "fp4", 256, 64, 2048, 4096),
]
ROTATE_BYTES = 200e6


def weight(fmt, E, N, K, seed):
    rng = np.random.default_rng(seed)
    if fmt == "fp8":
        w = rng.integers(0, 256, (E, N, K), dtype=np.uint8)
        w = np.where((w & 0x7F) == 0x7F, w ^ 1, w)
        return Fp8Weight(jax.lax.bitcast_convert_type(jnp.asarray(w), jnp.float8_e4m3fn),
                         jax.lax.bitcast_convert_type(jnp.asarray(rng.integers(
                             120, 134, (E, N // 128, K // 128), dtype=np.uint8)), jnp.float8_e8m0fnu))
    return Fp4Weight(jnp.asarray(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)),
                     jax.lax.bitcast_convert_type(jnp.asarray(rng.integers(
                         118, 136, (E, N, K // 32), dtype=np.uint8)), jnp.float8_e8m0fnu))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 64])
    ap.add_argument("--exact-fp4", action="store_true", help="the exact FP4 decode")
    a = ap.parse_args()
    ceiling = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; HBM ceiling {ceiling / 1e12:.2f} TB/s")
    print(f"{'weight':22s}   M  kernel_us  share  xla_us  speedup")
    rng = np.random.default_rng(0)
    for name, fmt, E, G, N, K in SHAPES:
        w = weight(fmt, E, N, K, 1)
        per_expert = sum(x.nbytes for x in jax.tree.leaves(w)) / E
        for M in a.rows:
            ids = [jnp.asarray(rng.choice(E, G, replace=False), jnp.int32)
                   for _ in range(max(1, int(ROTATE_BYTES // (per_expert * G))) if E > G else 1)]
            x = jnp.asarray(rng.standard_normal((G, M, K)), jnp.bfloat16)
            kern = jax.jit(functools.partial(grouped_matmul, exact_fp4=a.exact_fp4))
            xla = jax.jit(functools.partial(grouped_matmul, impl="xla"))
            rot = lambda f: (lambda x, w: [f(x, e, w) for e in ids])
            tk = gpu_seconds(rot(kern), (x, w)) / len(ids)
            tx = gpu_seconds(rot(xla), (x, w), n=3) / len(ids)
            nbytes = per_expert * G + x.nbytes
            print(f"{name:22s} {M:3d} {tk * 1e6:10.1f} {nbytes / tk / ceiling:6.1%} "
                  f"{tx * 1e6:7.1f} {tx / tk:7.2f}x")


if __name__ == "__main__":
    main()
