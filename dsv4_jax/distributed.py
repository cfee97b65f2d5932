"""Sharded execution over a device mesh: meshes and multi-process start-up, the
expert-parallel MoE, and the sharded forms of the step (programs.py jits them). The
same code runs on 1, 2, 4, 8 (or any number of) devices, and on several hosts after
`jax.distributed.initialize()` (docs/SHARDING.md). Where each array lives (the
logical-axis rules, the parameter / cache / module-state shardings) is sharding.py.

Routed experts run inside `jax.shard_map` (`expert_parallel_moe`): routing is computed
once outside; each device computes its local experts for the tokens routed to them (ids
outside its range get weight 0) and a psum over the EP axes combines the outputs. The
expert weights never move. Tensor parallelism on the ("data", "expert", "model") mesh is
left to GSPMD (jit with in/out shardings), kernels off; the tensor layout (a mesh of one
"model" axis, `make_tensor_mesh`) runs the whole step as one shard_map with every kernel on
its local heads and weights (the last section). The decode step runs data-parallel (a
shard_map over "data": each group steps its own request slots and pool blocks,
`DataParallelBlockManager`) when the batch splits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .cache import BlockManager, CacheSpec, PoolExhausted, blocks_needed, cache_structs
from .config import Config
from .quant import Numerics
from .sharding import AXES, _put, expert_axes, param_shardings
from . import decode as D
from . import layers as L
from .layers import experts
from . import model as M
from . import nnx_model as NX


# ---------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------
def init_processes_from_env() -> bool:
    """Join a multi-process run when DSV4_COORDINATOR ("host:port"), DSV4_NUM_PROCESSES and
    DSV4_PROCESS_ID are set (one process per GPU on a host, or per host): calls
    `jax.distributed.initialize` before any other JAX work; on CPU the cross-process
    collectives use gloo. Returns whether it did."""
    addr = os.environ.get("DSV4_COORDINATOR")
    if not addr or jax.distributed.is_initialized():
        return bool(addr)
    try:
        n, pid = int(os.environ["DSV4_NUM_PROCESSES"]), int(os.environ["DSV4_PROCESS_ID"])
    except (KeyError, ValueError) as e:
        raise ValueError("DSV4_COORDINATOR needs integer DSV4_NUM_PROCESSES and "
                         f"DSV4_PROCESS_ID: {e}") from None
    if not 0 <= pid < n:
        raise ValueError(f"DSV4_PROCESS_ID {pid} is not in [0, {n})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU backend only
    jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid)
    return True


def make_mesh(n_devices: int | None = None, *, expert: int | None = None,
              model: int | None = None, data: int | None = None, devices=None) -> Mesh:
    """A ("data", "expert", "model") mesh over the first n_devices of `devices` (default
    jax.devices(): every device of every host). Unset sizes: data = 1, model = 1 and
    expert takes the rest; if expert is set, model takes the rest."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if n_devices is None else int(n_devices)
    if not 0 < n <= len(devices):
        raise ValueError(f"make_mesh: asked for {n} devices, {len(devices)} available")
    data = 1 if data is None else data
    if expert is None:
        model = 1 if model is None else model
        expert = n // (data * model) if n % (data * model) == 0 else 0
    elif model is None:
        model = n // (data * expert) if n % (data * expert) == 0 else 0
    for name, v in (("data", data), ("expert", expert), ("model", model)):
        if not (isinstance(v, int) and v > 0):
            raise ValueError(f"make_mesh: axis {name!r} size must be a positive integer "
                             f"dividing {n} devices, got {v!r} (data={data}, expert={expert}, "
                             f"model={model})")
    if data * expert * model != n:
        raise ValueError(f"make_mesh: data {data} x expert {expert} x model {model} = "
                         f"{data * expert * model} != {n} devices")
    return jax.make_mesh((data, expert, model), AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices[:n])


# ---------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------
def _batch_axis(mesh: Mesh, B: int):
    return "data" if mesh.shape.get("data", 1) > 1 and B % mesh.shape["data"] == 0 else None


