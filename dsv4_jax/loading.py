"""`load(path, mesh=None)` -> (Config, params): an orbax checkpoint written by
`dsv4 convert`, or a HF-layout safetensors directory read directly.

Arrays go straight to their target shardings (one device, or the NamedShardings of
`sharding.param_shardings(cfg, mesh)`, the layout the sharded model uses), built from
abstract metadata: orbax restores each chunk with sharded targets, and the safetensors path
builds every array with `jax.make_array_from_callback`, reading only the experts each device
holds (other tensors: one tensor at a time). No copy of the whole model sits in host memory.
"""
from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import convert as C
from checkpoints import layout as CL
from checkpoints.errors import (CheckpointError, DtypeMismatchError, IncompleteCheckpointError,
                                MissingKeyError, ShapeMismatchError, UnknownKeyError)
from checkpoints.source import open_source
from pallas_kernels.quant_matmul import PLACE_MAX_SCALE_BYTE

from .config import Config
from . import param_specs as P
from . import sharding as S
from .quant import Fp4Weight


def load(path, mesh=None, numerics_check: bool = True, rules=None, include_mtp: bool = True):
    """Restore the checkpoint at `path` -> (Config, params).

    `mesh`: a `jax.sharding.Mesh` with axes from ("data", "expert", "model") (rules:
    `sharding.RULES`, or `rules`), or None for the first device. `numerics_check`: after
    loading, verify on device that no scale is NaN (E8M0 0xFF / non-finite), float tensors are finite and
    `tid2eid` indexes real experts; a failure names the tensor.
    Raises `checkpoints.errors.CheckpointError` subclasses on any mismatch between the
    checkpoint and its config."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    if (path / C.MANIFEST).exists() or (path / C.STATE).exists() or (path / "parts").exists():
        cfg, params = _load_orbax(path, mesh, rules, include_mtp)
    elif (path / "config.json").exists() and any(path.glob("*.safetensors")):
        cfg, params = _load_safetensors(path, mesh, rules, include_mtp)
    else:
        raise CheckpointError(f"{path}: neither an orbax checkpoint from `dsv4 convert` "
                              "(dsv4_checkpoint.json) nor a safetensors directory")
    if numerics_check:
        check_numerics(params, cfg)
    return cfg, params


def _targets(cfg: Config, mesh, rules, include_mtp):
    return S.abstract_with_shardings(cfg, mesh, rules, include_mtp)


def _load_orbax(path: Path, mesh, rules, include_mtp):
    mpath = path / C.MANIFEST
    if not mpath.exists():
        raise IncompleteCheckpointError(
            f"{path}: no {C.MANIFEST}: the conversion did not finish; run `dsv4 convert` "
            "with the same arguments again to resume it")
    manifest = json.loads(mpath.read_text())
    if manifest.get("format") != "dsv4-orbax" or manifest.get("version") != C.FORMAT_VERSION:
        raise IncompleteCheckpointError(f"{mpath}: unknown format/version "
                                        f"{manifest.get('format')!r} {manifest.get('version')!r}")
    cfg = Config.from_json(path)
    specs = P.describe(cfg, include_mtp=True)
    where = {k: (part, c) for part, pm in manifest["parts"].items()
             for c, keys in pm["chunks"].items() for k in keys}
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
# Numerics check (on device, one reduction per array)
# ---------------------------------------------------------------------------------------
def _bad_count(x):
    if x.dtype == jnp.float8_e8m0fnu:
        return jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint8) == 255)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.sum(~jnp.isfinite(x.astype(jnp.float32)))
    return jnp.zeros((), jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _numerics_counts(tree, n_experts: int):
    """-> ({name: count of NaN / non-finite / invalid entries},
           {FP4 weight name: count of scale bytes above what the Pallas matmul kernel's
            "place" FP4 program decodes (PLACE_MAX_SCALE_BYTE, 2^65)})."""
    out, big = {}, {}
    is_fp4 = lambda x: isinstance(x, Fp4Weight)
    for k, leaf in tree.items():
        for path, x in jax.tree_util.tree_leaves_with_path(leaf, is_leaf=is_fp4):
            name = k + jax.tree_util.keystr(path)
            if is_fp4(x):
                out[name + ".packed"] = _bad_count(x.packed)
                out[name + ".scale"] = _bad_count(x.scale)
                big[name] = jnp.sum(jax.lax.bitcast_convert_type(x.scale, jnp.uint8)
                                    > PLACE_MAX_SCALE_BYTE)
            else:
                out[name] = _bad_count(x)
        if k.endswith("gate.tid2eid"):
            out[k + " (expert id out of [0, n_routed_experts))"] = jnp.sum(
                (leaf < 0) | (leaf >= n_experts))
    return out, big


def check_numerics(params: dict, cfg: Config, exact_fp4: bool = False):
    """Raise naming the first tensor with NaN scales / non-finite values / bad expert ids;
    warn about FP4 scales the default FP4 matmul program cannot decode, unless the model
    will run with Numerics(exact_fp4=True) (`exact_fp4`).
    One jitted reduction over the whole tree (one compile per model shape; the arrays
    stay where they are)."""
    bad, big = jax.device_get(_numerics_counts(params, cfg.n_routed_experts))
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
