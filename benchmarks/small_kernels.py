"""The decode step's small kernels against their XLA paths, on one GPU: the KV cache's
quantise-and-scatter (append_window, flush_compressed), the top-k selection, the RMSNorm +
FP8 simulation, and the mHC mixing matrix.

    PYTHONPATH=. python benchmarks/small_kernels.py [--batch 1 8 64]

Per kernel and batch: GPU time a call (profiler traces: the kernels and copies
of a call, not the host's dispatch; the mean of calls after a
warm-up; the scatters donate their cache, so they update in place as in the step), the
XLA path's time, and for the top-k selection (the one that reads a large input: B x 32K
scores at 128K context) its share of the HBM ceiling measured in the same run. The others
are launch-latency bound at decode sizes.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, gpu_seconds
from pallas_kernels import formats as kf
from pallas_kernels.hc_sinkhorn import mhc_comb, mhc_comb_reference
from pallas_kernels.indexer_decode import topk_reference
from pallas_kernels.kv_scatter import append_window, flush_compressed
from pallas_kernels.norm_fp8 import rms_norm_fp8, rms_norm_fp8_reference
from pallas_kernels.topk_select import topk_select


def time_pair(kern, xla, args, donate=False):
    """(kernel seconds, XLA seconds) a call; donate: args[0] is a cache both update."""
    out = []
    for f in (kern, xla):
        if donate:
            g = jax.jit(f, donate_argnums=0)
            state = [jax.tree.map(jnp.copy, args[0])]

            def call(*rest, g=g, state=state):
                state[0] = g(state[0], *rest)
                return state[0]
            out.append(gpu_seconds(call, args[1:]))
        else:
            out.append(gpu_seconds(jax.jit(f), args))
    return out


def window(B, R=64):
    k = jax.random.split(jax.random.key(B), 2)
    win = {"win_nope": jnp.zeros((R, 128, 448), jnp.float8_e4m3fn),
           "win_scale": jnp.full((R, 128, 8), 127, jnp.uint8),
           "win_rope": jnp.zeros((R, 128, 64), jnp.bfloat16),
           "win_pos": jnp.full((R, 128), -1, jnp.int32)}
    return win, jax.random.normal(k[0], (B, 512), jnp.bfloat16), jnp.arange(B, dtype=jnp.int32) + 7


def pools(B, fmt="fp4", NB=4096, MAXB=64):
    rng = np.random.default_rng(B)
    pool = {"cmp_nope": jnp.zeros((NB, 32, 448), jnp.float8_e4m3fn),
            "cmp_scale": jnp.full((NB, 32, 8), 127, jnp.uint8),
            "cmp_rope": jnp.zeros((NB, 32, 64), jnp.bfloat16)}
    idx = {nm: jnp.zeros((NB, 32, *suffix), dt) for nm, (suffix, dt) in kf.index_key_fields(fmt).items()}
    bt = jnp.asarray(rng.permutation(NB)[: B * MAXB].reshape(B, MAXB).astype(np.int32))
    rest = (jax.random.normal(jax.random.key(1), (B, 512), jnp.bfloat16),
            jax.random.normal(jax.random.key(2), (B, 128), jnp.float32),
            jnp.ones((B,), jnp.int32), jnp.arange(B, dtype=jnp.int32) * 3, bt)
    return (pool, idx), rest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    a = ap.parse_args()
    ceiling = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; HBM ceiling {ceiling / 1e12:.2f} TB/s")
    print(f"{'kernel':28s}   B  kernel_us  xla_us  speedup  share")
    row = lambda nm, B, tk, tx, share="": print(
        f"{nm:28s} {B:3d} {tk * 1e6:10.1f} {tx * 1e6:7.1f} {tx / tk:7.2f}x  {share}")
    for B in a.batch:
        win, kv, pos = window(B)
        tk, tx = time_pair(lambda w, kv, p: append_window(w, kv, p),
                           lambda w, kv, p: append_window(w, kv, p, impl="xla"),
                           (win, kv, pos), donate=True)
        row("append_window", B, tk, tx)
        cache, rest = pools(B)
        tk, tx = time_pair(lambda c, *r: flush_compressed(*c, *r),
                           lambda c, *r: flush_compressed(*c, *r, impl="xla"),
                           (cache, *rest), donate=True)
        row("flush_compressed (fp4 key)", B, tk, tx)
        s = jax.random.normal(jax.random.key(B), (B, 32 * 1024), jnp.float32)
        tk, tx = time_pair(lambda s: topk_select(s, 512), lambda s: topk_reference(s, 512), (s,))
        row("topk_select (k=512, 128K)", B, tk, tx, f"{s.nbytes / tk / ceiling:.1%}")
        x = jax.random.normal(jax.random.key(B), (B, 4096), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(3), (4096,), jnp.bfloat16)
        rows = -(-B // 8) * 8
        tk, tx = time_pair(lambda x, w: rms_norm_fp8(x, w, eps=1e-6, rows=rows),
                           lambda x, w: rms_norm_fp8_reference(x, w, 1e-6, rows), (x, w))
        row("rms_norm_fp8 (D=4096)", B, tk, tx)
        sq = (jax.random.normal(jax.random.key(4), (B, 24), jnp.float32),
              jnp.abs(jax.random.normal(jax.random.key(5), (B, 1), jnp.float32)) * 1e4,
              jnp.ones((3,), jnp.float32), jax.random.normal(jax.random.key(6), (24,), jnp.float32))
        kw = dict(N=4, nd=16384, iters=20, eps=1e-6, rms_eps=1e-6)
        tk, tx = time_pair(functools.partial(mhc_comb, **kw),
                           lambda *a: mhc_comb_reference(*a, **kw), sq)
        row("mhc_comb", B, tk, tx)


if __name__ == "__main__":
    main()
