"""Decode step with the Pallas kernels vs the pure-JAX step, on identical cache states.

    PYTHONPATH=. python benchmarks/decode_kernels_check.py [--interpret] [--preset tiny]
        [--devices 2 --expert 2]

Prefills requests with the pure-JAX path, copies the cache, then runs the same decode steps
with kernels off and on (or interpreted on CPU) and compares the logits. With --devices the
tested side runs sharded (dsv4_jax.distributed.sharded_step on that mesh); the reference
stays single-device."""
import argparse
import copy
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import config, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics


def run(cfg, params, B, ctx, steps, kernels, chunk=128, seed=0, timing=False,
        random_cache=False, matmul="xla", act_quant=True, mesh=None, per_row=False,
        index_format="fp4"):
    """Pure-JAX step vs the step with cache kernels `kernels` ("on" | "interpret" | "off")
    and quantised matmuls `matmul` ("xla" | "pallas" | "interpret"), sharded over `mesh`
    when given."""
    nm = Numerics(act_quant=act_quant, dtype="bfloat16")
    mb = -(-(ctx + steps + 1) // 128)
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb,
                                **({"index_format": index_format} if act_quant else {}))
    base = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=chunk)
    rng = np.random.default_rng(seed)
    if random_cache:  # valid random FP8/FP4 contents at `ctx` tokens (full width: no prefill)
        from benchmarks.decode_bench import random_cache as rc
        base.cache = rc(cfg, cs, B, ctx, jax.random.key(seed))
        slots = [base.bm.admit(ctx) for _ in range(B)]
        for s in slots:
            base.bm.ensure(s, ctx)
            base.bm.advance(s, ctx)
    else:
        lens = [ctx - 7 * b for b in range(B)]  # requests at different positions
        slots = [base.bm.admit(n) for n in lens]
        for s, n in zip(slots, lens):
            base.prefill(s, rng.integers(0, cfg.vocab_size, n))
    feed = rng.integers(0, cfg.vocab_size, (steps, B))
    out = {}
    for side, mode, mm, m in (("ref", "off", "xla", None), ("test", kernels, matmul, mesh)):
        ecs = dataclasses.replace(cs, kernels=mode)
        eng = Engine(cfg, params, numerics=dataclasses.replace(nm, matmul=mm), cache_spec=ecs,
                     prefill_chunk=chunk, mesh=m)
        eng.cache = jax.tree.map(jnp.copy, base.cache)
        if m is not None:
            from dsv4_jax.distributed import shard_cache
            eng.cache = shard_cache(eng.cache, cfg, ecs, m)
        eng.bm = copy.deepcopy(base.bm)
        lg, times = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            l = eng.decode({s: int(feed[i, j]) for j, s in enumerate(slots)})
            l.block_until_ready()
            times.append(time.perf_counter() - t0)
            lg.append(np.asarray(l, np.float32))
        out[side] = (np.stack(lg), times)
    a, b = out["ref"][0], out["test"][0]
    err = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)
    res = dict(B=B, ctx=ctx, median_rel=float(np.median(err)), max_rel=float(err.max()),
               argmax_agree=float((a.argmax(-1) == b.argmax(-1)).mean()))
    if per_row:  # (steps, B) rel. L2 of each row: which requests / steps differ
        res["rows"] = np.array2string(err, precision=4, max_line_width=200)
    if timing:
        res["ms_off"] = 1e3 * float(np.median(out["ref"][1][1:]))
        res["ms_kernels"] = 1e3 * float(np.median(out["test"][1][1:]))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[2])
    ap.add_argument("--context", type=int, nargs="+", default=[140])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--random-cache", action="store_true")
    ap.add_argument("--kernels", choices=["on", "off"], default="on",
                    help="cache kernels of the tested side")
    ap.add_argument("--matmul", choices=["xla", "pallas"], default="xla",
                    help="quantised matmuls of the tested side")
    ap.add_argument("--combo", nargs="+", default=None, metavar="KERNELS:MATMUL",
                    help="tested sides to run in turn, e.g. off:pallas on:xla on:pallas "
                         "(overrides --kernels/--matmul; which part makes a difference)")
    ap.add_argument("--index-format", choices=["fp4", "nvfp4", "fp8"], default="fp4",
                    help="cached indexer keys (with act_quant on)")
    ap.add_argument("--per-row", action="store_true",
                    help="print the rel. L2 of every (step, request) row")
    ap.add_argument("--devices", type=int, default=0,
                    help="run the tested side sharded over this many devices")
    ap.add_argument("--expert", type=int, default=None, help="mesh expert axis size")
    ap.add_argument("--act-quant", choices=["on", "off"], nargs="+", default=["on"],
                    help="off: bf16 without the FP8 activation simulation (whose rounding "
                         "amplifies summation-order differences to ~5-10%%)")
    a = ap.parse_args()
    cfg = config.get_preset(a.preset)
    if a.preset != "tiny":
        n = a.layers
        cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                          num_hash_layers=min(cfg.num_hash_layers, n))
        params = P.init_params_device(cfg, 0)
    else:
        params = P.init_params(cfg, 0)
    mesh = None
    if a.devices:
        from dsv4_jax.distributed import make_mesh
        mesh = make_mesh(a.devices, expert=a.expert)
    combos = [c.split(":") for c in a.combo] if a.combo else [(a.kernels, a.matmul)]
    for aq, B, ctx, (k, m) in itertools.product(a.act_quant, a.batch, a.context, combos):
        kern = k if k == "off" or not a.interpret else "interpret"
        mm = "interpret" if a.interpret and m != "xla" else m
        r = run(cfg, params, B, ctx, a.steps, kern, chunk=a.chunk, timing=not a.interpret,
                random_cache=a.random_cache, matmul=mm, act_quant=aq == "on", mesh=mesh,
                per_row=a.per_row, index_format=a.index_format)
        print(f"{cfg.name} L={cfg.num_hidden_layers} kernels={kern} matmul={mm} "
              f"index={a.index_format if aq == 'on' else 'raw'} "
              f"devices={a.devices or 1} "
              f"act_quant={aq} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                            f"{k}={v}" for k, v in r.items()), flush=True)
