"""`dsv4` command line: generate, logits, and (from checkpoints/) make-checkpoint, convert,
inspect."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from . import chat, config as C, generate as G, params as P, speculative as SP
from .cache import BLOCK_TOKENS, CacheSpec, blocks_needed
from .distributed import (init_processes_from_env, is_tensor_mesh, make_mesh, make_tensor_mesh,
                          tensor_config, tensor_pspecs)
from .embedded import EMBEDDED_NAME, embedded_checkpoint
from .errors import UsageError, run_command
from .generate import Engine
from .loading import load
from .pipeline import Pipeline
from .quant import Numerics
from .serve.text import IncrementalText
from .tokenizer import ByteTokenizer, load_tokenizer


# --layout auto: the pipeline (each weight read on one device) up to this many request
# slots, the expert-parallel mesh above
PIPELINE_MAX_REQUESTS = 8


def _add_model_args(ap):
    ap.add_argument("--checkpoint", help="orbax or safetensors checkpoint directory "
                    f"(default: the embedded model, {EMBEDDED_NAME}: trained on the Python "
                    "standard library, docs/TRAINING.md)")
    ap.add_argument("--preset", help="instead of a checkpoint, a model with random weights "
                    "built in memory from --seed: 'tiny' (for tests)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed (sampling; the --preset model's weights)")
    ap.add_argument("--act-quant", choices=["on", "off"], default="on",
                    help="simulate the FP8/FP4 activation, KV-cache and indexer rounding the "
                         "checkpoint was trained with (on), or keep activations bf16/fp32 (off)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="activation dtype")
    ap.add_argument("--max-requests", type=int, default=4, help="request slots in the cache")
    ap.add_argument("--num-blocks", type=int, default=64,
                    help=f"blocks ({BLOCK_TOKENS} tokens) in the pool")
    ap.add_argument("--max-blocks", type=int, default=16,
                    help=f"blocks per request (capacity = {BLOCK_TOKENS} x this)")
    ap.add_argument("--index-format", choices=["fp4", "nvfp4", "fp8"],
                    help="cached indexer keys with --act-quant on (default fp4: the reference's "
                         "e2m1 with a power-of-two scale per 32 dims; nvfp4: e4m3 scale per 16)")
    ap.add_argument("--prefill-chunk", type=int, default=128,
                    help="prompt tokens fed per prefill step (a program of this width)")
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
    ap.add_argument("--layout", choices=["auto", "mesh", "pipeline", "tensor"], default="auto",
                    help="with --devices: 'pipeline' splits the layers across the devices "
                         "(each weight read on one device: small batches), 'mesh' shards "
                         "experts / weights / requests over a mesh, 'tensor' splits every "
                         "layer's heads and expert columns across the devices with the "
                         "kernels on (two all-reduces a layer); auto: pipeline up to "
                         f"{PIPELINE_MAX_REQUESTS} request slots in one process, else mesh")


# ---------------------------------------------------------------------------------------
# Checks that run before any weight is read or any program compiled
# ---------------------------------------------------------------------------------------
def _positive(args, *flags):
    for f in flags:
        v = getattr(args, f.lstrip("-").replace("-", "_"))
        if v is not None and v < 1:
            raise UsageError(f"{f} must be at least 1, got {v}")


def _check_model_flags(args):
    _positive(args, "--max-requests", "--num-blocks", "--max-blocks", "--prefill-chunk",
              "--expert", "--model", "--data")
    if args.devices < 0:
        raise UsageError(f"--devices must be 0 (one device) or more, got {args.devices}")
    if args.index_format is not None and args.act_quant == "off":
        raise UsageError("--index-format sets the quantised indexer cache: it needs "
                         "--act-quant on")
    if args.checkpoint is not None and args.preset is not None:
        raise UsageError("--preset builds a random-weight model; with --checkpoint the "
                         "checkpoint's config.json sets the model (drop one of the two)")
    if args.checkpoint is None and args.preset is None:
        args.checkpoint = str(embedded_checkpoint())
    elif args.checkpoint is None:
        if args.preset not in C.PRESETS:
            raise UsageError(f"--preset {args.preset!r} is not a preset; choose from "
                             f"{sorted(C.PRESETS)}")
        if args.preset != "tiny":
            raise UsageError(f"--preset builds only the 'tiny' preset in memory; "
                             f"for --preset {args.preset} write a checkpoint with "
                             f"`dsv4 make-checkpoint --preset {args.preset} DIR` and pass "
                             "--checkpoint DIR")
    if not args.devices:
        for ax in ("expert", "model", "data"):
            if getattr(args, ax, None):
                raise UsageError(f"--{ax} needs --devices (it sizes a mesh axis)")
    elif args.devices > jax.device_count():
        raise UsageError(f"--devices {args.devices}: this machine has {jax.device_count()} "
                         f"{jax.default_backend()} device(s)")
    if args.matmul == "pallas" or args.kernels == "on":
        _require_hopper("--matmul pallas" if args.matmul == "pallas" else "--kernels on",
                        "use auto or leave the flag out")


def _require_hopper(flag: str, instead: str):
    if not _on_hopper():
        raise UsageError(f"{flag} needs a Hopper GPU (sm_90); this run has {_device_name()} "
                         f"({instead})")


def _path(p: str, flag: str) -> Path:
    """A user's path: `~` expanded, relative to the working directory, symlinks followed."""
    path = Path(p).expanduser()
    if not path.exists():
        raise UsageError(f"{flag} {p}: no such file or directory")
    return path.resolve()


