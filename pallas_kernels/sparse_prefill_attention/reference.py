"""Pure-JAX sparse prefill attention over the kernel's inputs (its reference and the XLA
path), memory bounded: query rows in blocks, each block gathering only its own keys.

Semantics (the model's chunk attention, ARCHITECTURE.md 4 and 10): query row r (H heads of
512, K = V) attends the W window keys win_KD[woff[r] : woff[r] + W] whose bias wbias is 0
(-inf: a stale ring slot or a position before 0), plus its first ncmp[r] compressed
entries: ents_ND[coff[r] + ids[r, j]] (CSA: the indexer's top-k, valid ids first) or
ents_ND[coff[r] + j] (HCA, ids None: every visible entry). s = q.K / sqrt(512) (f32); one
softmax over the keys with the sink sink_H in the denominator only; p rounded to bf16
before P.V when bf16_p (the reference kernel's rounding).

Shapes: q_RHD [R, H, 512]; win_KD [NW, 512]; wbias_K [NW] f32; ents_ND [NE, 512]; ids_RL
[R, L] int32 or None; ncmp_R, woff_R, coff_R [R] int32; sink_H [H] f32 -> out f32
[R, H, 512]. Memory: blocks of `block` rows x (W + L) keys (HCA: + all entries).
"""
import math

import jax.numpy as jnp
from jax import lax

WINDOW = 128


def _block_keys(win_KD, wbias_K, ents_ND, ids_bL, ncmp_b, woff_b, coff_b, W):
    """-> keys [b, W + L', 512] f32 and bias [b, W + L'] (0 / -inf) of a block of rows."""
    wi = woff_b[:, None] + jnp.arange(W)[None, :]                      # [b, W]
    kw = win_KD[wi].astype(jnp.float32)
    bw = wbias_K[wi]
    if ids_bL is None:
        L = ents_ND.shape[0]
        j = jnp.arange(L)[None, :]
        ci = coff_b[:, None] + j
    else:
        j = jnp.arange(ids_bL.shape[1])[None, :]
        ci = coff_b[:, None] + jnp.maximum(ids_bL, 0)
    ok = j < ncmp_b[:, None]
    kc = ents_ND[jnp.clip(ci, 0, ents_ND.shape[0] - 1)].astype(jnp.float32)
    keys = jnp.concatenate([kw, kc], 1)
    bias = jnp.concatenate([bw, jnp.where(ok, 0.0, -jnp.inf)], 1)
    return keys, bias


def sparse_prefill_attention_reference(q_RHD, win_KD, wbias_K, ents_ND, ids_RL, ncmp_R,
                                       woff_R, coff_R, sink_H, *, bf16_p=True, block=64,
                                       window=WINDOW):
    R, H, D = q_RHD.shape
    nb = -(-R // block)
    pad = nb * block - R

    def padr(a):
        return None if a is None else jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))

    q, ids, ncmp, woff, coff = map(padr, (q_RHD, ids_RL, ncmp_R, woff_R, coff_R))
    sink = sink_H.astype(jnp.float32)

    def one(args):
        qb, idb, nb_, wb, cb = args
        keys, bias = _block_keys(win_KD, wbias_K, ents_ND, idb, nb_, wb, cb, window)
        s = jnp.einsum("bhd,bkd->bhk", qb.astype(jnp.float32), keys,
                       precision=lax.Precision.HIGHEST) / math.sqrt(D)
        s = s + bias[:, None, :]
        m = jnp.maximum(jnp.max(s, -1), sink[None, :])
        p = jnp.exp(s - m[..., None])
        den = p.sum(-1) + jnp.exp(sink[None, :] - m)
        if bf16_p:
            p = p.astype(jnp.bfloat16).astype(jnp.float32)
        o = jnp.einsum("bhk,bkd->bhd", p, keys, precision=lax.Precision.HIGHEST)
        return o / den[..., None]

    blk = lambda a: None if a is None else a.reshape(nb, block, *a.shape[1:])
    out = lax.map(one, (blk(q), blk(ids), blk(ncmp), blk(woff), blk(coff)))
    return out.reshape(nb * block, H, D)[:R]


def window_table(ring_WD, ring_pos_W, kv_TD, pos0, nvalid, window=WINDOW):
    """One request's chunk: the window keys in position order -> (win_KD [W + T, 512]:
    row i holds position pos0 - W + i, wbias_K [W + T] f32: 0 where that key exists),
    and row t's window starts at row t + 1. ring_WD [W, 512] (slot p % W holds position
    ring_pos_W[slot], -1: empty); kv_TD [T, 512] the chunk's keys (first nvalid real)."""
    W = window
    p_ring = pos0 - W + jnp.arange(W)                     # positions before the chunk
    slot = jnp.mod(p_ring, W)
    ring_ok = (p_ring >= 0) & (ring_pos_W[slot] == p_ring)
    T = kv_TD.shape[0]
    win = jnp.concatenate([ring_WD[slot].astype(kv_TD.dtype), kv_TD], 0)
    ok = jnp.concatenate([ring_ok, jnp.arange(T) < nvalid])
    return win, jnp.where(ok, 0.0, -jnp.inf).astype(jnp.float32)
