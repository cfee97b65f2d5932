"""Parameter shardings from the parameter description's logical axes (minimal version).

`param_shardings(cfg, mesh)` gives a tree shaped like `params.abstract_params(cfg)` whose
leaves (each array of each quant type) carry a `NamedSharding`: a logical axis is split over
the mesh axis the rules name when that mesh axis exists and divides the stored dimension;
everything else is replicated. Quant types' fields keep the logical axes of the dims they
share with the logical shape (packed and scale tensors are split along the same leading dims).
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from .config import Config
from . import params as P

# logical axis -> mesh axis. Experts over "expert" (EP); wide projections over "model" (TP).
DEFAULT_RULES: dict[str, str] = {
    "experts": "expert",
    "vocab": "model",
    "heads_hd": "model",
    "heads": "model",
    "mlp": "model",
    "o_groups_lora": "model",
}


def _pspec(axes, shape, mesh: Mesh, rules) -> PartitionSpec:
    out, used = [], set()
    for ax, n in zip(axes, shape):
        m = rules.get(ax) if ax else None
        if m and m in mesh.shape and m not in used and n % mesh.shape[m] == 0:
            out.append(m)
            used.add(m)
        else:
            out.append(None)
    return PartitionSpec(*out)


def leaf_shardings(spec: P.ParamSpec, mesh: Mesh, rules=None):
    """Shardings of one leaf's arrays (a quant type of shardings, or one sharding)."""
    rules = DEFAULT_RULES if rules is None else rules
    structs = P.storage_structs(spec)

    def one(s):
        # fields share the logical leading dims; trailing dims (packed/blocked) only when the
        # stored size equals the logical one
        axes = []
        for d, n in enumerate(s.shape):
            if d < len(spec.shape) and (n == spec.shape[d] or d < len(spec.shape) - 2):
                axes.append(spec.axes[d])
            else:
                axes.append(None)
        return NamedSharding(mesh, _pspec(axes, s.shape, mesh, rules))

    return jax.tree.map(one, structs)


def param_shardings(cfg: Config, mesh: Mesh, rules=None, include_mtp: bool = True) -> dict:
    return {k: leaf_shardings(v, mesh, rules) for k, v in P.describe(cfg, include_mtp).items()}


def single_device_shardings(cfg: Config, device=None, include_mtp: bool = True) -> dict:
    sh = SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda _: sh, P.abstract_params(cfg, include_mtp))


def abstract_with_shardings(cfg: Config, mesh: Mesh | None = None, rules=None,
                            include_mtp: bool = True) -> dict:
    """abstract_params(cfg) with each ShapeDtypeStruct carrying its target sharding."""
    shard = (param_shardings(cfg, mesh, rules, include_mtp) if mesh is not None
             else single_device_shardings(cfg, include_mtp=include_mtp))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        P.abstract_params(cfg, include_mtp), shard)
