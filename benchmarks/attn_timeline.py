"""Where the warp-specialised attention kernel's time goes, from Mosaic's in-kernel profiler
(DSV4_ATTN_PROFILE, pallas_kernels/sparse_decode_attention/kernel.py): each warpgroup
records its named scopes (consumers: wait_q, wait_copy, wait_kfree, deq, kfull,
qk_softmax, pv, finish; producer: issue, release) with the SM clock. The profiler's own
cost (~12 cycles an event) is subtracted by Mosaic, yet a profiled kernel ran ~1.7x
longer (H200, 2026-11-26: CTAs 46-51 us against ~28 us unprofiled), so read the shares,
not the absolute times; timings are of one warm call.
Prints the CTA start spread, the kernel span and, per warpgroup role, the mean time per
CTA in each scope. Usage (GPU):
  python3 benchmarks/attn_timeline.py --case flash:csa:64:32768 [--variant cpasync+qks]"""
import argparse
import collections
import glob
import json
import os
import statistics
import tempfile

import jax


def summarize(path):
    """Trace JSON -> text lines."""
    ev = json.load(open(path))["traceEvents"]
    by_tid = collections.defaultdict(list)
    for e in ev:
        by_tid[e["tid"]].append(e)
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] for e in ev)
    starts, ends = collections.defaultdict(list), collections.defaultdict(list)
    tot = collections.defaultdict(lambda: collections.defaultdict(float))
    cnt = collections.defaultdict(lambda: collections.defaultdict(int))
    n_wg = 3
    for tid, es in by_tid.items():
        cta, wg = (tid - 1) // n_wg, (tid - 1) % n_wg
        role = "producer" if wg == 2 else "consumer"
        stack = []
        for e in es:
            if e["ph"] == "B":
                stack.append(e)
            else:
                b = stack.pop()
                if not stack:   # top-level scopes only
                    tot[role][e["name"]] += e["ts"] - b["ts"]
                    cnt[role][e["name"]] += 1
        starts[cta].append(es[0]["ts"])
        ends[cta].append(es[-1]["ts"])
    ctas = sorted(starts)
    st = [min(starts[c]) - t0 for c in ctas]
    dur = [max(ends[c]) - min(starts[c]) for c in ctas]
    out = [f"trace {os.path.basename(path)}: {len(ctas)} CTAs, span {t1 - t0:.2f} us "
           f"(first scope to last), CTA start offsets min/median/max "
           f"{min(st):.2f}/{statistics.median(st):.2f}/{max(st):.2f} us, CTA duration "
           f"min/median/max {min(dur):.2f}/{statistics.median(dur):.2f}/{max(dur):.2f} us"]
    for role in ("consumer", "producer"):
        n = len(ctas) * (2 if role == "consumer" else 1)
        parts = sorted(tot[role].items(), key=lambda kv: -kv[1])
        out.append(f"  {role} (mean per warpgroup, us; calls): " + ", ".join(
            f"{k} {v / n:.2f} ({cnt[role][k] / n:.1f})" for k, v in parts))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="flash:csa:64:32768")
    ap.add_argument("--variant", default="cpasync", help="cpasync or cpasync+qks")
    a = ap.parse_args()
    d = tempfile.mkdtemp()
    os.environ["DSV4_ATTN_PROFILE"] = d
    import functools
    from benchmarks.attention_decode import MODELS, make_case
    from pallas_kernels.sparse_decode_attention import kernel as K
    model, mode, B, ctx = a.case.split(":")
    B, ctx = int(B), int(ctx)
    H, topk = MODELS[model]
    args = make_case(jax.random.key(0), B, H, ctx, topk if mode == "csa" else ctx // 128, mode)
    gather, *opts = a.variant.split("+")
    kw = dict(gather=gather, warp_specialized=True, qk_split="qks" in opts)
    for _ in range(2):   # a fresh trace each time; the second (warm) call's file is used
        f = jax.jit(functools.partial(K.sparse_decode_attention, **kw))
        jax.block_until_ready(f(*args))
        jax.effects_barrier()
    path = sorted(glob.glob(f"{d}/*trace.json"), key=os.path.getmtime)[-1]
    print(f"{a.case} {a.variant}")
    print("\n".join(summarize(path)))


if __name__ == "__main__":
    main()