def _model_config(args) -> C.Config:
    """The model's config, from the checkpoint's config.json (no weights read) or the preset."""
    if args.checkpoint is None:
        return C.get_preset(args.preset)
    ckpt = _path(args.checkpoint, "--checkpoint")
    if not ckpt.is_dir():
        raise UsageError(f"--checkpoint {args.checkpoint}: not a directory (a checkpoint is "
                         "the directory `dsv4 convert` or a safetensors release writes)")
    args.checkpoint = str(ckpt)
    from checkpoints.convert import MANIFEST
    if (ckpt / MANIFEST).exists():
        return C.Config.from_json(ckpt / "config.json")
    if (ckpt / "config.json").exists() and any(ckpt.glob("*.safetensors")):
        from checkpoints.source import open_source
        return open_source(ckpt).cfg   # headers only: validates every shard
    return load(ckpt)[0]  # not a recognised checkpoint: load names what is wrong


def _tokenizer(args, cfg):
    """The tokenizer (--tokenizer, else the checkpoint's tokenizer.json, else the byte-level
    one), named on stderr: a checkpoint without tokenizer.json gets a warning, since its
    text is right only if the model was trained on the byte-level ids (synthetic ones)."""
    given = getattr(args, "tokenizer", None)
    if given is not None:
        path = _path(given, "--tokenizer")
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            raise UsageError(f"--tokenizer {given}: holds no tokenizer.json")
        try:
            tok = load_tokenizer(path, cfg.vocab_size)
        except ValueError as e:
            raise UsageError(f"--tokenizer {given}: {e}") from None
    else:
        tok = load_tokenizer(args.checkpoint, cfg.vocab_size)
    if isinstance(tok, ByteTokenizer) and args.checkpoint is not None:
        print(f"warning: {args.checkpoint} has no tokenizer.json: using the byte-level "
              "tokenizer (ids 16..271 are UTF-8 bytes, unknown ids print as <|id=N|>), "
              "which only a synthetic checkpoint was made for; for a real model give its "
              "tokenizer.json with --tokenizer FILE", file=sys.stderr)
    else:
        print(f"tokenizer: {tok.source}", file=sys.stderr)
    return tok


def _prepare_layout(args, cfg):
    """args.mesh / args.pipeline from --devices and --layout (both None on one device)."""
    args.mesh = args.pipeline = None
    if not args.devices:
        return
    axes = [f"--{ax}" for ax in ("expert", "model", "data") if getattr(args, ax, None)]
    layout = args.layout
    one_process = jax.process_count() == 1
    if layout == "auto":
        layout = ("pipeline" if one_process and not axes
                  and args.max_requests <= PIPELINE_MAX_REQUESTS else "mesh")
    if layout == "pipeline":
        if not one_process:
            raise UsageError(f"--layout pipeline runs every stage from one process; this run "
                             f"has {jax.process_count()} processes (use --layout mesh)")
        if axes:
            raise UsageError(f"{', '.join(axes)} size a mesh; --layout pipeline splits the "
                             "layers instead (drop them or use --layout mesh)")
        if args.devices > cfg.num_hidden_layers:
            raise UsageError(f"--devices {args.devices}: a pipeline needs a layer per device; "
                             f"the model has {cfg.num_hidden_layers}")
        args.pipeline = Pipeline.balanced(cfg, jax.devices()[:args.devices], stages=args.devices)
    elif layout == "tensor":
        if args.expert or args.data or args.model not in (None, args.devices):
            raise UsageError("--layout tensor splits every layer over all --devices; drop "
                             "--expert / --data (and --model, or give it --devices)")
        try:   # heads / groups / experts and every split weight's blocks must split
            tensor_config(cfg, args.devices)
            tensor_pspecs(P.abstract_params(cfg, x_proj_merged=True), args.devices)
        except ValueError as e:
            raise UsageError(f"--layout tensor: {e}") from None
        args.mesh = make_tensor_mesh(args.devices)
    else:
        args.mesh = make_mesh(args.devices, expert=args.expert, model=args.model,
                              data=args.data)


