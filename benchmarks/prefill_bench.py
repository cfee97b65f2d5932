"""Prefill throughput: prompt tokens/s and time to first token of Engine.prefill against
prompt length, chunk size and number of prompts, with the share of the dense BF16 tensor
ceiling and of the weight-bandwidth floor, the new path (grouped expert matmul) against
the current one in the same run (issue 49).

    PYTHONPATH=. python3 -m benchmarks.prefill_bench [--preset flash --layers 10]
        [--lengths 1024 8192 32768 131072] [--chunks 512 2048] [--prompts 1]
        [--paths current grouped new]

Synthetic release-format weights (FP4 experts, FP8 linears), the kernels on
(Numerics(matmul="pallas"), CacheSpec(kernels="on")). The paths, chosen by Numerics fields
in the same run: "current": the MoE of a chunk as before (the loop over all experts with a
combine mask, grouped_prefill=False) and the dense chunk attention (sparse_prefill_rows=0);
"grouped": the pairs sorted into expert tiles through pallas_kernels/grouped_expert_matmul
(grouped_prefill=True), dense attention; "new": that and the sparse prefill attention
kernel (pallas_kernels/sparse_prefill_attention, sparse_prefill_rows=1: every chunk).

FLOPs of a token (the ceiling's numerator): 2 x the multiply-adds of every matmul it
runs (attention projections, the compressors and indexer, the shared and its k routed
experts, the head) + attention 4 x H x 512 x (keys it attends: window + top-k or
compressed entries). The ceiling: common.tensor_peak (jnp.dot 8192^3, measured here).
The bandwidth floor: every weight byte read once per chunk.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import jax

from benchmarks.common import copy_bandwidth, tensor_peak
from dsv4_jax import config as C, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics

PATHS = {"current": Numerics(matmul="pallas", grouped_prefill=False, sparse_prefill_rows=0),
         "grouped": Numerics(matmul="pallas", grouped_prefill=True, sparse_prefill_rows=0),
         "new": Numerics(matmul="pallas", grouped_prefill=True, sparse_prefill_rows=1)}


def matmul_flops_per_token(cfg) -> float:
    """2 x multiply-adds of one token's matmuls (no attention scores), all layers + head."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    att = D * cfg.q_lora_rank + cfg.q_lora_rank * H * hd + D * hd + H * hd * cfg.o_lora_rank \
        + cfg.o_groups * cfg.o_lora_rank * D
    ffn = 3 * D * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    ffn += D * cfg.n_routed_experts                                   # the gate
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        r = cfg.layer_ratio(i)
        extra = 0
        if r:
            co = 2 if r == 4 else 1                                   # overlapping pools
            extra += 2 * D * co * hd                                  # compressor wkv + wgate
        if r == 4:
            ci = cfg.index_head_dim
            extra += 2 * D * 2 * ci + cfg.q_lora_rank * cfg.index_n_heads * ci \
                + D * cfg.index_n_heads
        total += att + ffn + extra
    return 2.0 * (total + D * cfg.vocab_size)


def attention_flops(cfg, L: int) -> float:
    """QK^T and P.V over the keys each of L prompt tokens attends (window + top-k / all
    visible compressed entries), all layers; the indexer's scores on CSA layers."""
    t = np.arange(L, dtype=np.float64)
    H, hd, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    win = np.minimum(t + 1, W)
    f = 0.0
    for i in range(cfg.num_hidden_layers):
        r = cfg.layer_ratio(i)
        n = (t + 1) // r if r else 0 * t
        keys = win + (np.minimum(n, cfg.index_topk) if r == 4 else n)
        f += 4.0 * H * hd * keys.sum()
        if r == 4:
            f += 2.0 * cfg.index_n_heads * cfg.index_head_dim * n.sum()
    return f


