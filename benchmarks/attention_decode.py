"""GPU correctness at real shapes + benchmark of sparse decode attention (issue 5: rows
gathered in-kernel instead of the XLA staging gather).

Run on the device: PYTHONPATH=. python3 benchmarks/attention_decode.py [--budget S] [--out DIR]
Each variant is first smoke-tested in a subprocess with a time limit (a kernel that faults
or hangs is dropped, the rest still run). Then, per case (model, mode, B, context):
 - check: every kernel variant vs the pure-JAX reference on the same random cache
   (rel err = ||out - ref|| / ||ref|| over the bf16 outputs in f32);
 - time = median over runs of one jitted program that calls the op on N distinct input
   sets back to back, divided by N (host dispatch amortised over N only);
 - bytes = what the op must read: 584 B per attended cache entry (128 window slots + the
   valid compressed ids) + q and the output; GB/s over the op's end-to-end time; % = of
   the best copy bandwidth measured in the same run;
 - speedup = XLA path (reference.py over the dequantised gathered rows, the kernels-off
   path) / kernel, and staged (the previous version: XLA staging gather + kernel) / direct.
Variants: ws-lane = warp_specialized=True (the default), direct-lane = two single-warpgroup
CTAs per head tile (both gather="direct", Lane lowering), staged = the previous XLA
staging gather. Cases run in priority order until --budget seconds have passed (one case
with every variant, then the best correct variant); skipped ones are listed. --split-first
also times the XLA side and the kernel alone for the first case.
Writes attention_decode.jsonl and attention_decode.md under --out
(results so far: benchmarks/results/attention_decode.md).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from pallas_kernels.sparse_decode_attention import kernel as AK
from pallas_kernels.sparse_decode_attention import reference as AR

MB = 1 << 20
MODELS = {"flash": (64, 512), "pro": (128, 1024)}     # heads, CSA top-k
VARIANTS = {   # name -> kernel keyword arguments
    "ws-lane": dict(gather="direct", warp_specialized=True),
    "direct-lane": dict(gather="direct", warp_specialized=False),
    "staged": dict(gather="staged", warp_specialized=False),
}


def bench(fn, sets, reps=5, want_out=False):
    """Median seconds per call of fn over the input sets (one jit runs them all)
    [, fn's output on sets[0] from the same compiled program]."""
    many = jax.jit(lambda ss: [fn(*s) for s in ss])
    first = jax.block_until_ready(many(sets))[0]
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(sets))
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts) / len(sets)
    return (t, first) if want_out else t


def copy_bandwidth():
    """Bytes read + written per second of a 1 GiB device copy and of an elementwise pass."""
    x = jax.random.normal(jax.random.key(1), (256 * MB,), jnp.float32)
    out = {}
    for name, f in (("copy", jax.jit(lambda a: jnp.copy(a))), ("a+1", jax.jit(lambda a: a + 1.0))):
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t0)
        out[name] = 2 * x.nbytes / statistics.median(ts)
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


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def breakdown(sets, kw, interpret=None):
    """(XLA side alone, Mosaic kernel alone) seconds per call for one variant."""
    ws = kw.get("warp_specialized", False)
    pkw = dict(gather=kw["gather"], ctas_per_tile=1 if ws else 2)
    prep = jax.jit(lambda *x: AK.prepare_inputs(*x, **pkw))
    t_prep = bench(lambda *x: AK.prepare_inputs(*x, **pkw)[0], sets)
    prepped = [prep(*s) for s in sets]
    NS = int(prepped[0][1])
    call = AK._attn_call_ws if ws else AK._attn_call
    t_kern = bench(lambda *a: call(*a, NS=NS, gather=kw["gather"], interpret=interpret),
                   [p[0] for p in prepped])
    return t_prep, t_kern