def _check_capacity(args, cfg, lengths: list[int], new_tokens: int, what: str):
    """Every request fits its slot and the pool, named by the flags that size them."""
    cap = args.max_blocks * BLOCK_TOKENS
    longest = max(lengths)
    if longest + new_tokens > cap:
        need = -(-(longest + new_tokens) // BLOCK_TOKENS)
        raise UsageError(f"a {what} of {longest} tokens + {new_tokens} new token(s) does not fit "
                         f"a request's {cap} tokens (--max-blocks {args.max_blocks}); use "
                         f"--max-blocks {need}" + (" or fewer --max-new-tokens" if new_tokens > 1 else ""))
    wave = args.max_requests
    for i in range(0, len(lengths), wave):   # requests beyond the slots run in waves
        need = sum(blocks_needed(cfg, n + new_tokens) for n in lengths[i:i + wave])
        if need > args.num_blocks:
            n = min(wave, len(lengths) - i)
            raise UsageError(f"{n} request(s) need {need} cache blocks for their {what}s + "
                             f"{new_tokens} new token(s); the pool has --num-blocks "
                             f"{args.num_blocks}: use --num-blocks {need}"
                             + (" or fewer --max-requests" if n > 1 else ""))


def _load_params(args, cfg):
    if args.checkpoint:
        lcfg, params = load(args.checkpoint, mesh=args.mesh, pipeline=args.pipeline)
        if lcfg != cfg:
            raise UsageError(f"--checkpoint {args.checkpoint} changed while it was read")
        # the decode form, merged in place: each CSA block's five weights freed as it goes
        return P.merge_x_proj(params, cfg, consume=True)
    return P.merge_x_proj(P.init_params(cfg, args.seed), cfg, consume=True)


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
    if is_tensor_mesh(mesh):
        split = {}   # the tensor layout runs every kernel on its local heads and weights
    # auto: the matmul kernels unless heads / weights are split ("model"); the cache kernels
    # only where attention is replicated (a mesh that splits only the experts)
    matmul = (args.matmul if args.matmul != "auto" else
              "pallas" if hopper and "model" not in split else "xla")
    kernels = (args.kernels if args.kernels != "auto" else  # the kernels read FP8/FP4 caches
               "on" if hopper and args.act_quant == "on" and not set(split) - {"expert"}
               else "off")
    nm = Numerics(act_quant=args.act_quant == "on", dtype=args.dtype, matmul=matmul)
    cs = CacheSpec.for_numerics(nm, max_requests=args.max_requests, num_blocks=args.num_blocks,
                                max_blocks=args.max_blocks, kernels=kernels,
                                **({"index_format": args.index_format or "fp4"}
                                   if nm.act_quant else {}))
    return Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=args.prefill_chunk,
                  mesh=mesh, pipeline=getattr(args, "pipeline", None))


# ---------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------
def _check_sampling_flags(args):
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    t = args.temperature
    if not (np.isfinite(t) and t >= 0):
        raise UsageError(f"--temperature must be 0 (greedy) or a positive number, got {t}")
    given = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p),
                            ("--min-p", args.min_p)) if v is not None]
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {args.top_k}")
    if args.top_p is not None and not (0 < args.top_p <= 1):
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not (0 <= args.min_p < 1):
        raise UsageError(f"--min-p must be in [0, 1), got {args.min_p}")
    if given and t == 0:
        raise UsageError(f"{given[0]} shapes sampling; it needs --temperature > 0 (without it "
                         "decoding is greedy)")
    if len(given) > 1:
        raise UsageError(f"use one of --top-k, --top-p, --min-p, got {' and '.join(given)}")


def _sampler(args):
    if args.temperature == 0:
        return G.Greedy()
    if args.top_k is not None:
        return G.TopK(args.top_k, args.temperature)
    if args.top_p is not None:
        return G.TopP(args.top_p, args.temperature)
    if args.min_p is not None:
        return G.MinP(args.min_p, args.temperature)
    return G.Temperature(args.temperature)


