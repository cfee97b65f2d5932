"""Where a decode step's kernels come from: compile the step on the device and count the
kernels of its optimised HLO (fusions, library GEMMs, custom calls) by source op, then time
it. Decode at batch 1 is bound by kernel count as much as by bytes: every tiny fusion costs
a few microseconds however little it moves.

    PYTHONPATH=. python benchmarks/step_anatomy.py --ratios 0 4 128 [--matmul xla|pallas]
        [--kernels on] [--batch B] [--profile] [--layers N] [--devices 2 --expert 2]
        [--donate-logits]
"""
from __future__ import annotations

import argparse
import functools
import glob
import re
import tempfile
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import config as C, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec
from dsv4_jax.decode import STEP_COMPILER_OPTIONS as D_OPTS, step
from dsv4_jax.quant import Numerics

KERNEL_OPS = ("fusion", "custom-call", "dot", "scatter", "gather", "copy", "sort")


def op_sources(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (opcode, 'opcode: last two op_name parts') for every ENTRY
    instruction (without op_name metadata: the instruction's name, which says what it
    fuses)."""
    entry = hlo_text[hlo_text.index("ENTRY"):]
    out = {}
    for line in entry.splitlines():
        # result type: one word, or a tuple (a multi-output fusion: a kernel too)
        m = re.search(r"%?([\w.-]+) = (?:\(.*?\)|\S+) ([\w-]+)\(", line)
        if not m:
            continue
        name = re.search(r'op_name="([^"]+)"', line)
        if name is None:
            out[m.group(1)] = (m.group(2), f"{m.group(2)}: <{re.sub(r'[.]\d+$', '', m.group(1))}>")
            continue
        parts = [p for p in name.group(1).split("/") if not p.startswith("jit(")]
        label = f"{m.group(2)}: " + "/".join(parts[-2:])[:80]
        if m.group(2) == "custom-call":   # kernels all share an op name: add the result type
            label += " -> " + re.search(r" = (\(.*?\)|\S+) ", line).group(1)[:60]
        out[m.group(1)] = (m.group(2), label)
    return out


def event_label(kernel: str, hlo_op: str, src: dict) -> str | None:
    """op_sources' label of a profiled kernel: by its hlo_op, or (inside a CUDA graph, where
    hlo_op names the graph) by the kernel's name mapped back to its HLO instruction
    (`input_scatter_fusion_3` is `input_scatter_fusion.3`); None if neither is known.
    Note: XLA gives deduplicated fusions one kernel name, so a name can stand for several
    instructions (its label is the first one's)."""
    if hlo_op in src and not hlo_op.startswith("command_buffer"):
        return src[hlo_op][1]
    hlo = re.sub(r"_(\d+)$", r".\1", kernel)
    return src[hlo][1] if hlo in src else src.get(kernel, (None, None))[1]


def kernels_by_source(hlo_text: str) -> tuple[int, Counter]:
    """(number of kernel-launching instructions in ENTRY, Counter of their source ops)."""
    src = Counter(label for op, label in op_sources(hlo_text).values() if op in KERNEL_OPS)
    return sum(src.values()), src


def profile_kernels(run, n_steps: int, hlo_text: str, top: int = 30):
    """Trace n_steps calls of run() (with a pause between them) and sum the GPU kernel time
    per source op. Within a step, GPU span minus kernel time is time the GPU sat idle
    between kernels (launch latency, host work); the gaps are listed by size."""
    d = tempfile.mkdtemp()
    run()
    with jax.profiler.trace(d):
        for _ in range(n_steps):
            run()
            time.sleep(0.01)  # steps are told apart by this pause
    path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
    prof = jax.profiler.ProfileData.from_file(path)
    src = op_sources(hlo_text)
    evs = []  # (start, end, name, hlo_op)
    gpus = sorted(p.name for p in prof.planes if p.name.startswith("/device:GPU"))
    gpu = bool(gpus)
    for plane in prof.planes:  # GPU: the first device only (sharded runs: one device's view)
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
    evs.sort()
    host = Counter()  # host-side work per event name (python frames excluded)
    for plane in prof.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for ev in line.events:
                    if not ev.name.startswith("$"):
                        host[ev.name[:70]] += ev.duration_ns
    steps, cur = [], [evs[0]] if evs else []
    for e in evs[1:]:
        if e[0] - max(x[1] for x in cur[-4:]) > 5e6:  # the 10 ms pause
            steps.append(cur)
            cur = []
        cur.append(e)
    steps.append(cur)
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


def sinkhorn_variants(iters=20, eps=1e-6):
    """Kernels and time of the mHC Sinkhorn loop [1, 1, 4, 4] written three ways: with
    reductions (as in layers.hc_weights on CPU), with slice adds, with 16 scalar arrays;
    on GPU also the Pallas kernel (pallas_kernels/hc_sinkhorn, with its softmax)."""
    def reduce_sums(c):
        c = c / (c.sum(-2, keepdims=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdims=True) + eps)
            c = c / (c.sum(-2, keepdims=True) + eps)
        return c

    def slice_sums(c):
        def ss(a, ax):
            out = jax.lax.slice_in_dim(a, 0, 1, axis=ax)
            for i in range(1, a.shape[ax]):
                out = out + jax.lax.slice_in_dim(a, i, i + 1, axis=ax)
            return out
        c = c / (ss(c, -2) + eps)
        for _ in range(iters - 1):
            c = c / (ss(c, -1) + eps)
            c = c / (ss(c, -2) + eps)
        return c

    def scalars(c):
        n = c.shape[-1]
        e = [[c[..., i, j] for j in range(n)] for i in range(n)]
        col = lambda e: [[e[i][j] / (sum(e[k][j] for k in range(1, n)) + e[0][j] + eps)
                          for j in range(n)] for i in range(n)]
        row = lambda e: [[e[i][j] / (sum(e[i][k] for k in range(1, n)) + e[i][0] + eps)
                          for j in range(n)] for i in range(n)]
        e = col(e)
        for _ in range(iters - 1):
            e = col(row(e))
        return jnp.stack([jnp.stack(r, -1) for r in e], -2)

    def kernel(c):  # softmax(log c) = row-normalised c, then the same loop (one kernel)
        from pallas_kernels.hc_sinkhorn import sinkhorn_softmax
        return sinkhorn_softmax(jnp.log(c).reshape(-1, 4, 4), iters, eps).reshape(c.shape)

    c = jax.random.uniform(jax.random.key(0), (1, 1, 4, 4)) + 0.1
    forms = [reduce_sums, slice_sums, scalars] + ([kernel] if jax.default_backend() == "gpu" else [])
    for f in forms:
        ref = reduce_sums(jax.nn.softmax(jnp.log(c), -1) + eps) if f is kernel else reduce_sums(c)
        comp = jax.jit(f).lower(c).compile()
        n, _ = kernels_by_source(comp.as_text())
        # device time: 100 dependent calls inside one program (a single call's wall time is
        # dispatch, which hid the 50-100 us kernel of the scalar form)
        chain = jax.jit(lambda c: jax.lax.fori_loop(0, 100, lambda i, v: f(v), c)).lower(c).compile()
        chain(c).block_until_ready()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            chain(c).block_until_ready()
            ts.append(time.perf_counter() - t0)
        err = float(jnp.abs(comp(c) - ref).max())
        print(f"sinkhorn {f.__name__}: {n} kernels, {1e4 * float(np.median(ts)):.1f} us per "
              f"call (100 chained in one program), max diff {err:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--ratios", type=int, nargs="+", default=[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--matmul", default="xla")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kernels", default="off", help="cache/attention kernels: off|on")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--tokens", choices=["random", "same"], default="random",
                    help="the step's input tokens: random ids (as decode_bench; B tokens "
                         "route to ~E(1 - (1 - k/E)^B) experts) or one id for every request "
                         "(before 2026-11-26: all B tokens hit the same k experts, so MoE "
                         "weight traffic at B > 1 was that of B = 1)")
    ap.add_argument("--profile", action="store_true",
                    help="trace the step and sum GPU kernel time per source op")
    ap.add_argument("--hlo-out", help="write the optimised HLO of the step here")
    ap.add_argument("--layers", type=int, default=0,
                    help="the preset's first N layers instead of --ratios")
    ap.add_argument("--devices", type=int, default=0, help="run sharded over N devices")
    ap.add_argument("--expert", type=int, default=None, help="mesh expert-axis size")
    ap.add_argument("--model", type=int, default=None, help="mesh model-axis size")
    ap.add_argument("--sinkhorn", action="store_true", help="also compare Sinkhorn forms")
    ap.add_argument("--merge-x-proj", action="store_true",
                    help="the parameters in decode form (params.merge_x_proj), as the Engine "
                         "and the CLI run them")
    ap.add_argument("--place-args", action="store_true",
                    help="sharded: put the step's small inputs on the mesh (replicated) once, "
                         "instead of letting every call copy them there")
    ap.add_argument("--donate-logits", action="store_true",
                    help="the step writes its logits over the previous "
                         "step's (donated), so the output keeps one address (does a fresh "
                         "output buffer make XLA update the CUDA graph every step?)")
    a = ap.parse_args()
    import os
    cache_dir = os.environ.get("DSV4_COMPILE_CACHE", os.path.expanduser("~/.cache/dsv4-jax/xla"))
    if cache_dir != "off":  # a re-run on a warm machine skips the minutes of compilation
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    if a.sinkhorn:
        sinkhorn_variants()
    cfg = C.get_preset(a.preset)
    if a.layers:  # the preset's first N layers (0: all), its own layer kinds
        n = a.layers
        cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                          num_hash_layers=min(cfg.num_hash_layers, n))
    else:
        cfg = cfg.replace(num_hidden_layers=len(a.ratios),
                          compress_ratios=tuple(a.ratios) + (0,), num_hash_layers=0)
    nm = Numerics(True, "bfloat16", matmul=a.matmul)
    B, ctx = a.batch, a.context
    mb = -(-(ctx + 40) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb,
                                kernels=a.kernels)
    mesh = rep = None
    if a.devices:  # sharded as `dsv4 bench decode --devices`: profile device 0's stream
        from dsv4_jax.distributed import (cache_shardings, make_mesh, param_shardings,
                                          shard_cache, sharded_step)
        mesh = make_mesh(a.devices, expert=a.expert, model=a.model)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        ss = sharded_step(cfg, cs, nm, mesh, include_mtp=False)
        f = ss.form(a.merge_x_proj) if hasattr(ss, "form") else ss.jitted   # (older trees)
        if a.donate_logits:
            stp = ss.fn
            psh = param_shardings(cfg, mesh, include_mtp=False,
                                  **({"x_proj_merged": True} if a.merge_x_proj else {}))
            csh = cache_shardings(cfg, cs, mesh)

            def step_into_sh(params, cache, lg_prev, *args):
                lg, cache = stp(params, cache, *args)
                return lg + 0.0 * lg_prev, cache   # aliases lg_prev (donated)
            f = jax.jit(step_into_sh, in_shardings=(psh, csh, rep) + (rep,) * 5,
                        out_shardings=(rep, csh), donate_argnums=(1, 2),
                        compiler_options=D_OPTS)
    else:
        f = jax.jit(functools.partial(step, cfg=cfg, cs=cs, nm=nm), donate_argnums=(1,),
                    compiler_options=D_OPTS)
        if a.donate_logits:
            def step_into(params, cache, lg_prev, *args):
                lg, cache = step(params, cache, *args, cfg=cfg, cs=cs, nm=nm)
                return lg + 0.0 * lg_prev, cache   # aliases lg_prev (donated)
            f = jax.jit(step_into, donate_argnums=(1, 2),
                        compiler_options=D_OPTS)
    t0 = time.perf_counter()
    # drawn in the checkpoint form, then merged (on a mesh the merged weights are placed by
    # the sharding rules), as the CLI does
    params = P.init_params_device(cfg, 0, shardings=param_shardings(
        cfg, mesh, include_mtp=False) if mesh is not None else None)
    if a.merge_x_proj:
        params = P.merge_x_proj(params, cfg, consume=True)
    params = jax.block_until_ready(params)
    print(f"weights drawn in {time.perf_counter() - t0:.0f} s", flush=True)
    from benchmarks.decode_bench import random_cache
    cache = random_cache(cfg, cs, B, ctx, jax.random.key(0))
    if mesh is not None:
        cache = shard_cache(cache, cfg, cs, mesh)
    i32 = lambda v, *s: jnp.full(s, v, jnp.int32)
    table = jnp.arange(B * mb, dtype=jnp.int32).reshape(B, mb)
    toks = (i32(7, B, 1) if a.tokens == "same" else
            jax.random.randint(jax.random.key(1), (B, 1), 0, cfg.vocab_size, jnp.int32))
    args = (toks, jnp.arange(B, dtype=jnp.int32), i32(ctx, B), i32(1, B), table)
    if mesh is not None and a.place_args:   # else every call copies them onto the mesh
        args = tuple(jax.device_put(x, rep) for x in args)
    donate = a.donate_logits
    lg = jnp.zeros((B, cfg.vocab_size), jnp.float32)
    if mesh is not None:
        lg = jax.device_put(lg, rep)
    t0 = time.perf_counter()
    compiled = (f.lower(params, cache, lg, *args) if donate
                else f.lower(params, cache, *args)).compile()

    def call(lg, cache):   # -> (logits, cache); with --donate-logits lg is overwritten
        return compiled(params, cache, lg, *args) if donate else compiled(params, cache, *args)
    print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    n, src = kernels_by_source(compiled.as_text())
    print(f"{jax.devices()[0].device_kind}: layers {cfg.compress_ratios[:-1]} B={B} "
          f"matmul={a.matmul} devices={a.devices or 1}: "
          f"{n} kernels in the step")
    for k, v in src.most_common(a.top):
        print(f"  {v:4d}  {k}")
    ts, td = [], []
    for i in range(22):
        t0 = time.perf_counter()
        lg, cache = call(lg, cache)
        td.append(time.perf_counter() - t0)  # the call returns once the step is enqueued
        lg.block_until_ready()
        ts.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(ts[2:]))
    t0 = time.perf_counter()
    for i in range(20):  # back to back, one wait: host launch overlaps the GPU's work
        lg, cache = call(lg, cache)
    lg.block_until_ready()
    pipe = 1e3 * (time.perf_counter() - t0) / 20
    print(f"step {ms:.3f} ms (host enqueue {1e3 * float(np.median(td[2:])):.3f} ms) -> "
          f"{1e3 * ms / n:.1f} us per kernel on average; pipelined {pipe:.3f} ms"
          + (" (logits written over the donated previous ones)" if donate else ""))
    ms_ = jax.local_devices()[0].memory_stats() or {}
    if ms_:   # a step that must wait for memory freed by the previous one cannot pipeline
        print("device 0 memory: in use {:.1f} GB, peak {:.1f} GB, limit {:.1f} GB".format(
            *(ms_.get(k, 0) / 1e9 for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"))))
    if a.profile:
        state = {"cache": cache, "lg": lg}

        def run():
            state["lg"], state["cache"] = call(state["lg"], state["cache"])
            state["lg"].block_until_ready()
        profile_kernels(run, 10, compiled.as_text(), a.top)
    if a.hlo_out:
        with open(a.hlo_out, "w") as fh:
            fh.write(compiled.as_text())


if __name__ == "__main__":
    main()