def run_case(model, mode, B, ctx, variants, bw, log, split_times=False):
    H, topk = MODELS[model]
    K = topk if mode == "csa" else ctx // 128
    EPB = 32 if mode == "csa" else 1
    pool_bytes = B * (ctx // 128) * EPB * 584
    n_sets = int(max(2, min(3, (300 * MB) // max(pool_bytes, 1))))
    sets = [make_case(jax.random.key(1000 * B + 7 * ctx + i), B, H, ctx, K, mode)
            for i in range(n_sets)]
    a = sets[0]
    n_valid = int(jnp.sum(a[4] >= 0)) + int(jnp.sum(
        (a[1][3][:B] >= 0) & (a[1][3][:B] <= a[5][:, None]) & (a[1][3][:B] >= a[5][:, None] - 127)))
    op_bytes = n_valid * 584 + 2 * B * H * 512 * 2
    t_ref, ref = bench(AR.sparse_decode_attention_reference, sets, reps=3, want_out=True)
    ref = np.asarray(ref).astype(np.float32)
    row = dict(model=model, mode=mode, B=B, H=H, ctx=ctx, K=K, MB=op_bytes / MB, ref_us=t_ref * 1e6)
    n_blk = (128 + -(-K // 64) * 64) // 64
    outs = {}
    for name in variants:
        kw = VARIANTS[name]
        f = lambda *x, kw=kw: AK.sparse_decode_attention(*x, **kw)
        try:
            t, out = bench(f, sets, want_out=True)
            out = np.asarray(out).astype(np.float32)
            outs[name] = out
            ws = kw.get("warp_specialized", True)
            row[name] = dict(us=t * 1e6, GBs=op_bytes / t / 1e9, pct=100 * op_bytes / t / bw,
                             splits=AK.default_splits(B, H, n_blk, ctas_per_tile=1 if ws else 2),
                             rel_err=rel_err(out, ref), finite=bool(np.isfinite(out).all()),
                             speedup_ref=t_ref / t)
            if split_times:
                tp, tk = breakdown(sets, kw)
                row[name].update(xla_us=tp * 1e6, kernel_us=tk * 1e6,
                                 kernel_GBs=op_bytes / tk / 1e9, kernel_pct=100 * op_bytes / tk / bw)
        except Exception as e:   # keep going: the failure is reported in the table
            row[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if "staged" in outs:
        for name in outs:
            if name != "staged" and "us" in row[name]:
                row[name]["speedup_staged"] = row["staged"]["us"] / row[name]["us"]
                row[name]["max_diff_staged"] = float(np.max(np.abs(outs[name] - outs["staged"])))
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


def cases():
    """(model, mode, B, ctx, with_all_variants) in priority order: one case with every
    variant, then the key shapes, then the rest of the grid."""
    first = [("flash", "csa", 64, 32768, True)]
    key = [("pro", "csa", 64, 32768), ("flash", "hca", 64, 131072), ("flash", "csa", 1, 32768),
           ("flash", "csa", 8, 32768), ("pro", "hca", 64, 131072), ("flash", "csa", 64, 131072),
           ("flash", "csa", 32, 32768), ("pro", "csa", 1, 32768), ("flash", "hca", 1, 131072)]
    rest = [(*k, False) for k in key]
    for B in (64, 8, 1, 32):
        for ctx in (131072, 4096, 32768):
            for mode in ("csa", "hca"):
                for model in ("flash", "pro"):
                    if (model, mode, B, ctx) not in key and (model, mode, B, ctx, True) not in first:
                        rest.append((model, mode, B, ctx, False))
    return first + rest


def smoke(variants):
    """Small run of each variant vs the reference, in this process (called via --smoke):
    prints one SMOKE line per variant as it finishes."""
    a = make_case(jax.random.key(0), 2, 64, 4096, 512, "csa")
    ref = np.asarray(jax.jit(AR.sparse_decode_attention_reference)(*a)).astype(np.float32)
    for v in variants:
        out = np.asarray(jax.jit(lambda *x: AK.sparse_decode_attention(*x, **VARIANTS[v]))(*a))
        err = rel_err(out.astype(np.float32), ref)
        print(f"SMOKE {v} {'ok' if err < 5e-3 else 'bad'} rel_err {err:.3e}", flush=True)


def smoke_all(variants, timeout=75):
    """Smoke-test the variants in subprocesses (a fault or hang loses one variant, not the
    run) -> the variants that passed."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    todo, good = list(variants), []
    while todo:
        try:
            p = subprocess.run([sys.executable, __file__, "--smoke", ",".join(todo)], env=env,
                               capture_output=True, text=True, timeout=timeout)
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


def fmt_table(rows, variants, bw):
    head = ("| model | mode | B | H | ctx | K | MB | XLA ref us | "
            + " | ".join(f"{v} us (GB/s, % bw, x ref, x staged)" for v in variants)
            + " | rel err (max over variants) |")
    lines = [head, "|" + "---|" * (9 + len(variants))]
    for r in rows:
        cells = []
        errs = []
        for v in variants:
            d = r.get(v)
            if d is None:
                cells.append("-")
            elif "error" in d:
                cells.append("ERROR " + d["error"][:80].replace("|", "/"))
            else:
                s = f"{d['us']:.1f} ({d['GBs']:.0f}, {d['pct']:.0f}%, {d['speedup_ref']:.2f}x"
                s += f", {d['speedup_staged']:.2f}x)" if "speedup_staged" in d else ")"
                if "kernel_us" in d:
                    s += (f"; XLA side {d['xla_us']:.1f} + kernel {d['kernel_us']:.1f} us"
                          f" ({d['kernel_GBs']:.0f} GB/s, {d['kernel_pct']:.0f}%)")
                cells.append(s)
                errs.append(d["rel_err"] if d["finite"] else float("inf"))
        err = f"{max(errs):.1e}" if errs else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['B']} | {r['H']} | {r['ctx']} | {r['K']} | "
                     f"{r['MB']:.2f} | {r['ref_us']:.0f} | " + " | ".join(cells) + f" | {err} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=180.0, help="seconds for the case loop")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--trusted", default="", help="variants already checked: no smoke test")
    ap.add_argument("--split-first", action="store_true",
                    help="XLA-side / kernel-alone times for the first case")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N cases (resume)")
    ap.add_argument("--default", default=None, help="variant for the non-first cases")
    ap.add_argument("--smoke", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        return smoke(args.smoke.split(","))
    t_start = time.time()
    trusted = [v for v in args.variants.split(",") if v in args.trusted.split(",")]
    variants = smoke_all([v for v in args.variants.split(",") if v not in trusted]) + trusted
    print(f"smoke done in {time.time() - t_start:.0f} s; variants: {variants}", flush=True)
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    bws = copy_bandwidth()
    bw = max(bws.values())
    print("copy bandwidth (read+write) GB/s:", {k: round(v / 1e9) for k, v in bws.items()}, flush=True)
    log = open(os.path.join(args.out, "attention_decode.jsonl"), "w")
    rows, skipped = [], []
    t_loop = time.time()
    for model, mode, B, ctx, full in cases()[args.skip:]:
        if time.time() - t_loop > args.budget:
            skipped.append(f"{model} {mode} B={B} ctx={ctx}")
            continue
        vs = variants if full else [args.default or best_variant(rows, variants)]
        vs = [v for v in vs if v]
        try:
            rows.append(run_case(model, mode, B, ctx, vs, bw, log,
                                 split_times=args.split_first and not rows))
            print(json.dumps(rows[-1]), flush=True)
        except Exception as e:
            print(f"case {model} {mode} B={B} ctx={ctx}: {type(e).__name__}: {e}"[:1000], flush=True)
    table = fmt_table(rows, variants, bw)
    text = (f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
            f"copy bandwidth (read+write) {', '.join(f'{k} {v / 1e9:.0f} GB/s' for k, v in bws.items())}"
            f" (% below is of {bw / 1e9:.0f})\n\n{table}\n\nnot run (time budget): "
            f"{'; '.join(skipped) or 'none'}\n")
    open(os.path.join(args.out, "attention_decode.md"), "w").write(text)
    print("\n" + text)
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