def run(cfg, params, L, chunk, prompts, path, seed=0):
    """-> (seconds for all prompts, seconds to the first prompt's last logits, those
    logits [V] f32 as numpy)."""
    blocks = -(-L // BLOCK_TOKENS) + 1
    cs = CacheSpec(max_requests=prompts, num_blocks=blocks * prompts + 4, max_blocks=blocks,
                   kernels="on")
    eng = Engine(cfg, params, numerics=PATHS[path], cache_spec=cs,
                 prefill_chunk=chunk, progress=False)
    rng = np.random.default_rng(seed)
    toks = [rng.integers(2, cfg.vocab_size, L) for _ in range(prompts)]
    # warm-up: compiles the chunk program (one chunk of a throwaway request)
    s = eng.bm.admit(chunk + 1)
    jax.block_until_ready(eng.prefill(s, toks[0][:chunk]))
    eng.bm.release(s)
    slots = [eng.bm.admit(L + 1) for _ in range(prompts)]
    t0 = time.perf_counter()
    first = logits = None
    for s, tk in zip(slots, toks):
        out = jax.block_until_ready(eng.prefill(s, tk))
        if first is None:
            first, logits = time.perf_counter() - t0, out
    return time.perf_counter() - t0, first, np.asarray(logits, np.float32)


def check_args(args):
    """Impossible flags fail here (dsv4 bench prefill: before the GPU check and any work)."""
    base = C.get_preset(args.preset)
    for flag, vals in (("--lengths", args.lengths), ("--chunks", args.chunks),
                       ("--prompts", args.prompts)):
        if min(vals) < 1:
            raise ValueError(f"{flag} must be at least 1, got {min(vals)}")
    if not 0 <= args.layers <= base.num_hidden_layers:
        raise ValueError(f"--layers must be in [0, {base.num_hidden_layers}] (0: all), got "
                         f"{args.layers}")
    if max(args.chunks) > max(args.lengths):
        raise ValueError(f"--chunks {max(args.chunks)} is longer than every prompt "
                         f"(--lengths up to {max(args.lengths)})")
    return base


def main(args):
    base = check_args(args)
    a = args
    n = a.layers or base.num_hidden_layers
    cfg = base.replace(num_hidden_layers=n, compress_ratios=base.compress_ratios[:n] + (0,),
                       num_hash_layers=min(base.num_hash_layers, n))
    peak = tensor_peak()
    bw = copy_bandwidth(2 << 30)
    wbytes = P.nbytes(cfg, include_mtp=False)
    print(f"device {jax.devices()[0].device_kind}; dense BF16 ceiling {peak / 1e12:.0f} TFLOP/s, "
          f"HBM {bw / 1e9:.0f} GB/s; {cfg.name} {n} layers + head, weights {wbytes / 1e9:.1f} GB; "
          f"{matmul_flops_per_token(cfg) / 1e9:.2f} GFLOP/token of matmuls", flush=True)
    params = P.merge_x_proj(P.init_params_device(cfg, a.seed, include_mtp=False), cfg,
                            consume=True)
    # the last column: the first prompt's last logits against the first path's that ran
    # (same prompt, chunk and weights): max |diff| / max |logit|
    print("| path | prompt | chunk | prompts | s | TTFT s | tok/s | % tensor ceiling | "
          "% weight-bandwidth floor | logits rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for L in a.lengths:
        fl = matmul_flops_per_token(cfg) * L + attention_flops(cfg, L)
        for chunk in a.chunks:
            for B in a.prompts:
                ref = None
                for path in a.paths:
                    try:
                        t, ttft, logits = run(cfg, params, L, chunk, B, path, a.seed)
                    except Exception as e:  # noqa: BLE001 - report and go on (e.g. OOM)
                        print(f"| {path} | {L} | {chunk} | {B} | failed: "
                              f"{type(e).__name__}: {str(e)[:120]} |", flush=True)
                        continue
                    floor = wbytes / bw * (-(-L // chunk)) * B
                    if ref is None:
                        ref, diff = (path, logits), "-"
                    else:
                        d = np.abs(logits - ref[1]).max() / np.abs(ref[1]).max()
                        diff = f"{d:.1e} vs {ref[0]}"
                    print(f"| {path} | {L} | {chunk} | {B} | {t:.2f} | {ttft:.2f} | "
                          f"{B * L / t:.0f} | {100 * B * fl / t / peak:.1f} | "
                          f"{100 * floor / t:.1f} | {diff} |", flush=True)


def add_flags(ap):
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=10, help="first N layers + head (0 = all)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768, 131072],
                    help="prompt lengths (tokens)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048],
                    help="prefill chunk sizes (Engine prefill_chunk)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[1],
                    help="prompts prefilled one after another (TTFT: the first one's)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS),
                    help="current: expert loop + dense chunk attention; grouped: the grouped "
                         "expert matmul; new: that + the sparse prefill attention kernel")
    ap.add_argument("--seed", type=int, default=0)


def register(sub):
    """`dsv4 bench prefill` under the `bench` command that decode_bench.register made."""
    bench = sub.choices["bench"]
    sp = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    d = sp.add_parser("prefill", help="prompt tokens/s and TTFT vs the tensor ceiling "
                      "(the prefill kernels, Hopper)")
    add_flags(d)
    d.set_defaults(fn=main)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_flags(p)
    main(p.parse_args())
