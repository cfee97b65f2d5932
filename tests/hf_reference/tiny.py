"""A tiny DeepSeek-V4 config (all three layer types, hash layers, an MTP entry) and random
official-named float32 weights for it. numpy only; shared by the hf_reference tests."""
from __future__ import annotations

import numpy as np


def tiny_config(**over) -> dict:
    """HF config.json dict: layers SWA, CSA, HCA, CSA (+ MTP entry 0), 2 hash layers.

    32 indexer heads: with few heads, indexer scores of exactly 0 (every relu term 0) are
    common and top-k among such ties is arbitrary (see NOTES.md, difference 7)."""
    cfg = dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"],
        vocab_size=97, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, norm_topk_prob=True,
        num_hash_layers=2, index_n_heads=32, index_head_dim=128, index_topk=4,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536,
                          beta_fast=32, beta_slow=1),
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        compress_ratios=[0, 4, 128, 4, 0], num_nextn_predict_layers=1,
        max_position_embeddings=1048576, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0",
                                 weight_block_size=[128, 128]),
        expert_dtype="fp4",
    )
    cfg.update(over)
    return cfg


def official_shapes(cfg: dict, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Official tensor name -> logical (dequantised) shape, written from CHECKPOINT_FORMAT.md A."""
    d, V, H, D = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, G, L = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    E, I, k = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    nI, cI, hc = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hc_mult"]
    mix = (2 + hc) * hc
    s: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, d), "head.weight": (V, d), "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,),
    }

    def block(p: str, layer: int) -> None:
        r = cfg["compress_ratios"][layer]
        s.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        for w in ("attn", "ffn"):
            s.update({p + f"hc_{w}_fn": (mix, hc * d), p + f"hc_{w}_base": (mix,), p + f"hc_{w}_scale": (3,)})
        a = p + "attn."
        s.update({a + "attn_sink": (H,), a + "wq_a.weight": (q, d), a + "q_norm.weight": (q,),
                  a + "wq_b.weight": (H * D, q), a + "wkv.weight": (D, d), a + "kv_norm.weight": (D,),
                  a + "wo_a.weight": (G * L, H * D // G), a + "wo_b.weight": (d, G * L)})
        if r:
            coff = 2 if r == 4 else 1
            c = a + "compressor."
            s.update({c + "wkv.weight": (coff * D, d), c + "wgate.weight": (coff * D, d),
                      c + "ape": (r, coff * D), c + "norm.weight": (D,)})
        if r == 4:
            x = a + "indexer."
            s.update({x + "wq_b.weight": (nI * cI, q), x + "weights_proj.weight": (nI, d),
                      x + "compressor.wkv.weight": (2 * cI, d), x + "compressor.wgate.weight": (2 * cI, d),
                      x + "compressor.ape": (r, 2 * cI), x + "compressor.norm.weight": (cI,)})
        f = p + "ffn."
        s[f + "gate.weight"] = (E, d)
        if layer < cfg["num_hash_layers"]:
            s[f + "gate.tid2eid"] = (V, k)
        else:
            s[f + "gate.bias"] = (E,)
        for e in range(E):
            s.update({f + f"experts.{e}.w1.weight": (I, d), f + f"experts.{e}.w3.weight": (I, d),
                      f + f"experts.{e}.w2.weight": (d, I)})
        s.update({f + "shared_experts.w1.weight": (I, d), f + "shared_experts.w3.weight": (I, d),
                  f + "shared_experts.w2.weight": (d, I)})

    for i in range(cfg["num_hidden_layers"]):
        block(f"layers.{i}.", i)
    if include_mtp:
        for j in range(cfg["num_nextn_predict_layers"]):
            p = f"mtp.{j}."
            block(p, cfg["num_hidden_layers"] + j)
            s.update({p + "e_proj.weight": (d, d), p + "h_proj.weight": (d, d), p + "enorm.weight": (d,),
                      p + "hnorm.weight": (d,), p + "norm.weight": (d,), p + "hc_head_fn": (hc, hc * d),
                      p + "hc_head_base": (hc,), p + "hc_head_scale": (1,)})
    return s


def random_weights(cfg: dict, rng: np.random.Generator, include_mtp: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights (int64 tid2eid) scaled so activations stay O(1)."""
    E = cfg["n_routed_experts"]
    out: dict[str, np.ndarray] = {}
    for name, shape in official_shapes(cfg, include_mtp).items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
            out[name] = np.stack([rng.permutation(E)[: shape[1]] for _ in range(shape[0])]).astype(np.int64)
            continue
        if "norm" in leaf:  # RMSNorm weights
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf.endswith("_fn"):
            v = 0.05 * rng.standard_normal(shape)
        elif leaf.endswith("_scale"):
            v = 0.5 + 0.5 * rng.random(shape)
        elif leaf.endswith("_base") or leaf in ("ape", "bias"):
            v = 0.3 * rng.standard_normal(shape)
        elif leaf == "attn_sink":
            v = rng.standard_normal(shape)
        elif leaf == "embed":
            v = rng.standard_normal(shape)
        else:  # linears [out, in]
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = v.astype(np.float32)
    return out
