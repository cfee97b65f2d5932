"""On a Blackwell GPU (B200, sm_100a): the Blackwell kernels against their references, and
timed against the XLA paths they replace, in one run.

    PYTHONPATH=. python3 -m benchmarks.blackwell_check

Prints one line a kernel: max relative error against the pure-JAX reference and the median
GPU time (jax.block_until_ready over many calls after warm-up) of the kernel and the XLA
path. On another GPU it says so and exits: these kernels need tcgen05 / TMEM.
"""
import functools
import time

import numpy as np
import jax
import jax.numpy as jnp

from pallas_kernels.arch import compute_capability, is_blackwell


def _time(f, *args, n=50):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    fin = np.isfinite(b)
    return float(np.abs(a[fin] - b[fin]).max() / max(np.abs(b[fin]).max(), 1e-30))


def main():
    if jax.default_backend() != "gpu" or not is_blackwell():
        raise SystemExit(f"needs a Blackwell (sm_100) GPU; this is {jax.devices()[0].device_kind} "
                         f"(compute capability {compute_capability()})")
    import ml_dtypes
    from pallas_kernels.formats import Fp4Weight, Fp8Weight
    from pallas_kernels.quant_matmul import grouped_matmul
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}")
    for fmt, E, G, N, K, M in [("fp8", 1, 1, 4096, 7168, 8), ("fp4", 256, 64, 4096, 2048, 8),
                               ("fp4", 256, 6, 2048, 4096, 64)]:
        if fmt == "fp8":
            b = rng.integers(0, 256, (E, N, K), dtype=np.uint8)
            b = np.where((b & 0x7F) == 0x7F, b ^ 1, b)
            w = Fp8Weight(jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)),
                          jnp.asarray(rng.integers(120, 134, (E, N // 128, K // 128),
                                                   dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)))
        else:
            w = Fp4Weight(jnp.asarray(rng.integers(-128, 128, (E, N, K // 2), dtype=np.int8)),
                          jnp.asarray(rng.integers(118, 136, (E, N, K // 32),
                                                   dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)))
        ex = jnp.asarray(rng.integers(0, E, (G,)), jnp.int32)
        x = jnp.asarray(rng.standard_normal((G, M, K)), jnp.bfloat16)
        kern = jax.jit(grouped_matmul)
        xla = jax.jit(functools.partial(grouped_matmul, impl="xla"))
        err = _rel(kern(x, ex, w), xla(x, ex, w))
        print(f"quant_matmul {fmt} G={G} N={N} K={K} M={M}: rel err {err:.1e}, "
              f"kernel {_time(kern, x, ex, w):.1f} us, xla {_time(xla, x, ex, w):.1f} us")

    from pallas_kernels import formats as kvformat
    from pallas_kernels.indexer_decode import reference as R, score_keys
    B, MAXB = 64, 256                      # 32K context a request
    NB = B * MAXB
    ks = jax.random.split(jax.random.key(1), 3)
    q = kvformat.fp4_block_sim(jax.random.normal(ks[0], (B, 64, 128)))
    wI = jax.random.normal(ks[1], (B, 64)) * 0.1
    keys = kvformat.quantize_index_key(jax.random.normal(ks[2], (NB, 32, 128)), "fp4")
    bt = jnp.asarray(rng.permutation(NB).reshape(B, MAXB).astype(np.int32))
    t = jnp.full((B,), 4 * 32 * MAXB - 1, jnp.int32)
    kern = jax.jit(functools.partial(score_keys, fmt="fp4"))
    ref = jax.jit(functools.partial(R.indexer_scores_reference, fmt="fp4"))
    err = _rel(kern(q, wI, keys, bt, t), ref(q, wI, keys, bt, t))
    print(f"indexer scores fp4 B={B} 32K: rel err {err:.1e}, kernel "
          f"{_time(kern, q, wI, keys, bt, t):.1f} us, xla {_time(ref, q, wI, keys, bt, t):.1f} us")

    from pallas_kernels.sparse_decode_attention import (sparse_decode_attention,
                                                        sparse_decode_attention_reference)
    B, H, EPB, MAXB, KT = 64, 64, 32, 256, 512
    NB = B * MAXB
    ks = jax.random.split(jax.random.key(2), 4)
    qa = jax.random.normal(ks[0], (B, H, 512), jnp.bfloat16)
    win = kvformat.quantize_kv(jax.random.normal(ks[1], (B, 128, 512)))
    tt = jnp.full((B,), 128 * MAXB - 1, jnp.int32)
    pos = (tt[:, None] - ((tt[:, None] - jnp.arange(128)[None]) % 128)).astype(jnp.int32)
    cmp = kvformat.quantize_kv(jax.random.normal(ks[2], (NB, EPB, 512)))
    bt = jnp.asarray(rng.permutation(NB).reshape(B, MAXB).astype(np.int32))
    idx = jnp.asarray(np.stack([rng.permutation(MAXB * EPB)[:KT] for _ in range(B)])
                      .astype(np.int32))
    sink = jax.random.normal(ks[3], (H,))
    a = (qa, (*win, pos), cmp, bt, idx, tt, sink)
    kern = jax.jit(sparse_decode_attention)
    ref = jax.jit(sparse_decode_attention_reference)
    err = _rel(kern(*a), ref(*a))
    print(f"sparse attention B={B} H={H} top-{KT}: rel err {err:.1e}, kernel "
          f"{_time(kern, *a):.1f} us, xla {_time(ref, *a):.1f} us")


if __name__ == "__main__":
    main()
