"""Where every array lives on a device mesh: the logical-axis rules and the shardings of
the parameters and the cache derived from them. The meshes and the sharded programs that
use these shardings are in distributed.py.

Mesh axes ("data", "expert", "model"):
  data    requests / batch rows (and the cache's request slots and pool blocks)
  expert  routed experts (expert parallelism, EP)
  model   tensor parallelism (TP) of attention heads, shared expert, vocab; the routed
          experts are split over expert x model together, so every device that is not a
          data replica holds E / (expert * model) whole experts.

Every parameter (param_specs.describe) and every cache array (`cache_logical_axes`)
carries logical axis names; `RULES` maps them to mesh axes. A logical axis is split over
its mesh axes when they exist, are not used by an earlier dim of the same array, and
divide the dim; otherwise the dim is replicated (the same rule for every device count).
Without a mesh, everything goes to one device (`single_device_shardings`).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from .cache import Cache, CacheSpec, cache_structs
from .config import Config
from . import param_specs as PS

AXES = ("data", "expert", "model")

# logical axis -> mesh axis (or a tuple of mesh axes, major first); absent: replicated.
RULES: dict[str, str | tuple[str, ...]] = {
    # parameters
    "experts": ("expert", "model"),  # EP: whole routed experts per device
    "heads": "model",  # attn_sink [H]
    "heads_hd": "model",  # wq_b rows (H * head_dim): query heads
    "o_groups_lora": "model",  # wo_a rows (groups), wo_b input columns
    "mlp": "model",  # shared expert (routed ones: "model" is taken by "experts")
    "idx_heads_hd": "model",  # indexer wq_b rows
    "idx_heads": "model",  # indexer weights_proj rows
    "vocab": "model",  # embedding and head rows, hash-routing table
    # cache
    "requests": "data",  # request slots: window ring, positions, compressor state
    "pool_blocks": "data",  # paged pool blocks (see SHARDING.md: allocator is global)
}
# Logical axes kept whole on purpose (listed so a new axis name is a decision, not an
# accident: tests check every name is in RULES or here). The router (experts_r) runs on
# every device; the single shared K=V head (head_dim, kv_*) cannot be split over heads.
REPLICATED = frozenset({
    "embed", "embed_hc", "embed_in", "q_lora", "head_dim", "group_hd", "cmp_hd", "experts_r",
    "x_proj",  # the CSA blocks' merged x-projections (params.merge_x_proj)
    # params.ROW_MERGES: wq_a + wkv rows (both whole already), and the shared expert's
    # w1 + w3 rows (whole: split over "model" the rows would not pair w1 with w3)
    "qkv_a", "mlp13",
    "window", "entries", "cmp_rows", "cmp_state", "kv_nope", "kv_scale", "kv_rope", "kv_dim",
    "idx_dim"})



# ---------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec
# ---------------------------------------------------------------------------------------
def axis_size(mesh: Mesh, axis) -> int:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(mesh.shape.get(a, 1) for a in axes)


def _mesh_axes_for(logical, n: int, mesh: Mesh, rules, used: set):
    """The mesh axes (tuple) a dim of size n with this logical name is split over: the
    rule's axes that exist with size > 1 and are not used yet; trailing ones dropped
    until their product divides n."""
    r = rules.get(logical) if logical else None
    if r is None:
        return ()
    axes = [a for a in ((r,) if isinstance(r, str) else r)
            if mesh.shape.get(a, 1) > 1 and a not in used]
    while axes and n % axis_size(mesh, axes):
        axes.pop()
    return tuple(axes)


def logical_to_pspec(axes, shape, mesh: Mesh, rules=None) -> P:
    rules = RULES if rules is None else rules
    out, used = [], set()
    for ax, n in zip(axes, shape):
        m = _mesh_axes_for(ax, n, mesh, rules, used)
        used.update(m)
        out.append(None if not m else m[0] if len(m) == 1 else m)
    return P(*out)


def _storage_axes(spec: PS.ParamSpec, s) -> tuple:
    """Logical axes of one stored field of a (possibly quantised) parameter: leading
    (stacking) dims always; the last two only where the stored size equals the logical
    one (packed FP4 columns and block scales are not split). Routed experts are split
    only by whole experts (the expert-parallel MoE expects whole experts per device)."""
    nd = len(spec.shape)
    if spec.axes[:1] == ("experts",):
        return ("experts",) + (None,) * (len(s.shape) - 1)
    return tuple(spec.axes[d] if d < nd and (n == spec.shape[d] or d < nd - 2) else None
                 for d, n in enumerate(s.shape))


def param_pspecs(spec: PS.ParamSpec, mesh, rules=None):
    """PartitionSpecs of one parameter's stored arrays (a quant type of specs, or one)."""
    return jax.tree.map(lambda s: logical_to_pspec(_storage_axes(spec, s), s.shape, mesh, rules),
                        PS.storage_structs(spec))


