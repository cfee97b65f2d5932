"""DeepSeek-V4 building blocks as pure functions over parameter dicts.

Every function takes the block's params (official names with the block prefix stripped,
see `block_params`), activations, and a static `Numerics`. Shapes: B batch, T tokens,
D hidden, H heads, K head_dim (512), R rope dims (64), N hc streams (4), E experts.

    norms       rms_norm, norm_act (+ the matmul kernels' FP8 input at decode sizes)
    rope        rope_freqs, apply_rope
    mhc         hyper-connections: hc_sums, hc_weights, hc_site, hc_collapse, hc_expand
    compressor  the KV compressor: compressor_project, pool_blocks, finish_entries
    indexer     the lightning indexer: indexer_query, indexer_scores, topk_mask
    attention   q_and_kv, attend, attn_output, attention_prefill
    experts     the MoE: route, moe, routed_experts, expert_schedule
    weights     block_params (merged decode-form weights as views of their parts)
"""
from __future__ import annotations

from . import experts
from .attention import attend, attention_prefill, attn_output, q_and_kv
from .compressor import compressor_project, finish_entries, kv_quant_sim, pool_blocks
from .experts import expert_ffn, expert_schedule, moe, route, routed_experts
from .indexer import indexer_query, indexer_scores, topk_mask
from .mhc import (HC_FUSED_ROWS, hc_collapse, hc_expand, hc_head, hc_site, hc_sums,
                  hc_weights, sinkhorn_reduce)
from .norms import NORM_FP8_ROWS, norm_act, rms_norm
from .rope import apply_rope, rope_freqs
from .weights import block_params, row_merge_views

__all__ = [
    "attend", "attention_prefill", "attn_output", "q_and_kv",
    "compressor_project", "finish_entries", "kv_quant_sim", "pool_blocks",
    "expert_ffn", "expert_schedule", "moe", "route", "routed_experts",
    "indexer_query", "indexer_scores", "topk_mask",
    "HC_FUSED_ROWS", "hc_collapse", "hc_expand", "hc_head", "hc_site", "hc_sums",
    "hc_weights", "sinkhorn_reduce",
    "NORM_FP8_ROWS", "norm_act", "rms_norm",
    "apply_rope", "rope_freqs",
    "block_params", "row_merge_views",
]