def expert_parallel_moe(p, x, idx, w, cfg: Config, nm: Numerics, presim: bool = False, *,
                        mesh: Mesh, ep):
    """Routed experts with the experts split over mesh axes `ep` (same contract as
    layers.routed_experts). x [B, T, D], idx/w [B, T, k] (routing computed once, outside)
    -> [B, T, D] f32, combined with a psum over `ep`. Batch rows stay split over "data"
    when they divide evenly."""
    names = ("experts.w1", "experts.w2", "experts.w3")
    ex = {k: p[k] for k in names}
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty and "data" in ctx.manual_axes:  # inside the data-parallel step
        on, bs, manual = ctx, P(), set(ep)
    else:
        on, bs, manual = mesh, P(_batch_axis(mesh, x.shape[0])), set(mesh.axis_names)

    def local(ex, x, idx, w):
        n_loc = jax.tree.leaves(ex["experts.w1"])[0].shape[0]  # E / |ep| experts here
        loc = idx - jax.lax.axis_index(ep) * n_loc
        mine = (loc >= 0) & (loc < n_loc)
        y = L.routed_experts(ex, x, jnp.where(mine, loc, -1), jnp.where(mine, w, 0.0),
                             cfg, nm, presim)
        return jax.lax.psum(y, ep)

    return jax.shard_map(local, mesh=on, in_specs=(P(ep), bs, bs, bs), out_specs=bs,
                         axis_names=manual, check_vma=False)(ex, x, idx, w)


@contextlib.contextmanager
def expert_parallel(cfg: Config, mesh: Mesh, rules=None):
    """While tracing under this context, layers.moe runs its routed experts expert-parallel
    over the mesh (a no-op when the experts are not split). Not thread-safe: trace one
    program at a time."""
    ep = expert_axes(cfg, mesh, rules)
    old = experts.ROUTED_EXPERTS_HOOK
    if ep:
        experts.ROUTED_EXPERTS_HOOK = functools.partial(expert_parallel_moe, mesh=mesh, ep=ep)
    try:
        yield
    finally:
        experts.ROUTED_EXPERTS_HOOK = old


# ---------------------------------------------------------------------------------------
# Sharded entry points
# ---------------------------------------------------------------------------------------
def _constrain_batch(x, mesh: Mesh):
    b = _batch_axis(mesh, x.shape[0])
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(b))) if b else x


def data_groups(cs: CacheSpec, mesh: Mesh) -> int:
    """Number of data-parallel groups the step can run locally: the "data" size when it
    divides both the request slots and the pool blocks, else 1."""
    d = mesh.shape.get("data", 1)
    return d if d > 1 and cs.max_requests % d == 0 and cs.num_blocks % d == 0 else 1


class DataParallelBlockManager(BlockManager):
    """A BlockManager whose request slots and pool blocks are split into `groups`
    contiguous ranges (the cache's "data" sharding): a request gets blocks of its own
    group only, so the data-parallel step never reads another group's cache. groups=1 is
    the plain BlockManager."""

    def __init__(self, cfg: Config, cs: CacheSpec, groups: int):
        if groups < 1 or cs.max_requests % groups or cs.num_blocks % groups:
            raise ValueError(f"{groups} data groups must divide max_requests "
                             f"{cs.max_requests} and num_blocks {cs.num_blocks}")
        super().__init__(cfg, cs)
        self.groups = groups
        self.r_loc, self.nb_loc = cs.max_requests // groups, cs.num_blocks // groups
        self.group_free = [list(range(g * self.nb_loc, (g + 1) * self.nb_loc))[::-1]
                           for g in range(groups)]
        self._sync()

    def _sync(self):
        self.free = [b for f in self.group_free for b in f]

    def group(self, slot: int) -> int:
        return slot // self.r_loc

    def admit(self, prompt_len: int) -> int:
        free_slots = np.flatnonzero(~self.active)
        if prompt_len <= 0 or prompt_len > self.cs.capacity or len(free_slots) == 0:
            return super().admit(prompt_len)  # raises the base class's clear error
        # the free slot of the group with the most free blocks (balances the groups)
        slot = int(max(free_slots, key=lambda s: (len(self.group_free[self.group(s)]), -s)))
        self.active[slot] = True
        self.length[slot] = 0
        return slot

    def ensure(self, slot: int, new_len: int) -> None:
        self.free = self.group_free[self.group(slot)]  # the base class pops from self.free
        try:
            super().ensure(slot, new_len)
        finally:
            self._sync()

    def ensure_many(self, new_lens: dict[int, int]) -> None:
        for g in range(self.groups):  # all or nothing: check every group first
            extra = sum(max(0, blocks_needed(self.cfg, n) - int((self.table[s] >= 0).sum()))
                        for s, n in new_lens.items() if self.group(s) == g)
            if extra > len(self.group_free[g]):
                raise PoolExhausted(
                    f"block pool exhausted in data group {g}: the step needs {extra} more "
                    f"block(s) for requests {sorted(new_lens)}, {len(self.group_free[g])} free "
                    f"of {self.nb_loc}")
        super().ensure_many(new_lens)

    def release(self, slot: int) -> None:
        g = self.group(slot)
        self.free = self.group_free[g]
        try:
            super().release(slot)
        finally:
            self._sync()