def param_shardings(cfg: Config, mesh: Mesh, rules=None, include_mtp: bool = True,
                    x_proj_merged: bool = False) -> dict:
    """NamedSharding tree shaped like params.abstract_params(cfg, include_mtp,
    x_proj_merged)."""
    return {k: jax.tree.map(lambda p: NamedSharding(mesh, p), param_pspecs(v, mesh, rules))
            for k, v in PS.describe(cfg, include_mtp, x_proj_merged).items()}


# trailing (storage) dims of the entry formats: never split
_FIELD_AXES = {"nope": "kv_nope", "scale": "kv_scale", "rope": "kv_rope", "kv": "kv_dim"}


def cache_logical_axes(cfg: Config, cs: CacheSpec) -> Cache:
    """Logical axis names of every cache array: a tree shaped like cache.cache_structs (a
    tuple of names at each leaf), by LayerCache field:
      win.*    [R, W, ...]      requests, window, <field>
      win_pos  [R, W]           requests, window
      cmp.*    [NB, epb, ...]   pool_blocks, entries, <field>
      idx.*    [NB, epb, ...]   pool_blocks, entries, idx_dim...
      cst      [R, r, width]    requests, cmp_rows, cmp_state (the compressor state's
                                parts side by side: cache.cmp_state_parts)"""
    def axes(path, s):
        # path: (.layers, [i], .<name>) or (.layers, [i], .<name>, [<field>])
        name = path[2].name
        field = path[3].key if len(path) > 3 else None
        if name in ("win", "win_pos"):
            lead = ("requests", "window")
        elif name in ("cmp", "idx"):
            lead = ("pool_blocks", "entries")
        else:
            lead = ("requests", "cmp_rows", "cmp_state")
        tail = (_FIELD_AXES.get(field, "idx_dim"),) if field else ()
        return (lead + tail + ("idx_dim",) * s.ndim)[:s.ndim]
    return jax.tree_util.tree_map_with_path(axes, cache_structs(cfg, cs))


def cache_shardings(cfg: Config, cs: CacheSpec, mesh: Mesh, rules=None) -> Cache:
    return jax.tree.map(
        lambda s, a: NamedSharding(mesh, logical_to_pspec(a, s.shape, mesh, rules)),
        cache_structs(cfg, cs), cache_logical_axes(cfg, cs),
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _put(x, sharding):
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # (a global array, e.g. loaded onto the mesh)
    # multi-host: every process holds the full host value and builds its own shards
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(params: dict, cfg: Config, mesh: Mesh, rules=None) -> dict:
    """Place a parameter tree (host or device arrays; with or without the MTP keys; as
    described or in decode form, params.merge_x_proj) on the mesh by the rules."""
    sh = param_shardings(cfg, mesh, rules, include_mtp=True,
                         x_proj_merged=PS.x_proj_is_merged(params))
    unknown = sorted(set(params) - set(sh))
    if unknown:
        raise KeyError(f"shard_params: parameters not in the description: {unknown[:5]}")
    return {k: jax.tree.map(_put, v, sh[k]) for k, v in params.items()}


def shard_cache(cache: Cache, cfg: Config, cs: CacheSpec, mesh: Mesh, rules=None) -> Cache:
    """Place a cache tree (cache.init_cache(cfg, cs)) on the mesh by the rules."""
    return jax.tree.map(_put, cache, cache_shardings(cfg, cs, mesh, rules))


def expert_axes(cfg: Config, mesh: Mesh, rules=None) -> tuple[str, ...]:
    """Mesh axes the routed experts are split over (from the rules; () = not split)."""
    return _mesh_axes_for("experts", cfg.n_routed_experts, mesh,
                          RULES if rules is None else rules, set())




def single_device_shardings(cfg: Config, device=None, include_mtp: bool = True) -> dict:
    sh = SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda _: sh, PS.abstract_params(cfg, include_mtp))


def abstract_with_shardings(cfg: Config, mesh: Mesh | None = None, rules=None,
                            include_mtp: bool = True) -> dict:
    """abstract_params(cfg) with each ShapeDtypeStruct carrying its target sharding (where
    loading.load puts each array)."""
    shard = (param_shardings(cfg, mesh, rules, include_mtp) if mesh is not None
             else single_device_shardings(cfg, include_mtp=include_mtp))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        PS.abstract_params(cfg, include_mtp), shard)
