"""Compile a decode step for a GPU on a machine without one, and count its kernels.

XLA can compile for a GPU it only knows by description (a compile-only PJRT topology made
from a GpuTargetConfig, here benchmarks/gpu_specs/*.txtpb): the optimised HLO is what the
GPU run would execute, fusions, library GEMMs and Pallas kernels included. Decode at small
batch is bound by kernel count (each kernel costs ~3-4.5 us of host launch on the lent
machines, see BENCHMARKS.md), so changes that should remove kernels can be checked here
before any device time is spent. Nothing runs; there are no timings.

Needs the CUDA PJRT plugin importable (no GPU, no driver needed), e.g.

    pip install --no-deps --target /opt/jax-cuda jax-cuda12-plugin==0.11.2 \\
        jax-cuda12-pjrt==0.11.2 nvidia-cuda-nvcc-cu12
    PYTHONPATH=.:/opt/jax-cuda python benchmarks/aot_anatomy.py --preset flash --layers 4 \\
        --kernels on --matmul pallas [--batch 1] [--context 4096] [--hlo-out step.hlo]

Autotuning is off (no GPU to time candidates), so GEMM configs may differ from a GPU
compile; the kernel count does not.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the compile-only GPU needs no backend

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.step_anatomy import kernels_by_source  # noqa: E402
from dsv4_jax import config as C, layers as L, params as P  # noqa: E402
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec, init_cache  # noqa: E402
from dsv4_jax.decode import STEP_COMPILER_OPTIONS, step  # noqa: E402
from dsv4_jax.quant import Numerics  # noqa: E402

SPECS = os.path.join(os.path.dirname(__file__), "gpu_specs")


def gpu_devices(spec: str = "h100_sxm", n: int = 1):
    """Compile-only CUDA devices described by gpu_specs/<spec>.txtpb."""
    from jax.experimental import topologies
    with open(os.path.join(SPECS, spec + ".txtpb")) as fh:
        target = fh.read()
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target,
                                            topology=f"1x1x{n}")
    except Exception as e:  # noqa: BLE001 - say what is missing
        raise SystemExit(f"no compile-only CUDA topology ({type(e).__name__}: {e}); is the "
                         "jax CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt) importable? "
                         "See this script's docstring.") from e
    return topo.devices


def abstract(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)


def abstract_params(cfg, merge_x_proj: bool = False):
    """The step's parameter tree as ShapeDtypeStructs; merge_x_proj: in decode form
    (params.merge_x_proj: each CSA block's five x-projections as one weight)."""
    if merge_x_proj:
        return jax.eval_shape(lambda: P.merge_x_proj(P.init_params_device(cfg, 0), cfg))
    return jax.eval_shape(lambda: P.init_params_device(cfg, 0))


def compile_step(cfg, cs, nm, B: int, device, compiler_options=None, merge_x_proj=False):
    """-> the compiled decode step (tokens [B, 1]) for `device`, from abstract inputs."""
    sh = jax.sharding.SingleDeviceSharding(device)
    params = abstract(abstract_params(cfg, merge_x_proj), sh)
    cache = abstract(jax.eval_shape(lambda: init_cache(cfg, cs)), sh)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sh)
    args = (i32(B, 1), i32(B), i32(B), i32(B), i32(*cs_table_shape(cs)))
    f = jax.jit(functools.partial(step, cfg=cfg, cs=cs, nm=nm), donate_argnums=(1,),
                compiler_options=compiler_options or STEP_COMPILER_OPTIONS)
    with _tracing_for_gpu(device.device_kind):
        return f.lower(params, cache, *args).compile()


def compile_sharded_step(cfg, cs, nm, B: int, mesh, compiler_options=None, merge_x_proj=False):
    """-> the compiled distributed.sharded_step (tokens [B, 1]) over `mesh`."""
    from dsv4_jax.distributed import sharded_step
    S = jax.ShapeDtypeStruct
    params = abstract_params(cfg, merge_x_proj)
    cache = jax.eval_shape(lambda: init_cache(cfg, cs))
    args = (S((B, 1), jnp.int32), *(S((B,), jnp.int32),) * 3, S(cs_table_shape(cs), jnp.int32))
    step = sharded_step(cfg, cs, nm, mesh, include_mtp=False)
    f = step.form(merge_x_proj) if hasattr(step, "form") else step.jitted  # (older trees)
    with _tracing_for_gpu(mesh.devices.flat[0].device_kind):
        return f.lower(params, cache, *args).compile(compiler_options)


