"""Where a decode step's kernels and GPU time go: compile the step on the device, count the
kernels of its optimised HLO by source op, time it, and (--profile) sum the GPU time of
each source op from a profiler trace.

    PYTHONPATH=. python -m benchmarks.step_anatomy --preset flash --layers 10 --batch 1
        [--context 4096] [--kernels on|off] [--matmul pallas|xla] [--profile] [--top 25]
        [--devices 2 --expert 2] [--hlo-out step.hlo]

The step is the one `dsv4 bench decode` times (synthetic weights in the real formats, in
the decode form the Engine runs; a random valid cache at the given context). XLA turns
CUDA graphs off while the profiler runs unless told otherwise; the profiled program is
compiled with `xla_enable_command_buffers_during_profiling`, so the trace shows the
graphed step the real run executes, not one launch per kernel. The profile's GPU span per
step, the kernel time within it and the idle gaps tell a GPU-bound step from a
host-bound one. On the CPU it runs as a smoke test, without the kernels (the profile then
lists XLA's thunks).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import kernels_by_source, op_sources
from benchmarks.decode_bench import random_cache
from dsv4_jax import config as C, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec
from dsv4_jax.decode import STEP_COMPILER_OPTIONS
from dsv4_jax.distributed import make_mesh
from dsv4_jax.programs import Layout, split, step_program
from dsv4_jax.sharding import param_shardings, shard_cache
from dsv4_jax.quant import Numerics

PROFILE_OPTIONS = {"xla_enable_command_buffers_during_profiling": True}


def event_label(kernel: str, hlo_op: str, src: dict) -> str | None:
    """op_sources' label of a profiled kernel: by its hlo_op, or (inside a CUDA graph, where
    hlo_op names the graph) by the kernel's name mapped back to its HLO instruction
    (`input_scatter_fusion_3` is `input_scatter_fusion.3`); None if neither is known.
    XLA gives deduplicated fusions one kernel name, so a name can stand for several
    instructions (its label is the first one's)."""
    if hlo_op in src and not hlo_op.startswith("command_buffer"):
        return src[hlo_op][1]
    hlo = re.sub(r"_(\d+)$", r".\1", kernel)
    return src[hlo][1] if hlo in src else src.get(kernel, (None, None))[1]


STEP_MARK = "step_anatomy_step"


def _trace_events(path: str):
    """-> (device events [(start_ns, end_ns, name, hlo_op)] of the first GPU, or of the
    CPU's thunks; the marked steps' host intervals [(start_ns, end_ns)]; host time per
    event name)."""
    prof = jax.profiler.ProfileData.from_file(path)
    evs = []
    gpus = sorted(p.name for p in prof.planes if p.name.startswith("/device:GPU"))
    gpu = bool(gpus)
    for plane in prof.planes:  # sharded runs: the first device's view
        if gpu and plane.name != gpus[0]:
            continue
        for line in plane.lines:
            if gpu and "stream" not in line.name.lower():
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                if not gpu and "hlo_op" not in stats:  # CPU: only the thunks count
                    continue
                evs.append((ev.start_ns, ev.end_ns, ev.name, str(stats.get("hlo_op", ""))))
    host, marks = Counter(), []  # host work per event name (python frames excluded)
    for plane in prof.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for ev in line.events:
                    if ev.name == STEP_MARK:
                        marks.append((ev.start_ns, ev.end_ns))
                    elif not ev.name.startswith("$"):
                        host[ev.name[:70]] += ev.duration_ns
    return sorted(evs), sorted(marks), host


def profile_kernels(run, n_steps: int, hlo_text: str, top: int = 30):
    """Trace n_steps calls of run() (each blocks until its step is done, inside a marked
    host interval that holds its device events) and print the GPU kernel time per source
    op, the GPU span, the idle gaps by size, and the host events by time."""
    d = tempfile.mkdtemp()
    run()
    with jax.profiler.trace(d):
        for _ in range(n_steps):
            with jax.profiler.TraceAnnotation(STEP_MARK):
                run()
    evs, marks, host = _trace_events(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    steps = [[e for e in evs if lo <= e[0] <= hi] for lo, hi in marks]
    steps = [st for st in steps if st]
    src = op_sources(hlo_text)
    per_src, per_name, gaps, labels = Counter(), Counter(), [], {}
    span = busy = 0
    for st in steps:
        span += max(e[1] for e in st) - st[0][0]
        end = st[0][0]
        for e in st:
            gaps.append((e[0] - end, e[2]))
            end = max(end, e[1])
            busy += e[1] - e[0]
            label = event_label(e[2], e[3], src)
            per_src[label or f"kernel: {re.sub(r'_?[0-9]+$', '', e[2])[:60]}"] += e[1] - e[0]
            per_name[e[2][:70]] += e[1] - e[0]
            labels[e[2][:70]] = label or ""
    n = len(steps)
    print(f"profile: {n} steps, {len(evs) / n:.0f} kernels/step; per step: GPU span "
          f"{span / n / 1e3:.0f} us, kernel time {busy / n / 1e3:.0f} us, idle "
          f"{(span - busy) / n / 1e3:.0f} us")
    for lo, hi in ((-1e12, 1e3), (1e3, 3e3), (3e3, 10e3), (10e3, 50e3), (50e3, 1e12)):
        g = [x for x, _ in gaps if lo <= x < hi]
        print(f"  gaps {max(lo, 0) / 1e3:.0f}-{hi / 1e3:.0f} us: {len(g) / n:.0f}/step, "
              f"{sum(g) / n / 1e3:.0f} us/step")
    print("  largest gaps (us, kernel after the gap):",
          ", ".join(f"{x / 1e3:.0f} {k[:40]}" for x, k in sorted(gaps, reverse=True)[:8]))
    print("  us/step  share  source (by op_name, else by kernel name)")
    for k, v in per_src.most_common(top):
        print(f"  {v / n / 1e3:7.1f}  {100 * v / max(1, busy):4.1f}%  {k}")
    print("  host events by total time (us/step):",
          "; ".join(f"{k} {v / n / 1e3:.0f}" for k, v in host.most_common(14)))
    print("  top kernels by name:")
    for k, v in per_name.most_common(top):
        print(f"  {v / n / 1e3:7.1f}  {k}  {labels[k]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=0, help="the preset's first N layers (0: all)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kernels", default="on", choices=["off", "on"],
                    help="the cache / attention / indexer kernels")
    ap.add_argument("--matmul", default="pallas", choices=["xla", "pallas"],
                    help="quantised linears and experts: the weight-streaming kernels or XLA")
    ap.add_argument("--profile", action="store_true",
                    help="trace the step and sum GPU kernel time per source op")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hlo-out", help="write the optimised HLO of the step here")
    ap.add_argument("--devices", type=int, default=0, help="run sharded over N devices")
    ap.add_argument("--expert", type=int, default=None, help="mesh expert-axis size")
    ap.add_argument("--model", type=int, default=None, help="mesh model-axis size")
    a = ap.parse_args(argv)
    cache_dir = os.environ.get("DSV4_COMPILE_CACHE", os.path.expanduser("~/.cache/dsv4-jax/xla"))
    if cache_dir != "off":  # a re-run on a warm machine skips the minutes of compilation
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    cfg = C.get_preset(a.preset)
    n = a.layers or cfg.num_hidden_layers
    cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                      num_hash_layers=min(cfg.num_hash_layers, n))
    on_gpu = jax.default_backend() == "gpu"
    # the kernels need a Hopper GPU; elsewhere (a CPU smoke test) the step runs without them
    nm = Numerics(True, "bfloat16", matmul=a.matmul if on_gpu else "xla")
    kernels = a.kernels if on_gpu else "off"
    B, ctx = a.batch, a.context
    mb = -(-(ctx + 40) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb,
                                kernels=kernels)
    mesh = make_mesh(a.devices, expert=a.expert, model=a.model) if a.devices else None
    t0 = time.perf_counter()
    params = P.init_params_device(cfg, 0, shardings=None if mesh is None else
                                  param_shardings(cfg, mesh, include_mtp=False))
    params = jax.block_until_ready(P.merge_x_proj(params, cfg, consume=True))
    print(f"weights drawn in {time.perf_counter() - t0:.0f} s", flush=True)
    cache = random_cache(cfg, cs, B, ctx, jax.random.key(0))
    if mesh is not None:
        cache = shard_cache(cache, cfg, cs, mesh)
    graphdef, state = split(cfg, params)
    f = step_program(Layout.of(cfg, params, mesh), graphdef, cs, nm)
    table = jnp.arange(B * mb, dtype=jnp.int32).reshape(B, mb)
    toks = jax.random.randint(jax.random.key(1), (B, 1), 0, cfg.vocab_size, jnp.int32)
    args = (toks, jnp.arange(B, dtype=jnp.int32), jnp.full(B, ctx, jnp.int32),
            jnp.ones(B, jnp.int32), table)
    t0 = time.perf_counter()
    lowered = f.lower(state, cache, *args)
    opts = dict(STEP_COMPILER_OPTIONS, **(PROFILE_OPTIONS if a.profile else {}))
    compiled = lowered.compile(opts)
    print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    hlo = compiled.as_text()
    k, src = kernels_by_source(hlo)
    print(f"{jax.devices()[0].device_kind}: layers {cfg.compress_ratios[:-1]} B={B} "
          f"context {ctx} kernels={kernels} matmul={nm.matmul} devices={a.devices or 1}: "
          f"{k} kernels in the step")
    for name, v in src.most_common(a.top):
        print(f"  {v:4d}  {name}")
    ts, td = [], []
    for _ in range(22):
        t0 = time.perf_counter()
        lg, cache = compiled(state, cache, *args)
        td.append(time.perf_counter() - t0)  # the call returns once the step is enqueued
        lg.block_until_ready()
        ts.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(ts[2:]))
    t0 = time.perf_counter()
    for _ in range(20):  # back to back, one wait: host launch overlaps the GPU's work
        lg, cache = compiled(state, cache, *args)
    lg.block_until_ready()
    pipe = 1e3 * (time.perf_counter() - t0) / 20
    print(f"step {ms:.3f} ms (host enqueue {1e3 * float(np.median(td[2:])):.3f} ms); "
          f"pipelined {pipe:.3f} ms")
    if a.profile:
        held = {"cache": cache}

        def run():
            lg, held["cache"] = compiled(state, held["cache"], *args)
            lg.block_until_ready()
        profile_kernels(run, 10, hlo, a.top)
    if a.hlo_out:
        with open(a.hlo_out, "w") as fh:
            fh.write(hlo)


if __name__ == "__main__":
    main()
