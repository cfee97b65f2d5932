"""Where the stream step's time goes, against the plain step (GPU; --devices N: sharded):

    PYTHONPATH=. python3 benchmarks/stream_diag.py --layers 10 --batch 1 [--devices 2 --expert 2]

Same cache and weights; per step, median host enqueue (how long the call takes to return:
a CUDA-graph update shows here) and ms/step of 20 steps for:
  stream_read   the stream step, each step's tokens copied into a fresh device array and
                read back one step behind (Engine.stream until 2026-11-23)
  stream_noread the same, 20 enqueued back to back, one wait
  old_stream    the plain step + a sampling program, tokens read back one step behind
                (Engine.stream before the stream step)
  step_fixed    the plain step, inputs at fixed addresses, one wait
  stream_read_pinned  stream_read with the tokens copied into pinned host memory by the
                copy program (no device allocation between steps): Engine.stream now
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode_bench import random_cache
from dsv4_jax import config as C, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec
from dsv4_jax.decode import compiled_step, compiled_stream_step, init_stream_state, read_tokens
from dsv4_jax.generate import Greedy
from dsv4_jax.quant import Numerics


MODES = ("stream_read", "stream_noread", "old_stream", "step_fixed", "stream_read_pinned")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernels", default="on")
    ap.add_argument("--matmul", default="pallas")
    ap.add_argument("--only", nargs="+", choices=MODES, default=list(MODES),
                    help="run only these modes (e.g. one per process, to attribute XLA's logs)")
    ap.add_argument("--devices", type=int, default=0, help="run sharded over N devices")
    ap.add_argument("--expert", type=int, default=None, help="mesh expert-axis size")
    a = ap.parse_args(argv)
    cache_dir = os.environ.get("DSV4_COMPILE_CACHE", os.path.expanduser("~/.cache/dsv4-jax/xla"))
    if cache_dir != "off":
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    cfg = C.get_preset(a.preset)
    n = a.layers
    cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                      num_hash_layers=min(cfg.num_hash_layers, n))
    nm = Numerics(True, "bfloat16", matmul=a.matmul)
    B, ctx, S = a.batch, a.context, a.steps
    mb = -(-(ctx + 6 * S + 8) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb,
                                kernels=a.kernels)
    mesh = rep = None
    if a.devices:   # sharded as `dsv4 bench decode --devices`: inputs placed on the mesh once
        from dsv4_jax.distributed import (make_mesh, param_shardings, shard_cache,
                                          sharded_step, sharded_stream_step)
        mesh = make_mesh(a.devices, expert=a.expert)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.block_until_ready(P.init_params_device(
        cfg, 0, shardings=param_shardings(cfg, mesh, include_mtp=False) if mesh else None))
    cache = random_cache(cfg, cs, B, ctx, jax.random.key(0))
    table = jnp.arange(B * mb, dtype=jnp.int32).reshape(B, mb)
    toks = jnp.ones((B, 1), jnp.int32)
    slots, one, pos = (jnp.arange(B, dtype=jnp.int32), jnp.ones(B, jnp.int32),
                       jnp.full(B, ctx, jnp.int32))
    if mesh is None:
        step, prog = compiled_step(cfg, cs, nm), compiled_stream_step(cfg, cs, nm, Greedy())
    else:
        cache = shard_cache(cache, cfg, cs, mesh)
        toks, slots, one, pos, table = (jax.device_put(x, rep)
                                        for x in (toks, slots, one, pos, table))
        step = sharded_step(cfg, cs, nm, mesh, include_mtp=False)
        prog = sharded_stream_step(cfg, cs, nm, mesh, Greedy(), include_mtp=False)
    pick = jax.jit(lambda lg, k: Greedy().get_next_tokens(lg, k)[:, None])
    key = jax.random.key(0)
    t0 = time.perf_counter()
    if {"old_stream", "step_fixed"} & set(a.only):   # compile only the programs used
        lg, cache = step(params, cache, toks, slots, pos, one, table)
        np.asarray(pick(lg, key))
    st = init_stream_state(toks[:, 0], pos, one, table, key, sharding=rep)
    if {"stream_read", "stream_noread", "stream_read_pinned"} & set(a.only):
        cache, st = prog(params, cache, st)
        np.asarray(read_tokens(st))
    print(f"{jax.devices()[0].device_kind}: {n} layers B={B} ctx={ctx}; compiled in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    def run(name, one_step, read):
        nonlocal cache, st
        enq, prev = [], None
        t0 = time.perf_counter()
        for i in range(S):
            t1 = time.perf_counter()
            out = one_step(i)
            enq.append(time.perf_counter() - t1)
            if read:
                if prev is not None:
                    np.asarray(prev)
                prev = out
            else:
                prev = out
        np.asarray(prev) if read else jax.block_until_ready(prev)
        ms = 1e3 * (time.perf_counter() - t0) / S
        print(f"{name:14s} {ms:.3f} ms/step, host enqueue of the step {1e3 * np.median(enq[2:]):.3f} ms",
              flush=True)

    read_device = jax.jit(lambda s: s["tok"][:, 0])   # a fresh device array per step

    def stream_step(i):
        nonlocal cache, st
        cache, st = prog(params, cache, st)
        nxt = read_device(st)
        nxt.copy_to_host_async()   # as Engine.stream was
        return nxt

    def stream_step_pinned(i):   # as Engine.stream: decode.read_tokens, pinned host memory
        nonlocal cache, st
        cache, st = prog(params, cache, st)
        return read_tokens(st)

    def old_step(i):
        nonlocal cache
        lg, cache = step(params, cache, toks, slots, pos, one, table)
        return pick(lg, key)

    def fixed_step(i):
        nonlocal cache
        lg, cache = step(params, cache, toks, slots, pos, one, table)
        return lg

    runs = {"stream_read": (stream_step, True), "stream_noread": (stream_step, False),
            "old_stream": (old_step, True), "step_fixed": (fixed_step, False),
            "stream_read_pinned": (stream_step_pinned, True)}
    for rep in range(2):
        for name in MODES:
            if name in a.only:
                run(name, *runs[name])


if __name__ == "__main__":
    main()
