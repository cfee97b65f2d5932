"""Exact top-k selection (radix select + compaction) as a Pallas Triton-backend kernel.

Why: XLA-GPU lowers lax.top_k(scores [B, N], 512) to a full sort of every row. For the
lightning indexer at 128K context (N = 32K entries a request) that sort took 290 us at
B = 64 on the H100, as long as the indexer's scoring kernel (benchmarks/results/
indexer_attention.md); every CSA layer pays it. Selecting the top k needs no sort: find the
k-th largest value, then keep what is above it.

One program per row segment (request b, segment g; one segment per row unless the batch
leaves SMs idle, see default_segments):
  key    = the score's f32 bits made order-preserving as int32 (-0.0 taken as +0.0).
  search = 32 / bits passes (default 8 of 4 bits), most significant first: count the
           segment's keys under the prefix found so far by their next digit (2^bits counts,
           kept per lane and reduced once a pass), keep the digit where the running count
           from the top reaches k. At the end: T, the k-th largest key, and `need`, how
           many keys equal to T belong to the top k (the lowest ids).
  select = one pass in id order: keep key > T, and key == T while fewer than `need` such
           were kept; drop -inf; write the kept ids at their rank (a prefix sum in the
           tile), then -1 up to k.
Reads the scores 32 / bits + 1 times (from L1 / L2 after the first), writes k ids. With
several segments a second call selects the row's top k among the segments' candidates.
Output contract (ascending ids, -1 padded): reference.topk_select_reference.

NOT yet run on a GPU (interpreter- and compile-tested only): kept off the decode step's
default path (decode.TOPK_SELECT, DSV4_TOPK=kernel) until benchmarks/topk_select.py
proves and times it (benchmarks/gpu_session16.sh).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

INT_MIN = -(1 << 31)
# the order key of -inf: f32 bits 0xFF800000 with the magnitude bits flipped
NEG_INF_KEY = -2139095041


def _order_key(x):
    """f32 -> int32 whose signed order is x's order (-0.0 -> +0.0's key; no NaNs). On bits,
    not float compares: a flush-to-zero compare would merge denormals with zero."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jnp.where(bits == INT_MIN, 0, bits ^ 0x7FFFFFFF), bits)


