"""One description of every parameter (shape, format, logical axes, init rule):
`describe(cfg)` -> {name: ParamSpec}.

Random init (params.py), abstract shapes (ShapeDtypeStructs straight from the
description), checkpoint restore targets (loading.py), shardings (sharding.py) and
parameter counts all derive from it.

Parameter tree: a flat dict keyed by the OFFICIAL checkpoint names. Linears that may be
quantised are keyed by module path (`layers.3.attn.wq_a`) and hold a quant type from
`quant.py` (checkpoint tensors `<key>.weight` / `<key>.scale`); plain tensors keep the full
name (`layers.3.attn_norm.weight`). Routed experts are stacked along a leading expert axis:
`layers.N.ffn.experts.w1` holds all E experts' w1 ([E, out, in] logical).
"""
from __future__ import annotations

import dataclasses

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
    replicated (sharding.REPLICATED), as 4 of the 5 parts are; the fifth, weights_proj,
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


def _block_specs(cfg: Config, p: str, layer: int, x_proj_merged: bool = False,
                 ratio: int | None = None) -> dict[str, ParamSpec]:
    """The parameters of one block at prefix `p`; `ratio` overrides the config's ratio of
    `layer` (the DSpark stages: window-only blocks past the config's compress_ratios)."""
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
    r = cfg.layer_ratio(layer) if ratio is None else ratio
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
        if cfg.dspark:
            s.update(dspark_specs(cfg, x_proj_merged))
    return s


def dspark_blocks(cfg: Config) -> list[tuple[str, int]]:
    """The DSpark drafter's stages as (prefix, layer index): `mtp.j.`, num_hidden_layers + j
    (score-routed, window-only blocks: the layer index only keeps them off hash routing)."""
    return [(f"mtp.{j}.", cfg.num_hidden_layers + j) for j in range(cfg.dspark_num_stages)]


def dspark_specs(cfg: Config, x_proj_merged: bool = False) -> dict[str, ParamSpec]:
    """The DSpark drafter of V4-Flash-0731 (S stages, names as the release stores them):
    every stage a full block (ratio 0); stage 0 also main_proj [D, S*D] (linear format) +
    main_norm, which project the concatenated target-layer hidden states; the last stage
    also the head's hc_head_* + norm, the Markov head's markov_w1 [V, r] (bf16 embedding)
    and markov_w2 [V, r] (f32), and the confidence head's proj [1, D + r] (f32)."""
    d, V, hc, r = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.dspark_markov_rank
    s: dict[str, ParamSpec] = {}
    for p, layer in dspark_blocks(cfg):
        s.update(_block_specs(cfg, p, layer, x_proj_merged, ratio=0))
    s["mtp.0.main_proj"] = ParamSpec((d, d * cfg.dspark_num_stages), cfg.linear_dtype,
                                     ("embed", "embed_in"))
    s["mtp.0.main_norm.weight"] = ParamSpec((d,), "bf16", ("embed",), "norm")
    p = f"mtp.{cfg.dspark_num_stages - 1}."
    s[p + "norm.weight"] = ParamSpec((d,), "bf16", ("embed",), "norm")
    s[p + "hc_head_fn"] = ParamSpec((hc, hc * d), "f32", (None, "embed_hc"), "hc_fn")
    s[p + "hc_head_base"] = ParamSpec((hc,), "f32", (None,), "normal")
    s[p + "hc_head_scale"] = ParamSpec((1,), "f32", (None,), "hc_scale")
    s[p + "markov_head.markov_w1.weight"] = ParamSpec((V, r), "bf16", ("vocab", None), "small")
    s[p + "markov_head.markov_w2.weight"] = ParamSpec((V, r), "f32", ("vocab", None))
    s[p + "confidence_head.proj.weight"] = ParamSpec((1, d + r), "f32", (None, None))
    return s


def x_proj_is_merged(params: dict) -> bool:
    """Whether a parameter tree is in merge_x_proj's decode form (any block with
    x_proj_merged or one of ROW_MERGES)."""
    ends = ("attn." + X_PROJ, *ROW_MERGES)
    return any(k.endswith(ends) for k in params)


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
