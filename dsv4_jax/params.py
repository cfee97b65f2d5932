"""Parameter trees: random initialisation (host or device) and the decode form
(`merge_x_proj`). What each parameter is (shape, format, logical axes, init rule) is
described once in param_specs.py, re-exported here.

Parameter tree: a flat dict keyed by the OFFICIAL checkpoint names. Linears that may be
quantised are keyed by module path (`layers.3.attn.wq_a`) and hold a quant type from
`quant.py` (checkpoint tensors `<key>.weight` / `<key>.scale`); plain tensors keep the full
name (`layers.3.attn_norm.weight`). Routed experts are stacked along a leading expert axis:
`layers.N.ffn.experts.w1` holds all E experts' w1 ([E, out, in] logical).
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import Config
from . import quant as Q
from . import sharding
from .param_specs import (ROW_MERGE_AXIS, ROW_MERGES, X_PROJ, X_PROJ_PARTS,  # noqa: F401
                          ParamSpec, _block_specs, abstract_params, count_params, describe,
                          dspark_blocks, dspark_specs,
                          nbytes, row_merge_ok, storage_structs, x_proj_is_merged, x_proj_sizes,
                          x_proj_spec)

# ---------------------------------------------------------------------------------------
# Random, well-conditioned initialisation (numpy on the host, deterministic per name)
# ---------------------------------------------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def init_dense(name: str, spec: ParamSpec, cfg: Config, seed: int) -> np.ndarray:
    """The logical float32 (or int32) value of one parameter. Stacked expert tensors are
    drawn expert by expert (`init_expert`) so a writer can stream them."""
    if spec.axes[:1] == ("experts",):
        return np.stack([init_expert(name, spec, cfg, seed, e) for e in range(spec.shape[0])])
    g = _rng(seed, name)
    shp = spec.shape
    if spec.init == "tid2eid":
        E, k = cfg.n_routed_experts, shp[-1]
        return np.argsort(g.random((shp[0], E)), axis=-1)[:, :k].astype(np.int32)
    if spec.init == "linear":
        return (g.standard_normal(shp) / np.sqrt(shp[-1])).astype(np.float32)
    if spec.init == "norm":
        return (1.0 + 0.1 * g.standard_normal(shp)).astype(np.float32)
    if spec.init == "embed":
        return g.standard_normal(shp).astype(np.float32)
    if spec.init == "hc_fn":
        return (g.standard_normal(shp) / np.sqrt(shp[-1])).astype(np.float32)
    if spec.init == "hc_scale":
        return g.uniform(0.2, 1.0, shp).astype(np.float32)
    if spec.init == "normal":
        return g.standard_normal(shp).astype(np.float32)
    if spec.init == "small":
        return (0.1 * g.standard_normal(shp)).astype(np.float32)
    if spec.init == "ape":
        return (0.5 * g.standard_normal(shp)).astype(np.float32)
    raise ValueError(f"unknown init rule {spec.init!r} for {name}")


def init_expert(name: str, spec: ParamSpec, cfg: Config, seed: int, e: int) -> np.ndarray:
    """Expert e's slice [out, in] of a stacked expert tensor `layers.N.ffn.experts.wK`."""
    g = _rng(seed, f"{name}.{e}")
    return (g.standard_normal(spec.shape[1:]) / np.sqrt(spec.shape[-1])).astype(np.float32)


def encode(spec: ParamSpec, value: np.ndarray):
    """Logical float32 value -> stored leaf (numpy arrays) in the spec's format."""
    if spec.fmt == "fp8":
        return Q.Fp8Weight(*Q.encode_fp8_np(value))
    if spec.fmt == "fp4":
        return Q.Fp4Weight(*Q.encode_fp4_np(value))
    if spec.fmt == "nvfp4":
        return Q.NvFp4Weight(*Q.encode_nvfp4_np(value))
    if spec.fmt == "bf16":
        return value.astype(ml_dtypes.bfloat16)
    if spec.fmt == "f32":
        return value.astype(np.float32)
    if spec.fmt == "i32":
        return value.astype(np.int32)
    raise ValueError(f"unknown format {spec.fmt!r}")