def _kernel(s_ref, o_ref, *v_ref, N, K, TILE, BITS, SEG):
    """Program (b, g): the top K of row b's columns [g * SEG, min(N, g * SEG + SEG)) ->
    o_ref[b, g*K : g*K + K] (their ids, ascending, -1 padded) [, v_ref: their scores, -inf
    padded]."""
    b, g = pl.program_id(0), pl.program_id(1)
    N_DIGITS = 1 << BITS
    lanes = lax.broadcasted_iota(jnp.int32, (TILE,), 0)
    digits = lax.broadcasted_iota(jnp.int32, (N_DIGITS,), 0)
    n_search = -(-max(SEG, K) // TILE)  # >= k keys (past the end: -inf): the k-th exists
    n_tiles = -(-SEG // TILE)
    c0, end = g * SEG, jnp.minimum(N, g * SEG + SEG)   # this program's columns
    o0 = g * K                                          # ... and its outputs

    def load(t):          # [TILE] scores of tile t, -inf past the segment's end
        return pltriton.load(s_ref.at[b, pl.ds(c0 + t * TILE, TILE)],
                             mask=c0 + t * TILE + lanes < end, other=-jnp.inf)

    prefix, need = jnp.int32(0), jnp.int32(K)     # prefix: T's bits found so far, unsigned
    for p in range(32 // BITS):
        shift = 32 - BITS * (p + 1)

        def count(t, acc, shift=shift, prefix=prefix):
            u = _order_key(load(t)) ^ INT_MIN      # unsigned order, as int32 bits
            d = lax.shift_right_logical(u, shift) & (N_DIGITS - 1)
            hit = d[:, None] == digits[None, :]
            if shift + BITS < 32:                  # only keys under the prefix so far
                hit = hit & (lax.shift_right_logical(u, shift + BITS) == prefix)[:, None]
            return acc + hit.astype(jnp.int32)     # per lane: reduced once, after the loop

        acc = lax.fori_loop(0, n_search, count, jnp.zeros((TILE, N_DIGITS), jnp.int32))
        cnt = jnp.sum(acc, axis=0)
        # at_least[d] = keys under the prefix with digit >= d; the top k reach into digit d*
        at_least = jnp.sum(jnp.where(digits[None, :] >= digits[:, None], cnt[None, :], 0),
                           axis=1)
        d_star = jnp.sum((at_least >= need).astype(jnp.int32)) - 1
        need = need - jnp.sum(jnp.where(digits > d_star, cnt, 0))
        prefix = (prefix << BITS) | d_star
    t_key = prefix ^ INT_MIN                       # the k-th largest key (signed order)

    def select(t, carry):
        n_out, n_eq = carry
        x = load(t)
        key = _order_key(x)
        eq = (key == t_key).astype(jnp.int32)
        eq_rank = n_eq + jnp.cumsum(eq) - eq       # keys == T before this one
        take = (key > t_key) | ((eq == 1) & (eq_rank < need))
        take = take & (key > NEG_INF_KEY)
        ti = take.astype(jnp.int32)
        at = jnp.where(take, o0 + n_out + jnp.cumsum(ti) - ti, o0 + K)   # (masked: unused)
        pltriton.store(o_ref.at[b, at], c0 + t * TILE + lanes, mask=take)
        for v in v_ref:
            pltriton.store(v.at[b, at], x, mask=take)
        return n_out + jnp.sum(ti), n_eq + jnp.sum(eq)

    n_out, _ = lax.fori_loop(0, n_tiles, select, (jnp.int32(0), jnp.int32(0)))

    def fill(t, c):       # -1 (-inf) after the kept ids
        p = t * TILE + lanes
        m = (p >= n_out) & (p < K)
        pltriton.store(o_ref.at[b, pl.ds(o0 + t * TILE, TILE)],
                       jnp.full((TILE,), -1, jnp.int32), mask=m)
        for v in v_ref:
            pltriton.store(v.at[b, pl.ds(o0 + t * TILE, TILE)],
                           jnp.full((TILE,), -jnp.inf, jnp.float32), mask=m)
        return c

    lax.fori_loop(n_out // TILE, -(-K // TILE), fill, 0)


def default_segments(B, N, k, num_sms=132):
    """Programs per row: about sqrt(N / k) (balances the segments' search against the
    second stage's over segments * k candidates), while B * segments fills the GPU at most."""
    return max(1, min(int((N / k) ** 0.5), num_sms // max(B, 1)))


def _call(scores, k, *, N, seg, P, tile, bits, num_warps, values, interpret):
    B, W = scores.shape
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    out_shape = [jax.ShapeDtypeStruct((B, P * k), jnp.int32)]
    if values:
        out_shape.append(jax.ShapeDtypeStruct((B, P * k), jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, N=N, K=k, TILE=tile, BITS=bits, SEG=seg),
        out_shape=out_shape,
        grid=(B, P),
        in_specs=[whole((B, W))],
        out_specs=[whole(s.shape) for s in out_shape],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(scores)


def topk_select(scores_BN, k, *, n=None, segments=None, tile=512, bits=4, num_warps=4,
                interpret=False):
    """ids [B, k] int32 of the k largest scores per row, ascending, -1 padded (ties: lower
    id; -inf never selected). scores_BN [B, W] f32, of which the first n columns (all by
    default) are the scores: a wider buffer is read in place, with no slice copy before
    the kernel. bits: radix digit width (32 / bits passes, 2^bits counts per key and pass).
    segments: programs per row (default_segments; > 1 adds a second kernel over the
    segments' candidates and a gather). See reference.topk_select_reference."""
    if scores_BN.ndim != 2:
        raise ValueError(f"scores must be [B, N], got shape {scores_BN.shape}")
    if scores_BN.dtype != jnp.float32:
        raise ValueError(f"scores must be float32, got {scores_BN.dtype}")
    if not 0 < k < 1 << 30:
        raise ValueError(f"k must be positive, got {k}")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8 (a divisor of 32), got {bits}")
    B, W = scores_BN.shape
    N = W if n is None else n
    if not 0 < N <= W:
        raise ValueError(f"n must be in [1, {W}] (the scores' width), got {n}")
    P = default_segments(B, N, k) if segments is None else segments
    if not 0 < P <= N:
        raise ValueError(f"segments must be in [1, {N}], got {segments}")
    kw = dict(tile=tile, bits=bits, num_warps=num_warps, interpret=interpret)
    if P == 1:
        return _call(scores_BN, k, N=N, seg=N, P=1, values=False, **kw)[0]
    # stage 1: each segment's own top k (ids ascending, segment after segment, with their
    # scores); the top k of the row are among them. Stage 2: the top k of those candidates,
    # whose positions ascend with the ids, so ties still go to the lower id.
    ids, vals = _call(scores_BN, k, N=N, seg=-(-N // P), P=P, values=True, **kw)
    pos = _call(vals, k, N=P * k, seg=P * k, P=1, values=False, **kw)[0]
    return jnp.where(pos >= 0, jnp.take_along_axis(ids, jnp.maximum(pos, 0), 1), -1)
