"""Target shardings for loading: where each parameter array goes.

With a mesh, the layout is `distributed.param_shardings` (one logical-axis rules table,
`distributed.RULES`, shared with the sharded forward and decode step), so `load(path, mesh)`
places every array exactly where the sharded model expects it. Without a mesh, everything
goes to one device.
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, SingleDeviceSharding

from .config import Config
from . import params as P


def param_shardings(cfg: Config, mesh: Mesh, rules=None, include_mtp: bool = True) -> dict:
    """NamedSharding tree shaped like `params.abstract_params(cfg, include_mtp)`."""
    from . import distributed
    return distributed.param_shardings(cfg, mesh, rules, include_mtp)


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
