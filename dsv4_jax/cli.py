"""`dsv4` command line: generate, logits, and (from checkpoints/) make-checkpoint, convert,
inspect."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from . import chat, config as C, generate as G, params as P
from .cache import CacheSpec
from .distributed import init_processes_from_env, make_mesh
from .generate import Engine
from .loading import load
from .quant import Numerics
from .tokenizer import load_tokenizer


def _add_model_args(ap):
    ap.add_argument("--checkpoint", help="orbax or safetensors checkpoint directory "
                    "(default: the embedded tiny model, built deterministically)")
    ap.add_argument("--preset", default="tiny", help="preset for the embedded model (no checkpoint)")
    ap.add_argument("--seed", type=int, default=0, help="seed (embedded model weights and sampling)")
    ap.add_argument("--act-quant", choices=["on", "off"], default="on",
                    help="simulate the FP8/FP4 activation, KV-cache and indexer rounding the "
                         "checkpoint was trained with (on), or keep activations bf16/fp32 (off)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="activation dtype")
    ap.add_argument("--max-requests", type=int, default=4, help="request slots in the cache")
    ap.add_argument("--num-blocks", type=int, default=64, help="blocks (128 tokens) in the pool")
    ap.add_argument("--max-blocks", type=int, default=16,
                    help="blocks per request (capacity = 128 x this)")
    ap.add_argument("--index-format", choices=["fp4", "nvfp4", "fp8"], default="fp4",
                    help="cached indexer keys with --act-quant on (fp4: the reference's e2m1 "
                         "with a power-of-two scale per 32 dims; nvfp4: e4m3 scale per 16)")
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="directory for compiled programs ('off' to disable; default "
                         "$DSV4_COMPILE_CACHE or ~/.cache/dsv4-jax/xla)")
    ap.add_argument("--kernels", choices=["auto", "on", "off"], default="auto",
                    help="Pallas cache/indexer/attention kernels in the decode step "
                         "(auto: on for a Hopper GPU)")
    ap.add_argument("--matmul", choices=["auto", "xla", "pallas"], default="auto",
                    help="weight-streaming FP8/FP4 matmul kernels (auto: pallas on a Hopper GPU)")
    ap.add_argument("--devices", type=int, default=0,
                    help="run sharded over this many devices (weights loaded into their "
                         "shards); the mesh axes below default to all devices on 'expert'")
    ap.add_argument("--expert", type=int, help="mesh 'expert' axis size (expert parallelism)")
    ap.add_argument("--model", type=int, help="mesh 'model' axis size (tensor parallelism)")
    ap.add_argument("--data", type=int, help="mesh 'data' axis size (request slots split)")


def _mesh(args):
    """The mesh asked for by --devices (None without); make_mesh's defaults put the devices
    not given to another axis on 'expert'."""
    if not getattr(args, "devices", 0):
        for ax in ("expert", "model", "data"):
            if getattr(args, ax, None):
                raise ValueError(f"--{ax} needs --devices")
        return None
    return make_mesh(args.devices, expert=args.expert, model=args.model, data=args.data)


def _load_model(args):
    args.mesh = _mesh(args)
    if args.checkpoint:
        cfg, params = load(args.checkpoint, mesh=args.mesh)
        # the decode form, merged in place: each CSA block's five weights freed as it goes
        return cfg, P.merge_x_proj(params, cfg, consume=True), args.checkpoint
    cfg = C.get_preset(args.preset)
    if args.preset != "tiny":
        raise SystemExit(f"the embedded default only builds the 'tiny' preset in memory; "
                         f"for {args.preset!r} write a checkpoint with `dsv4 make-checkpoint`")
    return cfg, P.merge_x_proj(P.init_params(cfg, args.seed), cfg, consume=True), None


def _device_name() -> str:
    return f"{jax.default_backend()} ({jax.devices()[0].device_kind})"


def _on_hopper() -> bool:
    """A CUDA device of compute capability 9.x: the kernels are built for sm_90a."""
    d = jax.devices()[0]
    return jax.default_backend() == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


def _engine(args, cfg, params):
    hopper = _on_hopper()
    mesh = getattr(args, "mesh", None)
    split = {} if mesh is None else {a: n for a, n in mesh.shape.items() if n > 1}
    # auto: the matmul kernels unless heads / weights are split ("model"); the cache kernels
    # only where attention is replicated (a mesh that splits only the experts)
    matmul = (args.matmul if args.matmul != "auto" else
              "pallas" if hopper and "model" not in split else "xla")
    kernels = (args.kernels if args.kernels != "auto" else  # the kernels read FP8/FP4 caches
               "on" if hopper and args.act_quant == "on" and not set(split) - {"expert"}
               else "off")
    if (matmul == "pallas" or kernels == "on") and not hopper:
        raise SystemExit("--matmul pallas / --kernels on need a Hopper GPU (sm_90); "
                         f"this run has {_device_name()}")
    nm = Numerics(act_quant=args.act_quant == "on", dtype=args.dtype, matmul=matmul)
    cs = CacheSpec.for_numerics(nm, max_requests=args.max_requests, num_blocks=args.num_blocks,
                                max_blocks=args.max_blocks, kernels=kernels,
                                **({"index_format": args.index_format} if nm.act_quant else {}))
    return Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=args.prefill_chunk,
                  mesh=mesh)


def _sampler(args):
    if args.temperature == 0:
        return G.Greedy()
    if args.top_k:
        return G.TopK(args.top_k, args.temperature)
    if args.top_p < 1:
        return G.TopP(args.top_p, args.temperature)
    if args.min_p > 0:
        return G.MinP(args.min_p, args.temperature)
    return G.Temperature(args.temperature)


def cmd_generate(args):
    cfg, params, ckpt = _load_model(args)
    tok = load_tokenizer(ckpt, cfg.vocab_size)
    mode = "thinking" if args.thinking else "chat"
    texts = []
    if args.chat or args.user:
        msgs = json.loads(Path(args.chat).read_text()) if args.chat else []
        if args.system:
            msgs = [{"role": "system", "content": args.system}] + msgs
        msgs += [{"role": "user", "content": u} for u in args.user or []]
        texts.append(chat.encode_messages(msgs, thinking_mode=mode))
    if args.prompt is not None:
        texts.append(args.prompt)
    if args.prompts_file:
        texts += [l for l in Path(args.prompts_file).read_text().splitlines() if l.strip()]
    if not texts:
        texts = ["The quick brown fox"]
    prompts = [tok.encode(t) if t.startswith(chat.BOS) else [tok.bos_id] + tok.encode(t)
               for t in texts]
    eng = _engine(args, cfg, params)
    stop_ids = list(tok.stop_ids)
    kw = dict(max_new_tokens=args.max_new_tokens, sampler=_sampler(args), seed=args.seed,
              stop_ids=stop_ids)
    print(f"model: {cfg.name} ({cfg.num_hidden_layers} layers, d={cfg.hidden_size}), "
          f"{len(prompts)} prompt(s), act-quant {args.act_quant}"
          + (f", mesh {dict(eng.mesh.shape)}" if eng.mesh is not None else ""), file=sys.stderr)
    t0 = time.perf_counter()
    if args.stream:
        outs = [[] for _ in prompts]
        first_at = None
        for step in eng.stream(prompts, **kw):
            first_at = first_at or time.perf_counter() - t0
            for i, t in step:
                piece = tok.decode(outs[i] + [t])[len(tok.decode(outs[i])):]
                outs[i].append(t)
                if len(prompts) == 1:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        if len(prompts) == 1:
            print()
        ttft = first_at
    else:
        outs = eng.generate(prompts, **kw)
        ttft = eng.timing.first_token_s
    total = time.perf_counter() - t0
    if len(prompts) > 1 or not args.stream:
        for t, o in zip(texts, outs):
            text = tok.decode(o)
            if args.chat or args.user:
                try:
                    text = json.dumps(chat.parse_completion(text, mode), ensure_ascii=False)
                except ValueError:
                    pass
            print(f"--- prompt: {t[-60:]!r}\n{text}")
    n = sum(len(o) for o in outs)
    tm = eng.timing
    print(f"time to first token {ttft:.2f} s (first call includes compilation), {n} tokens in "
          f"{total:.2f} s; decode compile {tm.compile_s:.1f} s, then {tm.new_tokens} tokens "
          f"in {tm.decode_s:.2f} s = {tm.tokens_per_s:.1f} tokens/s", file=sys.stderr)


def cmd_logits(args):
    cfg, params, _ = _load_model(args)
    tokens = np.load(args.tokens)
    if tokens.ndim != 2:
        raise SystemExit(f"--tokens must hold an int array [B, T], got shape {tokens.shape}")
    args.max_requests = max(args.max_requests, tokens.shape[0])
    need = -(-tokens.shape[1] // 128)
    args.max_blocks = max(args.max_blocks, need)
    args.num_blocks = max(args.num_blocks, need * tokens.shape[0])
    eng = _engine(args, cfg, params)
    logits = eng.teacher_forced_logits(tokens.astype(np.int32), args.prefill_len)
    np.savez(args.out, logits=logits.astype(np.float32))
    print(f"wrote logits {logits.shape} to {args.out}", file=sys.stderr)


def build_parser():
    ap = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 in JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text")
    _add_model_args(g)
    g.add_argument("--prompt", help="a plain-text prompt")
    g.add_argument("--chat", help="JSON file with a list of chat messages")
    g.add_argument("--user", action="append", help="a user turn (repeatable)")
    g.add_argument("--system", help="a system prompt for --chat/--user")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="thinking mode for chat prompts")
    g.add_argument("--prompts-file", help="one prompt per line, generated as a batch")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    g.set_defaults(fn=cmd_generate)
    lg = sub.add_parser("logits", help="teacher-forced logits: prefill P tokens, then decode")
    _add_model_args(lg)
    lg.add_argument("--tokens", required=True, help="int32 [B, T] .npy")
    lg.add_argument("--prefill-len", type=int, required=True)
    lg.add_argument("--out", required=True, help="output .npz with `logits` [B, T-P+1, V]")
    lg.set_defaults(fn=cmd_logits)
    try:
        from checkpoints.cli import register
        register(sub)
    except ImportError:
        pass
    try:
        from benchmarks.decode_bench import register as reg_bench
        reg_bench(sub)
    except ImportError:
        pass
    return ap


def _compile_cache(args):
    """Keep compiled programs on disk (jax's persistent compilation cache): a full-width
    decode step compiles for minutes, the next run with the same shapes loads it."""
    d = getattr(args, "compile_cache", None)
    if d is None:
        d = os.environ.get("DSV4_COMPILE_CACHE", os.path.expanduser("~/.cache/dsv4-jax/xla"))
    if not d or d == "off":
        return
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if hasattr(args, "func"):  # make-checkpoint / convert / inspect (checkpoints.cli)
        from checkpoints.cli import run
        raise SystemExit(run(args))
    _compile_cache(args)
    try:
        init_processes_from_env()  # a no-op unless DSV4_COORDINATOR is set
        args.fn(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"dsv4 {args.cmd}: error: {e}") from None


if __name__ == "__main__":
    main()
