"""The decode-site norm / mHC kernels against the XLA chains they replace, at decode rows.

    PYTHONPATH=. python benchmarks/norm_kernels.py [--rows 1 8 64] [--preset flash]

Per call (one jitted program running 16 independent input sets back to back, so each
time includes a kernel's in-program launch, as inside the decode step) and GPU busy time
per call (profiler: the sum of the GPU events of one call):
  rms_norm_fp8  (q_norm site: x [M, q_lora_rank] -> y, yq [rows, q_lora_rank])
      vs its reference under XLA (rms_norm + fp8 simulation + pad: what layers.norm_act ran)
  hc_norm_fp8   (attn / ffn site: X [M, N, D] + the site's raw sums -> y, yq)
      vs the reference under XLA (hc weights + collapse + rms_norm + sim + pad)
  mhc_comb      (the comb matrix from the raw sums)
      vs the path before it (XLA prelude + the sinkhorn_softmax kernel) and the pure XLA
      reference.
Every XLA side compiles with quant.EXACT_COMPILER_OPTIONS (the FP8 simulation kept).
Bytes = inputs read + outputs written; share = bytes / time / the measured copy bandwidth.
Outputs are checked against the reference in the same run (max |diff| printed).
"""
import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention_decode import profile_times, wall_time  # noqa: E402
from benchmarks.common import copy_bandwidth  # noqa: E402
from dsv4_jax import config  # noqa: E402
from dsv4_jax.quant import EXACT_COMPILER_OPTIONS  # noqa: E402
from pallas_kernels.hc_sinkhorn import mhc_comb, mhc_comb_reference, sinkhorn_softmax  # noqa: E402
from pallas_kernels.norm_fp8 import (hc_norm_fp8, hc_norm_fp8_reference,  # noqa: E402
                                     rms_norm_fp8, rms_norm_fp8_reference)

SETS = 16
BF16, F32 = jnp.bfloat16, jnp.float32


def many(fn, exact=True):
    opts = EXACT_COMPILER_OPTIONS if exact else None
    return jax.jit(lambda ss: [fn(*s) for s in ss], compiler_options=opts)


def nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def site(M, N, D, key):
    ks = jax.random.split(key, 6)
    K = 2 * N + N * N
    X = jax.random.normal(ks[0], (M, N, D), F32).astype(BF16)
    flat = X.reshape(M, N * D).astype(F32)
    fn = jax.random.normal(ks[1], (K, N * D), F32) * 0.02
    s = flat @ fn.T
    q = jnp.sum(flat * flat, -1, keepdims=True)
    scale = jax.random.uniform(ks[2], (3,), F32, 0.5, 2.0)
    base = jax.random.normal(ks[3], (K,), F32)
    w = (1 + 0.1 * jax.random.normal(ks[4], (D,), F32)).astype(BF16)
    return X, s, q, scale, base, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--json", help="append one JSON line per case here")
    ap.add_argument("--interpret", action="store_true", help="CPU check of this script")
    a = ap.parse_args()
    ik = dict(interpret=True) if a.interpret else {}
    cfg = config.get_preset(a.preset)
    N, D, QL = cfg.hc_mult, cfg.hidden_size, cfg.q_lora_rank
    eps, hce, it = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
    bw = copy_bandwidth()
    dev = jax.devices()[0].device_kind
    print(f"device {dev}; copy bandwidth {bw / 1e9:.0f} GB/s; {cfg.name}: N={N} D={D} "
          f"q_lora={QL}; {SETS} calls per program")
    rows_of = lambda M: -(-M // 8) * 8
    for M in a.rows:
        R = rows_of(M)
        key = jax.random.key(M)
        cases = []
        # q_norm site
        xs = [(jax.random.normal(jax.random.fold_in(key, i), (M, QL), F32).astype(BF16),
               (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 99), (QL,), F32)).astype(BF16))
              for i in range(SETS)]
        cases.append(("rms_norm_fp8", xs,
                      lambda x, w: rms_norm_fp8(x, w, eps=eps, rows=R, **ik),
                      {"xla": lambda x, w: rms_norm_fp8_reference(x, w, eps, R)}))
        sites = [site(M, N, D, jax.random.fold_in(key, 100 + i)) for i in range(SETS)]
        cases.append(("hc_norm_fp8", sites,
                      lambda X, s, q, sc, b, w: hc_norm_fp8(X, s, q, sc, b, w, N=N, eps=eps,
                                                             rms_eps=eps, hc_eps=hce, rows=R,
                                                             **ik),
                      {"xla": lambda X, s, q, sc, b, w: hc_norm_fp8_reference(
                          X, s, q, sc, b, w, N, eps, eps, hce, R)}))
        comb_in = [st[1:5] for st in sites]
        kw = dict(N=N, nd=N * D, iters=it, eps=hce, rms_eps=eps)

        def prev(s, q, sc, b):   # the path before mhc_comb: XLA prelude + sinkhorn_softmax
            m = s * jax.lax.rsqrt(q[:, :1] / (N * D) + eps)
            return sinkhorn_softmax((m[:, 2 * N:] * sc[2] + b[2 * N:]).reshape(-1, N, N),
                                    iters=it, eps=hce, **ik)
        cases.append(("mhc_comb", comb_in, lambda s, q, sc, b: mhc_comb(s, q, sc, b, **kw, **ik),
                      {"prelude+sinkhorn_softmax": prev,
                       "xla": lambda s, q, sc, b: mhc_comb_reference(s, q, sc, b, N, N * D, it,
                                                                     hce, eps)}))
        for name, sets, kern, others in cases:
            progs = [("kernel", many(kern), sets)] + [(k, many(f), sets) for k, f in others.items()]
            res, outs = {}, {}
            for k, prog, ss in progs:
                t, first = wall_time(prog, ss)
                res[k] = t
                outs[k] = first
            busy = profile_times([(k, p, ss) for k, p, ss in progs])
            ref = outs["xla"]
            diff = max(float(jnp.max(jnp.abs(jnp.asarray(g, F32) - jnp.asarray(r, F32))))
                       for g, r in zip(jax.tree.leaves(outs["kernel"]), jax.tree.leaves(ref)))
            b = nbytes(sets[0]) + nbytes(outs["kernel"])
            line = (f"{name:13s} M={M:3d}: kernel {res['kernel'] * 1e6:7.2f} us/call "
                    f"(GPU busy {busy['kernel']['busy'] / SETS * 1e6:6.2f} us, "
                    f"{b / 1e3:6.1f} kB, {b / res['kernel'] / 1e9:6.1f} GB/s = "
                    f"{100 * b / res['kernel'] / bw:4.1f}% of copy bw)")
            for k in others:
                line += (f" | {k} {res[k] * 1e6:7.2f} us (busy {busy[k]['busy'] / SETS * 1e6:6.2f},"
                         f" {busy[k]['events'] / SETS:.1f} kernels)")
            line += f" | max |kernel - xla| {diff:.3g}"
            print(line, flush=True)
            if a.json:
                with open(a.json, "a") as fh:
                    fh.write(json.dumps(dict(case=name, M=M, device=dev, bytes=b,
                                             us={k: v * 1e6 for k, v in res.items()},
                                             busy_us={k: v["busy"] / SETS * 1e6
                                                      for k, v in busy.items()},
                                             max_abs_diff=diff)) + "\n")


if __name__ == "__main__":
    main()
