"""The indexer scoring kernel's pipeline knobs, timed against each other in one run, and a
plain run of one variant for Nsight Compute.

  PYTHONPATH=. python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072 \
      --variants fp4:e4m3:8:2:0,fp4:e4m3:8:4:1 [--out DIR]
  ncu --clock-control none --kernel-name regex:mosaic_gpu --launch-skip 1 --launch-count 1 \
      python3 benchmarks/indexer_probe.py run --cases 64:131072 --variants fp4:e4m3:8:2:0

A variant is fmt:dequant:chunks_per_cta:stages:overlap (chunks_per_cta 0: the default).
sweep: per case and variant, the kernel's time (one jitted program over 2 distinct input
sets, median of 10, divided by 2), GB/s of key bytes + scores read/written, % of the HBM
ceiling measured in the same run (benchmarks.common.hbm_bandwidth), and the scores'
largest difference from the first variant (all variants must agree bit for bit up to the
f32 sum order; printed, not assumed).
"""
import argparse
import json
import os

import numpy as np
import jax

from benchmarks.common import hbm_bandwidth, median_seconds
from benchmarks.indexer_attention import KEY_BYTES, indexer_inputs
from pallas_kernels.indexer_decode import kernel as IK


def parse_variant(v):
    fmt, dq, cpc, st, ov = v.split(":")
    return dict(fmt=fmt, dequant=dq, chunks_per_cta=int(cpc) or None, stages=int(st),
                overlap=ov == "1")


def scorer(var):
    kw = dict(var)
    fmt = kw.pop("fmt")
    return jax.jit(lambda q, w, k, bt, t: IK.score_keys(q, w, k, bt, t, fmt=fmt, **kw))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["sweep", "run"])
    ap.add_argument("--cases", default="64:131072")
    ap.add_argument("--variants", default="fp4:e4m3:0:2:0")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    variants = [(v, parse_variant(v)) for v in a.variants.split(",")]
    if a.mode == "run":
        for B, ctx in cases:
            for _, var in variants:
                inp = indexer_inputs(jax.random.key(B), B, ctx, var["fmt"])
                f = scorer(var)
                for _ in range(3):
                    jax.block_until_ready(f(*inp))
        return
    bw = hbm_bandwidth()
    print("device", jax.devices()[0].device_kind, "HBM ceiling (GB/s):",
          {k: round(v / 1e9) for k, v in bw.items()}, flush=True)
    log = open(os.path.join(a.out, "indexer_probe.jsonl"), "a")
    print("| B | ctx | variant (fmt:dequant:cpc:stages:overlap) | us | GB/s | % ceiling | max diff |")
    print("|---|---|---|---|---|---|---|")
    for B, ctx in cases:
        by_fmt = {}
        for name, var in variants:
            fmt = var["fmt"]
            if fmt not in by_fmt:
                by_fmt[fmt] = ([indexer_inputs(jax.random.key(100 * B + i), B, ctx, fmt)
                                for i in range(2)], None)
            sets, first = by_fmt[fmt]
            f = scorer(var)
            many = jax.jit(lambda ss, f=f: [f(*s) for s in ss])
            out = np.asarray(jax.block_until_ready(many(sets))[0])
            t = median_seconds(lambda: many(sets), 10) / len(sets)
            if first is None:
                by_fmt[fmt] = (sets, out)
                diff = 0.0
            else:
                fin = np.isfinite(first)
                diff = float(np.abs(out[fin] - first[fin]).max()) if (
                    np.isfinite(out) == fin).all() else float("nan")
            nbytes = B * (ctx // 4) * (KEY_BYTES[fmt] + 4)
            row = dict(B=B, ctx=ctx, variant=name, us=t * 1e6, GBs=nbytes / t / 1e9,
                       pct=100 * nbytes / t / bw["ceiling"], max_diff=diff,
                       device=jax.devices()[0].device_kind, ceiling_GBs=bw["ceiling"] / 1e9)
            log.write(json.dumps(row) + "\n"); log.flush()
            print(f"| {B} | {ctx} | {name} | {t * 1e6:.1f} | {row['GBs']:.0f} | {row['pct']:.1f} "
                  f"| {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
