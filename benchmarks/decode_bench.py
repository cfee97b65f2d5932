"""Decode-step benchmark against the HBM-bandwidth floor (the engine of `dsv4 bench decode`).

    dsv4 bench decode --preset flash --layers 4 --batch 1 8 --context 4096 --kernels on --matmul pallas
    (or: PYTHONPATH=. python -m benchmarks.decode_bench decode ...)

Synthetic weights in the real formats are drawn on the device; the cache of every request
is filled with random FP8/FP4 contents at the given context (the step's cost does not
depend on the values), so no prefill is needed. The floor is the bytes a decode step must
read: every non-expert weight once, the routed experts the batch hits (expected distinct
experts under uniform routing), the head, and each request's cache reads (window, CSA top-k
entries + all indexer keys, all HCA entries), divided by the HBM ceiling measured in the same run (benchmarks.common.hbm_bandwidth).
Each configuration is timed one step at a time (latency: host launch + GPU work) and
pipelined (steps enqueued back to back: what Engine.stream / Engine.generate get), and with
--loop also through Engine.generate's jitted while loop.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import copy_bandwidth, kernels_by_layer
from dsv4_jax import config as C, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec, init_cache
from flax import nnx

from dsv4_jax.decode import host_reader, init_stream_state, read_tokens
from dsv4_jax.distributed import init_processes_from_env, make_mesh
from dsv4_jax.generate import Greedy, loop_bucket, loop_stops
from dsv4_jax.nnx_model import DeepSeekV4
from dsv4_jax.pipeline import Pipeline
from dsv4_jax.programs import (Layout, decode_program, generate_loop, step_program,
                               verify_programs)
from dsv4_jax.quant import Numerics
from dsv4_jax import dspark as DS, dspark_runner as DR, speculative as SP
from dsv4_jax.serve.sampling import ROW_KEYS, TOP_LOGPROBS, RowSampler
from dsv4_jax.sharding import param_shardings, shard_cache

ENTRY_BYTES = 448 + 8 + 128  # FP8 nope + e8m0 scales + bf16 rope
IDX_KEY_BYTES = 64 + 4  # fp4 codes + e8m0 per 32


def _leaf_bytes(leaf) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(leaf))


def floor_bytes(cfg, B: int, ctx: int, mesh=None) -> dict:
    """Bytes one decode step must move, per layer kind and in total; with a mesh, per
    device (each parameter's shard as placed by sharding.param_shardings; the cache is
    replicated unless split over "data")."""
    structs = P.abstract_params(cfg, include_mtp=False)
    if mesh is not None:
        sh = param_shardings(cfg, mesh, include_mtp=False)
        structs = {k: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(s.shard_shape(a.shape),
                                                                     a.dtype), v, sh[k])
                   for k, v in structs.items()}
        B = B // mesh.shape.get("data", 1) or 1
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = E * (1 - (1 - k / E) ** B)  # expected distinct experts hit by B tokens
    per_kind: dict[str, float] = {}
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        w = 0.0
        for name, leaf in structs.items():
            if not name.startswith(pre):
                continue
            b = _leaf_bytes(leaf)
            if ".ffn.experts." in name:
                b = b / E * distinct
            elif name.endswith("gate.tid2eid"):
                b = 0  # B rows of the table
            w += b
        r = cfg.layer_ratio(i)
        cache = BLOCK_TOKENS * ENTRY_BYTES  # the window ring
        if r == 4:
            cache += min(cfg.index_topk, ctx // 4) * ENTRY_BYTES + (ctx // 4) * IDX_KEY_BYTES
        elif r == 128:
            cache += (ctx // 128) * ENTRY_BYTES
        kind = cfg.layer_kind(i)
        per_kind.setdefault(kind, [0.0, 0])
        per_kind[kind][0] += w + B * cache
        per_kind[kind][1] += 1
    head = _leaf_bytes(structs["head.weight"]) + _leaf_bytes(structs["hc_head_fn"])
    total = sum(v[0] for v in per_kind.values()) + head
    return {"per_kind": {k: (v[0] / v[1], v[1]) for k, v in per_kind.items()}, "head": head,
            "total": total}


def random_cache(cfg, cs, B: int, ctx: int, key):
    """A cache whose first B requests hold `ctx` tokens of random (valid) contents."""
    cache = init_cache(cfg, cs)
    leaves, tree = jax.tree_util.tree_flatten_with_path(cache)
    out = []
    for j, (path, a) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        kk = jax.random.fold_in(key, j)
        if "win_pos" in name:
            slots = jnp.arange(a.shape[1])
            p = ctx - 1 - ((ctx - 1 - slots) % a.shape[1])  # latest position of each slot
            out.append(jnp.where(p >= 0, p, -1)[None].repeat(a.shape[0], 0).astype(a.dtype))
        elif a.dtype == jnp.float8_e4m3fn and "scale" in name:   # nvfp4 key scales
            out.append(jax.random.uniform(kk, a.shape, jnp.float32, 0.5, 4).astype(a.dtype))
        elif a.dtype == jnp.float8_e4m3fn:
            out.append(jnp.clip(jax.random.normal(kk, a.shape) * 64, -448, 448).astype(a.dtype))
        elif a.dtype == jnp.float32 and "idx_scale" in name:      # fp8 key scales (>= 0)
            out.append(jax.random.uniform(kk, a.shape, jnp.float32, 0.01, 0.1))
        elif a.dtype == jnp.uint8 and "scale" in name:
            out.append(jnp.full(a.shape, 120, jnp.uint8))
        elif a.dtype == jnp.uint8:
            out.append(jax.random.randint(kk, a.shape, 0, 256, jnp.int32).astype(jnp.uint8))
        elif name.endswith("['cst']"):   # the compressor state; its -inf parts stay -inf
            out.append(jnp.where(jnp.isinf(a), a, jax.random.normal(kk, a.shape) * 0.1))
        else:
            out.append((jax.random.normal(kk, a.shape) * 0.1).astype(a.dtype))
    # placed (committed) as a step returns it, or a step fed this cache compiles twice
    return jax.device_put(jax.tree_util.tree_unflatten(tree, out), jax.devices()[0])


def kernel_counts(cfg, texts) -> dict:
    """Kernels of a compiled step (its optimised HLO texts: one, or one per pipeline stage):
    the total, the mean per layer and per layer kind."""
    by_layer = sum((kernels_by_layer(t) for t in texts), Counter())
    kinds: dict[str, list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        kinds.setdefault(cfg.layer_kind(i), []).append(by_layer.get(i, 0))
    n = cfg.num_hidden_layers
    return {"total": sum(by_layer.values()),
            "per_layer": sum(by_layer[i] for i in range(n)) / n,
            "per_kind": {k: sum(v) / len(v) for k, v in kinds.items()}}


def bench(cfg, params, B: int, ctx: int, kernels: str, steps: int = 20, seed: int = 0,
          matmul: str = "xla", mesh=None, loop: bool = False,
          what=("step", "stream"), index_format: str = "fp4", pipeline=None,
          spec_k: int = 0) -> dict:
    """ms per decode step, for what = "step" (the plain step program) three ways:
    ms        one step at a time, waiting for each (a latency figure: host launch + GPU);
    ms_pipe   `steps` steps enqueued back to back, one wait at the end (host launch overlaps
              the previous step's GPU work), a fresh pos array per step (inputs move);
    ms_pipe_fixed  the same with every input at one address (only the logits move);
    and for "stream":
    ms_stream what Engine.stream gets: the stream step (device state, donated: no buffer
              moves; greedy sampling inside), tokens read back one step behind through
              pinned host memory (no device allocation between steps);
    ms_loop   (loop=True) the jitted while-loop decode of `Engine.generate` (greedy), per
              token.
    ms_spec   (spec_k > 0) the speculative step (MTP drafts, the k+1-row verify, accept,
              rollback: one program) as Engine.stream runs it: its emitted tokens read
              back one step behind; ms_spec_sync one step at a time, each waiting for its
              read-back; tokens_per_step the measured mean (bench_speculative). XLA updates a step's CUDA graph whenever a buffer it uses moved.
    kernels   the step's kernels (kernel_counts), from the programs compiled ahead of time.
    mesh: expert / tensor parallel over a mesh; pipeline: a pipeline.Pipeline (layers split
    across devices)."""
    nm = Numerics(act_quant=True, dtype="bfloat16", matmul=matmul)
    rows_a_step = cfg.dspark_block_size + 1 if spec_k == "dspark" else spec_k + 1
    mb = -(-(ctx + 3 * steps + 4 + 2 * rows_a_step * (steps + 4)) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb,
                                kernels=kernels, index_format=index_format)
    cache = random_cache(cfg, cs, B, ctx, jax.random.key(seed))
    table = jnp.arange(B * mb, dtype=jnp.int32).reshape(B, mb)
    if mesh is not None:
        cache = shard_cache(cache, cfg, cs, mesh)
    if pipeline is not None:
        cache = [jax.device_put(cache.part(pipeline.layers(s)), pipeline.devices[s])
                 for s in range(pipeline.n)]
    toks = jax.random.randint(jax.random.key(seed + 1), (B, 1), 0, cfg.vocab_size, jnp.int32)
    slots, one = jnp.arange(B, dtype=jnp.int32), jnp.ones(B, jnp.int32)
    poss = [jnp.full(B, ctx + i, jnp.int32) for i in range(2 * steps + 1)]
    # the programs Engine runs: over the NNX module's split state, the cache donated
    lay = Layout.of(cfg, params, mesh, pipeline)
    if pipeline is None:
        graphdef, state = nnx.split(DeepSeekV4.from_params(cfg, params))
    else:
        graphdef = None
        state = [{k: v for k, v in params.items() if pipeline.stage_of(k) == s}
                 for s in range(pipeline.n)]
    out = {}
    if "step" in what:
        step = step_program(lay, graphdef, cs, nm)
        t0 = time.perf_counter()
        args = (state, cache, toks, slots, poss[0], one, table)
        if pipeline is not None:
            step, texts = step.compile(*args)
        else:
            step = step.lower(*args).compile()
            texts = [step.as_text()]
        out["kernels"] = kernel_counts(cfg, texts)
        lg, cache = step(state, cache, toks, slots, poss[0], one, table)
        lg.block_until_ready()
        out["compile_s"] = time.perf_counter() - t0
        ts = []
        for i in range(steps):
            t0 = time.perf_counter()
            lg, cache = step(state, cache, toks, slots, poss[1 + i], one, table)
            lg.block_until_ready()
            ts.append(time.perf_counter() - t0)
        out["ms"] = 1e3 * float(np.median(ts))
        t0 = time.perf_counter()
        for i in range(steps):
            lg, cache = step(state, cache, toks, slots, poss[1 + steps + i], one, table)
        lg.block_until_ready()
        out["ms_pipe"] = 1e3 * (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        for i in range(steps):   # one pos array for all steps
            lg, cache = step(state, cache, toks, slots, poss[0], one, table)
        lg.block_until_ready()
        out["ms_pipe_fixed"] = 1e3 * (time.perf_counter() - t0) / steps
    if "stream" in what:
        prog = decode_program(lay, graphdef, cs, nm, Greedy())
        st = init_stream_state(toks[:, 0], poss[-1], one, table, jax.random.key(seed),
                               sharding=lay.state_sharding())
        t0 = time.perf_counter()
        if pipeline is not None:
            prog, texts = prog.compile(state, cache, st)
        else:
            prog = prog.lower(state, cache, st).compile()
            texts = [prog.as_text()]
        out["kernels_stream"] = kernel_counts(cfg, texts)
        np.asarray(read_tokens(st))   # loaded before the step runs: loading an executable
        cache, st = prog(state, cache, st)   # drops the CUDA graphs of those loaded before
        np.asarray(read_tokens(st))
        out["compile_stream_s"] = time.perf_counter() - t0
        for _ in range(2):   # warm: the graphs are recorded at a program's first runs
            cache, st = prog(state, cache, st)
        np.asarray(read_tokens(st))
        t0, prev = time.perf_counter(), None
        for i in range(steps):
            cache, st = prog(state, cache, st)
            nxt = read_tokens(st)   # as Engine.stream: into pinned host memory
            if prev is not None:
                np.asarray(prev)   # the previous step's tokens, while this one runs
            prev = nxt
        np.asarray(prev)
        out["ms_stream"] = 1e3 * (time.perf_counter() - t0) / steps
    if spec_k == "dspark":
        out.update(bench_dspark(cfg, params, cs, cache, table, B, ctx, steps, seed, nm))
    elif spec_k:
        out.update(bench_speculative(cfg, params, cs, cache, table, B, ctx, spec_k, steps,
                                     seed, nm, mesh))
    if loop and mesh is None and pipeline is None:
        run = generate_loop(lay, graphdef, cs, nm, loop_bucket(steps + 1))
        pos0 = jnp.full(B, ctx + 2 * steps + 1, jnp.int32)
        args = (toks[:, 0], jnp.ones(B, bool), pos0, table, jax.random.key(seed),
                jnp.int32(steps + 1), loop_stops(()), Greedy())   # no stop ids
        comp = run.lower(state, cache, *args).compile()
        _, n_gen, cache = comp(state, cache, *args)  # warm
        t0 = time.perf_counter()
        _, n_gen, cache = comp(state, cache, *args)
        n = int(np.asarray(n_gen).max()) - 1  # decode steps taken (token 0 is given)
        out["ms_loop"] = 1e3 * (time.perf_counter() - t0) / max(n, 1)
    return out


def bench_speculative(cfg, params, cs, cache, table, B: int, ctx: int, k: int, steps: int,
                      seed: int, nm, mesh=None) -> dict:
    """The speculative step (programs.verify_programs, greedy) on the random cache from
    position ctx + 2 * steps + 1 (past the plain steps' writes): ms_spec per step (its
    emitted-token count read one step behind, as Engine.stream), ms_spec_sync (each step
    waiting for its count), tokens_per_step (measured mean over the batch: random weights
    accept almost nothing)."""
    if not any(key.startswith("mtp.0.") for key in params):
        raise ValueError("the speculative bench needs the MTP block's weights")
    graphdef, state = nnx.split(DeepSeekV4.from_params(cfg, params))
    mcache = jax.device_put(SP.init_mtp_cache(cfg, cs), jax.devices()[0])
    lay, rep = Layout.of(cfg, params, mesh), None
    if mesh is not None:
        from dsv4_jax.sharding import cache_shardings
        mcache = jax.device_put(mcache, SP.mtp_cache_shardings(
            cfg, cs, cache_shardings(cfg, cs, mesh), mesh))
        rep = lay.replicated()
    _, step = verify_programs(lay, graphdef, cs, nm, Greedy(), SP.Speculation(k))
    pos0 = ctx + 2 * steps + 1
    h = jax.random.normal(jax.random.key(seed + 2), (B, cfg.hc_mult, cfg.hidden_size))
    toks = np.asarray(jax.random.randint(jax.random.key(seed + 3), (B,), 0, cfg.vocab_size))
    st = SP.init_spec_state(k, cfg, toks, np.asarray(h.astype(nm.jdtype)), np.full(B, pos0),
                            np.ones(B), np.asarray(table), jax.random.key(seed), sharding=rep)
    read = host_reader("out", "n_out")
    np.asarray(read(st)[1])   # loaded before the step runs (as Engine.stream)
    t0 = time.perf_counter()
    step = step.lower(state, cache, mcache, st).compile()
    cache, mcache, st = step(state, cache, mcache, st)
    np.asarray(st["n_out"])
    out = {"compile_spec_s": time.perf_counter() - t0}
    for _ in range(2):
        cache, mcache, st = step(state, cache, mcache, st)
        np.asarray(st["n_out"])
    ts, n = [], 0
    for _ in range(steps):   # one at a time: each step waits for its emitted-token count
        t0 = time.perf_counter()
        cache, mcache, st = step(state, cache, mcache, st)
        n += int(np.asarray(st["n_out"]).sum())
        ts.append(time.perf_counter() - t0)
    out["ms_spec_sync"] = 1e3 * float(np.median(ts))
    t0, prev = time.perf_counter(), None
    for _ in range(steps):   # as Engine.stream: the count read one step behind
        cache, mcache, st = step(state, cache, mcache, st)
        nxt = read(st)
        if prev is not None:
            n += int(np.asarray(prev[1]).sum())
        prev = nxt
    n += int(np.asarray(prev[1]).sum())
    out["ms_spec"] = 1e3 * (time.perf_counter() - t0) / steps
    steps *= 2
    out["tokens_per_step"] = n / (steps * B)
    return out


def bench_dspark(cfg, params, cs, cache, table, B: int, ctx: int, steps: int, seed: int,
                 nm) -> dict:
    """The DSpark step (dspark_runner.step_fn: the drafter's block, the G+1-row verify
    through the kernels, accept, rollback, the rings' commit; one program, greedy rows) on
    the random cache from position ctx + 2 * steps + 1, its rings full: ms_spec (its
    emitted tokens read one step behind, as the runner's drivers), ms_spec_sync (each
    step waiting), tokens_per_step (measured: random weights accept almost nothing)."""
    from flax import nnx as _nnx
    DR.check(cfg, params)
    graphdef, state = _nnx.split(DeepSeekV4.from_params(cfg, params))
    _, step = verify_programs(Layout(cfg), graphdef, cs, nm, RowSampler(TOP_LOGPROBS),
                              DR.DSpark())
    pos0 = ctx + 2 * steps + 1
    st = DR.decode_state(cfg, B, nm, TOP_LOGPROBS)
    W = cfg.sliding_window
    st.update(pos=np.full(B, pos0, np.int32), table=np.asarray(table), run=np.ones(B, np.int32),
              draw=np.ones(B, np.int32),
              anchor=np.asarray(jax.random.randint(jax.random.key(seed + 3), (B,), 0,
                                                   cfg.vocab_size), np.int32),
              dsp_pos=np.broadcast_to(pos0 - W + (np.arange(W) - pos0) % W, (B, W)).astype(np.int32),
              dsp_kv=np.asarray(jax.random.normal(jax.random.key(seed + 4), st["dsp_kv"].shape)
                                * 0.1).astype(st["dsp_kv"].dtype),
              temperature=np.zeros(B, np.float32), top_k=np.zeros(B, np.int32),
              top_p=np.ones(B, np.float32), min_p=np.zeros(B, np.float32),
              seed=np.zeros(B, np.uint32))
    assert set(ROW_KEYS) <= set(st)
    st = {k: jax.device_put(jnp.asarray(v), jax.devices()[0]) for k, v in st.items()}
    read = host_reader("out", "n_out")
    np.asarray(read(st)[1])   # loaded before the step runs (as the runner's drivers)
    t0 = time.perf_counter()
    step = step.lower(state, cache, st).compile()
    cache, st = step(state, cache, st)
    np.asarray(st["n_out"])
    out = {"compile_spec_s": time.perf_counter() - t0,
           "kernels_spec": kernel_counts(cfg, [step.as_text()])}
    for _ in range(2):
        cache, st = step(state, cache, st)
        np.asarray(st["n_out"])
    ts, n = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        cache, st = step(state, cache, st)
        n += int(np.asarray(st["n_out"]).sum())
        ts.append(time.perf_counter() - t0)
    out["ms_spec_sync"] = 1e3 * float(np.median(ts))
    t0, prev = time.perf_counter(), None
    for _ in range(steps):
        cache, st = step(state, cache, st)
        nxt = read(st)
        if prev is not None:
            n += int(np.asarray(prev[1]).sum())
        prev = nxt
    n += int(np.asarray(prev[1]).sum())
    out["ms_spec"] = 1e3 * (time.perf_counter() - t0) / steps
    out["tokens_per_step"] = n / (2 * steps * B)
    return out


def expected_tokens_per_step(k: int, rate: float) -> float:
    """Mean tokens a step emits with k drafts each accepted with probability `rate`
    (independently, once the ones before it were): 1 + rate + ... + rate^k."""
    return sum(rate ** j for j in range(k + 1))


def _layers_cfg(cfg, ratios):
    n = len(ratios)
    return cfg.replace(num_hidden_layers=n, compress_ratios=tuple(ratios) + (0,),
                       num_hash_layers=0)


def check_args(args, base):
    """Bad flags fail here, before any weight is drawn or program compiled."""
    for flag, vals in (("--batch", args.batch), ("--context", args.context),
                       ("--steps", [args.steps])):
        if min(vals) < 1:
            raise ValueError(f"{flag} must be at least 1, got {min(vals)}")
    if not 0 <= args.layers <= base.num_hidden_layers:
        raise ValueError(f"--layers must be in [0, {base.num_hidden_layers}] (0: all), got "
                         f"{args.layers}")
    if args.devices < 0 or args.devices > jax.device_count():
        raise ValueError(f"--devices {args.devices}: this machine has {jax.device_count()} "
                         "device(s)")
    axes = [f"--{a}" for a in ("expert", "model", "data") if getattr(args, a) is not None]
    if args.speculative_tokens == "dspark":
        if args.devices:
            raise ValueError("--speculative-tokens dspark runs on one device (no --devices)")
    elif args.speculative_tokens:
        SP.check_draft_count(args.speculative_tokens)
    if args.speculative_tokens and args.devices and args.layout == "pipeline":
        raise ValueError("--speculative-tokens runs on one device or a mesh, not a pipeline")
    for a in args.accept_lengths:
        if a < 1:
            raise ValueError(f"--accept-lengths must be >= 1 (tokens a step), got {a}")
    for r in args.accept_rates:
        if not 0 <= r <= 1:
            raise ValueError(f"--accept-rates must be in [0, 1], got {r}")
    if axes and (not args.devices or args.layout == "pipeline"):
        raise ValueError(f"{', '.join(axes)} size a mesh: they need --devices and --layout mesh")


def main(args):
    multi = init_processes_from_env()  # one process per GPU (docs/SHARDING.md)
    base = C.get_preset(args.preset)
    check_args(args, base)
    n = args.layers or base.num_hidden_layers
    cfg = base.replace(num_hidden_layers=n, compress_ratios=base.compress_ratios[:n] + (0,),
                       num_hash_layers=min(base.num_hash_layers, n))
    if args.speculative_tokens == "dspark":   # the drafter reads the last 3 of the n layers
        cfg = DS.with_dspark(cfg)
        DR.check(cfg)
    dev = jax.local_devices()[0]
    bw = copy_bandwidth(2 << 30 if jax.default_backend() == "gpu" else 64 << 20)
    mesh = pipe = None
    if args.devices and args.layout == "pipeline":
        pipe = Pipeline.balanced(cfg, jax.devices()[:args.devices], stages=args.devices)
    elif args.devices:
        mesh = make_mesh(args.devices, expert=args.expert, model=args.model, data=args.data)
    print(f"device {dev.device_kind} x {args.devices or 1}"
          f"{f' in {jax.process_count()} processes' if multi else ''}"
          f"{' mesh ' + str(dict(mesh.shape)) if mesh else ''}"
          f"{' pipeline, stages at layers ' + str(pipe.bounds) if pipe else ''}; HBM ceiling (hbm_bandwidth) "
          f"{bw / 1e9:.0f} GB/s per device; {cfg.name}: {n} layers, d={cfg.hidden_size}, "
          f"H={cfg.num_attention_heads}; kernels={args.kernels}", flush=True)
    t0 = time.perf_counter()
    spec = args.speculative_tokens
    params = P.init_params_device(
        cfg, args.seed, include_mtp=bool(spec),
        shardings=param_shardings(cfg, mesh, include_mtp=bool(spec)) if mesh else
        pipe.param_shardings(cfg, include_mtp=False) if pipe else None)
    if not args.unmerged:   # the decode form, as the Engine and the CLI run it
        params = P.merge_x_proj(params, cfg, consume=True)
    jax.block_until_ready(params)
    print(f"synthetic weights drawn on device in {time.perf_counter() - t0:.0f} s "
          f"({P.nbytes(cfg, include_mtp=False) / 1e9:.1f} GB)", flush=True)
    rows = []
    sweep = [(mm, B, ctx) for mm in args.matmul for B in args.batch for ctx in args.context]
    for mm, B, ctx in tqdm(sweep, desc="decode bench", unit="config", disable=len(sweep) < 2):
        fl = floor_bytes(cfg, B, ctx, mesh)
        r = bench(cfg, params, B, ctx, args.kernels, args.steps, args.seed, mm, mesh,
                  loop=args.loop, what=args.what, index_format=args.index_format,
                  pipeline=pipe, spec_k=spec)
        floor_ms = 1e3 * fl["total"] / bw
        parts = []
        for key, label in (("ms", f"model({n}L) matmul={mm}, one step at a time"),
                           ("ms_pipe", "  pipelined"),
                           ("ms_pipe_fixed", "  pipelined, inputs at fixed addresses"),
                           ("ms_stream", "  stream step (Engine.stream)"),
                           ("ms_loop", "  generate loop")):
            if key in r:
                rows.append((label, B, ctx, r[key], floor_ms, fl["total"]))
                parts.append(f"{label.strip()} {r[key]:.2f} ms ({100 * floor_ms / r[key]:.1f}% of the bandwidth floor, "
                             f"{B / r[key] * 1e3:.1f} tokens/s)")
        if spec == "dspark":
            base_key = "ms_stream" if "ms_stream" in r else "ms"
            base_ms = r.get(base_key)
            G = cfg.dspark_block_size
            print(f"DSpark (blocks of {G}, verify {G + 1} rows): {r['ms_spec']:.2f} ms/step"
                  + (f" = {r['ms_spec'] / base_ms:.2f}x the plain {base_key} step "
                     f"({base_ms:.2f} ms)" if base_ms else "")
                  + f" (one at a time: {r['ms_spec_sync']:.2f} ms); measured "
                  f"{r['tokens_per_step']:.2f} tokens/step (random drafter)", flush=True)
            rows.append((f"  DSpark step (G={G})", B, ctx, r["ms_spec"], floor_ms, fl["total"]))
            for L_ in args.accept_lengths:
                sp = f", {L_ * base_ms / r['ms_spec']:.2f}x plain" if base_ms else ""
                print(f"  at acceptance length {L_:.1f} tokens/step: "
                      f"{B * L_ / r['ms_spec'] * 1e3:.1f} tokens/s{sp}"
                      + (f" (plain {B / base_ms * 1e3:.1f})" if base_ms else ""), flush=True)
        elif spec:
            # plain: the stream step Engine.stream runs, else the step one at a time
            base_key = "ms_stream" if "ms_stream" in r else "ms"
            base_ms = r.get(base_key)
            rel = "".join(f", {r['ms_spec'] / r[key]:.2f}x the plain {key} step"
                          for key in ("ms", "ms_stream") if key in r)
            print(f"speculative k={spec}: {r['ms_spec']:.2f} ms/step{rel} (one at a time, "
                  f"waiting for each: {r['ms_spec_sync']:.2f} ms); measured "
                  f"{r['tokens_per_step']:.2f} tokens/step -> "
                  f"{B * r['tokens_per_step'] / r['ms_spec'] * 1e3:.1f} tokens/s"
                  + (f" (plain: {B / base_ms * 1e3:.1f} tokens/s)" if base_ms else ""),
                  flush=True)
            rows.append((f"  speculative step k={spec}", B, ctx, r["ms_spec"], floor_ms,
                         fl["total"]))
            for rate in args.accept_rates:
                tps = expected_tokens_per_step(spec, rate)
                sp = (f", {tps * base_ms / r['ms_spec']:.2f}x plain" if base_ms else "")
                print(f"  at draft acceptance {rate:.2f}: {tps:.2f} tokens/step -> "
                      f"{B * tps / r['ms_spec'] * 1e3:.1f} tokens/s{sp}", flush=True)
        comp = ", ".join(f"{k} {r[k]:.0f} s" for k in ("compile_s", "compile_stream_s",
                                                          "compile_spec_s") if k in r)
        for key in ("kernels", "kernels_stream", "kernels_spec"):
            if key in r:
                k = r[key]
                kinds = ", ".join(f"{kind} {v:.0f}" for kind, v in k["per_kind"].items())
                print(f"{key.replace('_', ' ')}: {k['total']} in the step; "
                      f"kernels per layer: {k['per_layer']:.1f} ({kinds})", flush=True)
        print(f"matmul={mm} B={B} ctx={ctx}: floor {floor_ms:.2f} ms ({fl['total'] / 1e9:.2f} "
              f"GB); " + "; ".join(parts) + f" (compile: {comp})", flush=True)
        if args.per_kind:
            # one layer of a kind = time([SWA, kind]) - time([SWA]) (embedding + head cancel)
            kinds = {"swa": 0, "csa": 4, "hca": 128}
            one_cfg = _layers_cfg(base, [0])
            form = (lambda p, c: p) if args.unmerged else \
                (lambda p, c: P.merge_x_proj(p, c, consume=True))
            t_one = bench(one_cfg, form(P.init_params_device(one_cfg, args.seed), one_cfg), B, ctx,
                          args.kernels, args.steps, matmul=mm, what=("step",))["ms"]
            for kind, ratio in kinds.items():
                if kind not in fl["per_kind"]:
                    continue
                kc = _layers_cfg(base, [0, ratio])
                kp = form(P.init_params_device(kc, args.seed), kc)
                t = bench(kc, kp, B, ctx, args.kernels, args.steps,
                          matmul=mm, what=("step",))["ms"] - t_one
                fb = fl["per_kind"][kind][0]
                rows.append((kind, B, ctx, t, 1e3 * fb / bw, fb))
                print(f"  {kind} layer: {t:.2f} ms, floor {1e3 * fb / bw:.3f} ms "
                      f"({fb / 1e6:.0f} MB) -> {100 * 1e3 * fb / bw / t:.1f}%", flush=True)
    print("\n| what | batch | context | ms/step | floor ms | bytes (GB) | % of floor |")
    print("|---|---|---|---|---|---|---|")
    for w, B, ctx, ms, fms, b in rows:
        print(f"| {w} | {B} | {ctx} | {ms:.2f} | {fms:.3f} | {b / 1e9:.3f} | {100 * fms / ms:.1f}% |")


def _spec_arg(v: str):
    if v == "dspark":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer or 'dspark', got {v!r}") from None


def register(sub):
    ap = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    d = ap.add_parser("decode", help="decode step vs the HBM-bandwidth floor")
    d.add_argument("--preset", default="flash")
    d.add_argument("--layers", type=int, default=0, help="first N layers (0 = all)")
    d.add_argument("--batch", type=int, nargs="+", default=[1])
    d.add_argument("--context", type=int, nargs="+", default=[4096])
    d.add_argument("--kernels", choices=["off", "on"], default="off")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--per-kind", action="store_true", help="also time one layer of each kind")
    d.add_argument("--unmerged", action="store_true",
                   help="keep each CSA block's five x-projection weights apart (the checkpoint "
                        "form) instead of the decode form params.merge_x_proj")
    d.add_argument("--index-format", choices=["fp4", "nvfp4", "fp8"], default="fp4",
                   help="cached indexer keys (the floor counts fp4's bytes)")
    d.add_argument("--what", nargs="+", choices=["step", "stream"], default=["step", "stream"],
                   help="time the plain step program (sync / pipelined) and/or the stream "
                        "step of Engine.stream (each is its own compilation)")
    d.add_argument("--speculative-tokens", "--speculative", type=_spec_arg, default=0,
                   metavar="K", help="also time the speculative step with K MTP drafts (1..3; "
                   "0 = off) against the plain step, and its tokens/s at the measured and "
                   "the --accept-rates acceptance; 'dspark': the DSpark step (a DSpark "
                   "drafter on the last 3 layers) and its tokens/s at --accept-lengths")
    d.add_argument("--accept-lengths", type=float, nargs="+", default=[2.8, 3.5, 5.0],
                   help="DSpark: mean tokens a step (accepted drafts + 1) to report tokens/s "
                        "at (published: 2.8 vLLM GSM8K, 3.5 InferenceX, ~5 SGLang)")
    d.add_argument("--accept-rates", type=float, nargs="+", default=[0.6, 0.8, 0.9],
                   help="per-draft acceptance rates to report speculative tokens/s at")
    d.add_argument("--loop", action="store_true",
                   help="also time the jitted while-loop decode of Engine.generate")
    d.add_argument("--matmul", choices=["xla", "pallas"], nargs="+", default=["xla"],
                   help="quantised linears/experts: XLA and/or the weight-streaming kernels")
    d.add_argument("--devices", type=int, default=0,
                   help="run sharded over a mesh of this many devices (0: one device)")
    d.add_argument("--expert", type=int, default=None, help="mesh expert-axis size")
    d.add_argument("--model", type=int, default=None, help="mesh model-axis size")
    d.add_argument("--data", type=int, default=None, help="mesh data-axis size")
    d.add_argument("--layout", choices=["mesh", "pipeline"], default="mesh",
                   help="with --devices: a mesh (expert / tensor / data parallel) or the "
                        "layers split across the devices (pipeline; the floor is then every "
                        "byte read once at one device's bandwidth, stage after stage)")
    d.set_defaults(fn=main)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(["bench"] + sys.argv[1:])
    a.fn(a)
