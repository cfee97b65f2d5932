"""Time sparse-decode-attention variants against each other: GPU time of the op from
profiler traces, interleaved rounds, plus the error against the reference. A variant is
gather[:k=v,...] where k=v are environment knobs read while the kernel is traced
(e.g. cpasync:DSV4_ATTN_PREG=40:DSV4_ATTN_CREG=232); gather+qks splits the keys between the
consumers (qk_split), gather+sN runs N key-block splits (default: kernel.default_splits),
gather+idp bounds the key blocks from t (ids_prefix), gather+hid (HCA cases) derives the
ids in-kernel (idx_BK=None, hca_entries; implies idp), gather+hix builds them with
hca_indices inside the program as the decode step did before (implies idp), e.g.
cpasync+qks+s3; "xla" is the pure-JAX reference (the path the kernel replaces).
--roofline measures the HBM ceiling and the dense BF16 tensor ceiling (benchmarks/common)
and adds, per case, the op's bytes and flops (attention_decode.op_cost) and, per variant,
the share of the roofline: max(bytes / HBM ceiling, flops / tensor ceiling) / its time.
Usage:
  python3 benchmarks/attn_probe.py --cases flash:csa:64:32768 --variants direct,cpasync"""
import argparse
import functools
import statistics

import numpy as np
import jax

from benchmarks.attention_decode import MODELS, make_case, op_cost, profile_times
from benchmarks.common import hbm_bandwidth, tensor_peak, with_env
from pallas_kernels.sparse_decode_attention import kernel as K
from pallas_kernels.sparse_decode_attention import reference as R


def build(spec, args):
    if spec == "xla":   # the pure-JAX path the kernel replaces
        f = jax.jit(R.sparse_decode_attention_reference)
        return f, jax.block_until_ready(f(*args))
    gather, *kv = spec.split(":")
    gather, *opts = gather.split("+")   # +qks: the consumers split the keys; +sN: N splits
    qks, hid, hix = "qks" in opts, "hid" in opts, "hix" in opts
    idp = "idp" in opts or hid or hix
    splits = next((int(o[1:]) for o in opts if o[:1] == "s" and o[1:].isdigit()), None)
    kw = (dict(backend="triton", head_tile=64, num_warps=8) if gather == "triton"
          else dict(gather=gather, warp_specialized=True, qk_split=qks, ids_prefix=idp))
    kw["splits"] = splits
    if hid or hix:   # the case's idx (hca_indices) is passed but not read
        K_ = args[4].shape[1]
        f = jax.jit(lambda q, win, cmp, bt, idx, t, sink: K.sparse_decode_attention(
            q, win, cmp, bt, R.hca_indices(t, K_) if hix else None, t, sink,
            hca_entries=None if hix else K_, **kw))
    else:
        f = jax.jit(functools.partial(K.sparse_decode_attention, **kw))
    # traced and compiled with the variant's knobs set
    out = with_env(dict(x.split("=") for x in kv), lambda: jax.block_until_ready(f(*args)))
    return f, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="flash:csa:64:32768")
    ap.add_argument("--variants", default="direct,cpasync,triton")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", action="store_true",
                    help="also print each variant's GPU time per kernel (last round)")
    ap.add_argument("--roofline", action="store_true",
                    help="measure the HBM and tensor ceilings; print each variant's share")
    a = ap.parse_args()
    bw = peak = None
    if a.roofline:
        bw, peak = hbm_bandwidth()["ceiling"], tensor_peak()
        print(f"{jax.devices()[0].device_kind}: HBM ceiling {bw / 1e9:.0f} GB/s, dense BF16 "
              f"tensor ceiling {peak / 1e12:.0f} TFLOP/s (measured)", flush=True)
    roof_cols = (" MB | GFLOP | bound | roofline us | % of roofline | GB/s | % of HBM |"
                 if bw else "")
    print("| case | variant | GPU us (median of rounds; min-max) | rel err |" + roof_cols)
    print("|---|---|---|---|" + "---|" * (7 if bw else 0))
    for case in a.cases.split(","):
        model, mode, B, ctx = case.split(":")
        B, ctx = int(B), int(ctx)
        H, topk = MODELS[model]
        args = make_case(jax.random.key(0), B, H, ctx, topk if mode == "csa" else ctx // 128, mode)
        ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
        roof = ""
        if bw:
            _, nbytes, flops = op_cost(args)
            t_mem, t_mma = nbytes / bw, flops / peak
            t_roof = max(t_mem, t_mma)
            roof = (f" {nbytes / 1e6:.1f} | {flops / 1e9:.2f} | "
                    f"{'HBM' if t_mem >= t_mma else 'tensor'} | {t_roof * 1e6:.1f} |")
        progs, errs = [], {}
        for v in a.variants.split(","):
            if mode != "hca" and ("+hid" in v or "+hix" in v):
                # (session 26's queue timed pro:csa:8 this way: HCA ids, not the case's)
                raise SystemExit(f"variant {v!r}: +hid / +hix derive HCA ids, but case "
                                 f"{case!r} is {mode}; use +idp")
            f, out = build(v, args)
            o = np.asarray(out).astype(np.float32)
            errs[v] = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
            progs.append((v, lambda x, f=f: f(*x), args))
        ts = {v: [] for v, _, _ in progs}
        for _ in range(a.rounds):
            r = profile_times(progs, n=3)
            for v in ts:
                ts[v].append(r[v]["busy"] * 1e6)
        if a.events:
            for v in ts:
                print(f"  {case} {v}: " + "; ".join(f"{k} {t * 1e6:.1f}" for k, t in r[v]["per"]))
        for v, t in ts.items():
            med = statistics.median(t)
            share = (f" {100 * t_roof * 1e6 / med:.1f}% | {nbytes / med / 1e3:.0f} | "
                     f"{100 * nbytes / (med * 1e-6) / bw:.1f}% |" if bw else "")
            print(f"| {case} | {v} | {med:.1f} ({min(t):.1f}-{max(t):.1f}) | "
                  f"{errs[v]:.2e} |{roof}{share}", flush=True)


if __name__ == "__main__":
    main()
