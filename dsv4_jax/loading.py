"""`load(path, mesh=None)` -> (Config, params): an orbax checkpoint written by
`dsv4 convert`, or a HF-layout safetensors directory read directly.

Arrays go straight to their target shardings (one device, or the NamedShardings of
`sharding.param_shardings(cfg, mesh)`, the layout the sharded model uses), built from
abstract metadata: orbax restores each chunk with sharded targets, and the safetensors path
builds every array with `jax.make_array_from_callback`, reading only the experts each device
holds (other tensors: one tensor at a time). No copy of the whole model sits in host memory.

Host memory during `load`, beyond the process and the loaded arrays themselves (which on a
CPU backend are host memory), is bounded independently of the model size:
- safetensors: one tensor field (all its experts on one device) at a time, read into the
  buffer that becomes the array, plus at most one copy of it while it is placed;
- orbax: one chunk of the conversion at a time (at most the converter's chunk size, set by
  `dsv4 convert --memory-budget` and recorded in the manifest as `summary.chunk_bytes`);
- the numerics check: NUMERICS_SLICE_BYTES (32 MiB) of temporaries on a CPU backend (each
  array is checked in slices of its own host buffer, no copy); on GPU the check runs on
  the device, one fused reduction per array, compiled once per shape and dtype.
Measured (benchmarks/load_memory.py, docs/CHECKPOINTS.md): on CPU 0.09 GiB (safetensors)
and 0.65 GiB (orbax) above the loaded arrays, for a 3.85 and a 4.78 GiB checkpoint alike.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import convert as C
from checkpoints import formats as CF
from checkpoints import layout as CL
from checkpoints.errors import (CheckpointError, DtypeMismatchError, IncompleteCheckpointError,
                                MissingKeyError, ShapeMismatchError, UnknownKeyError)
from checkpoints.source import checkpoint_dir, open_source, read_config
from pallas_kernels.quant_matmul import PLACE_MAX_SCALE_BYTE

from .config import Config
from . import param_specs as P
from . import sharding as S
from .pipeline import Pipeline
from .quant import Fp4Weight


def load(path, mesh=None, numerics_check: bool = True, rules=None, include_mtp: bool = True,
         pipeline=None):
    """Restore the checkpoint at `path` -> (Config, params).

    `path`: a directory; relative paths, `~` and symlinks are resolved first.
    `mesh`: a `jax.sharding.Mesh` with axes from ("data", "expert", "model") (rules:
    `sharding.RULES`, or `rules`), or None for the first device. `pipeline`: instead of a
    mesh, a `pipeline.Pipeline`: each array straight onto its stage's device (for
    `Engine(pipeline=...)`; build it from the checkpoint's config.json). `numerics_check`: after
    loading, verify that no scale is NaN (E8M0 0xFF / non-finite), float tensors are finite
    and `tid2eid` indexes real experts; a failure names the tensor.
    Host memory stays within the loaded arrays plus a bound independent of model size (one
    tensor / one orbax chunk while reading, 32 MiB for the numerics check; see the module
    docstring and docs/CHECKPOINTS.md).
    Raises `checkpoints.errors.CheckpointError` subclasses on any mismatch between the
    checkpoint and its config."""
    path = checkpoint_dir(path, "a checkpoint is a directory (orbax from `dsv4 convert`, or "
                                "config.json + *.safetensors)")
    if mesh is not None and pipeline is not None:
        raise ValueError("load: give a mesh or a pipeline, not both")
    mesh = pipeline if pipeline is not None else mesh   # where the arrays go
    if (path / C.MANIFEST).exists() or (path / C.STATE).exists() or (path / "parts").exists():
        cfg, params = _load_orbax(path, mesh, rules, include_mtp)
    elif (path / "config.json").exists() and any(path.glob("*.safetensors")):
        cfg, params = _load_safetensors(path, mesh, rules, include_mtp)
    else:
        raise CheckpointError(f"{path}: neither an orbax checkpoint from `dsv4 convert` "
                              f"({C.MANIFEST}) nor a safetensors directory (config.json + "
                              "*.safetensors)")
    if numerics_check:
        check_numerics(params, cfg)
    return cfg, params


def _targets(cfg: Config, mesh, rules, include_mtp):
    if isinstance(mesh, Pipeline):
        if mesh.bounds[-1] != cfg.num_hidden_layers:
            raise ValueError(f"load: the pipeline's stages end at layer {mesh.bounds[-1]}, the "
                             f"checkpoint has {cfg.num_hidden_layers} layers")
        sh = mesh.param_shardings(cfg, include_mtp)
        return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                            P.abstract_params(cfg, include_mtp), sh)
    return S.abstract_with_shardings(cfg, mesh, rules, include_mtp)


def _load_orbax(path: Path, mesh, rules, include_mtp):
    manifest = C.read_manifest(path)
    cfg, _ = read_config(path)
    specs = P.describe(cfg, include_mtp=True)
    where = {k: (part, c) for part, pm in manifest["parts"].items()
             for c, keys in pm["chunks"].items() for k in keys}
    CL.check_drafter(cfg, where, path)  # a drafter of the other layout: say so by name
    unknown = sorted(set(where) - set(specs))
    if unknown:
        raise UnknownKeyError(f"{path}: checkpoint holds {len(unknown)} parameter(s) that "
                              f"config.json does not describe: {unknown[:5]}")
    missing = sorted(set(specs) - set(where))
    if missing:
        raise MissingKeyError(f"{path}: config.json needs {len(missing)} parameter(s) the "
                              f"checkpoint lacks: {missing[:5]}")
    targets = _targets(cfg, mesh, rules, include_mtp)
    chunks: dict[tuple[str, str], list[str]] = {}
    for k in targets:
        chunks.setdefault(where[k], []).append(k)
    params = {}
    for (part, c), keys in chunks.items():
        cdir = path / "parts" / part / c
        meta = C.chunk_metadata(cdir)
        tgt = {}
        for k in keys:
            want = CL.from_leaf(targets[k])
            if k not in meta:
                raise IncompleteCheckpointError(f"{cdir}: lacks {k}, which {C.MANIFEST} "
                                                "lists there")
            have = meta[k] if isinstance(meta[k], dict) else {"value": meta[k]}
            if set(want) != set(have):
                raise DtypeMismatchError(f"{cdir}: {k} is stored with fields {sorted(have)}, "
                                         f"the {specs[k].fmt} format of config.json needs {sorted(want)}")
            for f, w in want.items():
                h, name = have[f], k + ("" if f == "value" else "." + f)
                if tuple(h.shape) != tuple(w.shape):
                    raise ShapeMismatchError(f"{cdir}: {name} has shape {list(h.shape)}, "
                                             f"config.json implies {list(w.shape)}")
                if np.dtype(h.dtype) != np.dtype(w.dtype):
                    raise DtypeMismatchError(f"{cdir}: {name} is {h.dtype}, config.json's "
                                             f"{specs[k].fmt} format needs {w.dtype}")
            tgt[k] = want if isinstance(meta[k], dict) else want["value"]
        restored = C.restore_chunk(cdir, tgt)
        for k in keys:
            r = restored[k]
            params[k] = CL.to_leaf(specs[k].fmt, r if isinstance(r, dict) else {"value": r})
    return cfg, params


def _load_safetensors(path: Path, mesh, rules, include_mtp):
    src = open_source(path)
    cfg = src.cfg
    specs = P.describe(cfg, include_mtp=True)
    targets = _targets(cfg, mesh, rules, include_mtp)
    params = {}
    for k, leaf in targets.items():
        fields = {}
        stacked = CL.is_expert_key(k)
        for f, s in CL.from_leaf(leaf).items():
            fields[f] = _make_array(src, k, f, s, stacked)
        params[k] = CL.to_leaf(specs[k].fmt, fields)
    return cfg, params


def _make_array(src, key: str, field: str, s: jax.ShapeDtypeStruct, stacked: bool):
    cache = {}

    def read(index):
        if stacked:  # read only the experts this device holds
            e = range(*index[0].indices(s.shape[0]))
            return src.read_field(key, field, e)[(slice(None), *index[1:])]
        if "all" not in cache:  # one tensor at a time; replicas share the read
            cache["all"] = src.read_field(key, field)
        return cache["all"][index]

    arr = jax.make_array_from_callback(s.shape, s.sharding, read, dtype=s.dtype)
    cache.clear()
    return arr


# ---------------------------------------------------------------------------------------
# Numerics check: one array at a time, in place (host slices on CPU, on device otherwise)
# ---------------------------------------------------------------------------------------
NUMERICS_SLICE_BYTES = CF.CHECK_SLICE_BYTES


def _host_count(a: np.ndarray, test: str, arg: int) -> int:
    """Count entries failing `test` in a host array, slice by slice (small temporaries)."""
    if test == "nonfinite":
        return CF.nonfinite_count(a)
    flat = a.reshape(-1)
    if test == "scale_above":
        flat = flat.view(np.uint8)
    step = max(1, NUMERICS_SLICE_BYTES // max(1, flat.itemsize))
    n = 0
    for i in range(0, flat.size, step):
        v = flat[i:i + step]
        n += int(np.count_nonzero(v > arg if test == "scale_above" else (v < 0) | (v >= arg)))
    return n


@functools.partial(jax.jit, static_argnums=(1, 2))
def _device_count(x, test: str, arg: int):
    """The same counts on device: one fused reduction (bit tests, no float copy)."""
    if test == "nonfinite":
        view, mask = CF.NONFINITE_BITS[np.dtype(x.dtype)]
        u = jax.lax.bitcast_convert_type(x, view)
        return jnp.sum((u & view(mask)) == view(mask), dtype=jnp.uint32)
    if test == "scale_above":
        return jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint8) > arg, dtype=jnp.uint32)
    return jnp.sum((x < 0) | (x >= arg), dtype=jnp.uint32)


def _count(x: jax.Array, test: str, arg: int = 0):
    """-> int (CPU arrays: every addressable shard once, through zero-copy numpy views) or a
    device scalar (other backends; fetched together at the end)."""
    if test == "nonfinite" and np.dtype(x.dtype) not in CF.NONFINITE_BITS:
        return 0  # integer arrays (packed FP4, ids) have no NaN
    if all(d.platform == "cpu" for d in x.sharding.device_set):
        return sum(_host_count(np.asarray(s.data), test, arg)
                   for s in x.addressable_shards if s.replica_id == 0)
    return _device_count(x, test, arg)


def check_numerics(params: dict, cfg: Config, exact_fp4: bool = False):
    """Raise naming the first tensor with NaN scales / non-finite values / bad expert ids;
    warn about FP4 scales the default FP4 matmul program cannot decode, unless the model
    will run with Numerics(exact_fp4=True) (`exact_fp4`).
    Each array is checked where it lives, on its own: on a CPU backend through numpy views
    of its buffers in slices of NUMERICS_SLICE_BYTES (no compile, no copy); on a GPU by a
    fused on-device reduction compiled once per (shape, dtype, sharding), so same-shape
    arrays of different layers share one compile. Host memory: NUMERICS_SLICE_BYTES at most."""
    bad, big = {}, {}
    for k, leaf in params.items():
        for f, x in CL.from_leaf(leaf).items():
            bad[k if f == "value" else f"{k}.{f}"] = _count(x, "nonfinite")
        if isinstance(leaf, Fp4Weight):
            big[k] = _count(leaf.scale, "scale_above", PLACE_MAX_SCALE_BYTE)
        if k.endswith("gate.tid2eid"):
            bad[k + " (expert id out of [0, n_routed_experts))"] = _count(
                leaf, "id_range", cfg.n_routed_experts)
    bad, big = jax.device_get((bad, big))
    for name, n in bad.items():
        if int(n):
            raise CheckpointError(f"numerics check: {name} has {int(n)} NaN/non-finite or "
                                  "invalid entries")
    big = {name: int(n) for name, n in big.items() if int(n)}
    if big and not exact_fp4:
        first = ", ".join(f"{name} ({n})" for name, n in list(big.items())[:3])
        warnings.warn(
            f"{len(big)} FP4 weight(s) have e8m0 scales above 2^65 (bytes > "
            f"{PLACE_MAX_SCALE_BYTE}; no trained weight has them), e.g. {first}. The "
            "Pallas matmul kernel's default FP4 program ('place') reads such blocks as "
            "inf; run with Numerics(exact_fp4=True) (exact for every scale byte).", stacklevel=2)