def init_leaf(name: str, spec: ParamSpec, cfg: Config, seed: int):
    return encode(spec, init_dense(name, spec, cfg, seed))


def init_params(cfg: Config, seed: int = 0, include_mtp: bool = True) -> dict:
    """Random parameters for any preset (materialised: use only for models that fit)."""
    return {k: jax.tree.map(jnp.asarray, init_leaf(k, v, cfg, seed))
            for k, v in describe(cfg, include_mtp).items()}


def block_params(params: dict, prefix: str) -> dict:
    """The sub-dict of one block with the prefix stripped: block_params(p, 'layers.3.')."""
    n = len(prefix)
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------
# Fast on-device random init (for full-width benchmarks): same formats and conditioning as
# init_params, drawn with jax.random straight into the storage layout.
# ---------------------------------------------------------------------------------------
def _device_leaf(spec: ParamSpec, key, cfg: Config):
    shp = spec.shape
    k1, k2 = jax.random.split(key)
    if spec.fmt == "i32":  # tid2eid: k distinct experts per token
        r = jax.random.uniform(k1, (shp[0], cfg.n_routed_experts))
        return jnp.argsort(r, -1)[:, :shp[1]].astype(jnp.int32)
    std = {"linear": 1.0 / np.sqrt(shp[-1]), "hc_fn": 1.0 / np.sqrt(shp[-1]), "embed": 1.0,
           "normal": 1.0, "small": 0.1, "ape": 0.5, "norm": 0.1, "hc_scale": 0.0}[spec.init]
    if spec.fmt in ("bf16", "f32"):
        v = jax.random.normal(k1, shp, jnp.float32) * std
        if spec.init == "norm":
            v = v + 1.0
        if spec.init == "hc_scale":
            v = jax.random.uniform(k1, shp, jnp.float32, 0.2, 1.0)
        return v.astype(jnp.bfloat16 if spec.fmt == "bf16" else jnp.float32)
    *lead, o, i = shp
    if spec.fmt == "fp8":  # e4m3 values ~N(0, 64^2) with block scale 2^-6 * std
        w = jnp.clip(jax.random.normal(k1, shp, jnp.float32) * 64, -448, 448)
        e = int(np.round(np.log2(std / 64))) + 127
        sc = jnp.full((*lead, -(-o // 128), -(-i // 128)), e, jnp.uint8)
        return Q.Fp8Weight(w.astype(jnp.float8_e4m3fn),
                           jax.lax.bitcast_convert_type(sc, jnp.float8_e8m0fnu))
    if spec.fmt == "fp4":  # uniform e2m1 codes (std ~2.9) with scale ~ std / 2.9
        codes = jax.random.randint(k1, (*lead, o, i), 0, 16, jnp.int32)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)
        e = int(np.round(np.log2(std / 2.9))) + 127
        sc = jnp.full((*lead, o, i // 32), e, jnp.uint8)
        return Q.Fp4Weight(jax.lax.bitcast_convert_type(packed, jnp.int8),
                           jax.lax.bitcast_convert_type(sc, jnp.float8_e8m0fnu))
    raise ValueError(f"device init does not support {spec.fmt!r}")


@functools.lru_cache(maxsize=None)
def _device_leaf_fn(spec: ParamSpec, cfg: Config, sh_leaves: tuple, sh_tree):
    """One compiled initialiser per (spec, sharding): layers repeat their specs."""
    sh = None if sh_tree is None else jax.tree.unflatten(sh_tree, sh_leaves)
    return jax.jit(lambda key: _device_leaf(spec, key, cfg), out_shardings=sh)


def init_params_device(cfg: Config, seed: int = 0, include_mtp: bool = False,
                       shardings: dict | None = None) -> dict:
    """Random parameters generated on the device (no host copy): for full-width layer sets
    in benchmarks. Not value-identical to init_params. `shardings` (name -> sharding tree,
    e.g. sharding.param_shardings) draws each array straight into its shards, so a
    model larger than one device's memory never lands on one device."""
    out = {}
    for k, spec in describe(cfg, include_mtp).items():
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(k.encode()))
        if shardings is None:
            fn = _device_leaf_fn(spec, cfg, (), None)
        else:
            leaves, tree = jax.tree.flatten(shardings[k])
            fn = _device_leaf_fn(spec, cfg, tuple(leaves), tree)
        out[k] = fn(key)
    return out


# ---------------------------------------------------------------------------------------
# Decode form: the CSA blocks' x-projections and the ROW_MERGES pairs pre-concatenated
# ---------------------------------------------------------------------------------------
def _cat(*leaves, xp=jnp):  # rows: axis -2 of every stored array (FP8 scales: [.., out/128, in/128])
    return xp.concatenate(leaves, axis=-2 if leaves[0].ndim > 1 else 0)


@functools.lru_cache(maxsize=None)
def _concat_rows_fn(sh_leaves: tuple, sh_tree):
    sh = None if sh_tree is None else jax.tree.unflatten(sh_tree, sh_leaves)
    return jax.jit(lambda *ws: jax.tree.map(_cat, *ws), out_shardings=sh)


def _concat_rows(ws, spec: ParamSpec, rules):
    """Weights (plain arrays or one quant type, host or device) -> one weight, their rows
    concatenated: placed as the first one is (on a mesh: by the rules for `spec`)."""
    leaves = jax.tree.leaves(ws)
    if all(isinstance(w, np.ndarray) for w in leaves):  # host tree: stays on the host
        return jax.tree.map(functools.partial(_cat, xp=np), *ws)
    if any(isinstance(w, jax.core.Tracer) for w in leaves):  # inside a trace (eval_shape, jit)
        return jax.tree.map(_cat, *ws)
    sh = getattr(leaves[0], "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):  # on a mesh: placed by the rules
        sh = jax.tree.map(lambda p: jax.sharding.NamedSharding(sh.mesh, p),
                          sharding.param_pspecs(spec, sh.mesh, rules))
    sh_leaves, sh_tree = jax.tree.flatten(sh)
    return _concat_rows_fn(tuple(sh_leaves), sh_tree)(*ws)


def _check_x_proj_part(name: str, w, rows: int, cfg: Config):
    if Q.is_quantized(w) or tuple(w.shape) != (rows, cfg.hidden_size) or w.dtype != jnp.bfloat16:
        raise ValueError(f"merge_x_proj: {name} is {type(w).__name__} "
                         f"{getattr(w, 'shape', '?')} {getattr(w, 'dtype', '')}, expected "
                         f"bf16 [{rows}, {cfg.hidden_size}]")


def merge_x_proj(params: dict, cfg: Config, *, consume: bool = False, rules=None) -> dict:
    """The decode form of a parameter tree: in every CSA block (ratio 4, MTP included) the
    five bf16 weights that multiply the attention input x (X_PROJ_PARTS: compressor wkv,
    wgate; indexer compressor wkv, wgate; indexer weights_proj) are replaced by ONE weight
    `<block>attn.x_proj_merged` [sum(x_proj_sizes(cfg)), hidden], their rows concatenated
    in that order (row ranges: x_proj_sizes). Every other parameter is the same array.

    Every block (MTP and DSpark stages included) also gets its ROW_MERGES pairs stored as
    one weight each, rows concatenated in order (every stored array: FP8 values and their
    block scales): `attn.wqkv_a` = wq_a + wkv, `ffn.shared_experts.w13` = shared w1 + w3,
    `ffn.experts.w13` = the routed experts' w1 + w3 per expert ([E, 2I, hidden]), where
    row_merge_ok (FP8 with rows in whole 128-row scale blocks, FP4, or plain; NVFP4 stays
    apart). The layer code reads them as row views too, so each pair is one
    weight-streaming kernel per step instead of two (4 Flash layers compiled for an H100:
    284 -> 272 kernels, 50 -> 42 matmul kernels).

    Why: the layer code reads the five as row views of the merged weight
    (layers.block_params), so a step multiplies x by it in one dot. Stored apart, XLA's dot
    merger makes the same one dot but concatenates the five weights every step (21.5 MB
    per Flash CSA layer, measured on an H100).

    Logits are bit-identical to the unmerged tree's on CPU (tests/test_x_proj_merge.py);
    on a GPU the unmerged step already ran the five as this one dot (the same GEMM shape in
    the compiled H100 step), over the per-step copy. Blocks
    already merged are left alone (merging twice is a no-op); a block holding the merged
    weight and some of the five, or only some of the five, raises ValueError. Blocks
    missing from the tree (e.g. loaded without MTP) are skipped.

    Placement: host (numpy) weights give a host weight; device weights a weight on the
    same device; weights on a mesh a weight placed by the sharding rules (logical axes
    ("x_proj", "embed"): replicated under sharding.RULES; `rules` overrides).
    consume=False returns a new dict and leaves `params` untouched (its arrays stay alive
    while the caller holds it). consume=True merges `params` in place, block by block,
    dropping its references to each block's five weights as soon as their merged copy
    exists: when nothing else holds them they are freed then, so the extra memory is
    one block's weight at most. Returns the merged tree."""
    out = params if consume else dict(params)
    spec = x_proj_spec(cfg)
    sizes = x_proj_sizes(cfg)
    prefixes = [f"layers.{i}.attn." for i in range(cfg.num_hidden_layers)
                if cfg.layer_ratio(i) == 4]
    prefixes += [f"mtp.{j}.attn." for j in range(cfg.num_nextn_predict_layers)
                 if cfg.layer_ratio(cfg.num_hidden_layers + j) == 4]
    for a in prefixes:
        checks = [lambda n, w, rows=rows: _check_x_proj_part(n, w, rows, cfg) for rows in sizes]
        _merge_one(out, a, X_PROJ, X_PROJ_PARTS, checks, spec, rules, "CSA block")
    blocks = [(f"layers.{i}.", i, None) for i in range(cfg.num_hidden_layers)]
    blocks += [(f"mtp.{j}.", cfg.num_hidden_layers + j, None)
               for j in range(cfg.num_nextn_predict_layers)]
    blocks += [(b, layer, 0) for b, layer in dspark_blocks(cfg)]  # window-only stages
    for b, layer, ratio in blocks:
        specs = _block_specs(cfg, b, layer, ratio=ratio)
        merged = _block_specs(cfg, b, layer, True, ratio=ratio)
        for m, parts in ROW_MERGES.items():
            if b + m not in merged:
                continue  # not row_merge_ok (e.g. NVFP4 linears): stored apart here too
            checks = [lambda n, w, sp=specs[b + k]: _check_row_part(n, w, sp) for k in parts]
            _merge_one(out, b, m, parts, checks, merged[b + m], rules, "block")
    return out


def _merge_one(out: dict, b: str, merged: str, parts, checks, spec: ParamSpec, rules,
               what: str):
    """Block `b` of `out`: its weights b + parts -> one weight b + merged (rows
    concatenated, placed by `spec`), in place; merged already or block absent: nothing.
    A block with the merged weight and some parts, or only some parts, raises."""
    names = [b + k for k in parts]
    have = [n for n in names if n in out]
    if b + merged in out:
        if have:
            raise ValueError(f"merge_x_proj: {b + merged} is there together with the "
                             f"weights it replaces: {have}")
        return  # merged already
    if not have:
        if any(k.startswith(b) for k in out):
            raise ValueError(f"merge_x_proj: {what} {b!r} has neither {merged} nor the "
                             f"weights it is made of {list(parts)}")
        return  # block not in this tree
    if len(have) != len(names):
        raise ValueError(f"merge_x_proj: {what} {b!r} lacks {sorted(set(names) - set(have))}")
    for n, check in zip(names, checks):
        check(n, out[n])
    ws = [out.pop(n) for n in names]
    out[b + merged] = _concat_rows(ws, spec, rules)
    del ws  # the parts are freed here unless someone else holds them


def _check_row_part(name: str, w, spec: ParamSpec):
    st = storage_structs(spec)
    want = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), st)
    got = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), w)
    same_type = type(w) is type(st) if Q.is_quantized(st) else not Q.is_quantized(w)
    if not same_type or got != want:
        raise ValueError(f"merge_x_proj: {name} is {type(w).__name__} {got}, expected "
                         f"{spec.fmt} {spec.shape}")