def check_data_parallel_batch(slots, cs: CacheSpec, groups: int) -> None:
    """The data-parallel step splits the batch rows into `groups` equal contiguous chunks;
    chunk g must use request slots of group g (host check, numpy input)."""
    slots = np.asarray(slots)
    B = len(slots)
    if groups == 1 or B % groups:
        return
    want = np.arange(B) // (B // groups)
    got = slots // (cs.max_requests // groups)
    if (got != want).any():
        raise ValueError(f"data-parallel step: batch rows split into {groups} chunks must use "
                         f"slots of their own group ({cs.max_requests // groups} slots each), "
                         f"got slots {slots.tolist()}")


def data_parallel_step_fn(cfg: Config, cs: CacheSpec, nm: Numerics, mesh: Mesh, apply):
    """The sharded form of a step `apply(p, cache, tokens, slots, pos, nvalid, block_table,
    cs) -> (logits, cache)` (p: the flat tree or the module state) -> (stp(p, cache, tokens,
    slots, pos, nvalid, block_table), G). With G = data_groups(cs, mesh) > 1 and B
    divisible by G, stp runs data-parallel: a shard_map over "data" in which each group
    steps its own B/G rows against its own slots and pool blocks (local indices); other
    shapes (e.g. a one-request prefill chunk) run under plain GSPMD."""
    # The cache kernels run where attention is replicated: expert parallelism only. Under
    # "model" the heads are split; under "data" the step is a partly manual shard_map, where
    # the Mosaic-GPU interpreter's callbacks cannot run (so it could not be tested on CPU).
    split = {a: mesh.shape.get(a, 1) for a in ("data", "model") if mesh.shape.get(a, 1) > 1}
    if cs.kernels != "off" and split:
        raise ValueError(f"the cache kernels (CacheSpec.kernels={cs.kernels!r}) run on meshes "
                         f"that only split experts; this mesh splits {split}: use "
                         "kernels='off', an expert-only mesh, or the tensor layout "
                         "(make_tensor_mesh)")
    if nm.matmul != "xla" and mesh.shape.get("model", 1) > 1:
        raise ValueError("Numerics(matmul='pallas') under tensor parallelism (mesh 'model' "
                         f"size {mesh.shape['model']}) would all-gather the split weights "
                         "for the kernel; use matmul='xla' or a mesh without 'model'")
    G = data_groups(cs, mesh)
    cs_loc = dataclasses.replace(cs, max_requests=cs.max_requests // G,
                                 num_blocks=cs.num_blocks // G)
    dspec = jax.tree.map(lambda _: P("data"), cache_structs(cfg, cs))

    def local(p, cache, tokens, slots, pos, nvalid, block_table):
        g = jax.lax.axis_index("data")
        slots = slots - g * cs_loc.max_requests
        block_table = jnp.where(block_table >= 0, block_table - g * cs_loc.num_blocks, -1)
        return apply(p, cache, tokens, slots, pos, nvalid, block_table, cs_loc)

    def stp(p, cache, tokens, slots, pos, nvalid, block_table):
        with expert_parallel(cfg, mesh):
            if G > 1 and tokens.shape[0] % G == 0:
                d = P("data")
                return jax.shard_map(local, mesh=mesh, in_specs=(P(), dspec, d, d, d, d, d),
                                     out_specs=(d, dspec), axis_names={"data"},
                                     check_vma=False)(p, cache, tokens, slots, pos, nvalid,
                                                      block_table)
            return apply(p, cache, _constrain_batch(tokens, mesh), slots, pos, nvalid,
                         block_table, cs)
    return stp, G


def state_shardings(cfg: Config, mesh: Mesh, include_mtp: bool = True,
                    x_proj_merged: bool = False, rules=None):
    """The NamedShardings of the module state nnx.split(DeepSeekV4.from_params(cfg, p))
    for a tree p of that form: sharding.param_shardings, arranged as the module holds it."""
    return NX.state_of(cfg, param_shardings(cfg, mesh, rules, include_mtp, x_proj_merged))


# ---------------------------------------------------------------------------------------
# Tensor parallelism with every kernel on (the "tensor" layout)
# ---------------------------------------------------------------------------------------
# The whole step is one fully manual shard_map over a mesh of one axis, "model": each device
# runs the ordinary step code on its local weights, with a local config whose head, output
# group and expert-width counts are the global ones / n. Two psums a layer join the partial
# sums (after the attention output projection and after the MoE) and one all-gather of the
# head's vocab rows gives the logits. The single shared K=V head, the window ring, the pools,
# the compressors and the indexer are replicated: every device writes the same cache rows,
# and the cache kernels (scatters, indexer top-k, sparse attention) run on each device's
# local query heads. The indexer stays whole: split by heads its scores would need a third
# all-reduce before the top-k, and its kernel pads to 64 heads anyway.
TENSOR_AXIS = "model"

# A block's weights split over the tensor axis (names relative to "layers.N." / "mtp.J."),
# by the dim of every stored field: -2 rows (output features), -1 columns (input features;
# the attention sink's heads). Query heads and their output groups, and the experts'
# intermediate columns (routed and shared); wo_b and w2 then give partial sums.
TENSOR_SPLITS = {"attn.attn_sink": -1, "attn.wq_b": -2, "attn.wo_a": -2, "attn.wo_b": -1,
                 "ffn.shared_experts.w1": -2, "ffn.shared_experts.w3": -2,
                 "ffn.shared_experts.w13": -2, "ffn.shared_experts.w2": -1,
                 "ffn.experts.w1": -2, "ffn.experts.w3": -2, "ffn.experts.w13": -2,
                 "ffn.experts.w2": -1}
# Row merges of w1 and w3 (params.ROW_MERGES): stored permuted in the tensor layout, so that
# device d's contiguous rows are its w1 chunk then its w3 chunk (a local w13 of I / n).
TENSOR_PAIRED = ("ffn.shared_experts.w13", "ffn.experts.w13")
# Outside the blocks: the head's vocab rows (the logits are all-gathered); the embedding
# stays whole (a lookup of B rows).
TENSOR_TOP = {"head.weight": -2}
_BLOCK = re.compile(r"^(layers|mtp)\.\d+\.")


def make_tensor_mesh(n_devices: int | None = None, devices=None) -> Mesh:
    """The tensor layout's mesh: one axis, "model", over the first n_devices of `devices`
    (default jax.devices()). ModelRunner runs a mesh of this one axis as the tensor layout
    (`is_tensor_mesh`), every other mesh as sharding.py's GSPMD / expert-parallel one."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if n_devices is None else int(n_devices)
    if not 0 < n <= len(devices):
        raise ValueError(f"make_tensor_mesh: asked for {n} devices, {len(devices)} available")
    return jax.make_mesh((n,), (TENSOR_AXIS,), axis_types=(AxisType.Auto,),
                         devices=devices[:n])


def is_tensor_mesh(mesh) -> bool:
    return mesh is not None and tuple(mesh.axis_names) == (TENSOR_AXIS,)


def tensor_config(cfg: Config, n: int) -> Config:
    """The config one device of an n-way tensor layout computes with: heads, output groups
    and expert width divided by n (the indexer's heads stay whole)."""
    for f in ("num_attention_heads", "o_groups", "moe_intermediate_size"):
        if getattr(cfg, f) % n:
            raise ValueError(f"tensor parallelism over {n} devices: {f} = {getattr(cfg, f)} "
                             f"does not split {n} ways")
    return cfg.replace(num_attention_heads=cfg.num_attention_heads // n,
                       o_groups=cfg.o_groups // n,
                       moe_intermediate_size=cfg.moe_intermediate_size // n)


def _tensor_split(name: str):
    m = _BLOCK.match(name)
    return TENSOR_SPLITS.get(name[m.end():]) if m else TENSOR_TOP.get(name)


def _fields(leaf):
    """A leaf's stored fields (a quant type's arrays, or the array) and their treedef."""
    return jax.tree.flatten(leaf)


def tensor_pspecs(params: dict, n: int) -> dict:
    """PartitionSpecs of the tensor layout for a parameter tree (arrays or structs; any
    form): each TENSOR_SPLITS / TENSOR_TOP weight split over "model" along its dim in every
    stored field of the weight's rank (packed FP4 columns and block scales alike: each
    device then holds whole scale blocks), the rest replicated. Raises if a split dim (or,
    for TENSOR_PAIRED, half of it) does not divide n ways."""
    out = {}
    for k, v in params.items():
        d = _tensor_split(k)
        leaves, tdef = _fields(v)
        if d is None:
            out[k] = jax.tree.unflatten(tdef, [P()] * len(leaves))
            continue
        rank = leaves[0].ndim
        paired = any(k.endswith(s) for s in TENSOR_PAIRED)
        specs = []
        for a in leaves:
            if a.ndim != rank:   # NVFP4's per-weight global scale
                specs.append(P())
                continue
            if a.shape[d] % (2 * n if paired else n):
                raise ValueError(f"tensor parallelism over {n} devices: {k} field "
                                 f"{a.shape} does not split {n} ways along dim {d}"
                                 + (" (w1 and w3 halves each)" if paired else ""))
            spec = [None] * a.ndim
            spec[d] = TENSOR_AXIS
            specs.append(P(*spec))
        out[k] = jax.tree.unflatten(tdef, specs)
    return out


def _pair_rows(a, n: int, inverse: bool = False):
    """Rows (axis -2) [w1 (h) | w3 (h)] -> [w1_0 w3_0 | w1_1 w3_1 | ...] in chunks of h / n
    (inverse: back)."""
    *lead, r, c = a.shape
    x = a.reshape(*lead, *((n, 2) if inverse else (2, n)), r // (2 * n), c)
    return jnp.swapaxes(x, -4, -3).reshape(a.shape)


def tensor_form(params: dict, n: int, inverse: bool = False) -> dict:
    """The parameter values of the tensor layout: TENSOR_PAIRED weights' rows permuted
    (`_pair_rows`, every stored field of the weight's rank); other leaves unchanged.
    inverse=True turns a tensor-form tree back."""
    out = dict(params)
    for k, v in params.items():
        if any(k.endswith(s) for s in TENSOR_PAIRED):
            rank = _fields(v)[0][0].ndim
            out[k] = jax.tree.map(lambda a: _pair_rows(a, n, inverse) if a.ndim == rank else a,
                                  v)
    return out


def tensor_shardings(params: dict, mesh: Mesh) -> dict:
    """NamedShardings of the tensor layout for a tree of this form."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        tensor_pspecs(params, mesh.shape[TENSOR_AXIS]),
                        is_leaf=lambda x: isinstance(x, P))


def shard_tensor_params(params: dict, mesh: Mesh) -> dict:
    """Place a parameter tree (any form, host or device arrays) in the tensor layout: the
    paired rows permuted (tensor_form), then each leaf placed by tensor_shardings."""
    n = mesh.shape[TENSOR_AXIS]
    sh = tensor_shardings(params, mesh)    # checks the splits before any copy
    tf = tensor_form({k: v for k, v in params.items()
                      if any(k.endswith(s) for s in TENSOR_PAIRED)}, n)
    return {k: jax.tree.map(_put, tf.get(k, v), sh[k]) for k, v in params.items()}


def _tensor_moe(p, x, tokens, hash_layer, cfg, lcfg, nm, xq):
    """layers.moe on this device's expert columns: routing on the whole router (the same on
    every device), the local parts of the routed and shared experts in f32, one psum."""
    idx, w = L.route(p, x, tokens, cfg, hash_layer)
    if xq is None:
        out = L.routed_experts(p, x, idx, w, lcfg, nm)
    else:
        rows = int(np.prod(x.shape[:-1]))
        out = L.routed_experts(p, xq[:rows].reshape(x.shape), idx, w, lcfg, nm, presim=True)
    if cfg.n_shared_experts:
        out = out + L.expert_ffn(p["shared_experts.w1"], p["shared_experts.w2"],
                                 p["shared_experts.w3"], x, None, lcfg, nm, xq=xq)
    # the sum of the partials is a kernel before the all-reduce (on one device the add fuses
    # into hc_expand; XLA reassociates two psums into this one anyway)
    return jax.lax.psum(out, TENSOR_AXIS).astype(nm.jdtype)


def _tensor_block(bp, X, tokens, layer, cfg, nm, attn_fn, *, lcfg):
    """model.block on local weights (its signature, for decode.layer_loop): the attention's
    partial output all-reduced, the MoE on this device's expert columns -> (X, aux)."""
    with jax.named_scope("attn"):
        _, post, C, x, xq = L.hc_site(X, bp["hc_attn_fn"], bp["hc_attn_scale"],
                                      bp["hc_attn_base"], bp["attn_norm.weight"], cfg, nm)
        f, aux = attn_fn(L.block_params(bp, "attn."), x, xq=xq)
        X = L.hc_expand(jax.lax.psum(f, TENSOR_AXIS), X, post, C, nm.jdtype)
    with jax.named_scope("ffn"):
        _, post, C, x, xq = L.hc_site(X, bp["hc_ffn_fn"], bp["hc_ffn_scale"],
                                      bp["hc_ffn_base"], bp["ffn_norm.weight"], cfg, nm)
        f = _tensor_moe(L.block_params(bp, "ffn."), x, tokens, cfg.is_hash_layer(layer), cfg,
                        lcfg, nm, xq)
        X = L.hc_expand(f, X, post, C, nm.jdtype)
    return X, aux


def tensor_step_local(params, cache, tokens, slots, pos, nvalid, block_table, *, cfg: Config,
                      cs: CacheSpec, nm: Numerics, n: int):
    """decode.step on one device of the n-way tensor layout (inside the shard_map): params
    local (tensor_pspecs, tensor_form), the cache whole -> (logits [B, V], new cache)."""
    lcfg = tensor_config(cfg, n)
    B, T = tokens.shape
    tok_pos = pos[:, None] + jnp.arange(T)[None, :]
    valid = jnp.arange(T)[None, :] < nvalid[:, None]
    bt_rows = block_table[slots]
    X = M.embed(params, tokens, cfg, nm)

    def attend(i, ap, lc, x, xq):
        out, lc = D.attention_cached(ap, lc, x, tok_pos, valid, slots, pos, nvalid, bt_rows,
                                     lcfg, cs, nm, cfg.layer_ratio(i), xq)
        return out, lc, None

    X, new_cache, _, _ = D.layer_loop(params, cache, X, tokens, range(cfg.num_hidden_layers),
                                      cfg, nm, attend,
                                      block=functools.partial(_tensor_block, lcfg=lcfg))
    logits = D.step_head(params, X, nvalid, cfg, nm)        # [B, V / n]: local vocab rows
    return jax.lax.all_gather(logits, TENSOR_AXIS, axis=1, tiled=True), new_cache


def tensor_step_fn(cfg: Config, cs: CacheSpec, nm: Numerics, mesh: Mesh):
    """-> stp(params, cache, tokens [B, T], slots / pos / nvalid [B], block_table) ->
    (logits [B, V] f32, new cache): the step on a flat tree in the tensor layout, the cache
    and the small inputs replicated. Not jitted."""
    n = mesh.shape[TENSOR_AXIS]
    tensor_config(cfg, n)   # fail here, not in a trace
    local = functools.partial(tensor_step_local, cfg=cfg, cs=cs, nm=nm, n=n)

    def stp(params, cache, tokens, slots, pos, nvalid, block_table):
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(tensor_pspecs(params, n), P(), P(), P(), P(), P(), P()),
                             out_specs=(P(), P()), check_vma=False)(
            params, cache, tokens, slots, pos, nvalid, block_table)
    return stp
