"""Compile a decode step for a described GPU on a machine without one, and count its kernels.

    PYTHONPATH=.:/opt/jax-cuda python -m benchmarks.kernel_count --preset flash --layers 4 --batch 1
        [--context 4096] [--kernels on|off] [--matmul pallas|xla] [--spec h200|h100_sxm|b200]
        [--devices 2 --expert 2 | --devices 2 --model 2] [--top 25] [--hlo-out step.hlo]

--model N (= --devices) compiles the tensor layout's step (heads and expert columns split N
ways, the kernels on) and also counts its collectives per layer.

--spec b200 compiles for a described B200 (sm_100a): the kernel packages then take their
Blackwell variants (docs/KERNELS.md). XLA compiles for a GPU it knows only by description: a compile-only PJRT topology made from
a GpuTargetConfig (benchmarks/gpu_specs/<spec>.txtpb, which carries the CUDA versions XLA
needs to put custom calls into CUDA graphs). The optimised HLO is what the GPU would run:
fusions, library GEMMs and the Pallas kernels. At batch 1 a step's GPU time follows its
kernel count (~1.5-2 us a kernel however little it does), so a change meant to remove
kernels is checked here before any GPU time is spent. Nothing runs; there are no timings.

Prints the kernels of the step by source op, the CUDA graphs XLA formed (from its thunk
sequence) and, last, `kernels per layer: N` (the kernels whose op name carries a layer,
divided by the number of layers).

Needs the CUDA PJRT plugin importable (no GPU, no driver), e.g.

    pip install --no-deps --target /opt/jax-cuda jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2

Autotuning is off (no GPU to time candidates), so GEMM tilings may differ from a GPU
compile; the kernel count does not.
"""
from __future__ import annotations

import os
import argparse
import glob
import re
import tempfile
import time
from collections import Counter

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from benchmarks.common import kernels_by_layer, kernels_by_source, op_sources
from dsv4_jax import config as C, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec, init_cache
from dsv4_jax.decode import STEP_COMPILER_OPTIONS
from dsv4_jax.distributed import make_mesh, make_tensor_mesh, tensor_shardings
from dsv4_jax.programs import Layout, split, step_program
from dsv4_jax.quant import Numerics

SPECS = os.path.join(os.path.dirname(__file__), "gpu_specs")


def gpu_devices(spec: str = "h100_sxm", n: int = 1):
    """n compile-only CUDA devices described by gpu_specs/<spec>.txtpb."""
    with open(os.path.join(SPECS, spec + ".txtpb")) as fh:
        target = fh.read()
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target,
                                            topology=f"1x1x{n}")
    except Exception as e:  # noqa: BLE001 - say what is missing
        raise SystemExit(f"no compile-only CUDA topology ({type(e).__name__}: {e}); is the "
                         "jax CUDA plugin (jax-cuda13-plugin, jax-cuda13-pjrt) importable? "
                         "See benchmarks/kernel_count.py's docstring.") from e
    return topo.devices


def graph_summary(thunk_text: str) -> dict:
    """From XLA's `*.thunk_sequence_after_thunk_passes.txt`: how many CUDA graphs (command
    buffers) the step runs, the commands inside them, and the top-level thunks outside
    any graph by kind."""
    graphs = commands = 0
    outside = Counter()
    for line in thunk_text.splitlines():
        m = re.match(r"(\s*)\d+: (k\w+)", line)
        if not m:
            continue
        if m.group(1):
            commands += 1
        elif m.group(2) == "kCommandBuffer":
            graphs += 1
        else:
            outside[m.group(2)] += 1
    return {"graphs": graphs, "commands": commands, "outside": outside}


class _FixedGpuInfo:
    """Stands in for jax's Triton gpu_info module: get_gpu_info() describes `device_kind`
    (the Triton lowering asks the attached GPU for its model; there is none)."""

    def __init__(self, module, device_kind):
        self._m, self._kind = module, device_kind

    def __getattr__(self, name):
        return getattr(self._m, name)

    def get_gpu_info(self):
        version = self._m.gpu_version_from_device_kind(self._kind)
        if version is None:
            raise SystemExit(f"jax's Triton lowering does not know the GPU {self._kind!r}")
        return self._m.get_gpu_info_from_version(version)


