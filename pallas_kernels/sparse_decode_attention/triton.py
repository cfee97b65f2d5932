"""Sparse decode attention as a Pallas Triton kernel: the portable path, for GPUs without
Hopper's wgmma / Mosaic GPU (the Mosaic kernels need sm_90a). On an H200 it takes 1.4-1.6x
the Mosaic kernels' GPU time at B >= 32.

Rows are gathered by plain vector loads (`ref[rows_vector, cols]`: Triton lowers it to
vectorised global loads, many in flight per SM). Same semantics, inputs and outputs as
the Mosaic path (reference.py). The per-key metadata comes from XLA (metadata(): the pool
row of each selected id, the per-block scale exponents + validity byte), 8 bytes a key
beside its 584 bytes of cache. One program per (head tile, split, request):
  for each 64-key block of its split: the block's 64 pool rows, 7 FP8 chunks of 64 dims
  (dequantised in registers: e4m3 * 2^(e - 127), exact in bf16) + the BF16 rope;
  S = q K^T / sqrt(512) as 8 [64, 64] x [64, 64] dots, online softmax (P rounded to bf16),
  O += P V as 8 [64, 64] accumulators (V = K).
64 heads a program, 8 warps: its [64, 512] f32 accumulator sits in registers (~200 a
thread), so one program fills an SM; the head tiles of one request are neighbours in the
launch order, so the second read of a row hits L2.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.sparse_decode_attention.inputs import check_and_pad, default_splits
from pallas_kernels.sparse_decode_attention.layout import BLK, D, HT, NCH, NW, WINDOW

CH = NCH + 1         # + the rope chunk (64 dims)
NUM_WARPS = 8


def metadata(win, cmp, block_table, idx_BK, t_B):
    """Per-key metadata: crow [B, KP] i32 (pool row of each compressed id; a valid dummy row
    for -1 ids), meta [B, NK/64, 8, 64] u8 (7 scale exponents + validity byte per key: the
    format's unused 8th exponent), n_blocks [B] i32 (window blocks + compressed blocks up
    to the last valid id)."""
    win_nope, win_scale, win_rope, win_pos = win
    cmp_nope, cmp_scale, cmp_rope = cmp
    B, K = idx_BK.shape
    EPB = cmp_nope.shape[1]
    KP = -(-K // BLK) * BLK
    idx = jnp.pad(idx_BK.astype(jnp.int32), ((0, 0), (0, KP - K)), constant_values=-1)
    t = t_B.astype(jnp.int32)[:, None]
    pos = win_pos[:B]
    win_ok = (pos >= 0) & (pos <= t) & (pos >= t - (WINDOW - 1))
    cmp_ok = idx >= 0
    safe = jnp.maximum(idx, 0)
    blk = jnp.maximum(jnp.take_along_axis(block_table[:B].astype(jnp.int32), safe // EPB, axis=1), 0)
    crow = blk * EPB + safe % EPB
    e = jnp.concatenate([win_scale[:B], cmp_scale.reshape(-1, 8)[crow]], axis=1)  # [B, NK, 8]
    ok = jnp.concatenate([win_ok, cmp_ok], axis=1)
    e = e.at[..., 7].set(ok.astype(jnp.uint8))
    NK = WINDOW + KP
    meta = e.reshape(B, NK // BLK, BLK, 8).transpose(0, 1, 3, 2)
    # Valid compressed ids come first (top-k output, HCA prefix): later blocks are skipped.
    last = jnp.max(jnp.where(cmp_ok, jnp.arange(KP)[None, :] + 1, 0), axis=1)
    n_blocks = NW + -(-last // BLK)
    return crow, meta, n_blocks.astype(jnp.int32)


def prepare(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *, splits=None):
    """-> ((q, wn, wr, cn, cr, crow, meta, n_blocks, sink), NS): the kernel's arguments."""
    q, sink, pools = check_and_pad(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H)
    crow, meta, n_blocks = metadata(win, cmp, block_table, idx_BK, t_B)
    NS = splits or default_splits(q.shape[0], q.shape[1], meta.shape[1])
    return (q, *pools, crow, meta, n_blocks, sink), NS


def _dot_t(a, b):   # a [M, K] . b [N, K]^T -> f32 [M, N]
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):     # a [M, K] . b [K, N] -> f32 [M, N]
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dequant(rows, nope_ref, rope_ref, meta_ref, b, g):
    """A block's K (= V) as CH bf16 chunks [64 keys, 64]: e4m3 * 2^(e - 127) (exact in
    bf16), then the rope."""
    ks = []
    for j in range(NCH):
        x = nope_ref[rows * NCH + j, :].astype(jnp.float32)                  # [64, 64]
        e = meta_ref[b, g, j, :].astype(jnp.int32)                           # [64]
        f = lax.bitcast_convert_type(jnp.clip(e, 1, 254) << 23, jnp.float32)
        ks.append((x * f[:, None]).astype(jnp.bfloat16))
    ks.append(rope_ref[rows, :])
    return ks


