"""The lightning indexer of the CSA layers: which compressed entries each query attends.

    qI_BTHc, w_BTH = indexer_query(p, x_BTD, cq, pos_BT, freqs, cfg, nm[, cqq])
    I_BTn = indexer_scores(qI_BTHc, w_BTH, keys_Bnc)
    mask_BTn, idx_BTk = topk_mask(I_BTn, eligible_BTn, k)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import Config
from ..quant import Numerics, fp4_block_sim, linear
from .compressor import hadamard
from .rope import apply_rope

F32 = jnp.float32


def indexer_query(p, x, cq, pos, freqs, cfg: Config, nm: Numerics, cqq=None):
    """qI [B, T, nI, 128] (rope, Hadamard, FP4 sim) and head weights w [B, T, nI] f32.
    cqq: cq's padded FP8 simulation, if q_and_kv made one."""
    B, T, _ = x.shape
    nI, c = cfg.index_n_heads, cfg.index_head_dim
    q = linear(cq, p["wq_b"], nm, xq=cqq).reshape(B, T, nI, c)
    q = apply_rope(q, pos, freqs)
    q = hadamard(q)
    if nm.act_quant:
        q = fp4_block_sim(q, 32)
    q = q.astype(nm.jdtype)
    w = linear(x, p["weights_proj.weight"], nm, out_dtype=F32) * (c ** -0.5 * nI ** -0.5)
    return q, w


def indexer_scores(qI, w, keys):
    """I[b, t, i] = sum_h w[b,t,h] relu(qI[b,t,h] . K[b,i]). qI [B,T,nI,c], keys [B,n,c]."""
    s = jnp.einsum("bthc,bnc->bthn", qI.astype(F32), keys.astype(F32), precision="highest")
    return jnp.einsum("bth,bthn->btn", w, jax.nn.relu(s), precision="highest")


def topk_mask(scores, eligible, k):
    """Boolean [..., n] mask of the top-min(k, #eligible) eligible entries."""
    n = scores.shape[-1]
    k = min(k, n)
    s = jnp.where(eligible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(s, k)
    sel = jnp.zeros(scores.shape, bool)
    sel = jnp.any(jax.nn.one_hot(idx, n, dtype=bool), axis=-2) if k > 0 else sel
    return sel & eligible, idx