class _tracing_for_gpu:
    """Trace the GPU-only paths (the Sinkhorn kernel) although jax runs on the CPU, and let
    the Triton lowering, which asks the attached GPU for its model, see `device_kind`."""

    def __init__(self, device_kind):
        self.kind = device_kind

    def __enter__(self):
        from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg
        self.prev, L.ON_GPU = getattr(L, "ON_GPU", False), True   # (older trees lack it)
        reg.gpu_info_lib = _FixedGpuInfo(gpu_info, self.kind)

    def __exit__(self, *exc):
        from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg
        L.ON_GPU = self.prev
        reg.gpu_info_lib = gpu_info


class _FixedGpuInfo:
    """Stands in for jax's gpu_info module: get_gpu_info() describes `device_kind`."""

    def __init__(self, module, device_kind):
        self._m, self._kind = module, device_kind

    def __getattr__(self, name):
        return getattr(self._m, name)

    def get_gpu_info(self):
        version = self._m.gpu_version_from_device_kind(self._kind)
        if version is None:
            raise SystemExit(f"jax's Triton lowering does not know the GPU {self._kind!r}")
        return self._m.get_gpu_info_from_version(version)


def cs_table_shape(cs):
    return cs.max_requests, cs.max_blocks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4, help="the preset's first N layers")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kernels", default="on", choices=["off", "on"])
    ap.add_argument("--matmul", default="pallas", choices=["xla", "pallas"])
    ap.add_argument("--spec", default="h100_sxm", help="gpu_specs/<name>.txtpb")
    ap.add_argument("--devices", type=int, default=1,
                    help="compile distributed.sharded_step for this many GPUs (an expert mesh)")
    ap.add_argument("--expert", type=int, default=None, help="mesh expert-axis size")
    ap.add_argument("--merge-x-proj", action="store_true",
                    help="the parameters in decode form (params.merge_x_proj): each CSA "
                         "block's five x-projection weights stored as one")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--hlo-out", help="write the optimised HLO here")
    ap.add_argument("--xla-opt", action="append", default=[], metavar="NAME=VALUE",
                    help="an XLA compiler option on top of decode.STEP_COMPILER_OPTIONS "
                         "(repeatable), e.g. xla_gpu_dot_merger_threshold_mb=0")
    a = ap.parse_args(argv)
    cfg = C.get_preset(a.preset)
    n = a.layers
    cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                      num_hash_layers=min(cfg.num_hash_layers, n))
    nm = Numerics(True, "bfloat16", matmul=a.matmul)
    mb = -(-(a.context + 40) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=a.batch, num_blocks=a.batch * mb,
                                max_blocks=mb, kernels=a.kernels)
    devs = gpu_devices(a.spec, a.devices)
    t0 = time.perf_counter()
    opts = dict(STEP_COMPILER_OPTIONS)
    for kv in a.xla_opt:
        k, _, v = kv.partition("=")
        opts[k] = {"true": True, "false": False}.get(v.lower(), v)
    if a.devices > 1:
        from dsv4_jax.distributed import make_mesh
        mesh = make_mesh(a.devices, expert=a.expert, devices=devs)
        compiled = compile_sharded_step(cfg, cs, nm, a.batch, mesh, opts, a.merge_x_proj)
    else:
        compiled = compile_step(cfg, cs, nm, a.batch, devs[0], opts, a.merge_x_proj)
    hlo = compiled.as_text()
    k, src = kernels_by_source(hlo)
    print(f"{a.devices} x {a.spec} (compile only, {time.perf_counter() - t0:.0f} s): {a.preset} layers "
          f"{cfg.compress_ratios[:-1]} B={a.batch} kernels={a.kernels} matmul={a.matmul}: "
          f"{k} kernels in the step" + (f" (options {a.xla_opt})" if a.xla_opt else "")
          + (" (x-projections merged)" if a.merge_x_proj else ""))
    for name, v in src.most_common(a.top):
        print(f"  {v:4d}  {name}")
    if a.hlo_out:
        with open(a.hlo_out, "w") as fh:
            fh.write(hlo)


if __name__ == "__main__":
    main()
