"""Grouped quantised matmul at DeepSeek-V4-Flash decode shapes: correctness on the GPU vs
the XLA reference, then device time of the kernel vs the XLA paths it replaces.

    PYTHONPATH=. python benchmarks/quant_matmul.py --out $OUT [--sweep] [--budget 240]
    PYTHONPATH=. python benchmarks/quant_matmul.py --out $OUT --sweep --sweep-only --reg-a-ab
    PYTHONPATH=. python benchmarks/quant_matmul.py --out $OUT --sweep --sweep-only --decode-ab
    PYTHONPATH=. python benchmarks/quant_matmul.py --out $OUT --sweep --sweep-only --decode swar
    PYTHONPATH=. python benchmarks/quant_matmul.py --out $OUT --sweep --sweep-only --final-ab

Timing: CUPTI device time of every kernel a call launches (the kernel plus its small XLA
epilogue; for the baselines the dequantise fusion plus the GEMM), median over many calls
after warm-up. Calls rotate over enough weight copies / experts (>= ~200 MB) that the
50 MB L2 cannot serve repeats. GB/s counts the weight bytes of the used experts as stored
(FP8: 1 B/param + scales; FP4: 0.5 B/param + 1 B per 32). The copy ceiling is a 1 GiB
device-to-device copy (bytes read + written) measured in the same run.

Baselines: (a) `f32`: dequantise to f32 + f32 einsum (the current dsv4_jax path);
(b) `bf16`: dequantise to bf16 + bf16 einsum with f32 accumulation (exact, same function);
(c) `fp8dot` (dense FP8 only): x quantised to e4m3 per 128-K block, per-block batched
lax.dot_general on e4m3 operands, scales applied to the f32 block products (a different,
lossier function: timing only).
"""
import argparse
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv4_jax.quant import Fp4Weight, Fp8Weight
from pallas_kernels.quant_matmul import grouped_matmul
from pallas_kernels.quant_matmul import kernel as K
from pallas_kernels.quant_matmul.reference import _gather, grouped_matmul_reference
from benchmarks.common import copy_bandwidth

FP8_DENSE = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096),
             ("wo_b", 4096, 8192), ("shared w1/w3", 2048, 4096), ("shared w2", 4096, 2048),
             ("indexer wq_b", 8192, 1024)]
ROTATE_BYTES = 200e6
SWEEP_SHAPES = [("wq_b", "fp8", 1, 32768, 1024, 8), ("wo_b", "fp8", 1, 4096, 8192, 8),
                ("wo_b", "fp8", 1, 4096, 8192, 64), ("shared w1/w3", "fp8", 1, 2048, 4096, 8),
                ("expert w1/w3", "fp4", 6, 2048, 4096, 8), ("expert w2", "fp4", 64, 4096, 2048, 8)]
# decode A/B (--decode-ab): the Flash shapes where the dequantise pass costs the most
DECODE_AB_SHAPES = [
    ("expert w1/w3", "fp4", 6, 2048, 4096, 8), ("expert w2", "fp4", 6, 4096, 2048, 8),
    ("expert w1/w3", "fp4", 6, 2048, 4096, 64), ("expert w1/w3", "fp4", 64, 2048, 4096, 8),
    ("expert w2", "fp4", 64, 4096, 2048, 8), ("wq_b", "fp8", 1, 32768, 1024, 8),
    ("wo_b", "fp8", 1, 4096, 8192, 8), ("wo_b", "fp8", 1, 4096, 8192, 64),
    ("shared w1/w3", "fp8", 1, 2048, 4096, 8), ("wo_a (E=G=8)", "fp8", 8, 1024, 4096, 8)]
