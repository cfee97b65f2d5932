"""Exact top-k selection (register-resident radix select) as a Pallas Triton-backend kernel.

Why: XLA-GPU lowers lax.top_k(scores [B, N], 512) to a full sort of every row. For the
lightning indexer at 128K context (N = 32K entries a request) that sort took 290 us at
B = 64 on the H100; every CSA layer pays it.
Selecting the top k needs no sort: find the k-th largest value, then keep what is above it.

One program per row segment of at most `tile` keys (request b, segment g), all of them held
in registers (tile / (32 * num_warps) keys a thread), read from HBM once:
  key    = the score's f32 bits made order-preserving as int32 (-0.0 taken as +0.0).
  search = T, the k-th largest key, `bits` bits at a time from the most significant: with
           the prefix found so far, count the keys >= prefix + j << shift for each of the
           2^bits - 1 next digits j (independent block reductions) and keep the largest j
           whose count still reaches k. 32 / bits dependent steps, nothing reloaded.
           need = k - #(key > T): how many keys equal to T belong to the top k (lowest ids).
  select = keep key > T, and key == T while fewer than `need` such come before it (a
           prefix sum); drop -inf; write the kept ids at their rank (another prefix sum),
           then -1 up to k.
A row longer than one tile is split into segments, each keeping its own top k (ids
ascending, with their scores); the next call selects among those candidates, carrying the
ids through, until one program holds a whole row. Candidates ascend with the ids, so ties
still go to the lower id. Output contract (ascending ids, -1 padded):
reference.topk_select_reference.

On the H100 (benchmarks/small_kernels.py, exact at every shape): 7 / 17 / 26 / 57 us GPU
busy at B = 1 N = 1056 / B = 1 N = 8224 / B = 1 N = 32800 / B = 64 N = 32800, against
lax.top_k's 14 / 56 / 47 / 242 us. Per-lane digit counts re-reading the row every pass
were latency-bound (77 us at B = 1, N = 32800); a search step's counts as one [2^bits, S]
reduction cost more than the separate block reductions (B = 64: 56.6 -> 87.6 us).
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
MAX_KEYS = 16384     # keys one program holds: 32 a thread at 16 warps


def _order_key(x):
    """f32 -> int32 whose signed order is x's order (-0.0 -> +0.0's key; no NaNs). On bits,
    not float compares: a flush-to-zero compare would merge denormals with zero."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jnp.where(bits == INT_MIN, 0, bits ^ 0x7FFFFFFF), bits)