def _read_text(p: str, flag: str) -> str:
    path = _path(p, flag)
    if path.is_dir():
        raise UsageError(f"{flag} {p}: is a directory, not a file")
    try:
        return path.read_text(encoding="utf-8-sig")   # a BOM is not part of the text
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _chat_messages(args) -> list:
    if not args.chat:
        return []
    text = _read_text(args.chat, "--chat")
    try:
        msgs = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat {args.chat}: not valid JSON: {e.msg} at line {e.lineno} "
                         f"column {e.colno}") from None
    if not isinstance(msgs, list):
        raise UsageError(f"--chat {args.chat}: must hold a JSON list of messages "
                         f"([{{\"role\": \"user\", \"content\": \"...\"}}, ...]), got a "
                         f"{type(msgs).__name__}")
    return msgs


def _prompt_texts(args) -> tuple[list[str], bool]:
    """-> (prompt texts, whether they are chat-encoded)."""
    is_chat = bool(args.chat or args.user)
    plain = ("--prompt" if args.prompt is not None else
             "--prompts-file" if args.prompts_file else None)
    if is_chat and plain:
        raise UsageError(f"{plain} is plain text and {'--chat' if args.chat else '--user'} "
                         "builds a chat prompt: give one kind of prompt per run")
    if not is_chat:
        for flag, v in (("--system", args.system), ("--thinking", args.thinking or None)):
            if v is not None:
                raise UsageError(f"{flag} applies to chat prompts (--chat / --user); "
                                 "--prompt and --prompts-file are plain text")
    texts = []
    if is_chat:
        msgs = _chat_messages(args)
        if args.system:
            msgs = [{"role": "system", "content": args.system}] + msgs
        msgs += [{"role": "user", "content": u} for u in args.user or []]
        try:
            texts.append(chat.encode_messages(
                msgs, thinking_mode="thinking" if args.thinking else "chat"))
        except (ValueError, TypeError, KeyError) as e:
            src = f"--chat {args.chat}" if args.chat else "--user"
            raise UsageError(f"{src}: {e}") from None
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty")
        texts.append(args.prompt)
    if args.prompts_file:
        lines = [l for l in _read_text(args.prompts_file, "--prompts-file").splitlines()
                 if l.strip()]
        if not lines:
            raise UsageError(f"--prompts-file {args.prompts_file}: holds no prompt (only "
                             "blank lines); write one prompt per line")
        texts += lines
    if not texts:
        texts = ["The quick brown fox"]
    return texts, is_chat


def _prompt_header(text: str, keep: int = 60) -> str:
    """The `--- prompt:` line: the prompt's last `keep` characters, the cut marked."""
    if len(text) <= keep:
        return f"--- prompt: {text!r}"
    return f"--- prompt (its last {keep} of {len(text)} characters): ...{text[-keep:]!r}"


def _stream_text(eng, prompts, tok, kw) -> tuple[list[list[int]], float]:
    """Print each prompt's text as its tokens come -> (tokens per prompt, time to the first
    token). The text goes through the server's incremental detokenizer, so a character
    whose bytes span several tokens is printed once whole: the printed text is
    tok.decode(tokens), as without --stream."""
    one = len(prompts) == 1
    outs = [[] for _ in prompts]
    texts = [IncrementalText(tok.decode) for _ in prompts]

    def emit(i, piece):
        if not piece:
            return
        if one:
            sys.stdout.write(piece)
        else:  # one JSON line per new piece: which prompt, and its text
            sys.stdout.write(json.dumps({"prompt": i, "text": piece}, ensure_ascii=False)
                             + "\n")
        sys.stdout.flush()

    t0 = time.perf_counter()
    first_at = None
    for step in eng.stream(prompts, **kw):
        first_at = first_at or time.perf_counter() - t0
        for i, t in step:
            outs[i].append(t)
            emit(i, texts[i].push([t])[0])
    for i, text in enumerate(texts):   # an incomplete character at the end
        emit(i, text.finish())
    if one:
        print()
    return outs, first_at