# old vs new defaults (--final-ab): FP4 experts; "old" = the defaults before 2026-11-22
# evening (decode cvt, 64-row tiles, 64 B steps), "new" = today's defaults, plus one
# alternative tiling per shape
FINAL_AB_SHAPES = [
    ("expert w1/w3", "fp4", 6, 2048, 4096, 8), ("expert w2", "fp4", 6, 4096, 2048, 8),
    ("expert w1/w3", "fp4", 64, 2048, 4096, 8), ("expert w2", "fp4", 64, 4096, 2048, 8),
    ("expert w1/w3", "fp4", 6, 2048, 4096, 32), ("expert w1/w3", "fp4", 6, 2048, 4096, 64),
    ("expert w2", "fp4", 6, 4096, 2048, 64), ("wo_b", "fp8", 1, 4096, 8192, 8)]
# tiling sweep for one decode (--decode X): the M = 8 shapes that matter most
TILING_SHAPES = [("expert w1/w3", "fp4", 6, 2048, 4096, 8), ("expert w2", "fp4", 64, 4096, 2048, 8),
                 ("wo_b", "fp8", 1, 4096, 8192, 8), ("wq_b", "fp8", 1, 32768, 1024, 8)]


# --moe: the default, then one knob changed at a time
MOE_VARIANTS = [dict(), dict(tn=64), dict(tkp=64), dict(stages=3), dict(stages=4),
                dict(decode="swar"), dict(tn=64, tkp=64, stages=4)]


def sweep_variants(fmt, G, N, Kd, reg_a_only=False, decode=None, M=8):
    if reg_a_only:  # A/B of the register-lhs variant at the default tiling
        return [dict(reg_a=False), dict(reg_a=True)]
    if decode == "final":
        if fmt == "fp8":
            return [dict()]
        alt = dict(decode="swar", tn=128, tkp=128) if M > 32 else dict(decode="swar", tn=64, tkp=128)
        return [dict(decode="cvt", tn=64, tkp=64), dict(), dict(decode="swar-shfl"), alt]
    if decode == "ab":  # A/B of the dequantise code at the default tiling (reg_a default)
        return [dict(decode="cvt"), dict(decode="swar")]
    out = []
    for tn in (128, 64):
        for tkp in ((None,) if fmt == "fp8" else (128, 64)):
            for stages in (2, 4):
                S0 = K.default_splits(fmt, G, N, Kd, tn, tkp or K.TKP)
                for S in (S0, 2 * S0):
                    if K._valid_split(fmt, Kd, S, tkp or K.TKP):
                        kw = dict(tn=tn, stages=stages, splits=S)
                        if tkp:
                            kw["tkp"] = tkp
                        if decode:  # one decode, reg_a at its default
                            out.append(dict(kw, decode=decode))
                            continue
                        out.append(kw)
                        out.append(dict(kw, reg_a=True))  # rows into the wgmma from registers
    return out


def cupti_median(fn, arg_list):
    """Median per-call device time (s) over arg_list, via CUPTI kernel timings."""
    from jax._src.lib import mosaic_gpu as mgpu_lib
    ext = mgpu_lib._mosaic_gpu_ext
    jax.block_until_ready(fn(*arg_list[0]))
    jax.block_until_ready([fn(*a) for a in arg_list[:3]])
    ext._cupti_init()
    try:
        outs = [fn(*a) for a in arg_list]
        jax.block_until_ready(outs)
    finally:
        t = ext._cupti_get_timings(True)
    n = len(arg_list)
    if not t:
        return float("nan"), []
    if len(t) % n:
        return sum(ms for _, ms in t) / n * 1e-3, sorted({k for k, _ in t})
    k = len(t) // n
    per = [sum(ms for _, ms in t[i * k:(i + 1) * k]) for i in range(n)]
    return statistics.median(per) * 1e-3, [name for name, _ in t[:k]]


