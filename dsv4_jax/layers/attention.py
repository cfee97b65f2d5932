"""Attention of one block: the query heads and the shared K=V row, scores over the keys
with a sink in the denominator, the grouped output projection; and the whole-sequence
form (prefill from position 0, no cache) with the sliding window, the compressed entries
and, on CSA layers, the indexer's top-k.

    q_BTHK, kv_BTK, cq, cqq = q_and_kv(p, x_BTD, pos_BT, freqs, cfg, nm[, xq])
    o_BTHK = attend(q_BTHK, keys_B1SK, mask_BTS, sink_H, nm)
    y_BTD = attn_output(p, o_BTHK, pos_BT, freqs, cfg, nm)
    y_BTD = attention_prefill(p, x_BTD, cfg, nm, ratio[, debug, xq])
    o_BTHK = sparse_chunk_attention(q_BTHK, ring_BWK, ring_pos_BW, kv_BTK, pos_B, nvalid_B,
                                    ents_BNK, ids_BTL, ncmp_BT, sink_H, nm, kernels)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_prefill_attention import BLK, sparse_prefill_attention, window_table

from ..config import Config
from ..quant import KERNEL_MAX_ROWS, Fp8Weight, Numerics, dequant, grouped_linear, linear
from .compressor import compress_sequence, kv_quant_sim
from .indexer import indexer_query, indexer_scores, topk_mask
from .norms import norm_act, rms_norm
from .rope import apply_rope, rope_freqs
from .weights import block_params

F32 = jnp.float32


def attend(q, keys, mask, sink, nm: Numerics):
    """q [B, T, H, K], keys [B, T or 1, S, K] (K = V), mask [B, T, S] bool, sink [H] ->
    out [B, T, H, K] f32. p_j = exp(s_j) / (sum exp(s_j) + exp(sink))."""
    K = q.shape[-1]
    s = jnp.einsum("bthk,btsk->bths", q.astype(F32), keys.astype(F32),
                   precision="highest") / math.sqrt(K)
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    sink = sink.astype(F32)[None, None, :]
    m = jnp.maximum(jnp.max(s, -1), sink)
    p = jnp.exp(s - m[..., None])
    denom = p.sum(-1) + jnp.exp(sink - m)
    if nm.jdtype == jnp.bfloat16:  # the reference kernel rounds P to bf16 before P.V
        p = p.astype(jnp.bfloat16).astype(F32)
    o = jnp.einsum("bths,btsk->bthk", p, keys.astype(F32), precision="highest")
    return o / denom[..., None]


def q_and_kv(p, x, pos, freqs, cfg: Config, nm: Numerics, xq=None, sim_kv=True):
    """Query heads [B,T,H,K], the shared K=V row [B,T,K] (roped, FP8-simulated), cq, and
    cq's padded FP8 simulation cqq (norm_act; None off the kernel path). xq: x's, if the
    caller made one. sim_kv=False: kv without its FP8 simulation (for a caller that stores
    it quantised and reads it back: the same values, no simulation kernels)."""
    B, T, _ = x.shape
    H, K = cfg.num_attention_heads, cfg.head_dim
    cq, cqq = norm_act(linear(x, p["wq_a"], nm, xq=xq), p["q_norm.weight"], cfg, nm)
    q = linear(cq, p["wq_b"], nm, xq=cqq).reshape(B, T, H, K)
    q = rms_norm(q, None, cfg.rms_norm_eps, nm.jdtype)  # weightless per-head norm
    q = apply_rope(q, pos, freqs)
    kv = rms_norm(linear(x, p["wkv"], nm, xq=xq), p["kv_norm.weight"], cfg.rms_norm_eps,
                  nm.jdtype)
    kv = apply_rope(kv, pos, freqs)
    if sim_kv:
        kv = kv_quant_sim(kv, cfg, nm)
    return q, kv, cq, cqq


def attn_output(p, o, pos, freqs, cfg: Config, nm: Numerics):
    """Inverse rope, grouped wo_a (bf16, no activation quant, as the reference), wo_b.
    o [B, T, H, K] f32 -> [B, T, D]."""
    B, T, H, K = o.shape
    G = cfg.o_groups
    o = apply_rope(o.astype(nm.jdtype), pos, freqs, inverse=True)
    og = o.reshape(B, T, G, H // G * K)
    w = p["wo_a"]
    if (nm.matmul != "xla" and isinstance(w, Fp8Weight) and cfg.o_lora_rank % 128 == 0
            and B * T <= KERNEL_MAX_ROWS):  # groups = "experts" of the weight-streaming kernel
        wg = Fp8Weight(w.w.reshape(G, cfg.o_lora_rank, -1),
                       w.scale.reshape(G, cfg.o_lora_rank // 128, -1))
        z = grouped_linear(og.reshape(B * T, G, -1).transpose(1, 0, 2),
                           None, wg, nm)  # [G, B*T, ol]; group g = weight group g
        z = z.transpose(1, 0, 2).reshape(B, T, G, -1).astype(nm.jdtype)
    else:
        wo_a = dequant(w, nm.jdtype).reshape(G, cfg.o_lora_rank, H // G * K)
        z = jnp.einsum("btgk,gok->btgo", og, wo_a, preferred_element_type=F32).astype(nm.jdtype)
    return linear(z.reshape(B, T, G * cfg.o_lora_rank), p["wo_b"], nm)


def attention_prefill(p, x, cfg: Config, nm: Numerics, ratio: int, debug=None, xq=None):
    """Whole-sequence attention from position 0 (no cache). x [B, T, D] -> [B, T, D].
    `debug`, if a dict, receives intermediates (indexer picks, compressor entries). xq:
    x's padded FP8 simulation (norm_act), if made."""
    B, T, _ = x.shape
    freqs = rope_freqs(cfg, ratio)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    q, kv, cq, cqq = q_and_kv(p, x, pos, freqs, cfg, nm, xq=xq)
    t = jnp.arange(T)
    win = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - cfg.sliding_window)
    keys, mask = kv, jnp.broadcast_to(win, (B, T, T))
    if ratio > 0:
        ent = compress_sequence(block_params(p, "compressor."), x, ratio, cfg.head_dim, freqs,
                                cfg, nm, "main", debug)  # [B, n, K]
        n = ent.shape[1]
        visible = jnp.arange(n)[None, :] < ((t + 1) // ratio)[:, None]  # [T, n]
        visible = jnp.broadcast_to(visible, (B, T, n))
        if ratio == 4 and n > 0:
            ip = block_params(p, "indexer.")
            keysI = compress_sequence(block_params(ip, "compressor."), x, ratio,
                                      cfg.index_head_dim, freqs, cfg, nm, "indexer")
            qI, wI = indexer_query(ip, x, cq, pos, freqs, cfg, nm, cqq)
            scores = indexer_scores(qI, wI, keysI)
            if debug is not None:
                debug["indexer_eligible"] = visible  # [B, T, n]: what the top-k chose from
            visible, idx = topk_mask(scores, visible, cfg.index_topk)
            if debug is not None:
                debug["indexer_scores"] = scores  # [B, T, n] (before the causal mask)
                debug["indexer_topk"] = jnp.where(jnp.take_along_axis(
                    jnp.broadcast_to(jnp.arange(n) < ((t + 1) // ratio)[:, None], (B, T, n)),
                    idx, -1), idx, -1)
        if debug is not None:
            debug["compressed_entries"] = ent
        keys = jnp.concatenate([kv, ent], 1)
        mask = jnp.concatenate([mask, visible], -1)
    o = attend(q, keys[:, None], mask, p["attn_sink"], nm)
    if debug is not None:
        debug["attn_mask"] = mask  # [B, T, T + n]: window keys (by position), then entries
        debug["attn_probs"] = attention_probs(q, keys[:, None], mask, p["attn_sink"])
    return attn_output(p, o, pos, freqs, cfg, nm)


def attention_probs(q, keys, mask, sink):
    """[B, T, H, S] attention probabilities (sink excluded, so rows sum to < 1)."""
    s = jnp.einsum("bthk,btsk->bths", q.astype(F32), keys.astype(F32),
                   precision="highest") / math.sqrt(q.shape[-1])
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    m = jnp.maximum(jnp.max(s, -1), sink.astype(F32))
    p = jnp.exp(s - m[..., None])
    return p / (p.sum(-1) + jnp.exp(sink.astype(F32) - m))[..., None]


def sparse_chunk_attention(q, ring, ring_pos, kv, pos, nvalid, ents, ids, ncmp, sink,
                           nm: Numerics, kernels: str):
    """A chunk's attention through pallas_kernels.sparse_prefill_attention, memory bounded
    (no [T, W + T + n] mask): the same values as attend over decode.attention_cached's dense
    keys and mask, to rounding. Row t of request b attends its window (ring + chunk rows by
    position, window_table) plus ents[b, ids[b, t, :ncmp[b, t]]] (CSA: the indexer's top-k,
    valid ids first) or ents[b, :ncmp[b, t]] (ids None: HCA, and the window-only layers with
    ncmp 0). kernels: CacheSpec.kernels ("on": the Hopper kernel, "interpret": it on the
    Mosaic GPU interpreter); f32 numerics (the kernel rounds q, K and P to bf16) and windows
    off the kernel's 64-key blocks take the blocked pure-JAX form.

    q [B, T, H, K]; ring [B, W, K] and ring_pos [B, W] (-1: empty) the window ring before the
    chunk; kv [B, T, K] the chunk's rows (first nvalid[b] real), at positions pos[b] + t;
    ents [B, NE, K]; ids [B, T, L] int or None; ncmp [B, T] int -> o [B, T, H, K] f32."""
    B, T, H, K = q.shape
    W = ring.shape[1]
    bf16 = nm.jdtype == jnp.bfloat16
    impl = ("xla" if not bf16 or W % BLK else "interpret" if kernels == "interpret"
            else "pallas")
    win, wbias = jax.vmap(functools.partial(window_table, window=W))(
        ring.astype(kv.dtype), ring_pos, kv, pos, nvalid)        # [B, W + T, K], [B, W + T]
    t = jnp.arange(T, dtype=jnp.int32)
    b = jnp.arange(B, dtype=jnp.int32)[:, None]
    woff = b * (W + T) + t[None, :] + 1                            # row t's window: t+1 ..
    NE = ents.shape[1]
    coff = jnp.broadcast_to(b * NE, (B, T))
    o = sparse_prefill_attention(
        q.reshape(B * T, H, K), win.reshape(B * (W + T), K), wbias.reshape(-1),
        ents.reshape(B * NE, K), None if ids is None else ids.reshape(B * T, -1),
        ncmp.reshape(-1), woff.reshape(-1), coff.reshape(-1), sink, impl=impl, window=W,
        bf16_p=bf16)
    return o.reshape(B, T, H, K)
