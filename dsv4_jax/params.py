"""One description of every parameter (shape, format, logical axes, init rule).

Random init, abstract shapes (`jax.eval_shape`-free: ShapeDtypeStructs straight from the
description), checkpoint restore targets, shardings and parameter counts all derive from
`describe(cfg)`.

Parameter tree: a flat dict keyed by the OFFICIAL checkpoint names. Linears that may be
quantised are keyed by module path (`layers.3.attn.wq_a`) and hold a quant type from
`quant.py` (checkpoint tensors `<key>.weight` / `<key>.scale`); plain tensors keep the full
name (`layers.3.attn_norm.weight`). Routed experts are stacked along a leading expert axis:
`layers.N.ffn.experts.w1` holds all E experts' w1 ([E, out, in] logical).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from .config import Config
from . import quant as Q


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]  # logical (dequantised) shape
    fmt: str  # "bf16" | "f32" | "i32" | "fp8" | "fp4" | "nvfp4"
    axes: tuple[str | None, ...]  # logical axis names, one per logical dim
    init: str = "linear"  # linear | norm | embed | hc_fn | hc_scale | normal | small | ape | tid2eid

    @property
    def quantized(self) -> bool:
        return self.fmt in ("fp8", "fp4", "nvfp4")


# ---------------------------------------------------------------------------------------
# The decode form of a CSA block: its five x-projections stored as one weight
# ---------------------------------------------------------------------------------------
X_PROJ = "x_proj_merged"
# The weights `attn.x_proj_merged` holds, in row order (names relative to "attn."). All five
# are bf16 [rows, hidden] and multiply the same normed input x.
X_PROJ_PARTS = ("compressor.wkv.weight", "compressor.wgate.weight",
                "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight",
                "indexer.weights_proj.weight")


def x_proj_sizes(cfg: Config) -> tuple[int, ...]:
    """Rows of each X_PROJ_PARTS weight: 2*head_dim, 2*head_dim, 2*index_head_dim,
    2*index_head_dim, index_n_heads (Flash: 1024, 1024, 256, 256, 64 = 2624 rows, i.e.
    rows [0, 1024) compressor wkv, [1024, 2048) compressor wgate, [2048, 2304) indexer
    compressor wkv, [2304, 2560) indexer compressor wgate, [2560, 2624) indexer
    weights_proj)."""
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    return (2 * hd, 2 * hd, 2 * ihd, 2 * ihd, cfg.index_n_heads)


def x_proj_spec(cfg: Config) -> ParamSpec:
    """`attn.x_proj_merged` [sum(x_proj_sizes), hidden] bf16. Logical axis "x_proj" is
    replicated (distributed.REPLICATED), as 4 of the 5 parts are; the fifth, weights_proj,
    had its rows on "model" ("idx_heads"): its 64 rows are now whole on every device."""
    return ParamSpec((sum(x_proj_sizes(cfg)), cfg.hidden_size), "bf16", ("x_proj", "embed"))


# The decode form also stores pairs of linears that multiply the same input as one weight,
# their rows concatenated (one weight-streaming kernel per pair instead of two): names
# relative to the block ("layers.N." / "mtp.J."), merged name -> its parts in row order.
# The routed experts' w1 + w3 are stacked [E, I, in]: their rows (axis -2) are concatenated
# per expert, [E, 2I, in], so one kernel call streams both halves of each selected expert.
ROW_MERGES = {"attn.wqkv_a": ("attn.wq_a", "attn.wkv"),
              "ffn.shared_experts.w13": ("ffn.shared_experts.w1", "ffn.shared_experts.w3"),
              "ffn.experts.w13": ("ffn.experts.w1", "ffn.experts.w3")}
ROW_MERGE_AXIS = {"attn.wqkv_a": "qkv_a", "ffn.shared_experts.w13": "mlp13",
                  "ffn.experts.w13": "mlp13"}


def row_merge_ok(parts: list[ParamSpec]) -> bool:
    """Whether weights of these specs can be stored as one, rows (axis -2) concatenated:
    same format, leading dims and columns; FP8's 128 x 128 scale blocks must not straddle
    two parts (rows multiples of 128); FP4 (e2m1, one e8m0 scale per 32 along a row) merges
    at any row count; NVFP4 has one global scale per weight, so its weights stay apart."""
    f, shp = parts[0].fmt, parts[0].shape
    if len(shp) < 2 or any(q.fmt != f or len(q.shape) != len(shp) or q.shape[:-2] != shp[:-2]
                           or q.shape[-1] != shp[-1] for q in parts):
        return False
    if f == "fp8":
        return all(q.shape[-2] % 128 == 0 for q in parts)
    return f in ("fp4", "bf16", "f32")


def _row_merged_spec(merged: str, parts: list[ParamSpec]) -> ParamSpec:
    p0 = parts[0]
    rows = sum(q.shape[-2] for q in parts)
    return ParamSpec((*p0.shape[:-2], rows, p0.shape[-1]), p0.fmt,
                     (*p0.axes[:-2], ROW_MERGE_AXIS[merged], p0.axes[-1]), p0.init)


def _block_specs(cfg: Config, p: str, layer: int,
                 x_proj_merged: bool = False) -> dict[str, ParamSpec]:
    d, H, hd, ql = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol, E, I = cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
    lin, exp_fmt = cfg.linear_dtype, cfg.expert_dtype
    hc = cfg.hc_mult
    nmix = (2 + hc) * hc
    s: dict[str, ParamSpec] = {}
    s[p + "attn_norm.weight"] = ParamSpec((d,), "bf16", ("embed",), "norm")
    s[p + "ffn_norm.weight"] = ParamSpec((d,), "bf16", ("embed",), "norm")
    for w in ("attn", "ffn"):
        s[p + f"hc_{w}_fn"] = ParamSpec((nmix, hc * d), "f32", (None, "embed_hc"), "hc_fn")
        s[p + f"hc_{w}_base"] = ParamSpec((nmix,), "f32", (None,), "normal")
        s[p + f"hc_{w}_scale"] = ParamSpec((3,), "f32", (None,), "hc_scale")
    a = p + "attn."
    s[a + "attn_sink"] = ParamSpec((H,), "f32", ("heads",), "normal")
    s[a + "wq_a"] = ParamSpec((ql, d), lin, ("q_lora", "embed"))
    s[a + "q_norm.weight"] = ParamSpec((ql,), "bf16", ("q_lora",), "norm")
    s[a + "wq_b"] = ParamSpec((H * hd, ql), lin, ("heads_hd", "q_lora"))
    s[a + "wkv"] = ParamSpec((hd, d), lin, ("head_dim", "embed"))
    s[a + "kv_norm.weight"] = ParamSpec((hd,), "bf16", ("head_dim",), "norm")
    s[a + "wo_a"] = ParamSpec((G * ol, H * hd // G), lin, ("o_groups_lora", "group_hd"))
    s[a + "wo_b"] = ParamSpec((d, G * ol), lin, ("embed", "o_groups_lora"))
    r = cfg.layer_ratio(layer)
    if r > 0:
        coff = 2 if r == 4 else 1
        c = a + "compressor."
        s[c + "wkv.weight"] = ParamSpec((coff * hd, d), "bf16", ("cmp_hd", "embed"))
        s[c + "wgate.weight"] = ParamSpec((coff * hd, d), "bf16", ("cmp_hd", "embed"))
        s[c + "ape"] = ParamSpec((r, coff * hd), "f32", (None, "cmp_hd"), "ape")
        s[c + "norm.weight"] = ParamSpec((hd,), "bf16", ("head_dim",), "norm")
    if r == 4:
        ix, nI, ihd = a + "indexer.", cfg.index_n_heads, cfg.index_head_dim
        s[ix + "wq_b"] = ParamSpec((nI * ihd, ql), lin, ("idx_heads_hd", "q_lora"))
        s[ix + "weights_proj.weight"] = ParamSpec((nI, d), "bf16", ("idx_heads", "embed"))
        c = ix + "compressor."
        s[c + "wkv.weight"] = ParamSpec((2 * ihd, d), "bf16", (None, "embed"))
        s[c + "wgate.weight"] = ParamSpec((2 * ihd, d), "bf16", (None, "embed"))
        s[c + "ape"] = ParamSpec((r, 2 * ihd), "f32", (None, None), "ape")
        s[c + "norm.weight"] = ParamSpec((ihd,), "bf16", (None,), "norm")
        if x_proj_merged:
            for k in X_PROJ_PARTS:
                del s[a + k]
            s[a + X_PROJ] = x_proj_spec(cfg)
    f = p + "ffn."
    s[f + "gate.weight"] = ParamSpec((E, d), "bf16", ("experts_r", "embed"))
    if cfg.is_hash_layer(layer):
        s[f + "gate.tid2eid"] = ParamSpec((cfg.vocab_size, cfg.num_experts_per_tok), "i32",
                                          ("vocab", None), "tid2eid")
    else:
        s[f + "gate.bias"] = ParamSpec((E,), "f32", ("experts_r",), "small")
    s[f + "experts.w1"] = ParamSpec((E, I, d), exp_fmt, ("experts", "mlp", "embed"))
    s[f + "experts.w3"] = ParamSpec((E, I, d), exp_fmt, ("experts", "mlp", "embed"))
    s[f + "experts.w2"] = ParamSpec((E, d, I), exp_fmt, ("experts", "embed", "mlp"))
    if cfg.n_shared_experts:
        s[f + "shared_experts.w1"] = ParamSpec((I, d), lin, ("mlp", "embed"))
        s[f + "shared_experts.w3"] = ParamSpec((I, d), lin, ("mlp", "embed"))
        s[f + "shared_experts.w2"] = ParamSpec((d, I), lin, ("embed", "mlp"))
    if x_proj_merged:
        for m, names in ROW_MERGES.items():
            parts = [s.get(p + n) for n in names]
            if all(parts) and row_merge_ok(parts):
                for n in names:
                    del s[p + n]
                s[p + m] = _row_merged_spec(m, parts)
    return s


def describe(cfg: Config, include_mtp: bool = True,
             x_proj_merged: bool = False) -> dict[str, ParamSpec]:
    """Every parameter by name. x_proj_merged: the decode form of `merge_x_proj`, each CSA
    block's five x-projections as one `attn.x_proj_merged`, and every block's ROW_MERGES
    pairs (where row_merge_ok) as one weight each."""
    d, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    s: dict[str, ParamSpec] = {}
    s["embed.weight"] = ParamSpec((V, d), "bf16", ("vocab", "embed"), "embed")
    for i in range(cfg.num_hidden_layers):
        s.update(_block_specs(cfg, f"layers.{i}.", i, x_proj_merged))
    s["norm.weight"] = ParamSpec((d,), "bf16", ("embed",), "norm")
    s["hc_head_fn"] = ParamSpec((hc, hc * d), "f32", (None, "embed_hc"), "hc_fn")
    s["hc_head_base"] = ParamSpec((hc,), "f32", (None,), "normal")
    s["hc_head_scale"] = ParamSpec((1,), "f32", (None,), "hc_scale")
    s["head.weight"] = ParamSpec((V, d), "bf16", ("vocab", "embed"), "linear")
    if include_mtp:
        for j in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{j}."
            s.update(_block_specs(cfg, p, cfg.num_hidden_layers + j, x_proj_merged))
            s[p + "e_proj"] = ParamSpec((d, d), cfg.linear_dtype, ("embed", "embed_in"))
            s[p + "h_proj"] = ParamSpec((d, d), cfg.linear_dtype, ("embed", "embed_in"))
            for n in ("enorm", "hnorm", "norm"):
                s[p + n + ".weight"] = ParamSpec((d,), "bf16", ("embed",), "norm")
            s[p + "hc_head_fn"] = ParamSpec((hc, hc * d), "f32", (None, "embed_hc"), "hc_fn")
            s[p + "hc_head_base"] = ParamSpec((hc,), "f32", (None,), "normal")
            s[p + "hc_head_scale"] = ParamSpec((1,), "f32", (None,), "hc_scale")
    return s


# ---------------------------------------------------------------------------------------
# Storage layout of each format: the arrays a leaf is made of
# ---------------------------------------------------------------------------------------
def storage_structs(spec: ParamSpec):
    """The leaf as ShapeDtypeStructs (a quant type, or one struct)."""
    *lead, o, i = spec.shape if len(spec.shape) >= 2 else (None, *spec.shape)
    S = jax.ShapeDtypeStruct
    if spec.fmt == "fp8":
        return Q.Fp8Weight(S(spec.shape, jnp.float8_e4m3fn),
                           S((*lead, -(-o // 128), -(-i // 128)), jnp.float8_e8m0fnu))
    if spec.fmt == "fp4":
        return Q.Fp4Weight(S((*lead, o, i // 2), jnp.int8), S((*lead, o, i // 32), jnp.float8_e8m0fnu))
    if spec.fmt == "nvfp4":
        return Q.NvFp4Weight(S((*lead, o, i // 2), jnp.uint8), S((*lead, o, i // 16), jnp.float8_e4m3fn),
                             S(tuple(lead), jnp.float32))
    dt = {"bf16": jnp.bfloat16, "f32": jnp.float32, "i32": jnp.int32}[spec.fmt]
    return S(spec.shape, dt)


def abstract_params(cfg: Config, include_mtp: bool = True, x_proj_merged: bool = False) -> dict:
    """Parameter tree of ShapeDtypeStructs; no memory is allocated."""
    return {k: storage_structs(v) for k, v in describe(cfg, include_mtp, x_proj_merged).items()}


def count_params(cfg: Config, include_mtp: bool = True) -> int:
    """Logical parameter count (a packed FP4 byte counts as two parameters)."""
    return sum(int(np.prod(s.shape)) for s in describe(cfg, include_mtp).values())


def nbytes(cfg: Config, include_mtp: bool = True) -> int:
    leaves = jax.tree.leaves(abstract_params(cfg, include_mtp))
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


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
    import ml_dtypes
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
    e.g. distributed.param_shardings) draws each array straight into its shards, so a
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
def x_proj_is_merged(params: dict) -> bool:
    """Whether a parameter tree is in merge_x_proj's decode form (any block with
    x_proj_merged or one of ROW_MERGES)."""
    ends = ("attn." + X_PROJ, *ROW_MERGES)
    return any(k.endswith(ends) for k in params)


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
        from . import distributed
        sh = jax.tree.map(lambda p: jax.sharding.NamedSharding(sh.mesh, p),
                          distributed.param_pspecs(spec, sh.mesh, rules))
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

    Every block (MTP included) also gets its ROW_MERGES pairs stored as one weight each,
    rows concatenated in order (every stored array: FP8 values and their block scales):
    `attn.wqkv_a` = wq_a + wkv, `ffn.shared_experts.w13` = shared w1 + w3,
    `ffn.experts.w13` = the routed experts' w1 + w3 per expert ([E, 2I, hidden]), where
    row_merge_ok (FP8 with rows in whole 128-row scale blocks, FP4, or plain; NVFP4 stays
    apart). The layer code reads them as row views too, so each pair is one
    weight-streaming kernel per step instead of two (4 Flash layers compiled for an H100:
    284 -> 272 kernels, 50 -> 42 matmul kernels).

    Why: the layer code reads the five as row views of the merged weight
    (layers.block_params), so a step multiplies x by it in one dot. Stored apart, XLA's dot
    merger makes the same one dot but concatenates the five weights every step (21.5 MB
    per Flash CSA layer, BENCHMARKS.md "The weight concat of the CSA layers").

    Logits are bit-identical to the unmerged tree's on CPU (tests/test_x_proj_merge.py);
    on a GPU the unmerged step already ran the five as this one dot (the same GEMM shape in
    the compiled H100 step), over the per-step copy. Blocks
    already merged are left alone (merging twice is a no-op); a block holding the merged
    weight and some of the five, or only some of the five, raises ValueError. Blocks
    missing from the tree (e.g. loaded without MTP) are skipped.

    Placement: host (numpy) weights give a host weight; device weights a weight on the
    same device; weights on a mesh a weight placed by the sharding rules (logical axes
    ("x_proj", "embed"): replicated under distributed.RULES; `rules` overrides).
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
    blocks = [(f"layers.{i}.", i) for i in range(cfg.num_hidden_layers)]
    blocks += [(f"mtp.{j}.", cfg.num_hidden_layers + j)
               for j in range(cfg.num_nextn_predict_layers)]
    for b, layer in blocks:
        specs, merged = _block_specs(cfg, b, layer), _block_specs(cfg, b, layer, True)
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
