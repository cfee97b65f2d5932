"""GPU proof + benchmark of the KV-cache scatter kernels (pallas_kernels/kv_scatter).

Run on the device:  PYTHONPATH=. python3 benchmarks/kv_scatter_gather.py [--quick] [--out DIR]

Scatter part only. The gather kernels this script also measured (pallas_kernels/kv_gather:
gather_topk / gather_all / gather_window) were removed on 2026-11-22: they were slower than
XLA's fused gather (0.67x and 0.83x at B = 64, benchmarks/results/kv_scatter_gather.md), the
decode step never called them, and sparse decode attention now copies its rows straight
from the paged pool in-kernel (benchmarks/attention_decode.py). The file keeps its name so
the results file and earlier commands still point at it.

For each kernel and batch: bit-exact check against the jitted XLA reference (reference.py) at
real shapes, then timing of both. Timing: each jit call applies the op REPS times in sequence (the
cache carried through, donated). "wall" = CALLS such calls dispatched back to back with one sync at the end, per
op (best of 3): device-bound when the op is larger than its dispatch cost, else host-bound.
"GPU busy" = sum of the GPU stream events (kernels + copies) in a profiler trace, per op:
device time without launch gaps. Bytes are the
fewest the op must move (each input byte read once, each output byte written once);
GB/s is compared with a measured device-to-device copy (bytes read + written).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import formats as kf
from pallas_kernels.kv_scatter import kernel as sk
from pallas_kernels.kv_scatter import reference as sr
from benchmarks.common import copy_bandwidth

REPS = 4
ENTRY_B = 448 + 8 + 128  # stored bytes of one KV entry


CALLS = 20  # calls per timing loop, dispatched back to back (async), one sync at the end


def _pipelined(f, state, *args, donate):
    """Seconds per op over CALLS back-to-back calls (each applying the op REPS times)."""
    out = f(state, *args)
    jax.block_until_ready(out)
    state = out if donate else state
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(CALLS):
            out = f(state, *args)
            if donate:
                state = out
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    return min(ts) / (CALLS * REPS), state


def _gpu_busy(f, state, *args, donate, n=4):
    """GPU time per op from a profiler trace: sum of the events on the GPU stream lines
    (kernels and copies, launch gaps excluded) over n calls / (n * REPS)."""
    try:
        import glob
        import gzip
        import tempfile
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(n):
                out = f(state, *args)
                if donate:
                    state = out
            jax.block_until_ready(out)
        path = glob.glob(os.path.join(d, "plugins", "profile", "*", "perfetto_trace.json.gz"))[0]
        ev = json.load(gzip.open(path))["traceEvents"]
        pname = {e["pid"]: e["args"]["name"] for e in ev
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        tname = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        gpu = {p for p, nm in pname.items() if "GPU" in nm.upper()}
        lines = sorted({nm for (p, _), nm in tname.items() if p in gpu})
        tot = cnt = 0
        for e in ev:
            if (e.get("ph") == "X" and e.get("pid") in gpu
                    and tname.get((e["pid"], e.get("tid")), "").startswith("Stream")):
                tot += e["dur"]
                cnt += 1
        GPU_LINES.update(lines)
        if cnt == 0:
            return float("nan"), 0.0, state
        return tot * 1e-6 / (n * REPS), cnt / (n * REPS), state
    except Exception as err:  # the profiler is a bonus; wall time stays the main number
        print(f"profiler failed: {err!r}", flush=True)
        return float("nan"), float("nan"), state


GPU_LINES = set()


def timeit_donated(f, state, *args):
    t, state = _pipelined(f, state, *args, donate=True)
    g, c, state = _gpu_busy(f, state, *args, donate=True)
    return (t, g, c), state


def bits_equal(a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:
        a, b = jax.lax.bitcast_convert_type(a, jnp.uint8), jax.lax.bitcast_convert_type(b, jnp.uint8)
    elif a.dtype.itemsize == 2:
        a, b = jax.lax.bitcast_convert_type(a, jnp.uint16), jax.lax.bitcast_convert_type(b, jnp.uint16)
    elif a.dtype.itemsize == 4:
        a, b = jax.lax.bitcast_convert_type(a, jnp.uint32), jax.lax.bitcast_convert_type(b, jnp.uint32)
    return bool(jnp.array_equal(a, b))


def tree_equal(a, b):
    return all(bits_equal(a[k], b[k]) for k in b) and a.keys() == b.keys()


def rows(key, shape, dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(key)
    mag = 10.0 ** jax.random.uniform(k2, (*shape[:-1], 1), minval=-3, maxval=3)
    return (jax.random.normal(k1, shape) * mag).astype(dtype)


def rand_entries(key, lead):
    """Random stored entries (valid e4m3 codes, realistic exponents) without a full quantise."""
    k1, k2, k3 = jax.random.split(key, 3)
    u = jax.random.randint(k1, (*lead, 448), 0, 256).astype(jnp.uint8) & 0xF7  # no NaN code
    nope = jax.lax.bitcast_convert_type(u, jnp.float8_e4m3fn)
    scale = jax.random.randint(k2, (*lead, 8), 110, 135).astype(jnp.uint8)
    rope = jax.random.normal(k3, (*lead, 64), jnp.bfloat16)
    return nope, scale, rope


def pool_of(key, NB, EPB):
    n, s, r = rand_entries(key, (NB, EPB))
    return {"cmp_nope": n, "cmp_scale": s, "cmp_rope": r}


def idx_pool_of(key, NB, EPB, fmt):
    out = {}
    fields = kf.index_key_fields(fmt)   # nvfp4 has three (codes, scales lo / hi)
    for k, (nm, (suf, dt)) in zip(jax.random.split(key, len(fields)), fields.items()):
        if dt == jnp.float32:
            out[nm] = jax.random.uniform(k, (NB, EPB, *suf))
        else:
            u = jax.random.randint(k, (NB, EPB, *suf), 0, 256).astype(jnp.uint8) & 0x77
            out[nm] = jax.lax.bitcast_convert_type(u, dt) if dt != jnp.uint8 else u
    return out


def block_table(key, B, maxb, NB):
    return jax.random.permutation(key, NB)[: B * maxb].reshape(B, maxb).astype(jnp.int32)


RESULTS = []


def record(op, B, ctx, nbytes, tk, tx, ok, bw):
    (t_k, g_k, c_k), (t_x, g_x, c_x) = tk, tx
    r = dict(op=op, B=B, ctx=ctx, bytes=nbytes, us_kernel=t_k * 1e6, us_xla=t_x * 1e6,
             gpu_us_kernel=g_k * 1e6, gpu_us_xla=g_x * 1e6, gpu_events_kernel=c_k,
             gpu_events_xla=c_x, gbs=nbytes / t_k / 1e9, pct_copy=100 * nbytes / t_k / bw,
             gpu_gbs=nbytes / g_k / 1e9, speedup=t_x / t_k, gpu_speedup=g_x / g_k, exact=ok)
    RESULTS.append(r)
    print(f"{op:22s} B={B:3d} ctx={ctx:>6} {nbytes / 1e6:8.3f} MB | wall/op kernel {r['us_kernel']:7.1f} us "
          f"({r['gbs']:6.0f} GB/s {r['pct_copy']:5.1f}%) xla {r['us_xla']:7.1f} x{r['speedup']:.2f} | "
          f"GPU busy/op kernel {r['gpu_us_kernel']:7.1f} us ({r['gpu_gbs']:6.0f} GB/s, {c_k:.1f} ev) "
          f"xla {r['gpu_us_xla']:7.1f} ({c_x:.1f} ev) x{r['gpu_speedup']:.2f} | exact={ok}", flush=True)


# ------------------------------------------------------------------ scatters
def bench_append_window(key, B, bw, R=64):
    ks = jax.random.split(key, 4)
    n, s, r = rand_entries(ks[0], (R, 128))
    win = {"win_nope": n, "win_scale": s, "win_rope": r,
           "win_pos": jax.random.randint(ks[1], (R, 128), -1, 10000)}
    kv = rows(ks[2], (REPS, B, 512))
    pos = jax.random.randint(ks[3], (REPS, B), 0, 100000).at[:, ::7].set(-1)
    ok = tree_equal(jax.jit(sk.append_window)(win, kv[0], pos[0]),
                    jax.jit(sr.append_window)(win, kv[0], pos[0]))

    def many(op, w, kv, pos):
        for i in range(REPS):
            w = op(w, kv[i], pos[i])
        return w

    fk = jax.jit(functools.partial(many, sk.append_window), donate_argnums=0)
    fx = jax.jit(functools.partial(many, sr.append_window), donate_argnums=0)
    # in place: the donated buffer comes back as the output
    ptr = win["win_nope"].unsafe_buffer_pointer()
    w2 = jax.jit(sk.append_window, donate_argnums=0)(win, kv[0], pos[0])
    in_place = w2["win_nope"].unsafe_buffer_pointer() == ptr
    hlo = jax.jit(sk.append_window, donate_argnums=0).lower(w2, kv[0], pos[0]).compile().as_text()
    copies = [l.strip()[:120] for l in hlo.splitlines()
              if (" copy(" in l or "copy-start" in l) and "[] copy" not in l]  # non-scalar copies
    t_k, w2 = timeit_donated(fk, w2, kv, pos)
    t_x, w2 = timeit_donated(fx, w2, kv, pos)
    nbytes = B * (1024 + ENTRY_B + 4)
    record("append_window", B, "-", nbytes, t_k, t_x, ok, bw)
    return dict(in_place=in_place, copies_in_compiled_hlo=copies)


def bench_flush(key, B, bw, ctx, fmt):
    ks = jax.random.split(key, 8)
    EPB = 32
    maxb = ctx // 128
    NB = B * maxb
    pool = pool_of(ks[0], NB, EPB)
    idx = idx_pool_of(ks[1], NB, EPB, fmt)
    bt = block_table(ks[2], B, maxb, NB)
    ent = rows(ks[3], (REPS, B, 512))
    keys = rows(ks[4], (REPS, B, 128), jnp.float32)
    fl = jax.random.randint(ks[5], (REPS, B), 0, 4) > 0  # ~3/4 of rows flush
    ei = jax.random.randint(ks[6], (REPS, B), 0, maxb * EPB)
    fk1 = jax.jit(functools.partial(sk.flush_compressed, fmt=fmt))
    fx1 = jax.jit(functools.partial(sr.flush_compressed, fmt=fmt))
    a, b = fk1(pool, idx, ent[0], keys[0], fl[0], ei[0], bt), fx1(pool, idx, ent[0], keys[0], fl[0], ei[0], bt)
    ok = tree_equal(a[0], b[0]) and tree_equal(a[1], b[1])
    del a, b

    def many(op, state, ent, keys, fl, ei, bt):
        p, ip = state
        for i in range(REPS):
            p, ip = op(p, ip, ent[i], keys[i], fl[i], ei[i], bt, fmt=fmt)
        return p, ip

    fk = jax.jit(functools.partial(many, sk.flush_compressed), donate_argnums=0)
    fx = jax.jit(functools.partial(many, sr.flush_compressed), donate_argnums=0)
    ptr = pool["cmp_nope"].unsafe_buffer_pointer()
    t_k, state = timeit_donated(fk, (pool, idx), ent, keys, fl, ei, bt)
    in_place = state[0]["cmp_nope"].unsafe_buffer_pointer() == ptr
    t_x, state = timeit_donated(fx, state, ent, keys, fl, ei, bt)
    kb = sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in kf.index_key_fields(fmt).values())
    nbytes = B * (1024 + 512 + ENTRY_B + kb + 12)  # rows, keys, entry, key fields, scalars
    record(f"flush_compressed[{fmt}]", B, ctx, nbytes, t_k, t_x, ok, bw)
    return dict(in_place=in_place)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--final", action="store_true", help="short list of cases")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this")
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    key = jax.random.key(int(time.time()))
    extra = {}
    # (name, fn, args) in priority order; a time guard skips the rest (compiles dominate)
    jobs = []
    if args.final:  # the short device run: bandwidth-relevant cases + the smallest batch
        jobs = [(f"append_window B=64", bench_append_window, (64, bw)),
                (f"append_window B=1", bench_append_window, (1, bw)),
                (f"flush fp4 B=64", bench_flush, (64, bw, 32768, "fp4"))]
    for B in ([64, 8, 1, 32] if not (args.quick or args.final) else [8] if args.quick else []):
        jobs += [(f"append_window B={B}", bench_append_window, (B, bw)),
                 (f"flush fp4 B={B}", bench_flush, (B, bw, 32768, "fp4"))]
        if B == 64:
            jobs += [(f"flush nvfp4 B={B}", bench_flush, (B, bw, 32768, "nvfp4")),
                     (f"flush fp8 B={B}", bench_flush, (B, bw, 32768, "fp8"))]
    t0 = time.time()
    for name, fn, fargs in jobs:
        if time.time() - t0 > args.budget_s:
            print(f"time guard: skipped {fn.__name__}{fargs[:1]}", flush=True)
            continue
        key, k = jax.random.split(key)
        res = fn(k, *fargs)
        if name:
            extra[name] = res
        print(f"  [{time.time() - t0:.0f}s]", flush=True)
    print(json.dumps(extra, indent=1))
    with open(os.path.join(args.out, "kv_scatter_gather.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, copy_gbs=bw / 1e9,
                       results=RESULTS, extra=extra), f, indent=1)
    print("GPU trace lines:", sorted(GPU_LINES))
    print("\n| op | B | ctx | MB moved | wall us/op | GB/s | % copy BW | XLA wall us | speedup "
          "| GPU us/op | XLA GPU us | GPU speedup | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in RESULTS:
        print(f"| {r['op']} | {r['B']} | {r['ctx']} | {r['bytes'] / 1e6:.3f} | {r['us_kernel']:.1f} | "
              f"{r['gbs']:.0f} | {r['pct_copy']:.1f} | {r['us_xla']:.1f} | {r['speedup']:.2f} | "
              f"{r['gpu_us_kernel']:.1f} | {r['gpu_us_xla']:.1f} | {r['gpu_speedup']:.2f} | {r['exact']} |")
    if not all(r["exact"] for r in RESULTS):
        print("MISMATCH vs reference", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
