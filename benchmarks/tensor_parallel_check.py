"""The tensor layout on N GPUs against one GPU, kernels on: the same greedy tokens and
logits, and the decode step's time in both layouts, in one run.

    PYTHONPATH=. python3 -m benchmarks.tensor_parallel_check [--devices 2] [--layers 4]
        [--steps 32] [--context 1024] [--iters 50]

Random Flash-width layers (the preset's first --layers, drawn on the device), B = 1, the
trained numerics with every kernel on (CacheSpec.kernels "on", Numerics.matmul "pallas").
Prints one line per check and a summary: tokens equal over --steps greedy steps, the
largest logit difference relative to the largest logit (FP8 activation simulation makes a
reordered sum a different rounding, so a few 1e-2 is rounding here), and ms per decode
step for one GPU and for the tensor layout, plus the psum of one layer's 8 KB alone.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dsv4_jax import config as C, distributed as DI, params as PR
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec
from dsv4_jax.quant import Numerics
from dsv4_jax.runner import ModelRunner


def _decode(runner, first, pos0, steps):
    """Greedy decode of slot 0 from token `first` at pos0 -> (tokens [steps], logits)."""
    cur, out, lg = np.asarray([first], np.int32), [], []
    for t in range(steps):
        logits = np.asarray(runner.run_step(cur[:, None], [0], [pos0 + t], [1]), np.float32)
        lg.append(logits)
        cur = logits.argmax(-1).astype(np.int32)
        out.append(int(cur[0]))
    return np.asarray(out), np.stack(lg)


def _time_steps(runner, pos0, iters):
    """ms per decode step (slot 0, fixed token), enqueued back to back, waited at the end."""
    tok = jnp.zeros((1, 1), jnp.int32)
    for i in range(3):   # warm
        runner.run_step(tok, [0], [pos0 + i], [1])
    jax.block_until_ready(runner.cache)
    t0 = time.perf_counter()
    for i in range(iters):
        runner.run_step(tok, [0], [pos0 + 3 + i], [1])
    jax.block_until_ready(runner.cache)
    return (time.perf_counter() - t0) / iters * 1e3


def _time_psum(mesh, iters):
    """ms for one psum of a bf16 [1, 1, 4096] (a layer's attention output) alone."""
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "model"), mesh=mesh, in_specs=P(),
                              out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.ones((1, 1, 4096), jnp.bfloat16),
                       jax.sharding.NamedSharding(mesh, P()))
    for _ in range(3):
        x = f(x)
    jax.block_until_ready(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        x = f(x)
    jax.block_until_ready(x)
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    if len(jax.devices()) < a.devices:
        raise SystemExit(f"needs {a.devices} GPUs, found {len(jax.devices())}")
    cfg = C.flash()
    n = a.layers
    cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                      num_hash_layers=min(cfg.num_hash_layers, n))
    nm = Numerics(True, "bfloat16", matmul="pallas")
    mb = -(-(a.context + a.steps + a.iters + 64) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=1, num_blocks=mb, max_blocks=mb,
                                kernels="on")
    params = jax.device_get(PR.merge_x_proj(PR.init_params_device(cfg, 0), cfg))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, a.context).astype(np.int32)
    chunk = 512
    mesh = DI.make_tensor_mesh(a.devices)
    res = {}
    for name, m in (("1 GPU", None), (f"tensor x{a.devices}", mesh)):
        r = ModelRunner(cfg, params, numerics=nm, cache_spec=cs, chunk=chunk, mesh=m)
        r.bm.admit(a.context)
        r.bm.ensure(0, a.context + a.steps + a.iters + 8)
        for s in range(0, a.context, chunk):     # prefill through the layout's own chunks
            c = prompt[s:s + chunk]
            buf = np.zeros((1, chunk), np.int32)
            buf[0, :len(c)] = c
            last = r.run_step(buf, [0], [s], [len(c)])
        first = int(np.asarray(last).argmax(-1)[0])
        toks, lg = _decode(r, first, a.context, a.steps)
        ms = _time_steps(r, a.context + a.steps, a.iters)
        res[name] = (toks, lg, ms)
        print(f"{name}: first tokens {toks[:8].tolist()}, {ms:.3f} ms / decode step", flush=True)
        del r
    (t1, l1, ms1), (t2, l2, ms2) = res.values()
    rel = float(np.abs(l1 - l2).max() / np.abs(l1).max())
    same = int((t1 == t2).sum())
    psum = _time_psum(mesh, a.iters)
    print(f"SUMMARY flash {n} layers, B=1, context {a.context}: greedy tokens equal "
          f"{same}/{a.steps}, logits rel diff {rel:.2e}; 1 GPU {ms1:.3f} ms/step, tensor x"
          f"{a.devices} {ms2:.3f} ms/step ({ms1 / ms2:.2f}x); one 8 KB psum alone "
          f"{psum * 1e3:.1f} us; {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()