def rand_fp8_bank(key, E, N, Kd):
    k1, k2 = jax.random.split(key)
    b = jax.random.bits(k1, (E, N, Kd), jnp.uint8)
    b = jnp.where((b & 0x7F) == 0x7F, b ^ 1, b)          # no NaN codes
    sc = jax.random.randint(k2, (E, N // 128, Kd // 128), 120, 134).astype(jnp.uint8)
    return Fp8Weight(lax.bitcast_convert_type(b, jnp.float8_e4m3fn),
                     lax.bitcast_convert_type(sc, jnp.float8_e8m0fnu))


def rand_fp4_bank(key, E, N, Kd):
    k1, k2 = jax.random.split(key)
    p = lax.bitcast_convert_type(jax.random.bits(k1, (E, N, Kd // 2), jnp.uint8), jnp.int8)
    sc = jax.random.randint(k2, (E, N, Kd // 32), 118, 136).astype(jnp.uint8)
    return Fp4Weight(p, lax.bitcast_convert_type(sc, jnp.float8_e8m0fnu))


def expert_bytes(w):
    E = w.shape[0]
    leaves = jax.tree.leaves(w)
    return sum(l.size * l.dtype.itemsize for l in leaves) / E


def fp8dot(x_GMK, expert_G, w):
    """(c): e4m3 x e4m3 per-128-K-block products with f32 output, block scales after."""
    G, M, Kd = x_GMK.shape
    E, N, _ = w.shape
    KT = Kd // 128
    e = jnp.clip(expert_G, 0, E - 1)
    wq = _gather(w.w, e).reshape(G, N, KT, 128)
    ws = _gather(w.scale, e).astype(jnp.float32)                               # [G, N/128, KT]
    xb = x_GMK.astype(jnp.float32).reshape(G, M, KT, 128)
    amax = jnp.maximum(jnp.abs(xb).max(-1), 1e-4)
    xs = jnp.exp2(jnp.ceil(jnp.log2(amax / 448.0)))                   # [G, M, KT]
    xq = jnp.clip(xb / xs[..., None], -448, 448).astype(jnp.float8_e4m3fn)
    yb = lax.dot_general(xq, wq, (((3,), (3,)), ((0, 2), (0, 2))),
                         preferred_element_type=jnp.float32)          # [G, KT, M, N]
    s = xs.transpose(0, 2, 1)[..., None] * jnp.repeat(ws, 128, axis=1).transpose(0, 2, 1)[:, :, None, :]
    return (yb * s).sum(1)


REF_FNS = {
    "f32": jax.jit(lambda x, e, w: grouped_matmul_reference(x, e, w, dtype=jnp.float32)),
    "bf16": jax.jit(lambda x, e, w: grouped_matmul_reference(x, e, w, dtype=jnp.bfloat16)),
    "fp8dot": jax.jit(fp8dot),
}


def run_config(name, fmt, bank, G, M, Kd, N, rotate_experts, impls, log, kernel_kw=None,
               wbytes=None):
    """Time impls on one shape; returns a result dict (plus correctness for the kernel).
    wbytes: weight bytes a call reads (default: G experts)."""
    kernel_kw = kernel_kw or {}
    E = bank.shape[0]
    x = jax.random.normal(jax.random.key(M * 7 + G), (G, M, Kd), jnp.float32).astype(jnp.bfloat16)
    n = max(24, 2 * len(rotate_experts))
    args = [(x, rotate_experts[i % len(rotate_experts)], bank) for i in range(n)]
    wbytes = G * expert_bytes(bank) if wbytes is None else wbytes
    fns = dict(REF_FNS, kernel=jax.jit(lambda x, e, w: grouped_matmul(x, e, w, **kernel_kw)))
    res = dict(name=name, fmt=fmt, G=G, M=M, N=N, K=Kd, weight_MB=wbytes / 1e6, **kernel_kw)
    # correctness: one empty group where G > 1
    ex = np.asarray(rotate_experts[0]).copy()
    if G > 1:
        ex[1] = -1
    ex = jnp.asarray(ex)
    y = np.asarray(fns["kernel"](x, ex, bank))
    r = np.asarray(fns["bf16"](x, ex, bank))
    res["rel_err"] = float(np.abs(y - r).max() / np.abs(r).max())
    res["empty_zero"] = bool(G == 1 or (y[1] == 0).all())
    res["finite"] = bool(np.isfinite(y).all())
    for impl in impls:
        t, kernels = cupti_median(fns[impl], args)
        res[f"t_{impl}_us"] = t * 1e6
        res[f"kernels_{impl}"] = len(kernels)
    res["GBps"] = wbytes / (res["t_kernel_us"] * 1e-6) / 1e9
    log.write(json.dumps(res) + "\n")
    log.flush()
    print(json.dumps(res), flush=True)
    return res


def dense_rotation(nbytes):
    return max(2, min(64, math.ceil(ROTATE_BYTES / nbytes)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; stop starting new configs after")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="M=8 only")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--reg-a-ab", action="store_true",
                    help="the sweep only compares reg_a off / on at the default tiling")
    ap.add_argument("--decode-ab", action="store_true",
                    help="the sweep compares decode cvt / swar at the default tiling "
                         "(DECODE_AB_SHAPES)")
    ap.add_argument("--fmt", choices=("fp8", "fp4"), help="sweep only this format's shapes")
    ap.add_argument("--final-ab", action="store_true",
                    help="old vs new defaults at FINAL_AB_SHAPES")
    ap.add_argument("--decode", choices=("cvt", "swar"),
                    help="tiling sweep (TILING_SHAPES) with this decode, reg_a default")
    ap.add_argument("--moe", type=int, nargs="*", default=[],
                    help="decode batch sizes: time the routed experts as the step groups them")
    args = ap.parse_args()
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "quant_matmul.jsonl"), "w")
    dev = jax.devices()[0]
    bw = copy_bandwidth()
    print(f"device {dev.device_kind}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    log.write(json.dumps(dict(device=dev.device_kind, copy_GBps=bw / 1e9)) + "\n")
    Ms = (8,) if args.quick else (8, 32, 64)
    results = []
    key = jax.random.key(1)

    def left():
        return args.budget - (time.time() - t0)

    # FP8 dense linears: G = 1, a bank of R copies as E, rotated
    for name, N, Kd in ([] if args.sweep_only else FP8_DENSE):
        R = dense_rotation(N * Kd)
        bank = rand_fp8_bank(key, R, N, Kd)
        rot = [jnp.asarray([i], jnp.int32) for i in range(R)]
        for M in Ms:
            if left() < 0:
                break
            impls = ["kernel", "f32", "bf16"] + (["fp8dot"] if M in (8, 64) else [])
            results.append(run_config(name, "fp8", bank, 1, M, Kd, N, rot, impls, log))
        del bank
    # FP8 grouped wo_a: E = G = 8 per copy
    N, Kd = 1024, 4096
    R = dense_rotation(8 * N * Kd)
    bank = rand_fp8_bank(key, 8 * R, N, Kd)
    rot = [jnp.arange(8 * i, 8 * i + 8, dtype=jnp.int32) for i in range(R)]
    for M in ([] if args.sweep_only else Ms):
        if left() > 0:
            results.append(run_config("wo_a (E=G=8)", "fp8", bank, 8, M, Kd, N, rot,
                                      ["kernel", "f32", "bf16"], log))
    del bank
    # Routed experts, E = 256: FP4 as stored, and the FP8 offline conversion
    for fmt in (() if args.sweep_only else ("fp4", "fp8")):
        for name, N, Kd in (("expert w1/w3", 2048, 4096), ("expert w2", 4096, 2048)):
            if left() < 0:
                break
            bank = (rand_fp4_bank if fmt == "fp4" else rand_fp8_bank)(key, 256, N, Kd)
            cases = [(6, M) for M in (Ms if fmt == "fp4" else (8,))] + [(64, 8)]
            for G, M in cases:
                if left() < 0:
                    break
                rot = [jnp.asarray((np.arange(G) * 37 + i * G * 37 + i) % 256, jnp.int32)
                       for i in range(max(4, math.ceil(ROTATE_BYTES / (G * N * Kd / 2))))]
                results.append(run_config(f"{name} ({fmt})", fmt, bank, G, M, Kd, N, rot,
                                          ["kernel", "f32", "bf16"], log))
            del bank
    # The routed experts as the decode step calls them at batch B (layers._moe_scheduled):
    # B tokens x k = 6 random experts of E = 256, grouped by expert_schedule into S tiles of
    # 8 rows (S = ceil(6B/8) + 257; at B = 64, 305 slots of which ~200 hold an expert, the
    # rest empty: no weight reads). w13 (w1 | w3 stacked: N = 4096, K = 4096) and w2 (N =
    # 4096, K = 2048), the kernel's default and MOE_VARIANTS; GB/s counts the experts read.
    for B in args.moe:
        from dsv4_jax.layers import expert_schedule
        E, k = 256, 6
        draws = [expert_schedule(jax.random.randint(jax.random.key(100 + i), (B, k), 0, E),
                                 E, 8)[0] for i in range(8)]
        S = int(draws[0].shape[0])
        used = float(np.mean([int((np.asarray(d) >= 0).sum()) for d in draws]))
        for name, N, Kd in (("experts w13", 4096, 4096), ("experts w2", 4096, 2048)):
            bank = rand_fp4_bank(key, E, N, Kd)
            for kw in MOE_VARIANTS:
                if left() < 0:
                    break
                results.append(run_config(f"{name} B={B} ({used:.0f} of {S} slots)", "fp4", bank,
                                          S, 8, Kd, N, draws, ["kernel"], log, kernel_kw=kw,
                                          wbytes=used * expert_bytes(bank)))
            del bank
    # Tuning sweep: tile rows, FP4 step width, pipeline depth, K splits (kernel only)
    if args.sweep:
        shapes = (FINAL_AB_SHAPES if args.final_ab else DECODE_AB_SHAPES if args.decode_ab
                  else TILING_SHAPES if args.decode else SWEEP_SHAPES)
        mode = "final" if args.final_ab else "ab" if args.decode_ab else args.decode
        for name, fmt, G, N, Kd, M in shapes:
            if left() < 0:
                break
            if args.fmt and fmt != args.fmt:
                continue
            E = 256 if fmt == "fp4" else dense_rotation(G * N * Kd) * G
            bank = (rand_fp4_bank if fmt == "fp4" else rand_fp8_bank)(key, E, N, Kd)
            nrot = max(4, math.ceil(ROTATE_BYTES / (G * N * Kd / (2 if fmt == "fp4" else 1))))
            rot = [jnp.asarray((np.arange(G) + i * G) % E, jnp.int32) for i in range(min(nrot, 64))]
            for kw in sweep_variants(fmt, G, N, Kd, reg_a_only=args.reg_a_ab, decode=mode, M=M):
                if left() < 0:
                    break
                results.append(run_config(name + " sweep", fmt, bank, G, M, Kd, N, rot,
                                          ["kernel"], log, kernel_kw=kw))
            del bank
    log.close()
    lines = table(results, bw, dev.device_kind)
    open(os.path.join(args.out, "quant_matmul.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"total {time.time() - t0:.0f} s")


def table(results, bw, device):
    out = [f"device: {device}; HBM ceiling (hbm_bandwidth: best of copy, a+1, read): {bw / 1e9:.0f} GB/s", "",
           "| matrix | fmt | G | M | N x K | weight MB | kernel us | GB/s | % copy BW | "
           "f32 path us (x) | bf16 path us (x) | fp8 dot us (x) | rel err | empty=0 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tk = r["t_kernel_us"]

        def cmp(k):
            t = r.get(f"t_{k}_us")
            return f"{t:.1f} ({t / tk:.2f}x)" if t is not None else "-"
        extra = "".join(f" {k}={r[k]}" for k in ("tn", "tkp", "stages", "splits", "reg_a",
                                                  "decode") if k in r)
        out.append(f"| {r['name']}{extra} | {r['fmt']} | {r['G']} | {r['M']} | {r['N']} x {r['K']} | "
                   f"{r['weight_MB']:.1f} | {tk:.1f} | {r['GBps']:.0f} | {100 * r['GBps'] * 1e9 / bw:.0f}% | "
                   f"{cmp('f32')} | {cmp('bf16')} | {cmp('fp8dot')} | {r['rel_err']:.1e} | "
                   f"{'yes' if r['empty_zero'] and r['finite'] else 'NO'} |")
    return out


if __name__ == "__main__":
    main()