def _softmax_step(s, m, l, meta_ref, b, g):
    """Masked, scaled scores s [HT, 64] -> (p bf16, alpha, m_new, l_new) of the online
    softmax (P rounded to bf16 as the reference)."""
    ok = meta_ref[b, g, 7, :].astype(jnp.int32) != 0
    s = jnp.where(ok[None, :], s * (1.0 / math.sqrt(D)), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                        # all masked so far
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    return p.astype(jnp.bfloat16), alpha, m_new, l * alpha + jnp.sum(p, axis=1)


def _block(q, rows, nope_ref, rope_ref, meta_ref, b, g, carry):
    """One 64-key block: rows [64] pool rows -> the updated (accs, m, l); accs are the CH
    [HT, 64] output chunks; q[j]: q's chunk j."""
    accs, m, l = carry
    ks = _dequant(rows, nope_ref, rope_ref, meta_ref, b, g)
    s = _dot_t(q[0], ks[0])
    for j in range(1, CH):
        s = s + _dot_t(q[j], ks[j])                                          # [HT, 64]
    p16, alpha, m_new, l = _softmax_step(s, m, l, meta_ref, b, g)
    accs = [a * alpha[:, None] + _dot(p16, k) for a, k in zip(accs, ks)]
    return accs, m_new, l


def _kernel(q_ref, wn_ref, wr_ref, cn_ref, cr_ref, crow_ref, meta_ref, nb_ref, sink_ref,
            o_ref, lse_ref, *, NS, bps):
    ht, s_id, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(ht * HT, HT)
    q = [q_ref[b, heads, pl.ds(j * 64, 64)] for j in range(CH)]             # [HT, 64]
    g0 = s_id * bps
    g1 = jnp.minimum(nb_ref[b], g0 + bps)          # this split's blocks: [g0, g1)
    keys = lax.broadcasted_iota(jnp.int32, (BLK,), 0)
    m0, l0 = jnp.full((HT,), -jnp.inf, jnp.float32), jnp.zeros((HT,), jnp.float32)
    carry = ([jnp.zeros((HT, 64), jnp.float32) for _ in range(CH)], m0, l0)

    def win_body(g, c):      # window ring: this request's rows b*128 + g*64 + j
        return _block(q, b * WINDOW + g * BLK + keys, wn_ref, wr_ref, meta_ref, b, g, c)

    def cmp_body(g, c):      # compressed: the pool rows of the selected ids
        return _block(q, crow_ref[b, pl.ds((g - NW) * BLK, BLK)], cn_ref, cr_ref, meta_ref,
                      b, g, c)

    carry = lax.fori_loop(jnp.minimum(g0, NW), jnp.minimum(g1, NW), win_body, carry)
    accs, m, l = lax.fori_loop(jnp.maximum(g0, NW), jnp.maximum(g1, NW), cmp_body, carry)
    if NS == 1:   # final: the sink joins the denominator
        sk = sink_ref[heads]
        mm = jnp.maximum(m, sk)
        scale = jnp.exp(m - mm) / (l * jnp.exp(m - mm) + jnp.exp(sk - mm))
    else:         # a split: normalised partial output + its log-sum-exp, merged in XLA
        scale = 1.0 / jnp.where(l > 0, l, 1.0)
        lse_ref[s_id, b, heads] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)),
                                            -jnp.inf)
    for j, a in enumerate(accs):
        o_ref[s_id, b, heads, pl.ds(j * 64, 64)] = (a * scale[:, None]).astype(jnp.bfloat16)


def attention(q, wn, wr, cn, cr, crow, meta, n_blocks, sink, *, NS, interpret=False):
    """The kernel on prepare()'s arguments -> (o [NS, B, HP, 512] bf16, lse [NS, B, HP]
    f32). The pools are passed whole (no blocking): wn / cn [rows * 7, 64] e4m3 (a row's
    448 B as 7 chunks), wr / cr [rows, 64] bf16."""
    B, HP, _ = q.shape
    bps = -(-meta.shape[1] // NS)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    args = (q, wn, wr, cn, cr, crow, meta, n_blocks, sink)
    return pl.pallas_call(
        functools.partial(_kernel, NS=NS, bps=bps),
        out_shape=(jax.ShapeDtypeStruct((NS, B, HP, D), jnp.bfloat16),
                   jax.ShapeDtypeStruct((NS, B, HP), jnp.float32)),
        grid=(HP // HT, NS, B),
        in_specs=[whole(a) for a in args],
        out_specs=(pl.BlockSpec((NS, B, HP, D), lambda *_: (0, 0, 0, 0)),
                   pl.BlockSpec((NS, B, HP), lambda *_: (0, 0, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
    )(*args)