def _compile(f, args, device_kind: str, options: dict):
    """f.lower(*args).compile(options), with the Triton lowering told the GPU's model."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg
    reg.gpu_info_lib = _FixedGpuInfo(gpu_info, device_kind)
    try:
        return f.lower(*args).compile(options)
    finally:
        reg.gpu_info_lib = gpu_info


def _abstract(tree, sharding=None):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)


def compile_step(cfg, cs: CacheSpec, nm: Numerics, B: int, devices, expert=None,
                 options=None, model=None):
    """-> the compiled decode step (tokens [B, 1], parameters in decode form as the Engine
    runs them) for the compile-only `devices`: one device the plain step, more the
    sharded step over an expert mesh, or with `model` the tensor layout's step."""
    params = jax.eval_shape(lambda: P.merge_x_proj(P.init_params_device(cfg, 0), cfg))
    cache = jax.eval_shape(lambda: init_cache(cfg, cs))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    args = (i32(B, 1), i32(B), i32(B), i32(B), i32(cs.max_requests, cs.max_blocks))
    opts = dict(STEP_COMPILER_OPTIONS, **(options or {}))
    if model:
        mesh = make_tensor_mesh(len(devices), devices=devices)
        lay = Layout(cfg, mesh=mesh)
        params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              params, tensor_shardings(params, mesh))
        cache, args = _abstract((cache, args), lay.replicated())
    elif len(devices) > 1:
        lay = Layout.of(cfg, params, make_mesh(len(devices), expert=expert, devices=devices))
    else:
        lay = Layout(cfg)
        params, cache, args = _abstract((params, cache, args),
                                        jax.sharding.SingleDeviceSharding(devices[0]))
    graphdef, state = split(cfg, params)
    f = step_program(lay, graphdef, cs, nm)
    return _compile(f, (state, cache, *args), devices[0].device_kind, opts)


COLLECTIVE_OPS = ("all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                  "reduce-scatter", "all-to-all", "collective-permute",
                  "collective-permute-start")


def collectives_by_layer(hlo_text: str) -> Counter:
    """Counter: layer index (None: outside the layers) -> collectives of the step's ENTRY
    (an async pair counts once, by its start)."""
    out = Counter()
    for op, _, op_name in op_sources(hlo_text).values():
        if op in COLLECTIVE_OPS:
            m = re.search(r"(?:^|/)layer(\d+)_", op_name)
            out[int(m.group(1)) if m else None] += 1
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4, help="the preset's first N layers")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kernels", default="on", choices=["off", "on"],
                    help="the cache / attention / indexer kernels")
    ap.add_argument("--matmul", default="pallas", choices=["xla", "pallas"],
                    help="quantised linears and experts: the weight-streaming kernels or XLA")
    ap.add_argument("--spec", default="h200", help="benchmarks/gpu_specs/<name>.txtpb")
    ap.add_argument("--devices", type=int, default=1,
                    help="compile the sharded step for this many GPUs")
    ap.add_argument("--expert", type=int, default=None, help="mesh expert-axis size")
    ap.add_argument("--model", type=int, default=None,
                    help="the tensor layout over --devices GPUs (must equal --devices)")
    ap.add_argument("--top", type=int, default=25, help="list this many kernel sources")
    ap.add_argument("--hlo-out", help="write the optimised HLO here")
    a = ap.parse_args(argv)
    if a.model and (a.model != a.devices or a.expert):
        ap.error("--model N compiles the tensor layout over all N = --devices GPUs (no --expert)")
    jax.config.update("jax_platforms", "cpu")   # the compile-only GPU needs no GPU backend
    cfg = C.get_preset(a.preset)
    n = a.layers
    cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                      num_hash_layers=min(cfg.num_hash_layers, n))
    nm = Numerics(True, "bfloat16", matmul=a.matmul, gpu=True)
    mb = -(-(a.context + 40) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=a.batch, num_blocks=a.batch * mb,
                                max_blocks=mb, kernels=a.kernels)
    devices = gpu_devices(a.spec, a.devices)
    # Mosaic GPU reads the target's compute capability from the default device (no GPU here:
    # it would assume 9.0), and the kernel packages pick their Hopper / Blackwell variant by it
    jax.config.update("jax_default_device", devices[0])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_step(cfg, cs, nm, a.batch, devices, a.expert,
                                {"xla_dump_to": dump}, a.model)
        thunks = sorted(glob.glob(f"{dump}/*thunk_sequence_after_thunk_passes.txt"))
        graphs = None
        if thunks:
            with open(thunks[-1]) as fh:
                graphs = graph_summary(fh.read())
    hlo = compiled.as_text()
    total, src = kernels_by_source(hlo)
    per_layer = kernels_by_layer(hlo)
    in_layers = total - per_layer[None]
    print(f"{a.devices} x {a.spec} (compile only, {time.perf_counter() - t0:.0f} s): "
          f"{a.preset}, layers {cfg.compress_ratios[:-1]} (compress ratios), B={a.batch}, "
          f"context {a.context}, kernels={a.kernels}, matmul={a.matmul}")
    print(f"{total} kernels in the step: {in_layers} in the layers "
          f"({', '.join(str(per_layer[i]) for i in range(n))}), {per_layer[None]} outside "
          "(embedding, head)")
    for name, v in src.most_common(a.top):
        print(f"  {v:4d}  {name}")
    if graphs is not None:
        out = ", ".join(f"{v} {k}" for k, v in graphs["outside"].most_common()) or "none"
        print(f"CUDA graphs: {graphs['graphs']} holding {graphs['commands']} commands; "
              f"top-level thunks outside graphs: {out}")
    if a.hlo_out:
        with open(a.hlo_out, "w") as fh:
            fh.write(hlo)
    coll = collectives_by_layer(hlo)
    print(f"collectives: {sum(coll.values())} in the step, by layer "
          f"{[coll[i] for i in range(n)]}, {coll[None]} outside")
    print(f"kernels per layer: {in_layers / n:g}")


if __name__ == "__main__":
    main()
