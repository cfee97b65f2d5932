"""The tensor layout's all-reduce at batch 1 on N GPUs: XLA's (NCCL) outside and inside the
CUDA graphs against the one-shot Mosaic kernel (pallas_kernels/allreduce_oneshot), in one
run: the kernel's sums against the reference, and microseconds per all-reduce.

    PYTHONPATH=. python3 -m benchmarks.allreduce_check [--devices 2] [--rows 32]
        [--chain 86] [--iters 20]
    PYTHONPATH=.:/opt/jax-cuda python3 -m benchmarks.allreduce_check --compile-only [--spec h200]

--compile-only (no GPU: described GPUs, as benchmarks.kernel_count) compiles the three
chains and prints their kernels and collectives instead.

Each program is a chain of --chain all-reduces of a bf16 [rows, 128] (32 rows: a layer's
8 KB; 86 = two a layer of Flash's 43), each fed by the last (times 1/n, so the values stay
put), as they sit in a decode step; time per all-reduce = program time / chain.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv4_jax.decode import STEP_COMPILER_OPTIONS
from dsv4_jax.distributed import make_tensor_mesh
from pallas_kernels.allreduce_oneshot import all_reduce_oneshot
from pallas_kernels.allreduce_oneshot.reference import all_reduce_reference

# the CUDA graphs' commands with collectives (off by default in jax 0.11.2's XLA)
GRAPH_COLLECTIVES = {"xla_gpu_enable_command_buffer":
                     "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"}


def _chain(reduce, n, chain):
    def body(x):
        for _ in range(chain):
            x = (reduce(x) * (1.0 / n)).astype(x.dtype)
        return x
    return body


def _time(f, x, iters):
    y = f(x)
    jax.block_until_ready(y)
    t0 = time.perf_counter()
    for _ in range(iters):
        y = f(y)
    jax.block_until_ready(y)
    return (time.perf_counter() - t0) / iters


def compile_only(a):
    from benchmarks.common import kernels_by_source
    from benchmarks.kernel_count import _compile, gpu_devices
    jax.config.update("jax_platforms", "cpu")
    devs = gpu_devices(a.spec, a.devices)
    jax.config.update("jax_default_device", devs[0])   # Mosaic reads the arch from it
    mesh = make_tensor_mesh(a.devices, devices=devs)
    n = a.devices
    x = jax.ShapeDtypeStruct((n * a.rows, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("model")))
    for name, r in (("XLA psum", lambda v: jax.lax.psum(v, "model")),
                    ("one-shot", lambda v: all_reduce_oneshot(v, axis_name="model", n=n))):
        f = jax.jit(jax.shard_map(_chain(r, n, a.chain), mesh=mesh, in_specs=P("model"),
                                  out_specs=P("model"), check_vma=False))
        hlo = _compile(f, (x,), devs[0].device_kind, dict(STEP_COMPILER_OPTIONS)).as_text()
        total, src = kernels_by_source(hlo)
        coll = sum(hlo.count(k) for k in (" all-reduce(", " all-reduce-start("))
        print(f"{name}: chain of {a.chain}: {total} kernels, {coll} XLA all-reduces; "
              f"{dict(src.most_common(4))}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--chain", type=int, default=86)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--spec", default="h200", help="with --compile-only: gpu_specs/<name>")
    a = ap.parse_args(argv)
    n = a.devices
    if a.compile_only:
        return compile_only(a)
    mesh = make_tensor_mesh(n)
    sh = NamedSharding(mesh, P("model"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n * a.rows, 128), jnp.bfloat16),
                       sh)

    def prog(reduce, chain, options):
        f = jax.shard_map(_chain(reduce, n, chain), mesh=mesh, in_specs=P("model"),
                          out_specs=P("model"), check_vma=False)
        return jax.jit(f, compiler_options={**STEP_COMPILER_OPTIONS, **options})

    psum = lambda v: jax.lax.psum(v, "model")
    one = lambda v: all_reduce_oneshot(v, axis_name="model", n=n)
    ref = lambda v: all_reduce_reference(v, axis_name="model", n=n)
    # correctness: one all-reduce, and the whole chain, against the reference
    got1, want1 = (np.asarray(prog(r, 1, {})(x), np.float32) for r in (one, ref))
    gotc, wantc = (np.asarray(prog(r, a.chain, {})(x), np.float32) for r in (one, ref))
    err1 = float(np.abs(got1 - want1).max())
    errc = float(np.abs(gotc - wantc).max() / np.abs(wantc).max())
    print(f"one-shot vs reference: one all-reduce max abs diff {err1:.3g} (same order of "
          f"f32 sums: 0 expected), chain of {a.chain} rel {errc:.3g}", flush=True)
    res = {}
    for name, r, opt in (("XLA psum, outside the graphs", psum, {}),
                         ("XLA psum, inside the graphs", psum, GRAPH_COLLECTIVES),
                         ("one-shot Mosaic kernel", one, {})):
        res[name] = _time(prog(r, a.chain, opt), x, a.iters) / a.chain * 1e6
        print(f"{name}: {res[name]:.1f} us per all-reduce", flush=True)
    print("SUMMARY " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items())
          + f"; {n} x {jax.devices()[0].device_kind}, bf16 [{a.rows}, 128]; one-shot sums "
          f"{'match' if err1 == 0 else 'DIFFER'}")


if __name__ == "__main__":
    main()
