"""Parameter names: official DeepSeek-V4 checkpoint <-> Hugging Face `transformers` port.

Pure Python (no numpy/torch/jax), so it can be imported from either virtual environment,
by module path or by file path.

Official names are the release's tensor names (CHECKPOINT_FORMAT.md section A), e.g.
`layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.17.w1.scale`, `mtp.0.e_proj.weight`.
HF names follow `transformers.models.deepseek_v4` (its `conversion_mapping` entry and module
tree), e.g. `model.layers.3.self_attn.q_a_proj.weight`. Routed experts get the per-expert
HF checkpoint spelling `model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`
(section B); the port itself stacks them into `mlp.experts.gate_up_proj` [E, 2I, d]
(= concat(w1, w3) along dim 1) and `mlp.experts.down_proj` [E, d, I]: see `packed_expert_slot`.
Block scales `X.scale` map to `X.weight_scale_inv` (the name the port's FP8 loader uses).

The port has no MTP module; `mtp.J.*` maps to our own convention `mtp.J.<layer-style suffix>`
plus `mtp.J.{e_proj,h_proj,enorm,hnorm,norm}.weight` and `mtp.J.hc_head.hc_{fn,base,scale}`;
the DSpark drafter's extras (`main_proj`, `main_norm`, `markov_head.*`, `confidence_head.*`)
keep their official suffixes.

Unknown names raise KeyError naming the key.
"""
from __future__ import annotations

import re

# Whole-model tensors.
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Linears that may carry an FP8/FP4 block scale (`.scale`) in the official checkpoint:
# official module suffix (inside a block) -> HF module suffix.
_QUANT_LINEARS = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
}

# Plain tensors inside a block (layers.N. / mtp.J.): official suffix -> HF suffix.
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    # compressor (CSA and HCA layers)
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    # lightning indexer (CSA layers)
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    # router
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}
for _o, _h in _QUANT_LINEARS.items():
    _BLOCK[_o + ".weight"] = _h + ".weight"
    _BLOCK[_o + ".scale"] = _h + ".weight_scale_inv"

# MTP-only tensors (inside mtp.J.).
_MTP_EXTRA = {
    "e_proj.weight": "e_proj.weight",
    "e_proj.scale": "e_proj.weight_scale_inv",
    "h_proj.weight": "h_proj.weight",
    "h_proj.scale": "h_proj.weight_scale_inv",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    # the DSpark drafter of V4-Flash-0731 (mtp.0..S-1 are its stages, no e/h_proj)
    "main_proj.weight": "main_proj.weight",
    "main_proj.scale": "main_proj.weight_scale_inv",
    "main_norm.weight": "main_norm.weight",
    "markov_head.markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_head.markov_w2.weight",
    "confidence_head.proj.weight": "confidence_head.proj.weight",
}

_EXPERT_PART = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_KIND = {"weight": "weight", "scale": "weight_scale_inv"}


def _invert(d: dict[str, str]) -> dict[str, str]:
    inv = {v: k for k, v in d.items()}
    assert len(inv) == len(d), "name table is not one-to-one"
    return inv


_TOP_INV, _BLOCK_INV, _MTP_EXTRA_INV = _invert(_TOP), _invert(_BLOCK), _invert(_MTP_EXTRA)
_EXPERT_PART_INV, _EXPERT_KIND_INV = _invert(_EXPERT_PART), _invert(_EXPERT_KIND)

_OFF_BLOCK = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_OFF_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_HF_BLOCK = re.compile(r"^(model\.layers|mtp)\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def official_to_hf(name: str) -> str:
    """Official checkpoint tensor name -> HF name. KeyError if `name` is not a V4 tensor."""
    if name in _TOP:
        return _TOP[name]
    m = _OFF_BLOCK.match(name)
    if m:
        kind, idx, rest = m.groups()
        prefix = f"model.layers.{idx}." if kind == "layers" else f"mtp.{idx}."
        if rest in _BLOCK:
            return prefix + _BLOCK[rest]
        if kind == "mtp" and rest in _MTP_EXTRA:
            return prefix + _MTP_EXTRA[rest]
        e = _OFF_EXPERT.match(rest)
        if e:
            expert, w, k = e.groups()
            return f"{prefix}mlp.experts.{expert}.{_EXPERT_PART[w]}.{_EXPERT_KIND[k]}"
    raise KeyError(f"unknown official DeepSeek-V4 tensor name: {name!r}")


def hf_to_official(name: str) -> str:
    """HF name -> official checkpoint tensor name. KeyError if `name` is unknown.

    The port's stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` hold many official
    tensors and have no single official name: they raise KeyError too (see
    `packed_expert_slot` for the per-expert names).
    """
    if name in _TOP_INV:
        return _TOP_INV[name]
    m = _HF_BLOCK.match(name)
    if m:
        kind, idx, rest = m.groups()
        prefix = f"layers.{idx}." if kind == "model.layers" else f"mtp.{idx}."
        if rest in _BLOCK_INV:
            return prefix + _BLOCK_INV[rest]
        if kind == "mtp" and rest in _MTP_EXTRA_INV:
            return prefix + _MTP_EXTRA_INV[rest]
        e = _HF_EXPERT.match(rest)
        if e:
            expert, part, k = e.groups()
            return f"{prefix}ffn.experts.{expert}.{_EXPERT_PART_INV[part]}.{_EXPERT_KIND_INV[k]}"
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            raise KeyError(f"{name!r} stacks all routed experts (no single official name); "
                           "see packed_expert_slot()")
    raise KeyError(f"unknown HF DeepSeek-V4 tensor name: {name!r}")


def packed_expert_slot(hf_name: str) -> tuple[str, int, str] | None:
    """Per-expert HF weight name -> (port parameter name, expert index, part), or None.

    part is "gate" (rows [:I] of gate_up_proj[e]), "up" (rows [I:]) or "down" (down_proj[e]).
    Returns None for every other name (including scales: the port holds no scales here).
    """
    m = _HF_BLOCK.match(hf_name)
    if not m or m.group(1) != "model.layers":
        return None
    e = _HF_EXPERT.match(m.group(3))
    if not e or e.group(3) != "weight":
        return None
    expert, part, _ = e.groups()
    base = f"model.layers.{m.group(2)}.mlp.experts."
    if part == "down_proj":
        return base + "down_proj", int(expert), "down"
    return base + "gate_up_proj", int(expert), "gate" if part == "gate_proj" else "up"
