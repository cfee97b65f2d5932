"""The top-k selection kernel against XLA's lax.top_k (the path the decode step runs now),
at the lightning indexer's decode shapes.

    PYTHONPATH=. python benchmarks/topk_select.py [--cases 64:32768:512 ...] [--json F]
        [--tiles 0 2048] [--bits 2 4] [--segments 0 9] [--fused 0 1] [--interpret]

Scores [B, N] f32 as the indexer writes them: random, -inf past each request's eligible
entries ((t + 1) // 4, t drawn per request). N = max_blocks * 32 (4K / 32K / 128K context:
~1K / 8K / 32K entries), k = index_topk (Flash 512, Pro 1024).
Per case: time per call (one jitted program running several independent input sets back to
back, sized past the L2), GPU busy per call (profiler; with several segments per row the
kernel is two calls and a gather), bytes = scores read once + ids
written, share of the copy bandwidth measured in the same run, and the check: the kernel's
ids equal reference.topk_select_reference (the set lax.top_k picks, ascending) exactly.
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
from pallas_kernels.indexer_decode import topk_from_scores  # noqa: E402
from pallas_kernels.topk_select import topk_select, topk_select_reference  # noqa: E402

CASES = ["1:1056:512", "8:1056:512", "64:1056:512", "1:8224:512", "8:8224:512",
         "64:8224:512", "1:32800:512", "8:32800:512", "64:32800:512", "8:32800:1024",
         "32:32800:1024"]


def scores(key, B, N):
    ks = jax.random.split(key)
    s = jax.random.normal(ks[0], (B, N), jnp.float32)
    t = jax.random.randint(ks[1], (B,), 4 * N // 2, 4 * N)           # positions
    return jnp.where(jnp.arange(N)[None, :] < ((t + 1) // 4)[:, None], s, -jnp.inf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=CASES, help="B:N:k")
    ap.add_argument("--tiles", type=int, nargs="+", default=[0],
                    help="keys a program holds when a row is split (0: default_tile)")
    ap.add_argument("--bits", type=int, nargs="+", default=[2], help="radix digit widths")
    ap.add_argument("--segments", type=int, nargs="+", default=[0],
                    help="programs per row (0: kernel.default_segments)")
    ap.add_argument("--fused", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="a search step's counts in one reduction (topk_select's fused)")
    ap.add_argument("--json", help="append one JSON line per case here")
    ap.add_argument("--interpret", action="store_true", help="CPU check of this script")
    a = ap.parse_args()
    bw = copy_bandwidth() if not a.interpret else 1e12
    dev = jax.devices()[0].device_kind
    print(f"device {dev}; HBM ceiling (hbm_bandwidth) {bw / 1e9:.0f} GB/s")
    for case in a.cases:
        B, N, k = map(int, case.split(":"))
        sets = [scores(jax.random.key(1000 * B + i), B, N)
                for i in range(1 if a.interpret else max(2, min(16, (64 << 20) // (B * N * 4))))]
        progs = {f"kernel t{t or 'auto'}b{d}s{g or 'auto'}{'f' if fu else ''}": functools.partial(
                     topk_select, k=k, tile=t or None, bits=d, segments=g or None,
                     fused=bool(fu), interpret=a.interpret)
                 for t in a.tiles for d in a.bits for g in a.segments for fu in a.fused}
        progs["xla lax.top_k"] = functools.partial(topk_from_scores, topk=k)
        many = {n: jax.jit(lambda ss, f=f: [f(s) for s in ss]) for n, f in progs.items()}
        res, outs = {}, {}
        for n, prog in many.items():
            res[n], outs[n] = wall_time(prog, sets, reps=2 if a.interpret else 5)
        busy = ({} if a.interpret else
                profile_times([(n, p, sets) for n, p in many.items()]))
        ref = np.asarray(topk_select_reference(sets[0], k))
        xla_set = np.sort(np.where(np.asarray(outs["xla lax.top_k"]) < 0, 1 << 30,
                                   np.asarray(outs["xla lax.top_k"])), axis=1)
        assert np.array_equal(np.where(xla_set == 1 << 30, -1, xla_set), ref), "reference"
        nbytes = B * N * 4 + B * k * 4
        line = f"B={B:3d} N={N:6d} k={k:5d} ({nbytes / 1e6:6.2f} MB, {len(sets)} sets):"
        row = dict(B=B, N=N, k=k, device=dev, bytes=nbytes, bw=bw, us={}, busy_us={}, ok={})
        for n in many:
            ok = n.startswith("xla") or bool(np.array_equal(np.asarray(outs[n]), ref))
            b_us = busy[n]["busy"] / len(sets) * 1e6 if busy else float("nan")
            line += (f" | {n} {res[n] * 1e6:8.2f} us (busy {b_us:7.2f}, "
                     f"{100 * nbytes / res[n] / bw:5.1f}% bw){'' if ok else ' WRONG'}")
            row["us"][n], row["busy_us"][n], row["ok"][n] = res[n] * 1e6, b_us, ok
        kern = min((n for n in many if n.startswith("kernel")), key=lambda n: res[n])
        line += f" | speedup {res['xla lax.top_k'] / res[kern]:.2f}x ({kern})"
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