def cmd_generate(args):
    _check_model_flags(args)
    _check_sampling_flags(args)
    texts, is_chat = _prompt_texts(args)
    cfg = _model_config(args)
    tok = _tokenizer(args, cfg)
    prompts = [tok.encode(t) if t.startswith(chat.BOS) else [tok.bos_id] + tok.encode(t)
               for t in texts]
    k = args.speculative_tokens
    _check_speculation(args, cfg)
    extra = cfg.dspark_block_size if k == "dspark" else k   # drafts a step may write past
    _check_capacity(args, cfg, [len(p) for p in prompts], args.max_new_tokens + extra, "prompt")
    _prepare_layout(args, cfg)
    params = _load_params(args, cfg)
    eng = _engine(args, cfg, params)
    mode = "thinking" if args.thinking else "chat"
    kw = dict(max_new_tokens=args.max_new_tokens, sampler=_sampler(args),
              stop_ids=list(tok.stop_ids), speculative_tokens=k)
    waves = -(-len(prompts) // args.max_requests)
    print(f"model: {cfg.name} ({cfg.num_hidden_layers} layers, d={cfg.hidden_size}), "
          f"{len(prompts)} prompt(s)"
          + (f" in {waves} waves of up to {args.max_requests} (--max-requests)"
             if waves > 1 else "") + f", act-quant {args.act_quant}"
          + (f", mesh {dict(eng.mesh.shape)}" if eng.mesh is not None else "")
          + (f", pipeline stages at layers {eng.pipeline.bounds}" if eng.pipeline else ""),
          file=sys.stderr)
    print("generating (a first run with these shapes compiles its programs: tens of seconds "
          "on a CPU; --compile-cache keeps them for the next run)...", file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    acc = None
    if args.stream:
        outs, ttft = _stream_text(eng, prompts, tok, dict(kw, seed=args.seed))
        tm = eng.timing
        acc = eng.acceptance if k else None
    else:
        outs = eng.generate(prompts, seed=args.seed, **kw)
        tm, acc = eng.timing, eng.acceptance if k else None
        ttft = tm.first_token_s
    total = time.perf_counter() - t0
    if not args.stream:
        for t, o in zip(texts, outs):
            text = tok.decode(o)
            if is_chat:
                try:
                    text = json.dumps(chat.parse_completion(text, mode), ensure_ascii=False)
                except ValueError:
                    pass
            print(f"{_prompt_header(t)}\n{text}")
    n = sum(len(o) for o in outs)
    print(f"time to first token {ttft:.2f} s (first call includes compilation), {n} tokens in "
          f"{total:.2f} s; decode compile {tm.compile_s:.1f} s, then {tm.new_tokens} tokens "
          f"in {tm.decode_s:.2f} s = {tm.tokens_per_s:.1f} tokens/s", file=sys.stderr)
    if k and acc is not None:
        per = ", ".join(f"{a:.2f}" for a in acc["per_request"])
        print(f"speculative {'DSpark' if k == 'dspark' else f'k={k}'}: mean tokens per step {acc['overall']:.2f} (accepted drafts "
              f"+ 1; per request: {per})", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# logits
# ---------------------------------------------------------------------------------------
def _read_tokens(args, cfg) -> np.ndarray:
    path = _path(args.tokens, "--tokens")
    try:
        tokens = np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises several types for a file that is not .npy
        raise UsageError(f"--tokens {args.tokens}: not a .npy array ({e})") from None
    if not isinstance(tokens, np.ndarray):
        raise UsageError(f"--tokens {args.tokens}: holds an .npz archive; give one .npy array")
    if tokens.dtype == bool or not np.issubdtype(tokens.dtype, np.integer):
        raise UsageError(f"--tokens {args.tokens}: token ids must be integers, got "
                         f"{tokens.dtype}")
    if tokens.ndim != 2 or tokens.size == 0:
        raise UsageError(f"--tokens {args.tokens}: must hold a non-empty int array [B, T], got "
                         f"shape {tokens.shape}")
    bad = (tokens < 0) | (tokens >= cfg.vocab_size)
    if bad.any():
        b, t = map(int, np.argwhere(bad)[0])
        raise UsageError(f"--tokens {args.tokens}: id {int(tokens[b, t])} at [{b}, {t}] is "
                         f"outside the vocabulary [0, {cfg.vocab_size})")
    T = tokens.shape[1]
    if not 1 <= args.prefill_len <= T:
        raise UsageError(f"--prefill-len must be in [1, {T}] (the tokens' length), got "
                         f"{args.prefill_len}")
    return tokens.astype(np.int32)


def _out_path(p: str, flag: str, suffix: str) -> Path:
    out = Path(p).expanduser()
    if out.suffix != suffix:
        out = out.with_name(out.name + suffix)   # as np.savez names it
    parent = out.parent.resolve()
    if not parent.is_dir():
        raise UsageError(f"{flag} {p}: directory {parent} does not exist")
    if out.is_dir():
        raise UsageError(f"{flag} {p}: is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {p}: directory {parent} is not writable")
    return parent / out.name


def cmd_logits(args):
    _check_model_flags(args)
    out = _out_path(args.out, "--out", ".npz")
    cfg = _model_config(args)
    tokens = _read_tokens(args, cfg)
    B, T = tokens.shape
    # the cache is sized to the tokens; the flags only raise it
    args.max_requests = max(args.max_requests, B)
    need = -(-T // BLOCK_TOKENS)
    args.max_blocks = max(args.max_blocks, need)
    args.num_blocks = max(args.num_blocks, sum(blocks_needed(cfg, T) for _ in range(B)),
                          args.max_blocks)
    _prepare_layout(args, cfg)
    params = _load_params(args, cfg)
    eng = _engine(args, cfg, params)
    logits = eng.teacher_forced_logits(tokens, args.prefill_len)
    tmp = out.with_name(out.name + ".partial.npz")
    np.savez(tmp, logits=logits.astype(np.float32))
    os.replace(tmp, out)   # a file at --out is always complete
    print(f"wrote logits {logits.shape} to {out}", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------
def speculative_arg(v: str):
    """--speculative-tokens: an integer K (MTP drafts) or "dspark" (the DSpark drafter)."""
    if v == "dspark":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer or 'dspark', got {v!r}") from None


def _check_speculation(args, cfg) -> None:
    """--speculative-tokens against the config and the layout, before any weight is read."""
    k = args.speculative_tokens
    if getattr(args, "decode_steps", 1) > 1 and args.devices:
        if args.layout == "pipeline":
            raise UsageError("--decode-steps > 1 runs on one device or a mesh, not with "
                             "--layout pipeline")
        if args.layout == "auto":
            args.layout = "mesh"   # the multi-step program runs on one device or a mesh
    if not k:
        return
    if k == "dspark":
        from . import dspark_runner
        try:
            dspark_runner.check(cfg)
        except ValueError as e:
            raise UsageError(f"--speculative-tokens dspark: {e}") from None
        if args.devices:
            raise UsageError("--speculative-tokens dspark runs on one device (no --devices)")
        return
    try:
        SP.check_draft_count(k)
        SP.check_mtp_config(cfg, k)
    except ValueError as e:
        raise UsageError(f"--speculative-tokens: {e}") from None
    if args.devices and args.layout == "tensor":
        raise UsageError("--speculative-tokens runs on one device or a mesh, not with "
                         "--layout tensor (yet)")
    if args.devices and args.layout == "pipeline":
        raise UsageError("--speculative-tokens runs on one device or a mesh, not with "
                         "--layout pipeline")
    if args.layout == "auto":
        args.layout = "mesh"   # the speculative step runs on one device or a mesh


def serving_engine(args):
    """-> (engine, tokenizer, model name) from the model flags (checked first), as `dsv4
    serve` runs them; benchmarks/serve_load.py builds its in-process server with it too.
    The name: the checkpoint directory's, or the preset's."""
    _check_model_flags(args)
    cfg = _model_config(args)
    if getattr(args, "speculative_tokens", 0):
        _check_speculation(args, cfg)
    tok = _tokenizer(args, cfg)
    _prepare_layout(args, cfg)
    eng = _engine(args, cfg, _load_params(args, cfg))
    eng.progress = False
    return eng, tok, Path(args.checkpoint).name if args.checkpoint else cfg.name


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), before anything is loaded: a port in use (or a host
    this machine does not have) is bad input, found in a second, not after the compile.
    uvicorn listens on it once the server is built."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address of this machine ({e.strerror})") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = {98: "is in use (another server?); pick another --port or stop that one",
               13: "needs more privileges (ports below 1024); pick a --port above 1023",
               99: "is not an address of this machine (--host)"}.get(
                   e.errno, f"cannot be bound ({e.strerror})")
        raise UsageError(f"--port {port} on {host} {why}") from None
    return sock


def cmd_serve(args):
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    _positive(args, "--prefill-chunks-per-step", "--max-waiting", "--decode-steps")
    if args.decode_steps > 1 and args.speculative_tokens:
        raise UsageError("--decode-steps > 1 and --speculative-tokens do not combine (a "
                         "speculative step already emits several tokens)")
    if args.prefix_cache_entries is None:   # on where it runs: one device, no speculation
        args.prefix_cache_entries = (0 if args.devices or args.speculative_tokens
                                     else 2 * args.max_requests)
    elif args.prefix_cache_entries < 0:
        raise UsageError(f"--prefix-cache-entries must be 0 (off) or more, got "
                         f"{args.prefix_cache_entries}")
    elif args.prefix_cache_entries and args.devices:
        raise UsageError("--prefix-cache-entries needs a single-device engine; with "
                         "--devices use --prefix-cache-entries 0")
    if args.speculative_tokens:
        if args.prefix_cache_entries:
            raise UsageError("--speculative-tokens and the prefix cache do not combine (its "
                             "snapshots do not hold the MTP block's cache); add "
                             "--prefix-cache-entries 0")
    from checkpoints.convert import parse_bytes
    max_body = parse_bytes(args.max_request_size, "--max-request-size")
    try:
        from .serve import run as serve_run
        from .serve.scheduler import SchedulerConfig
    except ImportError as e:
        raise UsageError(f"dsv4 serve needs the serve extra ({e.name} is missing): "
                         "pip install 'dsv4-jax[serve]'") from None
    sock = _bind(args.host, args.port)
    try:
        eng, tok, name = serving_engine(args)
        name = args.served_model_name or name
        cfg = eng.cfg
        print(f"model: {name} ({cfg.num_hidden_layers} layers, d={cfg.hidden_size}), "
              f"{args.max_requests} request slots, {args.num_blocks} blocks, context "
              f"{args.max_blocks * BLOCK_TOKENS} tokens; compiling...", file=sys.stderr)
        t0 = time.perf_counter()
        srv = serve_run.build(eng, tok, name, SchedulerConfig(
            prefill_chunks_per_step=args.prefill_chunks_per_step,
            max_waiting=args.max_waiting, prefix_cache_entries=args.prefix_cache_entries,
            speculative_tokens=args.speculative_tokens, decode_steps=args.decode_steps),
            seed=args.seed, max_body_bytes=max_body)
        host, port = sock.getsockname()[:2]

        def ready():   # uvicorn is listening: requests are answered from now on
            print(f"ready in {time.perf_counter() - t0:.1f} s: http://{args.host}:{port}/v1",
                  file=sys.stderr, flush=True)
        serve_run.serve(srv, sock, log_level=args.log_level, on_ready=ready)
    finally:
        sock.close()


class _HelpFormatter(argparse.HelpFormatter):
    """--help names each flag's default, where it has one its text does not state."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (action.option_strings and not (d is None or d is False or d is argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("dsv4-jax")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_tokenizer_arg(ap):
    ap.add_argument("--tokenizer", metavar="FILE",
                    help="a tokenizer.json (or a directory holding one) instead of the "
                         "checkpoint's (default: the checkpoint's tokenizer.json; without "
                         "one, or with --preset, the byte-level tokenizer)")


def build_parser():
    fmt = dict(formatter_class=_HelpFormatter)
    ap = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 in JAX", **fmt)
    ap.add_argument("--version", action="version", version=f"dsv4 {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text", **fmt)
    _add_model_args(g)
    _add_tokenizer_arg(g)
    g.add_argument("--prompt", help="a plain-text prompt")
    g.add_argument("--chat", help="JSON file with a list of chat messages")
    g.add_argument("--user", action="append", help="a user turn (repeatable)")
    g.add_argument("--system", help="a system prompt for --chat/--user")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="thinking mode for chat prompts")
    g.add_argument("--prompts-file", help="one plain-text prompt per line, generated as a "
                   "batch (in waves of --max-requests)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens generated per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; "
                   "0 = greedy")
    g.add_argument("--top-k", type=int, help="sample from the k likeliest tokens "
                   "(needs --temperature)")
    g.add_argument("--top-p", type=float, help="nucleus sampling, 0 < p <= 1 (needs --temperature)")
    g.add_argument("--min-p", type=float, help="drop tokens below p x the likeliest, 0 <= p < 1 "
                   "(needs --temperature)")
    g.add_argument("--speculative-tokens", "--speculative", type=speculative_arg, default=0,
                   metavar="K", help="draft K tokens a step with the model's MTP block and "
                   "verify them in one step (1..3; 0 = off), or 'dspark': the DSpark drafter "
                   "of V4-Flash-0731 (its block of drafts); prints the mean tokens per step")
    g.add_argument("--stream", action="store_true", help="print tokens as they are produced "
                   "(several prompts: one JSON line {\"prompt\": i, \"text\": piece} each)")
    g.set_defaults(fn=cmd_generate)
    lg = sub.add_parser("logits", help="teacher-forced logits: prefill P tokens, then decode",
                        **fmt)
    _add_model_args(lg)
    lg.add_argument("--tokens", required=True, help="int32 [B, T] .npy")
    lg.add_argument("--prefill-len", type=int, required=True,
                    help="P: tokens prefilled; the rest are fed one per decode step")
    lg.add_argument("--out", required=True, help="output .npz with `logits` [B, T-P+1, V]")
    lg.set_defaults(fn=cmd_logits)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous "
                        "batching (docs/SERVING.md; needs the serve extra)", **fmt)
    _add_model_args(sv)
    _add_tokenizer_arg(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: "
                    "every interface)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one)")
    sv.add_argument("--served-model-name", help="the model's name in the API (default: the "
                    "checkpoint directory's name, or the preset's)")
    sv.add_argument("--prefill-chunks-per-step", type=int, default=1,
                    help="prefill chunks of new requests run between two decode steps")
    sv.add_argument("--max-waiting", type=int, default=1024,
                    help="queued requests beyond which new ones get 503")
    sv.add_argument("--prefix-cache-entries", type=int,
                    help="prompt prefixes (whole 128-token blocks) kept for reuse across "
                         "requests; 0: off (default: 2 x --max-requests on one device, off "
                         "with --devices)")
    sv.add_argument("--speculative-tokens", "--speculative", type=speculative_arg, default=0,
                    metavar="K", help="draft K tokens a step with the model's MTP block and "
                    "verify them in one step (1..3; 0 = off), or 'dspark' (the DSpark "
                    "drafter); needs --prefix-cache-entries 0; usage reports the acceptance")
    sv.add_argument("--decode-steps", type=int, default=1, metavar="N",
                    help="plain decode steps one program runs before the host reads their "
                         "tokens: the host's work per token drops N-fold, and each request's "
                         "tokens stream N at a time")
    sv.add_argument("--max-request-size", default="16MiB",
                    help="request bodies above this get 413 (e.g. 4MiB, 1G, or bytes)")
    sv.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level")
    sv.set_defaults(fn=cmd_serve)
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
    try:
        from benchmarks.prefill_bench import register as reg_prefill
        reg_prefill(sub)
    except (ImportError, KeyError):   # (no benchmarks, or no `bench` command to join)
        pass
    return ap


def _compile_cache(args):
    """Keep compiled programs on disk (jax's persistent compilation cache): a full-width
    decode step compiles for minutes, the next run with the same shapes loads it. A
    directory the user named must be writable (checked here, not by jax's warnings at the
    first compile); the default one is skipped with a note when it is not."""
    d = getattr(args, "compile_cache", None)
    src = "--compile-cache"
    if d is None:
        src = "DSV4_COMPILE_CACHE"
        d = os.environ.get("DSV4_COMPILE_CACHE")
    if d is None:
        src, d = None, os.path.expanduser("~/.cache/dsv4-jax/xla")
    if not d or d == "off":
        return
    d = Path(d).expanduser().absolute()
    if d.exists() and not d.is_dir():
        raise UsageError(f"{src or 'the compile cache'} {d}: is a file, not a directory "
                         "(or 'off')")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):   # what jax will do at the first compile
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        if src is None:
            print(f"note: the compile cache {d} is not writable ({why}): compiled programs "
                  "are not kept (--compile-cache DIR to keep them elsewhere)", file=sys.stderr)
            return
        raise UsageError(f"{src} {d}: cannot write there ({why}); give a writable "
                         "directory, or 'off'") from None
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _check_other_commands(args):
    """Flag checks for the commands other modules define (bench, inspect), before they
    start any work."""
    if args.cmd == "bench" and args.bench == "prefill":   # the prefill kernels, always
        from benchmarks.prefill_bench import check_args
        check_args(args)
        _require_hopper("dsv4 bench prefill", "it times the Hopper prefill kernels")
    if args.cmd == "bench":
        if getattr(args, "kernels", None) == "on":
            _require_hopper("--kernels on", "leave the flag out")
        if "pallas" in (getattr(args, "matmul", None) or ()):
            _require_hopper("--matmul pallas", "use --matmul xla")
    if getattr(args, "checkpoint_cmd", None) == "inspect" and args.match is not None:
        if not args.tensors or args.json:
            raise UsageError("--match filters the tensor list of the text report: it needs "
                             "--tensors (and no --json)")


def main(argv=None) -> int:
    """The `dsv4` command -> its exit status (dsv4_jax.errors: 0 done, 2 bad input, 1 failed,
    130 interrupted). Every flag and input file is checked before a model is loaded."""
    args = build_parser().parse_args(argv)
    if hasattr(args, "func"):  # make-checkpoint / convert / inspect (checkpoints.cli)
        rc = run_command(args.cmd, lambda: _check_other_commands(args))
        if rc:
            return rc
        from checkpoints.cli import run
        return run(args)

    def go():
        _check_other_commands(args)
        _compile_cache(args)
        init_processes_from_env()  # a no-op unless DSV4_COORDINATOR is set
        return args.fn(args)

    note = ("stopped; the text printed so far is all that was generated"
            if args.cmd == "generate" else "the server stopped" if args.cmd == "serve"
            else "nothing was written")
    return run_command(args.cmd, go, on_interrupt=note)


if __name__ == "__main__":
    raise SystemExit(main())