def _i32(v):
    """A Python int taken mod 2^32 as an int32 constant (two's complement wrap)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _kernel(s_ref, *refs, N, K, S, SEG, BITS, has_ids, values):
    """Program (b, g): the top K of row b's columns [g * SEG, min(N, g * SEG + SEG)) (SEG <=
    S keys, S a power of two >= K) -> o_ref[b, g*K : g*K + K]: their ids (ids_ref's entries
    at those columns when given), ascending, -1 padded [, v_ref: their scores, -inf
    padded]."""
    ids_ref = refs[0] if has_ids else None
    o_ref = refs[1 if has_ids else 0]
    v_ref = refs[-1] if values else None
    b, g = pl.program_id(0), pl.program_id(1)
    lanes = lax.broadcasted_iota(jnp.int32, (S,), 0)
    c0 = g * SEG
    live = lanes < jnp.minimum(N - c0, SEG)
    x = pltriton.load(s_ref.at[b, pl.ds(c0, S)], mask=live, other=-jnp.inf)
    key = _order_key(x)

    # T as a signed key; the search walks the unsigned order (key ^ INT_MIN) from 0, i.e.
    # signed INT_MIN, where count(key >= T) = S >= K. Adding j << shift in int32 wraps as
    # the unsigned sum would (no unsigned overflow: the low bits are still 0).
    t = jnp.int32(INT_MIN)
    J = 1 << BITS
    for p in range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        d = jnp.int32(0)
        for j in range(1, J):   # counts fall with j: d = #{j : count_j >= K}
            cnt = jnp.sum((key >= t + jnp.int32(_i32(j << shift))).astype(jnp.int32))
            d = d + (cnt >= K).astype(jnp.int32)
        t = t + (d << shift)
    need = K - jnp.sum((key > t).astype(jnp.int32))

    eq = (key == t).astype(jnp.int32)
    take = (key > t) | ((eq == 1) & (jnp.cumsum(eq) - eq < need))
    take = take & (key > NEG_INF_KEY)
    ti = take.astype(jnp.int32)
    o0 = g * K
    # lanes not taken are masked; their address is past this segment's k slots all the
    # same (the interpreter reads and writes back masked lanes; o0 would race the kept one)
    at = jnp.where(take, o0 + jnp.cumsum(ti) - ti, o0 + K)
    if has_ids:
        ids = pltriton.load(ids_ref.at[b, pl.ds(c0, S)], mask=take, other=-1)
    else:
        ids = c0 + lanes
    pltriton.store(o_ref.at[b, at], ids, mask=take)
    if values:
        pltriton.store(v_ref.at[b, at], x, mask=take)

    KP = pl.next_power_of_2(K)
    pos = lax.broadcasted_iota(jnp.int32, (KP,), 0)
    fill = (pos >= jnp.sum(ti)) & (pos < K)                  # -1 (-inf) after the kept ids
    pltriton.store(o_ref.at[b, pl.ds(o0, KP)], jnp.full((KP,), -1, jnp.int32), mask=fill)
    if values:
        pltriton.store(v_ref.at[b, pl.ds(o0, KP)], jnp.full((KP,), -jnp.inf, jnp.float32),
                       mask=fill)


def _pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def default_tile(k):
    """Keys a stage-1 program holds: 4096, or 8 k (each stage shrinks a row >= 8x)."""
    return max(4096, 8 * _pow2(k))


def default_segments(N, k, tile=None):
    """Stage-1 programs per row: one for a row of at most `tile` keys, else segments of
    `tile` keys. (One program over a longer row is one SM's latency-bound work: on the
    H100 at B = 1, N = 8224 it took 25 us GPU busy, four segments + stage 2 17 us; the
    later stages take up to MAX_KEYS candidates in one program.)"""
    tile = tile or default_tile(k)
    return 1 if N <= tile else -(-N // tile)


def _call(level, ids, k, *, N, seg, P, bits, num_warps, values, interpret):
    B, W = level.shape
    S = _pow2(max(seg, k))
    nw = num_warps or min(16, max(4, S // 512))
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))
    out_shape = [jax.ShapeDtypeStruct((B, P * k), jnp.int32)]
    if values:
        out_shape.append(jax.ShapeDtypeStruct((B, P * k), jnp.float32))
    ins = [level] + ([ids] if ids is not None else [])
    return pl.pallas_call(
        functools.partial(_kernel, N=N, K=k, S=S, SEG=seg, BITS=bits,
                          has_ids=ids is not None, values=values),
        out_shape=out_shape,
        grid=(B, P),
        in_specs=[whole(a) for a in ins],
        out_specs=[whole(s) for s in out_shape],
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=1),
        interpret=interpret,
    )(*ins)


def topk_select(scores_BN, k, *, n=None, segments=None, tile=None, bits=2, num_warps=None,
                interpret=False):
    """ids [B, k] int32 of the k largest scores per row, ascending, -1 padded (ties: lower
    id; -inf never selected). scores_BN [B, W] f32, of which the first n columns (all by
    default) are the scores: a wider buffer is read in place, with no slice copy before
    the kernel.
    tile: keys a program holds when a row is split (power of two >= k; default_tile).
    segments: stage-1 programs per row (default_segments); each later stage selects among
      the previous one's segments * k candidates, in programs of `tile` keys, until one
      program holds a row (<= MAX_KEYS keys).
    bits: digit width of the search (1, 2 or 4: 32 / bits steps of 2^bits - 1 counts).
    num_warps: default S / 512 keys-per-program, clamped to [4, 16].
    See reference.topk_select_reference."""
    if scores_BN.ndim != 2:
        raise ValueError(f"scores must be [B, N], got shape {scores_BN.shape}")
    if scores_BN.dtype != jnp.float32:
        raise ValueError(f"scores must be float32, got {scores_BN.dtype}")
    if not 0 < k <= MAX_KEYS:
        raise ValueError(f"k must be in [1, {MAX_KEYS}], got {k}")
    tile = default_tile(k) if tile is None else tile
    if tile < 16 or tile & (tile - 1) or not k <= tile <= MAX_KEYS // 2:
        raise ValueError(f"tile must be a power of two in [max(16, k), {MAX_KEYS // 2}] "
                         f"(k = {k}), got {tile}")
    if bits not in (1, 2, 4):
        raise ValueError(f"bits must be 1, 2 or 4, got {bits}")
    B, W = scores_BN.shape
    N = W if n is None else n
    if not 0 < N <= W:
        raise ValueError(f"n must be in [1, {W}] (the scores' width), got {n}")
    P = default_segments(N, k, tile) if segments is None else segments
    if not 0 < P <= N or _pow2(max(-(-N // P), k)) > MAX_KEYS:
        raise ValueError(f"segments must be in [1, {N}] with at most {MAX_KEYS} keys each "
                         f"(N = {N}), got {segments}")
    kw = dict(bits=bits, num_warps=num_warps, interpret=interpret)
    level, ids = scores_BN, None
    while True:
        if P == 1:
            return _call(level, ids, k, N=N, seg=N, P=1, values=False, **kw)[0]
        ids, level = _call(level, ids, k, N=N, seg=-(-N // P), P=P, values=True, **kw)
        N = P * k
        P = 1 if N <= MAX_KEYS else -(-N // tile)
