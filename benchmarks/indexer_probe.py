"""The indexer scoring kernel's pipeline knobs, timed against each other in one run, and a
plain run of one variant for Nsight Compute.

  PYTHONPATH=. python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072 \
      --variants fp4:e4m3:8:2:0,fp4:e4m3:8:4:1 [--out DIR]
  ncu --clock-control none --kernel-name regex:mosaic_gpu --launch-skip 1 --launch-count 1 \
      python3 benchmarks/indexer_probe.py run --cases 64:131072 --variants fp4:e4m3:8:2:0

A variant is fmt:dequant:chunks_per_cta:stages:overlap[:kreg[:barriers[:w_in_loop[:g]]]]
(chunks_per_cta 0: the default; barriers "a" auto / "m" manual / "w" warp, default the
kernel's BARRIERS; w_in_loop 1: the head weights re-read every chunk; g: chunks a loop
iteration, chunks_per_step), optionally followed by +NAME=VALUE environment knobs set while
the variant is traced (e.g. fp4:place:0:2:0:1:w:0:2+DSV4_IDX_ABLATE=nodeq).
sweep: per case and variant, the GPU time of one call (untrimmed scores, as the decode step
calls it: the kernel + q's small XLA prep), from a profiler trace (benchmarks.attention_decode
.profile_times: sum of the GPU events of a call), median over --rounds rounds of 3 calls
each, the rounds interleaved over the variants (drift shows as a wide min-max); also the
synchronised wall time; GB/s of key bytes + scores, % of the HBM ceiling measured in the
same run (benchmarks.common.hbm_bandwidth), and the scores' largest difference from the
format's first variant (printed, not assumed: the same sums in the same order give 0).
"""
import argparse
import json
import os

import numpy as np
import jax

from benchmarks.attention_decode import profile_times
from benchmarks.common import hbm_bandwidth, median_seconds, with_env
from benchmarks.indexer_attention import KEY_BYTES, indexer_inputs
from pallas_kernels.indexer_decode import kernel as IK


def parse_variant(v):
    v, *knobs = v.split("+")
    fields = v.split(":")
    if len(fields) not in (5, 6, 7, 8, 9):
        raise SystemExit(f"variant {v!r}: expected "
                         "fmt:dequant:cpc:stages:overlap[:kreg[:barriers[:w_in_loop[:g]]]]")
    fmt, dq, cpc, st, ov, *rest = fields
    bar = {"a": "auto", "m": "manual", "w": "warp"}[rest[1]] if len(rest) > 1 else None
    return dict(fmt=fmt, dequant=dq, chunks_per_cta=int(cpc) or None, stages=int(st),
                overlap=ov == "1", kreg=rest[:1] == ["1"], barriers=bar,
                w_in_loop=rest[2] == "1" if len(rest) > 2 else None,
                chunks_per_step=int(rest[3]) if len(rest) > 3 else None,
                env=dict(k.split("=", 1) for k in knobs))



def scorer(var, interpret=False):
    kw = dict(var)
    kw.pop("env")
    if interpret:   # CPU check of this script (the Mosaic GPU interpreter)
        from jax.experimental.pallas import mosaic_gpu as plgpu
        kw["interpret"] = plgpu.InterpretGPUParams()
    fmt = kw.pop("fmt")
    return jax.jit(lambda q, w, k, bt, t: IK.score_keys(q, w, k, bt, t, fmt=fmt, trim=False, **kw))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["sweep", "run"])
    ap.add_argument("--cases", default="64:131072")
    ap.add_argument("--variants", default="fp4:e4m3:0:2:0")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interpret", action="store_true")
    a = ap.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    variants = [(v, parse_variant(v)) for v in a.variants.split(",")]
    if a.mode == "run":
        for B, ctx in cases:
            for _, var in variants:
                inp = indexer_inputs(jax.random.key(B), B, ctx, var["fmt"])
                f = scorer(var)
                with_env(var["env"], lambda: jax.block_until_ready(f(*inp)))
                for _ in range(2):
                    jax.block_until_ready(f(*inp))
        return
    bw = hbm_bandwidth()
    print("device", jax.devices()[0].device_kind, "HBM ceiling (GB/s):",
          {k: round(v / 1e9) for k, v in bw.items()}, flush=True)
    log = open(os.path.join(a.out, "indexer_probe.jsonl"), "a")
    print("| B | ctx | variant (fmt:dequant:cpc:stages:overlap:kreg) | GPU us (median of rounds; "
          "min-max) | GB/s | % ceiling | wall us | max diff | scoring kernel us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, ctx in cases:
        inputs, first, progs, wall, diffs = {}, {}, [], {}, {}
        for name, var in variants:
            fmt = var["fmt"]
            if fmt not in inputs:
                inputs[fmt] = indexer_inputs(jax.random.key(100 * B), B, ctx, fmt)
            f = scorer(var, a.interpret)
            # (untrimmed: the width depends on the CTA span; the scores are the first
            # ctx // 4 columns, -inf past them)
            out = np.asarray(with_env(
                var["env"], lambda: jax.block_until_ready(f(*inputs[fmt]))))[:, :ctx // 4]
            if fmt not in first:
                first[fmt] = out
            fin = np.isfinite(first[fmt])
            diffs[name] = float(np.abs(out[fin] - first[fmt][fin]).max()) if (
                fin.any() and (np.isfinite(out) == fin).all()) else float("nan")
            g = lambda inp, f=f: f(*inp)
            wall[name] = median_seconds(lambda: g(inputs[fmt]), 10)
            progs.append((name, g, inputs[fmt]))
        rounds = [profile_times(progs, n=3) for _ in range(a.rounds)]
        for name, var in variants:
            ts = sorted(r[name]["busy"] for r in rounds)
            t = ts[len(ts) // 2]
            # the Mosaic kernel alone (a call may add XLA work on q: "words" permutes it,
            # which the decode step fuses into q's own fusion)
            ks = sorted(sum(v for k, v in r[name]["per"] if "mosaic" in k)
                        for r in rounds)
            kt = ks[len(ks) // 2]
            nbytes = B * (ctx // 4) * (KEY_BYTES[var["fmt"]] + 4)
            row = dict(B=B, ctx=ctx, variant=name, gpu_us=t * 1e6, gpu_us_all=[x * 1e6 for x in ts],
                       wall_us=wall[name] * 1e6, GBs=nbytes / t / 1e9,
                       pct=100 * nbytes / t / bw["ceiling"], max_diff=diffs[name],
                       kernel_us=kt * 1e6,
                       top=rounds[0][name]["top"], device=jax.devices()[0].device_kind,
                       ceiling_GBs=bw["ceiling"] / 1e9)
            log.write(json.dumps(row) + "\n"); log.flush()
            print(f"| {B} | {ctx} | {name} | {t * 1e6:.1f} ({ts[0] * 1e6:.0f}-{ts[-1] * 1e6:.0f}) "
                  f"| {row['GBs']:.0f} | {row['pct']:.1f} | {wall[name] * 1e6:.0f} "
                  f"| {diffs[name]:.2e} | {kt * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
