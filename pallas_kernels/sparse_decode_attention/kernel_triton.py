"""Sparse decode attention as a Pallas Triton-backend kernel: rows gathered by plain vector
loads instead of one TMA copy per row.

Why: the Mosaic kernel (kernel.py) copies each selected row with its own TMA instruction,
~129 per 64-key block, issued by one thread; that issue rate, not HBM, bounds it (5-8% of
the bandwidth at B = 64, benchmarks/results/attention_decode.md). Here every thread of the
program loads 16-byte pieces of the rows it needs (`ref[rows_vector, cols]`: a gather that
Triton lowers to vectorised global loads, many in flight per SM).

Same semantics, inputs and outputs as kernel.sparse_decode_attention (reference.py), same
XLA-side metadata (kernel._prep: the pool row of each selected id, the per-block scale
exponents + validity byte), same split merge. One program per (head tile, split, request):
  for each 64-key block of its split: the block's 64 pool rows, 7 FP8 chunks of 64 dims
  (dequantised in registers: e4m3 * 2^(e - 127), exact in bf16) + the BF16 rope;
  S = q K^T / sqrt(512) as 8 [HT, 64] x [64, 64] dots, online softmax (P rounded to bf16),
  O += P V as 8 [HT, 64] accumulators (V = K).
HT heads per program (16 by default: the [HT, 512] f32 accumulator stays in registers);
the head tiles of one request are neighbours in the launch order, so the 2nd..nth reads of
a row hit L2.

joined=True: the same math with K as ONE [64, 512] tile and the output as ONE [HT, 512]
accumulator (chunks joined by a tree of tt.join, the only concatenation Pallas Triton
lowers, which interleaves columns: q is permuted the same way in XLA, the output split
back in the epilogue). The sm_90a SASS of the chunked form (compile-only, 2026-11-25) has,
per 64-key block, 23 CTA barriers and 16 wgmma waits (each of the 16 dots stores its
operand to SMEM, syncs, runs, waits); the joined form has 3 and 2, with q read by the
wgmma from SMEM (a plain load, not a register join: a register q serialised every wgmma
for lack of registers). ~28 registers a block still spill. Not yet timed on a GPU.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.sparse_decode_attention.kernel import BLK, D, NOPE, NW, WINDOW

NCH = NOPE // 64     # FP8 chunks of 64 dims per row
CH = NCH + 1         # + the rope chunk (64 dims)
_BITREV = [int(f"{j:03b}"[::-1], 2) for j in range(CH)]   # _join's chunk order


def _dot_t(a, b):   # a [M, K] . b [N, K]^T -> f32 [M, N]
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):     # a [M, K] . b [K, N] -> f32 [M, N]
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _join(chunks):
    """2^n chunks [M, 64] -> one [M, 64 * 2^n] tile, chunk j's column c at c * 2^n +
    bitreverse(j) (a tree of 2-way tt.join + reshape: the only concatenation Pallas Triton
    lowers). A dot over this column order equals the dot over the natural one when both
    operands use it."""
    while len(chunks) > 1:
        chunks = [jnp.stack([a, b], axis=-1).reshape(a.shape[0], -1)
                  for a, b in zip(chunks[0::2], chunks[1::2])]
    return chunks[0]


def _split(x, n):
    """_join's inverse: [M, 64 * n] -> n chunks [M, 64] in natural order."""
    if n == 1:
        return [x]
    a, b = lax.unstack(x.reshape(x.shape[0], -1, 2), axis=2)
    return _split(a, n // 2) + _split(b, n // 2)


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


def _block_joined(q_il, rows, nope_ref, rope_ref, meta_ref, b, g, carry):
    """joined=True: one 64-key block with K as ONE [64, 512] tile (_join order) and the
    output accumulator as one [HT, 512] tile: 2 dots a block instead of 16 (the chunked
    form compiles to a shared-memory store + CTA barrier + wgmma + wait per dot, 32
    barriers a block in the sm_90a PTX)."""
    acc, m, l = carry
    k = _join(_dequant(rows, nope_ref, rope_ref, meta_ref, b, g))           # [64, 512]
    p16, alpha, m_new, l = _softmax_step(_dot_t(q_il, k), m, l, meta_ref, b, g)
    return acc * alpha[:, None] + _dot(p16, k), m_new, l


def _block(q, rows, nope_ref, rope_ref, meta_ref, b, g, carry, cols):
    """One 64-key block: rows [64] pool rows -> the updated (accs, m, l); accs are the
    [HT, 64] output chunks `cols` (all CH, or one column half). q(j) -> q's chunk j."""
    accs, m, l = carry
    ks = _dequant(rows, nope_ref, rope_ref, meta_ref, b, g)
    s = _dot_t(q(0), ks[0])
    for j in range(1, CH):
        s = s + _dot_t(q(j), ks[j])                                          # [HT, 64]
    p16, alpha, m_new, l = _softmax_step(s, m, l, meta_ref, b, g)
    accs = [a * alpha[:, None] + _dot(p16, ks[j]) for a, j in zip(accs, cols)]
    return accs, m_new, l


def _kernel(q_ref, wn_ref, wr_ref, cn_ref, cr_ref, crow_ref, meta_ref, nb_ref, sink_ref,
            o_ref, lse_ref, *, HT, NS, bps, q_in_loop, col_split, joined=False):
    ht, s_id, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(ht * HT, HT)
    qload = lambda j: q_ref[b, heads, pl.ds(j * 64, 64)]                    # [HT, 64]
    if joined:      # q arrives in _join's column order (attention_call): a plain load, so
        q_il = q_ref[b, heads, :]   # Triton keeps it in SMEM for the dot, not in registers
    elif q_in_loop:   # re-read per block (L1 / L2): 64 registers a thread fewer at HT = 64
        q = qload
    else:
        q_held = [qload(j) for j in range(CH)]
        q = lambda j: q_held[j]
    g0 = s_id * bps
    g1 = jnp.minimum(nb_ref[b], g0 + bps)          # this split's blocks: [g0, g1)
    keys = lax.broadcasted_iota(jnp.int32, (BLK,), 0)

    def run(cols):
        m0, l0 = jnp.full((HT,), -jnp.inf, jnp.float32), jnp.zeros((HT,), jnp.float32)
        if joined:
            carry = (jnp.zeros((HT, CH * 64), jnp.float32), m0, l0)
            blk = lambda rows, n_ref, r_ref, g, c: _block_joined(q_il, rows, n_ref, r_ref,
                                                                 meta_ref, b, g, c)
        else:
            carry = ([jnp.zeros((HT, 64), jnp.float32) for _ in cols], m0, l0)
            blk = lambda rows, n_ref, r_ref, g, c: _block(q, rows, n_ref, r_ref, meta_ref,
                                                          b, g, c, cols)

        def win_body(g, c):      # window ring: this request's rows b*128 + g*64 + j
            return blk(b * WINDOW + g * BLK + keys, wn_ref, wr_ref, g, c)

        def cmp_body(g, c):      # compressed: the pool rows of the selected ids
            return blk(crow_ref[b, pl.ds((g - NW) * BLK, BLK)], cn_ref, cr_ref, g, c)

        carry = lax.fori_loop(jnp.minimum(g0, NW), jnp.minimum(g1, NW), win_body, carry)
        accs, m, l = lax.fori_loop(jnp.maximum(g0, NW), jnp.maximum(g1, NW), cmp_body, carry)
        if joined:
            accs = _split(accs, CH)
        if NS == 1:   # final: the sink joins the denominator
            sk = sink_ref[heads]
            mm = jnp.maximum(m, sk)
            scale = jnp.exp(m - mm) / (l * jnp.exp(m - mm) + jnp.exp(sk - mm))
        else:         # a split: normalised partial output + its log-sum-exp, merged in XLA
            scale = 1.0 / jnp.where(l > 0, l, 1.0)
            # (with col_split, both halves store the same values)
            lse_ref[s_id, b, heads] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)),
                                                -jnp.inf)
        for j, a in zip(cols, accs):
            o_ref[s_id, b, heads, pl.ds(j * 64, 64)] = (a * scale[:, None]).astype(jnp.bfloat16)

    if col_split == 1:
        run(tuple(range(CH)))
    else:   # this program's half of the output columns (scores over all of them)
        half = pl.program_id(3)
        for h in range(2):
            pl.when(half == h)(lambda h=h: run(tuple(range(h * CH // 2, (h + 1) * CH // 2))))


def attention_call(q, wn, wr, cn, cr, crow, meta, n_blocks, sink, *, NS, HT=16, num_warps=4,
                   num_stages=1, q_in_loop=False, col_split=1, joined=False, interpret=False):
    """The kernel on kernel.prepare_inputs' direct-gather arguments -> (o [NS, B, HP, 512]
    bf16, lse [NS, B, HP] f32). The pools are passed whole (no blocking): wn / cn
    [rows * 7, 64] e4m3 (a row's 448 B as 7 chunks), wr / cr [rows, 64] bf16."""
    B, HP, _ = q.shape
    if HP % HT:
        raise ValueError(f"heads {HP} must be a multiple of the head tile {HT}")
    if col_split not in (1, 2):
        raise ValueError(f"col_split must be 1 or 2, got {col_split}")
    if joined and (col_split != 1 or q_in_loop):
        raise ValueError("joined=True holds q and all 512 output columns: col_split=1, "
                         "q_in_loop=False")
    bps = -(-meta.shape[1] // NS)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    if joined:   # q's columns in _join's order: chunk j's column c at c * 8 + bitreverse(j)
        q = q.reshape(B, HP, CH, 64)[:, :, _BITREV].transpose(0, 1, 3, 2).reshape(B, HP, D)
    args = (q, wn, wr, cn, cr, crow, meta, n_blocks, sink)
    return pl.pallas_call(
        functools.partial(_kernel, HT=HT, NS=NS, bps=bps, q_in_loop=q_in_loop,
                          col_split=col_split, joined=joined),
        out_shape=(jax.ShapeDtypeStruct((NS, B, HP, D), jnp.bfloat16),
                   jax.ShapeDtypeStruct((NS, B, HP), jnp.float32)),
        grid=(HP // HT, NS, B) + ((2,) if col_split == 2 else ()),
        in_specs=[whole(a) for a in args],
        out_specs=(pl.BlockSpec((NS, B, HP, D), lambda *_: (0, 0, 0, 0)),
                   pl.BlockSpec((NS, B, HP), lambda *_: (0, 0, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)
