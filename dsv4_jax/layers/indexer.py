"""The lightning indexer of the CSA layers: which compressed entries each query attends.

    qI_BTHc, w_BTH = indexer_query(p, x_BTD, cq, pos_BT, freqs, cfg, nm[, cqq])
    I_BTn = indexer_scores(qI_BTHc, w_BTH, keys_Bnc)
    mask_BTn, idx_BTk = topk_mask(I_BTn, eligible_BTn, k)
    idx_BTk = topk_ids_blocked(qI_BTHc, w_BTH, keys_Bnc, nvis_BT, k)   # many queries
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


# Elements of one query block's [b, q, nI, n] f32 head scores in topk_ids_blocked (256 MiB).
SCORE_BLOCK_ELEMS = 1 << 26


def topk_ids_blocked(qI, w, keys, nvis, k):
    """The ids of topk_mask(indexer_scores(qI, w, keys), arange(n) < nvis, k), valid ids
    first, scored in blocks of query rows: no [B, T, n] (or [B, T, nI, n]) array exists.
    qI [B, T, nI, c], w [B, T, nI], keys [B, n, c], nvis [B, T] int (row t's eligible
    entries are 0 .. nvis - 1) -> idx [B, T, min(k, n)] int32: the first min(k, nvis) are
    the chosen entries (in score order), the rest arbitrary (the caller counts them)."""
    B, T, nI, _ = qI.shape
    n = keys.shape[1]
    k = min(k, n)
    if k == 0:
        return jnp.zeros((B, T, 0), jnp.int32)
    qb = max(1, min(T, SCORE_BLOCK_ELEMS // max(1, B * nI * n)))
    nb = -(-T // qb)
    pad = nb * qb - T

    def blocks(a):   # [B, T, ...] -> [nb, B, qb, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, nb, qb, *a.shape[2:]), 1, 0)

    def one(args):
        qb_, wb_, nv = args
        s = indexer_scores(qb_, wb_, keys)                          # [B, qb, n]
        s = jnp.where(jnp.arange(n) < nv[..., None], s, -jnp.inf)
        return jax.lax.top_k(s, k)[1].astype(jnp.int32)             # eligible ones first

    idx = jax.lax.map(one, (blocks(qI), blocks(w), blocks(nvis)))   # [nb, B, qb, k]
    return jnp.moveaxis(idx, 0, 1).reshape(B, nb * qb, k)[:, :T]
