"""Host cost of launching one XLA GPU program per kernel it holds, and what changes it.

The whole-Flash decode step on 2 x H200 spends more host time enqueueing its ~4300 kernels
(19.3 ms) than the GPUs take to run them (11.5 ms); the profiles put that time inside
cuGraphLaunch (1 SWA layer: 393 us for 140 kernels). This isolates the question from the
model: a chain of N small reduction kernels (one kernel each, counted in the optimised HLO)
in one jitted program, timed as

  enqueue   : host time until the call returns (the launch), median
  sync      : launch + wait, median
  pipelined : N_CALLS calls back to back, one wait, per call

for two ways of handing back the output (and, --kinds mosaic, for a chain of Pallas
Mosaic-GPU kernels, custom calls like the project's cache and matmul kernels):
  fresh   : the output is a new buffer every call (what the decode step does with its
            logits): its address alternates, which may make XLA update the CUDA graph;
  donated : the previous output is donated and reused (same address every call).

Run it once per XLA setting, each in a fresh process (the flags are read at start-up):

    PYTHONPATH=. python3 benchmarks/graph_launch.py
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED PYTHONPATH=. python3 ...
    XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python3 ...   (graphs off)

Prints one JSON line per (N, mode). On the CPU it runs (as a smoke test) but says nothing
about GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_anatomy import kernels_by_source


def chain(x, n: int):
    """n dependent row reductions on x [R, C] f32, one kernel each on the GPU: an
    optimization barrier after each step keeps XLA from fusing them (without it, the GPU
    compile fused the whole chain into one kernel)."""
    for i in range(n):
        r = jnp.max(x, axis=1, keepdims=True) if i % 2 else jnp.sum(x, axis=1, keepdims=True)
        x = jax.lax.optimization_barrier(x * 0.999 + r * 1e-4)
    return x


def _mosaic_scale(x):
    """x * 0.999 + 1e-4 as one Pallas Mosaic-GPU kernel (the whole [R, C] block in SMEM);
    the CPU runs it in the Mosaic-GPU interpreter."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_g, o_g, x_s, bar):
        plgpu.copy_gmem_to_smem(x_g, x_s, bar)
        plgpu.barrier_wait(bar)
        x_s[...] = x_s[...] * 0.999 + 1e-4
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, o_g)
        plgpu.wait_smem_to_gmem(0)
    interp = None if jax.default_backend() == "gpu" else plgpu.InterpretGPUParams()
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_types=[plgpu.SMEM(x.shape, x.dtype),
                                       plgpu.Barrier(num_arrivals=1)],
                        interpret=interp)(x)


def chain_mosaic(x, n: int):
    """n dependent Mosaic-GPU kernels (a custom call each, as the project's cache and
    matmul kernels are): does a Mosaic kernel cost the host more per launch / per graph
    update than an XLA fusion?"""
    for _ in range(n):
        x = _mosaic_scale(x)
    return x


def measure(n: int, mode: str, calls: int, shape=(64, 256), kind: str = "xla"):
    x = jax.random.normal(jax.random.key(n), shape, jnp.float32)
    body = chain if kind == "xla" else chain_mosaic
    if mode == "fresh":
        f = jax.jit(lambda x: body(x, n))
        args = lambda prev: (x,)
    else:   # the previous output goes back in, donated: XLA writes the new one over it
        f = jax.jit(lambda x, out: body(x, n) + 0.0 * out, donate_argnums=(1,))
        args = lambda prev: (x, prev)
    prev = jnp.zeros(shape, jnp.float32) + 1.0
    t0 = time.perf_counter()
    compiled = f.lower(*args(prev)).compile()
    compile_s = time.perf_counter() - t0
    kernels, _ = kernels_by_source(compiled.as_text())
    enq, sync = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        y = compiled(*args(prev))
        enq.append(time.perf_counter() - t0)
        y.block_until_ready()
        sync.append(time.perf_counter() - t0)
        prev = y
    t0 = time.perf_counter()
    for _ in range(calls):
        prev = compiled(*args(prev))
    prev.block_until_ready()
    pipe = (time.perf_counter() - t0) / calls
    med = lambda v: float(np.median(v[2:]))
    us = lambda s: round(1e6 * s, 1)
    return dict(n=n, kind=kind, mode=mode, kernels=kernels, compile_s=round(compile_s, 1),
                enqueue_us=us(med(enq)), sync_us=us(med(sync)), pipelined_us=us(pipe),
                enqueue_us_per_kernel=round(1e6 * med(enq) / max(kernels, 1), 2),
                pipelined_us_per_kernel=round(1e6 * pipe / max(kernels, 1), 2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--modes", nargs="+", default=["fresh", "donated"],
                    choices=["fresh", "donated"])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--kinds", nargs="+", default=["xla"], choices=["xla", "mosaic"],
                    help="chain of XLA reduction kernels and/or of Pallas Mosaic-GPU kernels")
    a = ap.parse_args(argv)
    dev = jax.devices()[0]
    head = dict(device=dev.device_kind, platform=dev.platform,
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(json.dumps(head), flush=True)
    for kind in a.kinds:
        for n in a.n:
            for mode in a.modes:
                print(json.dumps(measure(n, mode, a.calls, kind=kind)), flush=True)


if __name__ == "__main__":
    main()
