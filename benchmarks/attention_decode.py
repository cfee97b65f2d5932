"""GPU correctness at real shapes + benchmark of sparse decode attention (issue 5: rows
gathered in-kernel instead of the XLA staging gather).

Run on the device: PYTHONPATH=. python3 benchmarks/attention_decode.py [--budget S] [--out DIR]
CPU smoke run of the whole script (GPU interpreter, tiny shapes, every code path but the
real timings; 4 min for 2 of its 3 cases on 2 cores): python3 benchmarks/attention_decode.py --tiny --budget 900
--variants ws-lane --out /tmp/x
Each variant is first smoke-tested in a subprocess with a time limit (a kernel that faults
or hangs is dropped, the rest still run) on Flash CSA, Flash HCA and Pro CSA shapes. Then,
per case (model, mode, B, context):
 - check: every kernel variant vs the pure-JAX reference on the same random cache
   (rel err = ||out - ref|| / ||ref|| over the bf16 outputs in f32);
 - time ("wall") = median over runs of one jitted program that calls the op on N distinct
   input sets back to back, divided by N (host dispatch and the sync amortised over N only:
   at small B this is mostly launch overhead, for kernel and XLA alike);
 - "GPU busy" / "GPU span" per op from a profiler trace of the same programs: the sum of
   the GPU stream events (kernels + copies, no launch gaps) / first start to last end of
   each program (gaps between its kernels included), divided by N; the kernel path's
   largest event is its Mosaic kernel, the rest is its XLA side (metadata, split merge);
 - bytes = what the op must read: 584 B per attended cache entry (128 window slots + the
   valid compressed ids) + q and the output; GB/s over the op's end-to-end time; % = of
   the best copy bandwidth measured in the same run;
 - speedup = XLA path (reference.py over the dequantised gathered rows, the kernels-off
   path) / kernel, and staged (the previous version: XLA staging gather + kernel) / direct.
Variants: ws-lane = warp_specialized=True (the default), direct-lane = two single-warpgroup
CTAs per head tile (both gather="direct", Lane lowering), staged = the previous XLA
staging gather, tritonN = kernel_triton (vector-load gathers) with N heads per program. Cases run in priority order (cases()) until --budget seconds have passed
since the start (smoke test included; a case once started runs to its end: 19-42 s on the H100, mostly compilation; the
smoke test takes ~60 s, --trusted skips it);
skipped ones are listed. The first case gets every variant, later ones the best correct
one so far (or --default). --split-first also times the XLA side and the kernel alone
(separate programs) for the first case.
Writes attention_decode.jsonl and attention_decode.md under --out after every case
(results so far: benchmarks/results/attention_decode.md).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention import kernel as AK
from pallas_kernels.sparse_decode_attention import reference as AR
from benchmarks.common import hbm_bandwidth

MB = 1 << 20
MODELS = {"flash": (64, 512), "pro": (128, 1024)}     # heads, CSA top-k
TINY_MODELS = {"flash": (64, 64), "pro": (128, 64)}   # --tiny (CPU interpreter)
VARIANTS = {   # name -> kernel keyword arguments
    "ws-lane": dict(gather="direct", warp_specialized=True),
    # the producer warpgroup copies rows with cp.async (16-byte pieces, 128 threads)
    "ws-cpasync": dict(gather="cpasync", warp_specialized=True),
    # ... with the consumers splitting the keys: one QK per block (not yet GPU-timed)
    "ws-cpasync-qks": dict(gather="cpasync", warp_specialized=True, qk_split=True),
    "direct-lane": dict(gather="direct", warp_specialized=False),
    "staged": dict(gather="staged", warp_specialized=False),
    # ws-lane with the split rule before 2026-11-23 (kernel.default_splits_v1), for A/B
    "ws-lane-v1split": dict(gather="direct", warp_specialized=True, split_rule="v1"),
    # kernel_triton: rows gathered by vector loads; head_tile heads per program
    "triton16": dict(backend="triton", head_tile=16, num_warps=4),
    "triton32": dict(backend="triton", head_tile=32, num_warps=4),
    "triton64": dict(backend="triton", head_tile=64, num_warps=8),
    "triton64s2": dict(backend="triton", head_tile=64, num_warps=8, num_stages=2),
    "triton64s3": dict(backend="triton", head_tile=64, num_warps=8, num_stages=3),
    "triton64w4": dict(backend="triton", head_tile=64, num_warps=4),
    # the split rule of the first Triton runs (4 programs per SM assumed)
    "triton64-cps4": dict(backend="triton", head_tile=64, num_warps=8, ctas_per_sm=4),
    # triton64 spills (255 registers + 360 B, benchmarks/triton_regs.py); these do not /
    # less: two programs per tile, one per output column half; q re-read per block
    "triton64c2": dict(backend="triton", head_tile=64, num_warps=8, col_split=2),
    "triton64q": dict(backend="triton", head_tile=64, num_warps=8, q_in_loop=True),
    # K / output as whole [.., 512] tiles: 2 dots a key block (sm_90a SASS: 3 barriers and
    # 2 wgmma waits a block instead of 23 and 16; ~28 spilled registers a block)
    "triton64j": dict(backend="triton", head_tile=64, num_warps=8, joined=True),
}


def batched(fn):
    """One jitted program that applies fn to every input set of a list, back to back."""
    return jax.jit(lambda ss: [fn(*s) for s in ss])


def wall_time(many, sets, reps=5):
    """(median seconds per op of many(sets) / len(sets), the output on sets[0])."""
    first = jax.block_until_ready(many(sets))[0]
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(sets))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / len(sets), first


def bench(fn, sets, reps=5, want_out=False):
    """Median seconds per call of fn over the input sets (one jit runs them all)
    [, fn's output on sets[0] from the same compiled program]."""
    t, first = wall_time(batched(fn), sets, reps)
    return (t, first) if want_out else t


def profile_times(progs, n=3):
    """progs: [(name, compiled program, its argument)], each already run once. Traces n
    calls of each (10 ms pause between calls) -> {name: dict(busy, span, top, events)} per
    call: busy = sum of the GPU stream events' durations (kernels + copies), span = first
    start to last end, top = the 3 longest event names with their time, per = every event
    name with its time, in seconds."""
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _, f, arg in progs:
            for _ in range(n):
                jax.block_until_ready(f(arg))
                time.sleep(0.01)   # calls are told apart by this pause
    path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
    prof = jax.profiler.ProfileData.from_file(path)
    gpu = any(pl_.name.startswith("/device:GPU") for pl_ in prof.planes)
    evs = []
    for plane in prof.planes:
        if gpu and not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if gpu and "stream" not in line.name.lower():
                continue
            for ev in line.events:
                if not gpu and "hlo_op" not in dict(ev.stats):   # CPU: the thunks only
                    continue
                evs.append((ev.start_ns, ev.end_ns, ev.name))
    evs.sort()
    calls, end = [], -1e30
    for e in evs:
        if e[0] - end > 5e6:
            calls.append([])
        calls[-1].append(e)
        end = max(end, e[1])
    if len(calls) != n * len(progs):
        raise RuntimeError(f"profile: {len(calls)} event groups for {n * len(progs)} calls")
    out = {}
    for i, (name, _, _) in enumerate(progs):
        group = calls[i * n:(i + 1) * n]
        per = Counter()
        for c in group:
            for e in c:
                per[e[2]] += e[1] - e[0]
        out[name] = dict(busy=sum(per.values()) / n * 1e-9,
                         span=sum(max(e[1] for e in c) - c[0][0] for c in group) / n * 1e-9,
                         per=[(k[:80], v / n * 1e-9) for k, v in per.most_common()],
                         events=sum(len(c) for c in group) / n)
        out[name]["top"] = out[name]["per"][:3]
    return out


def random_e4m3(key, shape):
    """Random finite e4m3 values from random bytes (0x7F / 0xFF are NaN: nudged down)."""
    u = jax.random.bits(key, shape, jnp.uint8)
    u = jnp.where((u & 0x7F) == 0x7F, u - 1, u)
    return jax.lax.bitcast_convert_type(u, jnp.float8_e4m3fn)


def make_case(key, B, H, ctx, topk, mode):
    """Random cache for B requests near context ctx: window ring, pool of B * ctx/128 blocks
    in random order, and the id list (CSA: topk distinct visible ids, -1 when fewer are
    visible; HCA: all visible ids, hca_indices)."""
    EPB, ratio = (32, 4) if mode == "csa" else (1, 128)
    MAXB = ctx // 128
    NB = B * MAXB
    ks = jax.random.split(key, 10)
    q = jax.random.normal(ks[0], (B, H, 512), jnp.bfloat16)
    win = (random_e4m3(ks[1], (B, 128, 448)),
           jax.random.randint(ks[7], (B, 128, 8), 118, 126).astype(jnp.uint8),
           jax.random.normal(ks[8], (B, 128, 64), jnp.bfloat16))
    t = (ctx - 1 - jax.random.randint(ks[2], (B,), 0, 64)).astype(jnp.int32)
    slots = jnp.arange(128)[None]
    pos = (t[:, None] - ((t[:, None] - slots) % 128)).astype(jnp.int32)
    cmp = (random_e4m3(ks[3], (NB, EPB, 448)),
           jax.random.randint(ks[9], (NB, EPB, 8), 118, 126).astype(jnp.uint8),
           jax.random.normal(ks[6], (NB, EPB, 64), jnp.bfloat16))
    bt = jax.random.permutation(ks[4], NB).reshape(B, MAXB).astype(jnp.int32)
    n_vis = (t + 1) // ratio
    if mode == "csa":
        u = jax.random.uniform(ks[5], (B, MAXB * EPB))
        u = jnp.where(jnp.arange(MAXB * EPB)[None] < n_vis[:, None], u, -1.0)
        val, idx = jax.lax.top_k(u, topk)
        idx = jnp.where(val >= 0, idx, -1).astype(jnp.int32)
    else:
        idx = AR.hca_indices(t, MAXB)
    sink = jax.random.normal(ks[6], (H,), jnp.float32)
    return q, (*win, pos), cmp, bt, idx, t, sink


def op_cost(args):
    """(n_valid, bytes, flops) of one attention op on make_case's args: n_valid = attended
    cache entries (the window slots inside the last 128 positions + the valid ids); bytes =
    584 a cache entry (448 FP8 nope + 8 scale bytes + 128 rope) + q and the bf16 output;
    flops = the algorithm's tensor work, 2 * H * n_valid * (512 for q.k + 512 for p.v)
    (the kernel's two consumers each compute all of q.k: it issues 1.5x this)."""
    q, win, _, _, idx, t, _ = args
    B, H, _ = q.shape
    pos = win[3][:B]
    n_valid = int(jnp.sum(idx >= 0)) + int(jnp.sum(
        (pos >= 0) & (pos <= t[:, None]) & (pos >= t[:, None] - 127)))
    return n_valid, n_valid * 584 + 2 * B * H * 512 * 2, 2.0 * H * n_valid * 1024


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def breakdown(sets, kw, interpret=None):
    """(XLA side alone, Mosaic kernel alone) seconds per call for one variant."""
    ws = kw.get("warp_specialized", False)
    pkw = dict(gather=kw["gather"], ctas_per_tile=1 if ws else 2, splits=kw.get("splits"))
    prep = jax.jit(lambda *x: AK.prepare_inputs(*x, **pkw))
    t_prep = bench(lambda *x: AK.prepare_inputs(*x, **pkw)[0], sets)
    prepped = [prep(*s) for s in sets]
    NS = int(prepped[0][1])
    call = AK._attn_call_ws if ws else AK._attn_call
    extra = {"qk_split": kw["qk_split"]} if ws and "qk_split" in kw else {}
    if kw["gather"] == "cpasync":
        extra["epb"] = sets[0][2][0].shape[1]     # compressed entries per pool block
    t_kern = bench(lambda *a: call(*a, NS=NS, gather=kw["gather"], interpret=interpret, **extra),
                   [p[0] for p in prepped])
    return t_prep, t_kern


def run_case(model, mode, B, ctx, variants, bw, log, split_times=False, models=MODELS,
             interpret=None, profile=True, reps=10):
    """Check and time one case -> its row (also appended to log as one JSON line)."""
    t0 = time.time()
    H, topk = models[model]
    K = topk if mode == "csa" else ctx // 128
    EPB = 32 if mode == "csa" else 1
    pool_bytes = B * (ctx // 128) * EPB * 584
    n_sets = int(max(2, min(3, (300 * MB) // max(pool_bytes, 1))))
    sets = [make_case(jax.random.key(1000 * B + 7 * ctx + i), B, H, ctx, K, mode)
            for i in range(n_sets)]
    n_valid, op_bytes, _ = op_cost(sets[0])
    ref_many = batched(AR.sparse_decode_attention_reference)
    t_ref, ref = wall_time(ref_many, sets, reps=reps)
    ref = np.asarray(ref).astype(np.float32)
    row = dict(model=model, mode=mode, B=B, H=H, ctx=ctx, K=K, n_sets=n_sets, n_valid=n_valid,
               MB=op_bytes / MB, ref_us=t_ref * 1e6)
    n_blk = (128 + -(-K // 64) * 64) // 64
    outs, progs = {}, [("ref", ref_many, sets)]
    for name in variants:
        kw = dict(VARIANTS[name], interpret=interpret)
        ws = kw.get("warp_specialized", True)
        rule = AK.default_splits_v1 if kw.pop("split_rule", None) == "v1" else AK.default_splits
        if kw.get("backend") == "triton":
            cps = kw.pop("ctas_per_sm", None) or AK.triton_ctas_per_sm(kw["head_tile"])
            kw["splits"] = AK.default_splits(
                B, -(-H // 64) * 64, n_blk, ctas_per_sm=cps,
                ctas_per_tile=64 // kw["head_tile"] * kw.get("col_split", 1))
        else:
            kw["splits"] = rule(B, -(-H // 64) * 64, n_blk, ctas_per_tile=1 if ws else 2)
        f = lambda *x, kw=kw: AK.sparse_decode_attention(*x, **kw)
        try:
            many = batched(f)
            t, out = wall_time(many, sets, reps=reps)
            progs.append((name, many, sets))
            out = np.asarray(out).astype(np.float32)
            outs[name] = out
            row[name] = dict(us=t * 1e6, GBs=op_bytes / t / 1e9, pct=100 * op_bytes / t / bw,
                             splits=kw["splits"],
                             rel_err=rel_err(out, ref), finite=bool(np.isfinite(out).all()),
                             speedup_ref=t_ref / t)
            if split_times:
                tp, tk = breakdown(sets, kw, interpret=interpret)
                row[name].update(xla_us=tp * 1e6, kernel_us=tk * 1e6,
                                 kernel_GBs=op_bytes / tk / 1e9, kernel_pct=100 * op_bytes / tk / bw)
        except Exception as e:   # keep going: the failure is reported in the table
            row[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if "staged" in outs:
        for name in outs:
            if name != "staged" and "us" in row[name]:
                row[name]["speedup_staged"] = row["staged"]["us"] / row[name]["us"]
                row[name]["max_diff_staged"] = float(np.max(np.abs(outs[name] - outs["staged"])))
    if profile:
        try:
            prof = profile_times(progs)
            for name, p in prof.items():
                d = dict(busy_us=p["busy"] / n_sets * 1e6, span_us=p["span"] / n_sets * 1e6,
                         events=p["events"] / n_sets,
                         top=[(k, v / n_sets * 1e6) for k, v in p["top"]])
                if name == "ref":
                    row["ref_gpu"] = d
                else:
                    d["busy_pct"] = 100 * op_bytes / (d["busy_us"] * 1e-6) / bw
                    d["x_ref_busy"] = row["ref_gpu"]["busy_us"] / d["busy_us"]
                    row[name]["gpu"] = d
        except Exception as e:   # the profile is a bonus: wall times stay
            row["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    row["case_s"] = time.time() - t0
    log.write(json.dumps(row) + "\n")
    log.flush()
    return row


def best_variant(rows, variants):
    """The in-kernel-gather variant with the least total time over the rows measured so far
    (all of them correct), else the first one."""
    cands = [v for v in variants if v != "staged"]
    tot = {v: 0.0 for v in cands}
    for r in rows:
        for v in cands:
            d = r.get(v, {})
            ok = "us" in d and d["finite"] and d["rel_err"] < 5e-3
            tot[v] += d["us"] if ok else float("inf")
    return min(cands, key=lambda v: tot[v]) if cands else None


PRIORITY = [   # issue 5's decode shapes, most wanted first (fits ~240 s with one variant)
    ("flash", "csa", 1, 4096), ("flash", "csa", 1, 32768), ("flash", "hca", 1, 32768),
    ("flash", "csa", 8, 32768), ("flash", "csa", 32, 32768), ("pro", "csa", 1, 32768),
    ("pro", "csa", 8, 32768), ("flash", "csa", 1, 131072), ("flash", "hca", 8, 131072),
]


def cases(tiny=False):
    """(model, mode, B, ctx, with_all_variants) in priority order: PRIORITY (the first one
    with every variant), then the rest of the grid (B 1..64, 4K..128K, CSA / HCA, Flash /
    Pro)."""
    if tiny:
        return [("flash", "csa", 1, 1024, True), ("flash", "hca", 2, 1024, False),
                ("pro", "csa", 1, 1024, False)]
    out = [(*PRIORITY[0], True)] + [(*k, False) for k in PRIORITY[1:]]
    for B in (64, 8, 1, 32):
        for ctx in (32768, 131072, 4096):
            for mode in ("csa", "hca"):
                for model in ("flash", "pro"):
                    if (model, mode, B, ctx) not in PRIORITY:
                        out.append((model, mode, B, ctx, False))
    return out


def smoke_shapes(tiny):
    """(label, B, model, ctx, mode) of the smoke test: Flash CSA, Flash HCA, Pro CSA."""
    if tiny:
        return [("flash-csa", 2, "flash", 1024, "csa"), ("flash-hca", 2, "flash", 1024, "hca")]
    return [("flash-csa", 2, "flash", 4096, "csa"), ("flash-hca", 2, "flash", 8192, "hca"),
            ("pro-csa", 1, "pro", 4096, "csa")]


def smoke(variants, tiny=False):
    """Small run of each variant vs the reference, in this process (called via --smoke):
    prints one SMOKE line per variant as it finishes (ok only if every shape passes)."""
    models = TINY_MODELS if tiny else MODELS
    interpret = plgpu.InterpretGPUParams() if tiny else None
    shapes = []
    for label, B, model, ctx, mode in smoke_shapes(tiny):
        H, topk = models[model]
        a = make_case(jax.random.key(len(shapes)), B, H, ctx,
                      topk if mode == "csa" else ctx // 128, mode)
        ref = np.asarray(jax.jit(AR.sparse_decode_attention_reference)(*a)).astype(np.float32)
        shapes.append((label, a, ref))
    for v in variants:
        kw = dict(VARIANTS[v], interpret=interpret)
        kw.pop("split_rule", None)
        kw.pop("ctas_per_sm", None)
        errs = []
        for label, a, ref in shapes:
            out = np.asarray(jax.jit(lambda *x: AK.sparse_decode_attention(*x, **kw))(*a))
            errs.append((label, rel_err(out.astype(np.float32), ref)))
        ok = all(e < 5e-3 for _, e in errs)   # NaN fails too
        print(f"SMOKE {v} {'ok' if ok else 'bad'} rel_err "
              + " ".join(f"{lb}={e:.3e}" for lb, e in errs), flush=True)


def smoke_all(variants, timeout=90, tiny=False):
    """Smoke-test the variants in subprocesses (a fault or hang loses one variant, not the
    run) -> the variants that passed."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    todo, good = list(variants), []
    while todo:
        cmd = [sys.executable, __file__, "--smoke", ",".join(todo)] + (["--tiny"] if tiny else [])
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            text, hung = p.stdout + p.stderr, False
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() + (e.stderr or b"").decode()
            hung = True
        done = [ln.split() for ln in text.splitlines() if ln.startswith("SMOKE ")]
        for d in done:
            print("smoke", " ".join(d[1:]), flush=True)
            good += [d[1]] if d[2] == "ok" else []
        finished = {d[1] for d in done}
        todo = [v for v in todo if v not in finished]
        if todo:   # the first unfinished one faulted or hung: drop it, retry the rest
            errs = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
            why = "timed out (hang?)" if hung else "failed: " + " / ".join(errs[-2:])
            print(f"smoke {todo[0]} {why}"[:600], flush=True)
            todo = todo[1:]
    return good


def fmt_table(rows, variants):
    head = ("| model | mode | B | H | ctx | K | MB | XLA wall us (GPU busy / span) | "
            + " | ".join(f"{v} wall us (GB/s, % bw, x XLA[, x staged]) | {v} GPU busy us "
                         f"(Mosaic kernel; % bw; x XLA busy) / span" for v in variants)
            + " | rel err (max over variants) |")
    lines = [head, "|" + "---|" * (9 + 2 * len(variants))]
    for r in rows:
        rg = r.get("ref_gpu")
        ref = f"{r['ref_us']:.1f}" + (f" ({rg['busy_us']:.1f} / {rg['span_us']:.1f})" if rg else "")
        cells, errs = [], []
        for v in variants:
            d = r.get(v)
            if d is None:
                cells += ["-", "-"]
            elif "error" in d:
                cells += ["ERROR " + d["error"][:80].replace("|", "/"), "-"]
            else:
                s = f"{d['us']:.1f} ({d['GBs']:.0f}, {d['pct']:.0f}%, {d['speedup_ref']:.2f}x"
                s += f", {d['speedup_staged']:.2f}x)" if "speedup_staged" in d else ")"
                if "kernel_us" in d:
                    s += (f"; XLA side {d['xla_us']:.1f} + kernel {d['kernel_us']:.1f} us"
                          f" ({d['kernel_GBs']:.0f} GB/s, {d['kernel_pct']:.0f}%)")
                g = d.get("gpu")
                gs = "-"
                if g:
                    gs = (f"{g['busy_us']:.1f} ({g['top'][0][1]:.1f}; {g['busy_pct']:.0f}%; "
                          f"{g['x_ref_busy']:.2f}x) / {g['span_us']:.1f}")
                cells += [s, gs]
                errs.append(d["rel_err"] if d["finite"] else float("inf"))
        err = f"{max(errs):.1e}" if errs else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['B']} | {r['H']} | {r['ctx']} | {r['K']} | "
                     f"{r['MB']:.2f} | {ref} | " + " | ".join(cells) + f" | {err} |")
    return "\n".join(lines)


def write_report(out_dir, rows, variants, bws, bw, skipped):
    table = fmt_table(rows, variants)
    tops = "\n".join(f"- {r['model']} {r['mode']} B={r['B']} ctx={r['ctx']}: "
                     + "; ".join(f"{v}: " + ", ".join(f"{k} {t:.1f} us" for k, t in r[v]["gpu"]["top"])
                                 for v in variants if "gpu" in r.get(v, {}))
                     + (f"; XLA: " + ", ".join(f"{k} {t:.1f} us" for k, t in r["ref_gpu"]["top"])
                        if "ref_gpu" in r else "")
                     + (f" (profile failed: {r['profile_error']})" if "profile_error" in r else "")
                     for r in rows)
    text = (f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
            f"copy bandwidth (read+write) {', '.join(f'{k} {v / 1e9:.0f} GB/s' for k, v in bws.items())}"
            f" (% below is of {bw / 1e9:.0f})\n\n{table}\n\nlongest GPU events per op (us):\n{tops}\n\n"
            f"not run (time budget): {'; '.join(skipped) or 'none'}\n")
    open(os.path.join(out_dir, "attention_decode.md"), "w").write(text)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=240.0,
                    help="seconds since the start after which no new case starts")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--trusted", default="", help="variants already checked: no smoke test")
    ap.add_argument("--split-first", action="store_true",
                    help="XLA-side / kernel-alone times for the first case")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N cases (resume)")
    ap.add_argument("--default", default=None, help="variant for the non-first cases")
    ap.add_argument("--only", default=None, metavar="MODEL:MODE:B:CTX,...",
                    help="run just these cases, in this order (e.g. flash:csa:64:32768)")
    ap.add_argument("--all-variants", action="store_true", help="every variant on every case")
    ap.add_argument("--no-profile", action="store_true", help="no GPU busy / span columns")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run: GPU interpreter, tiny shapes and top-k 64")
    ap.add_argument("--smoke", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        return smoke(args.smoke.split(","), tiny=args.tiny)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    trusted = [v for v in args.variants.split(",") if v in args.trusted.split(",")]
    variants = smoke_all([v for v in args.variants.split(",") if v not in trusted],
                         timeout=600 if args.tiny else 90, tiny=args.tiny) + trusted
    print(f"smoke done in {time.time() - t_start:.0f} s; variants: {variants}", flush=True)
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    bws = hbm_bandwidth(16 * MB if args.tiny else 1 << 30)
    bw = bws["ceiling"]
    print("copy bandwidth (read+write) GB/s:", {k: round(v / 1e9) for k, v in bws.items()}, flush=True)
    log = open(os.path.join(args.out, "attention_decode.jsonl"), "w")
    rows, skipped = [], []
    kw = dict(models=TINY_MODELS, interpret=plgpu.InterpretGPUParams(), reps=1) if args.tiny else {}
    todo = cases(args.tiny)[args.skip:]
    if args.only:
        todo = [(m, md, int(b), int(c), True) for m, md, b, c in
                (t.split(":") for t in args.only.split(","))]
    for model, mode, B, ctx, full in todo:
        full = full or args.all_variants
        if time.time() - t_start > args.budget:
            skipped.append(f"{model} {mode} B={B} ctx={ctx}")
            continue
        vs = variants if full else [args.default or best_variant(rows, variants)]
        vs = [v for v in vs if v]
        try:
            rows.append(run_case(model, mode, B, ctx, vs, bw, log,
                                 split_times=args.split_first and not rows,
                                 profile=not args.no_profile, **kw))
            print(json.dumps(rows[-1]), flush=True)
            write_report(args.out, rows, variants, bws, bw, skipped + ["(run still going)"])
        except Exception as e:
            print(f"case {model} {mode} B={B} ctx={ctx}: {type(e).__name__}: {e}"[:1000], flush=True)
    text = write_report(args.out, rows, variants, bws, bw, skipped)
    print("\n" + text)
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
