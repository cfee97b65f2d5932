"""Sparse decode attention (window ring + selected compressed entries + sink) as a Pallas
Mosaic-GPU kernel (Hopper, sm_90a). Semantics: see reference.py.

The kernel reads FP8 nope rows and BF16 rope rows straight from the cache (never a bf16
copy) and dequantises them in SMEM: K tile bf16 [64 keys, 512] = e4m3 * 2^(e-127) (exact)
| rope.
gather="cpasync" (what the decode step uses, warp-specialised only): the producer
warpgroup's 128 threads copy the selected rows in 16-byte cp.async pieces, two threads a
key, into a chunk-major, tiled and 64-byte swizzled buffer (conflict-free dequant loads);
with P V accumulating in place and 56 / 224 registers nothing spills (H200, 2026-11-26:
1.4-1.6x less GPU time than the Triton kernel at B >= 32; BENCHMARKS.md, session 20).
Its producer also derives each key's pool row (block table), scale exponents and validity
itself, so XLA only finds the last valid id (session 21: 4-5 us less per op).
gather="direct": rows are fetched one by one with TMA, with the physical row ids read as scalars
in-kernel (window: b*128 + slot; compressed, gather="direct": the pool row of each
selected id). A stored nope row is 448 B: it is copied as an [8, 64]-byte box of the pool
viewed as 64-byte chunks (the row + the next row's first 64 B; zero-filled past the end),
into SMEM rows 512 B apart. That keeps every copy a multiple of 128 B (what Pallas' copy
accounting needs) and every destination 128-B aligned (what tensor TMA needs: the earlier
per-row attempt faulted on destinations 448 B apart). The row buffers must not be
swizzled, so the kernel uses the Lane lowering, which keeps SMEM exactly as declared (the
Warpgroup lowering's layout inference swizzled them: wrong results on the H100).
gather="staged" (the previous version, kept to compare) has XLA gather the selected rows
into a staging buffer first. H100 numbers: benchmarks/results/attention_decode.md.
For direct / staged, per-key metadata stays in XLA, 8 bytes per key next to 584 bytes of
cache (cpasync derives it in the producer instead, _cp_gather): the pool row id
(block-table lookup, i32) and `meta` [.., 8, 64] u8 per block = the 7 scale exponents + a
validity byte in place of the format's unused 8th exponent (a single 8-byte scale row is
below the 16-byte TMA minimum, so the kernel cannot fetch it row by row).
Heads are the wgmma M rows (64 per CTA); the f32 accumulator [64, 512] is too big for one
warpgroup, so output columns are split in two halves:
 - warp_specialized=True: one CTA per (request, split, head tile); a producer warpgroup
   issues the row copies into a double buffer, two consumer warpgroups (one per column
   half) each dequantise half of the shared K tile and compute the same full scores;
 - warp_specialized=False: two single-warpgroup CTAs per tile (one per half), each copying
   and dequantising every row itself (the second read is served by L2).
Split s: flash-decoding over key blocks when there are too few CTAs to fill the chip;
partial outputs are merged by merge.py's kernel (from 8 requests) or in XLA (merge_splits).
"""
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention.merge import (COL, HT, MAX_SPLITS, ROW, TILED, WG,
                                                          merge_splits_kernel)

WINDOW = 128
D = 512
NOPE = 448
ROPE = 64
BLK = 64        # keys per step (the reference's online-softmax block)
HALF = D // 2   # output columns a consumer warpgroup owns
BLOCK_TOKENS = 128   # tokens a compressed pool block covers (EPB entries of 128 / EPB each)
NW = WINDOW // BLK
GATHERS = ("direct", "staged", "cpasync")
MERGES = ("xla", "kernel", "auto", "cluster")
# The default merge of key splits from this batch on: the merge kernel (one launch, the
# weights in registers) instead of XLA's two fusions. H100, 128K, op GPU us, xla -> kernel
# (session 30 run11): Flash CSA B=64 33.6 -> 32.0, Pro CSA B=32 47.9 -> 46.4, Flash HCA
# B=64 46.0 -> 44.6, Pro HCA B=32 43.5 -> 42.0, Flash CSA B=8 13.2 -> 13.0, Pro CSA B=8 19.8
# -> 19.7, Flash HCA B=8 17.0 -> 16.5; but Flash CSA B=1 at 32K 9.9 -> 11.7 (XLA makes one
# 1.8 us fusion of the whole merge there; the kernel's floor is ~3.5 us).
MERGE_KERNEL_MIN_BATCH = 8


def _prep(win, cmp, block_table, idx_BK, t_B):
    """Per-key metadata: crow [B, KP] i32 (pool row of each compressed id; a valid dummy row
    for -1 ids), meta [B, NK/64, 8, 64] u8 (7 scale exponents + validity byte per key),
    n_blocks [B] i32 (window blocks + compressed blocks up to the last valid id)."""
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
    e = e.at[..., 7].set(ok.astype(jnp.uint8))        # byte 7 is unused by the format
    NK = WINDOW + KP
    meta = e.reshape(B, NK // BLK, BLK, 8).transpose(0, 1, 3, 2)
    # Valid compressed ids come first (top-k output, HCA prefix): later blocks are skipped.
    last = jnp.max(jnp.where(cmp_ok, jnp.arange(KP)[None, :] + 1, 0), axis=1)
    n_blocks = NW + -(-last // BLK)
    return crow, meta, n_blocks.astype(jnp.int32)


def _pad_ids(idx_BK):
    """idx [B, K] -> int32 [B, KP], padded with -1 to whole key blocks."""
    K = idx_BK.shape[1]
    return jnp.pad(idx_BK.astype(jnp.int32), ((0, 0), (0, -K % BLK)), constant_values=-1)


def _ids_used(idx_BK):
    """-> (idx [B, KP] i32 padded with -1 to whole key blocks, used [B] i32 = 1 + the
    position of the last valid id: the kernel runs NW + ceil(used / 64) key blocks)."""
    idx = _pad_ids(idx_BK)
    KP = idx.shape[1]
    return idx, jnp.max(jnp.where(idx >= 0, jnp.arange(KP)[None, :] + 1, 0), axis=1)


def gather_rows_fp8(pool_ND, rows):
    """pool[rows] for an FP8 pool, gathered through a uint8 view: XLA's float normalisation
    otherwise upcasts the WHOLE pool to f16 before a float8 gather (seen in the HLO)."""
    u8 = lax.bitcast_convert_type(pool_ND, jnp.uint8)[rows]
    return lax.bitcast_convert_type(u8, pool_ND.dtype)


def default_splits(B, H, n_blk, num_sms=132, ctas_per_tile=2, ctas_per_sm=1):
    """Key-block splits (flash-decoding) per (request, head tile): the count that needs the
    fewest key blocks run one after another on an SM, waves included; ties: fewer splits
    (less merging). One CTA fits per SM (its SMEM). E.g. Flash B=64, 10 blocks: 2 splits
    (128 CTAs, one wave of 5 blocks) where filling the SMs first (3 splits: 192 CTAs,
    2 waves x 4 blocks = 8) ran a second, partial wave (H100, 2026-11-23)."""
    ctas = B * -(-H // HT) * ctas_per_tile
    slots = num_sms * ctas_per_sm

    def serial_blocks(s):
        return -(-ctas * s // slots) * -(-n_blk // s)
    return int(min(range(1, max(1, n_blk) + 1), key=lambda s: (serial_blocks(s), s)))


def default_splits_v1(B, H, n_blk, num_sms=132, ctas_per_tile=2):
    """The rule before 2026-11-23 (fill the SMs, ignoring waves), kept for A/B runs."""
    ctas = B * -(-H // HT) * ctas_per_tile
    return int(max(1, min(n_blk, -(-num_sms // ctas))))


BACKENDS = ("mosaic", "triton")


def triton_ctas_per_sm(head_tile):
    """Programs of kernel_triton resident per SM: its [head_tile, 512] f32 accumulator sits in
    registers, so a 64-head program (8 warps, ~200 registers a thread) fills an SM alone.
    (Assuming 4 for 64 heads split B=64 Flash CSA 10 ways into 5 waves, ~10% slower.)"""
    return max(1, 64 // head_tile)


def sparse_decode_attention(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *,
                            splits=None, gather="direct", warp_specialized=True,
                            backend="mosaic", head_tile=64, num_warps=8, num_stages=1,
                            q_in_loop=False, col_split=1, joined=False, qk_split=False,
                            ids_prefix=False, hca_entries=None, merge=None, double_k=None,
                            interpret=None):
    """-> out [B, H, 512] bf16. Same arguments as reference.sparse_decode_attention_reference.
    -1 entries anywhere are masked; key blocks after the last valid id are skipped, so lists
    with valid ids first (top-k output, HCA prefix) do the least work. gather: "direct"
    (rows copied from the pool in-kernel; a row is a tensor-TMA [8, 64]-byte box, 448 B +
    64 B over-read, into 512-B SMEM rows), "cpasync" (the producer warpgroup's 128
    threads copy 16-byte pieces of the rows with cp.async; warp_specialized only; the
    interpreter cannot run it, so interpreted calls take "direct") or "staged" (XLA
    staging gather, to compare). qk_split (warp_specialized only): each consumer warpgroup
    scores only its 32 keys of a block and the two exchange row maxima, instead of both
    computing the full scores: 2-6% less op time (H200, 2026-11-26), no step-level gain,
    and the 4-layer decode check drifts further from pure JAX at B=1 (rel 0.078 vs 0.039:
    the two partial row sums round differently), so it is off by default.
    warp_specialized: one CTA per (request, split, head tile) with a producer warpgroup
    issuing the row copies and two consumer warpgroups (one per output column half) sharing
    the K tile; otherwise two single-warpgroup CTAs (one per column half) each copy and
    dequantise every row.
    backend="triton": kernel_triton (rows gathered by vector loads, head_tile heads per
    program, num_warps, num_stages, q_in_loop (re-read q per key block instead of holding
    it), col_split (2: two programs per tile, one per output column half), joined (K and
    the output accumulator as whole [.., 512] tiles: 2 dots per key block instead of 16);
    gather must be "direct"); interpret then only needs to be truthy.
    ids_prefix: the caller promises that no valid id sits at a position >= min(K, (t+1) //
    ratio) (ratio = BLOCK_TOKENS / EPB): true of both top-k paths' output (valid ids first,
    as many as there are eligible entries) and of hca_indices. gather="cpasync" then bounds
    its key blocks from t in-kernel instead of XLA searching for the last valid id (one
    fusion fewer a call); the other gathers and backends ignore it.
    idx_BK=None with hca_entries=K: the ids are an HCA layer's, hca_indices(t, K, ratio)
    (entries 0 .. min(K, (t+1) // ratio) - 1, ratio = 128 / EPB). gather="cpasync" derives
    them in-kernel from t (no id array, one fusion fewer a call); the other paths build
    them with hca_indices.
    merge (key splits' merge; None: $DSV4_ATTN_MERGE, else "kernel" from
    MERGE_KERNEL_MIN_BATCH requests and "xla" below): "xla" merges in XLA (merge_splits, two
    fusions); "kernel" in one Mosaic-GPU kernel of the same formula (merge.
    merge_splits_kernel; interpreted calls take it only when asked by argument, and the
    default gives way to XLA's merge past merge.MAX_SPLITS = 27 splits);
    "auto" merges 2 splits in-kernel (the cpasync kernel on a GPU, no
    qk_split) and more in XLA; "cluster" requires the in-kernel merge (_cluster_merge).
    The in-kernel merge runs on the H100 with the XLA merge's error (session 24 run1), but
    the op is slower: the kernel grows by more than the two merge fusions it saves (Flash
    CSA B=64 33.2 -> 33.9 us, HCA B=64 50.3 -> 52.4, Pro CSA B=32 47.4 -> 48.0), so it is
    never the default.
    double_k (gather="cpasync" on a GPU, no qk_split, merge "xla" or "kernel"; None:
    $DSV4_ATTN_DOUBLE_K, on unless "0", and then off where qk_split or the in-kernel merge
    is asked for): two K
    tiles, block i+1's dequant overlapping block i's P V wgmma (or its score wgmma:
    $DSV4_ATTN_DK_AT=qk; _attn_call_dk); the same values, bit for bit (GPU-tested, session
    29), 4-10% faster at 128K. Interpreted calls (gather "direct") ignore it."""
    H = q_BHD.shape[1]
    dk_asked = double_k is not None
    if double_k is None:
        double_k = os.environ.get("DSV4_ATTN_DOUBLE_K", "1") != "0"
    merge_asked = merge is not None
    merge = merge or os.environ.get("DSV4_ATTN_MERGE") or (
        "kernel" if q_BHD.shape[0] >= MERGE_KERNEL_MIN_BATCH else "xla")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    implicit = 0
    if idx_BK is None:
        if not hca_entries or hca_entries < 1:
            raise ValueError(f"idx_BK=None needs hca_entries >= 1 (the HCA id list's length), "
                             f"got {hca_entries!r}")
        if (backend == "mosaic" and gather == "cpasync" and warp_specialized
                and not interpret):
            implicit, ids_prefix = int(hca_entries), True
        else:
            from pallas_kernels.sparse_decode_attention.reference import hca_indices
            idx_BK = hca_indices(t_B, int(hca_entries), BLOCK_TOKENS // cmp[0].shape[1])
    elif hca_entries is not None:
        raise ValueError("hca_entries is for idx_BK=None only")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        from pallas_kernels.sparse_decode_attention import kernel_triton as T
        if gather != "direct":
            raise ValueError("the triton backend gathers rows itself: gather must be 'direct'")
        args, NS = prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H,
                                  splits=splits,
                                  ctas_per_tile=max(1, HT // head_tile) * col_split,
                                  ctas_per_sm=triton_ctas_per_sm(head_tile))
        o, lse = T.attention_call(*args, NS=NS, HT=head_tile, num_warps=num_warps,
                                  num_stages=num_stages, q_in_loop=q_in_loop,
                                  col_split=col_split, joined=joined,
                                  interpret=bool(interpret))
    else:
        if gather == "cpasync" and not warp_specialized:
            raise ValueError("gather='cpasync' needs warp_specialized=True (its producer "
                             "warpgroup does the copies)")
        if gather == "cpasync" and interpret:
            gather = "direct"   # same values; the interpreter runs no inline PTX
        args, NS = prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H,
                                  splits=splits, gather=gather,
                                  ctas_per_tile=1 if warp_specialized else 2,
                                  ids_prefix=ids_prefix, implicit=implicit)
        if qk_split and not warp_specialized:
            raise ValueError("qk_split needs warp_specialized=True (its two consumers split "
                             "the keys)")
        can = warp_specialized and gather == "cpasync" and not qk_split and NS == 2
        if merge == "cluster" and not can:
            raise ValueError(f"merge='cluster' needs the cpasync kernel on a GPU, 2 key splits "
                             f"and no qk_split (got gather={gather!r}, splits={NS}, "
                             f"qk_split={qk_split})")
        cluster = can and merge in ("auto", "cluster")
        if double_k and gather == "cpasync" and (qk_split or cluster):
            if dk_asked:
                raise ValueError(f"double_k takes neither qk_split nor the in-kernel merge "
                                 f"(got qk_split={qk_split}, merge={merge!r})")
            double_k = False   # the default gives way to an explicit qk_split / merge
        if double_k and gather == "cpasync" and _seesaw(q_BHD.shape[0], H):
            o, lse = _attn_call_ss(*args, NS=NS, epb=cmp[0].shape[1],
                                   used_from_t=ids_prefix, implicit=implicit)
        elif double_k and gather == "cpasync":
            o, lse = _attn_call_dk(*args, NS=NS, epb=cmp[0].shape[1],
                                   used_from_t=ids_prefix, implicit=implicit)
        elif warp_specialized:
            o, lse = _attn_call_ws(*args, NS=NS, gather=gather, interpret=interpret,
                                   qk_split=qk_split, epb=cmp[0].shape[1],
                                   used_from_t=ids_prefix and gather == "cpasync",
                                   implicit=implicit, cluster_merge=cluster)
            if cluster:
                NS = 1   # merged in-kernel: o [1, B, HP, 512] is final
        else:
            o, lse = _attn_call(*args, NS=NS, gather=gather, interpret=interpret)
    sink = args[-1]
    if NS == 1:
        out = o[0]
    elif merge == "kernel" and backend == "mosaic" and (
            merge_asked or (not interpret and NS <= MAX_SPLITS)):
        # (asked for by argument with too many splits, the merge kernel says so)
        out = merge_splits_kernel(o, lse, sink, interpret=interpret)
    else:
        out = merge_splits(o, lse, sink)
    return out[:, :H]


def merge_splits(o, lse, sink):
    """Flash-decoding merge of the splits' normalised outputs o [NS, B, HP, 512] and
    log-sum-exps lse [NS, B, HP], with the sink in the denominator -> [B, HP, 512] bf16.
    Written as a sum over the (few) splits so XLA makes two fusions of it, not three."""
    ls = [lse[s] for s in range(lse.shape[0])]
    m = functools.reduce(jnp.maximum, ls, sink[None, :])                       # [B, HP]
    ws = [jnp.exp(x - m) for x in ls]
    den = functools.reduce(jnp.add, ws, jnp.exp(sink[None, :] - m))
    acc = functools.reduce(jnp.add, [w[..., None] * o[s].astype(jnp.float32)
                                     for s, w in enumerate(ws)])
    return (acc / den[..., None]).astype(jnp.bfloat16)


def prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *, splits=None,
                   gather="direct", ctas_per_tile=2, ctas_per_sm=1, ids_prefix=False,
                   implicit=0):
    """The XLA side of the op (checks, per-key metadata, and for gather="staged" the staging
    gather) -> (kernel args, NS). gather="cpasync" with ids_prefix: the `used` argument is
    t itself (the kernel derives the bound; sparse_decode_attention). implicit = K > 0
    (cpasync, ids_prefix; idx_BK None): the HCA ids are derived in-kernel; idx is the
    block table, passed but never read as ids (no XLA work)."""
    win_nope, win_scale, win_rope, win_pos = win
    cmp_nope, cmp_scale, cmp_rope = cmp
    B, H, Dq = q_BHD.shape
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
    if Dq != D:
        raise ValueError(f"q must be [B, H, {D}], got {q_BHD.shape}")
    if win_nope.shape[1:] != (WINDOW, NOPE) or win_nope.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"win_nope must be float8_e4m3fn [R, 128, 448], got {win_nope.dtype} {win_nope.shape}")
    if cmp_nope.shape[2:] != (NOPE,) or cmp_nope.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"cmp_nope must be float8_e4m3fn [NB, EPB, 448], got {cmp_nope.dtype} {cmp_nope.shape}")
    if cmp_rope.shape != cmp_nope.shape[:2] + (ROPE,) or cmp_scale.shape != cmp_nope.shape[:2] + (8,):
        raise ValueError(f"cmp_rope / cmp_scale must be [NB, EPB, 64] / [NB, EPB, 8], got "
                         f"{cmp_rope.shape} / {cmp_scale.shape}")
    if implicit and not (gather == "cpasync" and ids_prefix and idx_BK is None):
        raise ValueError("implicit HCA ids need gather='cpasync', ids_prefix and idx_BK=None")
    if (win_nope.shape[0] < B or block_table.shape[0] < B or t_B.shape != (B,)
            or (idx_BK is not None and idx_BK.shape[0] != B)):
        raise ValueError("window ring / block table need >= B rows; idx and t need B rows")
    if sink_H.shape != (H,):
        raise ValueError(f"attn_sink must be [H]={H}, got {sink_H.shape}")
    HP = -(-H // HT) * HT
    q = q_BHD.astype(jnp.bfloat16)
    sink = sink_H.astype(jnp.float32)
    if HP != H:   # tiny test shapes: pad heads to the 64-row wgmma tile
        q = jnp.pad(q, ((0, 0), (0, HP - H), (0, 0)))
        sink = jnp.pad(sink, (0, HP - H))
    # the pools as 64-byte chunks / rope rows (free reshapes)
    wn, wr = win_nope.reshape(-1, 64), win_rope.reshape(-1, ROPE)
    cn, cr = cmp_nope.reshape(-1, 64), cmp_rope.reshape(-1, ROPE)
    if gather == "cpasync":
        # The producer derives each key's pool row, scale exponents and validity itself
        # (_cp_gather): XLA only finds the last valid id (one small fusion instead of three,
        # which took 6.4 us of GPU time at Flash B = 64: H200, 2026-11-26).
        if implicit:   # idx is never read: the block table stands in (a constant array
            # here became a broadcast kernel of its own: H100, 2026-11-26)
            idx, used = block_table.astype(jnp.int32), t_B.astype(jnp.int32)
            KP = -(-implicit // BLK) * BLK
        else:
            idx, used = ((_pad_ids(idx_BK), t_B.astype(jnp.int32)) if ids_prefix
                         else _ids_used(idx_BK))
            KP = idx.shape[1]
        n_blk = NW + KP // BLK
    else:
        crow, meta, n_blocks = _prep(win, cmp, block_table, idx_BK, t_B)
        n_blk = meta.shape[1]
    NS = splits or default_splits(B, HP, n_blk, ctas_per_tile=ctas_per_tile,
                                  ctas_per_sm=ctas_per_sm)
    if gather == "cpasync":
        keys = (idx, block_table.astype(jnp.int32), win_scale.reshape(-1, 8),
                cmp_scale.reshape(-1, 8), win_pos.astype(jnp.int32), t_B.astype(jnp.int32))
        return (q, wn, wr, cn, cr, *keys, used, sink), NS
    if gather == "staged":
        # Staging gather of the selected compressed rows (FP8 padded to 512 B, BF16 rope).
        cn = gather_rows_fp8(cmp_nope.reshape(-1, NOPE), crow)               # [B, KP, 448]
        cn = jnp.pad(cn, ((0, 0), (0, 0), (0, 64))).reshape(B, -1, 8, 64)
        cr = cmp_rope.reshape(-1, ROPE)[crow]                                 # [B, KP, 64]
    return (q, wn, wr, cn, cr, crow, meta, n_blocks, sink), NS


NCH = NOPE // 64          # 64-byte chunks of a stored nope row
N_ROW_COPIES = 2 * BLK + 1  # copies per block gathered row by row (nope, rope per key + meta)


def _issuer(b, g_refs, s_refs, direct):
    """-> issue(g, slot, wbar, cbar): start the copies of key block g into buffer slot.
    Compressed blocks complete cbar (N_ROW_COPIES arrivals if direct else 3); window
    blocks complete wbar (N_ROW_COPIES arrivals)."""
    wn_g, wr_g, cn_g, cr_g, crow_g, meta_g = g_refs
    n_s, r_s, m_s = s_refs

    def copy_rows(rows, nope_g, rope_g, slot, bar):
        # One row = an [8, 64] box of 64-byte chunks from chunk 7 * row: the row's 448
        # bytes plus the next row's first 64 (a multiple of 128 bytes, as the copy needs;
        # past the pool's end the tensor copy fills zeros). SMEM rows are 512 B apart, so
        # every destination is 128-byte aligned.
        for j, row in enumerate(rows):
            plgpu.copy_gmem_to_smem(nope_g.at[pl.ds(row * NCH, 8)], n_s.at[slot, j], bar)
            plgpu.copy_gmem_to_smem(rope_g.at[pl.ds(row, 1)], r_s.at[slot, pl.ds(j, 1)], bar)

    def issue(g, slot, wbar, cbar):
        @pl.when(g < NW)
        def _():   # window ring: this request's rows b*128 + g*64 + j
            copy_rows([b * WINDOW + g * BLK + j for j in range(BLK)], wn_g, wr_g, slot,
                      wbar.at[slot])
            plgpu.copy_gmem_to_smem(meta_g.at[b, g], m_s.at[slot], wbar.at[slot])

        @pl.when(g >= NW)
        def _():
            base = (g - NW) * BLK
            if direct:
                # All 64 row ids are loaded before the first copy is issued, so their
                # latencies overlap instead of adding up.
                copy_rows([crow_g[b, base + j] for j in range(BLK)], cn_g, cr_g, slot,
                          cbar.at[slot])
            else:
                keys = pl.ds(base, BLK)
                plgpu.copy_gmem_to_smem(cn_g.at[b, keys], n_s.at[slot], cbar.at[slot])
                plgpu.copy_gmem_to_smem(cr_g.at[b, keys], r_s.at[slot], cbar.at[slot])
            plgpu.copy_gmem_to_smem(meta_g.at[b, g], m_s.at[slot], cbar.at[slot])
    return issue


# gather="cpasync": the producer warpgroup's 128 threads copy a block's rows with 16-byte
# cp.async (Ampere-style asynchronous copies; Hopper has no TMA gather): two threads a key,
# 14 nope + 4 rope pieces each, the block's meta (512 B) by threads 0..31. It replaced one
# TMA per row issued by a single thread (gather="direct"), once thought the kernel's bound;
# alone it gained 4%. Nsight Compute then showed spills and 7-way bank conflicts as the
# bounds (BENCHMARKS.md, session 20): P V in place, the half-row mapping, 56 / 224
# registers and the swizzled buffer below removed them.
CP_NOPE, CP_ROPE = NOPE // 16, ROPE * 2 // 16     # 16-byte pieces of a row
# Registers a thread of the warp-specialised kernel: producer / consumer warpgroups.
# setmaxnreg moves registers within what the CTA was launched with (ptxas' count, 168, for
# 384 threads), so p + 2 c <= 504: 64 / 224 hung the kernel (consumers waiting for
# registers that never came; H100, 2026-11-26, session 23). 56 / 224 measured 1-2% faster
# than 40 / 232 (H200, 2026-11-26, benchmarks/attn_probe.py); with merge="cluster" the
# producer spills two scalars at 56 (8 bytes, reloaded a few times a block). DSV4_ATTN_PREG
# / DSV4_ATTN_CREG override them for A/B runs.
P_REGS, C_REGS = 56, 224


def _set_registers(consumer):
    """The warpgroup's register budget (P_REGS / C_REGS, or $DSV4_ATTN_PREG / _CREG)."""
    if consumer:
        plgpu.set_max_registers(int(os.environ.get("DSV4_ATTN_CREG", C_REGS)), action="increase")
    else:
        plgpu.set_max_registers(int(os.environ.get("DSV4_ATTN_PREG", P_REGS)), action="decrease")


def _ablated():
    """Stages the warp-specialised kernel skips, for timing only (wrong results):
    DSV4_ATTN_ABLATE = a "/"-separated list of copy (no row copies), deq (no dequant), qk
    (no score wgmma), pv (no P V wgmma). What each removal saves bounds that stage's share
    of the serial chain (benchmarks/attn_probe.py variants cpasync:DSV4_ATTN_ABLATE=deq/qk)."""
    return set(filter(None, os.environ.get("DSV4_ATTN_ABLATE", "").split("/")))


def _cp_gather(window, refs, s_refs, row_base, idx_off, b, slot, epb, implicit=0,
               parts="nr", rope_in_k=False, nope_chunks=(0, NCH), meta=True, commit=False):
    """Copy one key block into buffer `slot` with cp.async from the calling warpgroup's
    128 threads, write its meta (scale exponents + validity byte) into m_s, then wait for
    this thread's copies (the caller's barrier_arrive releases them to the consumers).
    window: rows row_base + key, valid where row's position is within the last 128 of
    t[b]; else rows of the ids idx[idx_off + key] (pool row blk * EPB + id % EPB with
    blk = block_table[b, id // epb]; a -1 id reads row 0 and is masked). refs = (nope
    [rows * 7, 64] e4m3, rope [rows, 64] bf16, idx [B, KP] i32, block_table [R, MAXB]
    i32, win_scale [R * 128, 8] u8, cmp_scale [rows, 8] u8, win_pos [R, 128] i32, t [B]
    i32) in GMEM; s_refs = (n_s [2, 7, 64, 64] (chunk-major, tiled and swizzled: see
    below), r_s [2, 64, 64], m_s [2, 8, 64]) in SMEM. GPU only (inline PTX).
    implicit = K > 0 (HCA): idx is not read; the id at list position idx_off + key is the
    position itself, valid below min(K, (t[b] + 1) * epb // 128) (what hca_indices lists).
    parts: "n" the nope rows and the meta, "r" the rope rows, "nr" both. rope_in_k (the
    double_k kernel): s_refs = (n_s [1, 7, 64, 64], k_s [2, 64, 512] bf16 (tiled (8, 64),
    128-byte swizzled), m_s [2, 8, 64]); the nope rows go to n_s's one slot, the meta to
    m_s[slot], the rope rows straight into columns 448.. of K tile `slot`, followed by a
    proxy fence (the consumers' wgmma read them through the async proxy).
    nope_chunks (lo, hi): only chunks lo..hi-1 of the nope rows; meta: write the meta with
    them; commit (the seesaw kernel): close this thread's copies as one cp.async group
    instead of waiting for them (the caller retires it: _cp_retire)."""
    splat = plgpu.Layout.WG_SPLAT(())
    ref, n_ref = plgpu.RefType(), plgpu.RefType(SWZ64)
    r_ref = plgpu.RefType(TILED) if rope_in_k else ref
    EPB_, MAXB = epb, refs[3].shape[1]

    @plgpu.inline_mgpu(arg_types=(ref,) * 8 + (n_ref, r_ref, ref) + (splat,) * 4)
    def gather(ctx, nope_g, rope_g, idx_g, bt_g, wsc_g, csc_g, pos_g, t_g, n_s, r_s, m_s,
               rb, io, bb, sl):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm
        from jax.experimental.mosaic.gpu import utils as mu
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        c32 = lambda v: mu.c(v, i32)
        c64 = lambda v: mu.c(v, i64)
        gaddr = lambda ref: llvm.ptrtoint(i64, mu.memref_ptr(ref))
        saddr = lambda ref: llvm.ptrtoint(i32, mu.memref_ptr(ref))
        rb, io, bb, sl = (x.registers.item() for x in (rb, io, bb, sl))
        t = arith.remui(mu.thread_idx(), c32(128))
        g_n, g_r = gaddr(nope_g), gaddr(rope_g)
        s_n, s_r, s_m = (saddr(r) for r in (n_s, r_s, m_s))

        def ld32(base, i):   # base: i64 address, i: i32 element index
            a = arith.addi(base, arith.muli(arith.extui(i64, i), c64(4)))
            return mu.inline_ptx("ld.global.nc.b32 $0, [$1];", a, result_types=i32)

        def sge(x, y):
            return arith.cmpi(arith.CmpIPredicate.sge, x, y)

        key, h = arith.shrui(t, c32(1)), arith.andi(t, c32(1))
        if window:
            row = arith.addi(rb, key)
            pos, tb = ld32(gaddr(pos_g), row), ld32(gaddr(t_g), bb)
            ok = arith.andi(arith.andi(sge(pos, c32(0)), sge(tb, pos)),
                            sge(pos, arith.subi(tb, c32(WINDOW - 1))))
            g_sc = gaddr(wsc_g)
        elif implicit:   # HCA: the list position is the id; valid below min(K, n(t))
            i, tb = arith.addi(io, key), ld32(gaddr(t_g), bb)
            n = arith.divsi(arith.muli(arith.maxsi(arith.addi(tb, c32(1)), c32(0)), c32(EPB_)),
                            c32(BLOCK_TOKENS))
            ok = arith.cmpi(arith.CmpIPredicate.slt, i, arith.minsi(n, c32(implicit)))
            safe = i
        if not window:
            if not implicit:
                i = ld32(gaddr(idx_g), arith.addi(io, key))
                ok = sge(i, c32(0))
                safe = arith.maxsi(i, c32(0))
            # (an id past the table reads its last entry, as XLA's clamping gather did,
            # instead of another request's row or past the table's end)
            col = arith.minui(arith.divui(safe, c32(EPB_)), c32(MAXB - 1))
            blk = ld32(gaddr(bt_g), arith.addi(arith.muli(bb, c32(MAXB)), col))
            row = arith.addi(arith.muli(arith.maxsi(blk, c32(0)), c32(EPB_)),
                             arith.remui(safe, c32(EPB_)))
            g_sc = gaddr(csc_g)
        row = arith.extui(i64, row)

        def copy(dst, src, pred=None):   # dst: i32 shared address, src: i64 global
            mu.inline_ptx("cp.async.cg.shared.global [$0], [$1], 16;", dst, src,
                          predicate=pred, has_side_effects=True)

        # thread t copies half of key t // 2's row: pieces h, h + 2, h + 4, ... (h = t % 2),
        # so the two threads of a key read adjacent 16 bytes (whole 32-byte sectors), one
        # row id a thread, and every piece is a constant offset from two base addresses
        h16 = arith.muli(h, c32(16))
        # n_s is [2, 7 chunks, 64 keys, 64 B], tiled (8, 64) and 64-byte swizzled: key r's
        # 16-byte unit v of chunk j sits at j * 4096 + (r // 8) * 512 + (r % 8) * 64 +
        # (v ^ ((r >> 1) & 3)) * 16; this thread's units are v = h (even i), h + 2 (odd i)
        if "n" in parts:
            src = arith.addi(g_n, arith.addi(arith.muli(row, c64(NOPE)), arith.extui(i64, h16)))
            x = arith.andi(arith.shrui(key, c32(1)), c32(3))
            n_off = c32(0) if rope_in_k else arith.muli(sl, c32(NCH * BLK * 64))
            base = arith.addi(s_n, arith.addi(n_off, arith.muli(key, c32(64))))
            unit = [arith.addi(base, arith.muli(arith.xori(arith.addi(h, c32(2 * k)), x),
                                                c32(16))) for k in range(2)]
            for i in range(2 * nope_chunks[0], 2 * nope_chunks[1]):
                copy(arith.addi(unit[i % 2], c32((i // 2) * BLK * 64)),
                     arith.addi(src, c64(32 * i)))
        if "r" in parts:
            src = arith.addi(g_r, arith.addi(arith.muli(row, c64(ROPE * 2)),
                                             arith.extui(i64, h16)))
            if rope_in_k:
                # K tile [64 keys, 512] bf16, tiled (8, 64), 128-byte swizzled: the rope
                # columns are tile column 7; key r's 16-byte unit u sits at slot * 64 KB +
                # ((r // 8) * 8 + 7) * 1024 + (r % 8) * 128 + (u ^ (r % 8)) * 16; this
                # thread's units are u = h + 2 i
                r8 = arith.andi(key, c32(7))
                base = arith.addi(s_r, arith.addi(
                    arith.muli(sl, c32(BLK * D * 2)),
                    arith.addi(arith.muli(arith.addi(arith.muli(arith.shrui(key, c32(3)), c32(8)),
                                                     c32(NCH)), c32(1024)),
                               arith.muli(r8, c32(128)))))
                for i in range(CP_ROPE // 2):
                    u = arith.xori(arith.addi(h, c32(2 * i)), r8)
                    copy(arith.addi(base, arith.muli(u, c32(16))), arith.addi(src, c64(32 * i)))
            else:
                dst = arith.addi(s_r, arith.addi(arith.muli(sl, c32(BLK * ROPE * 2)),
                                                 arith.addi(arith.muli(key, c32(ROPE * 2)), h16)))
                for i in range(CP_ROPE // 2):
                    copy(arith.addi(dst, c32(32 * i)), arith.addi(src, c64(32 * i)))
        def finish(fence):
            """Close this thread's copies: one group (commit) or wait for them, and
            fence them for the wgmma's async proxy."""
            if commit:
                mu.inline_ptx("cp.async.commit_group;", has_side_effects=True)
                return
            mu.inline_ptx("cp.async.wait_all;", has_side_effects=True)
            if fence:
                mu.inline_ptx("fence.proxy.async.shared::cta;", has_side_effects=True)

        if "n" not in parts or not meta:
            finish(rope_in_k)
            return
        # meta: thread h writes exponents 4h .. 4h + 3 of its key into m_s [8, 64]; the
        # format's unused 8th exponent becomes the validity byte
        w = mu.inline_ptx("ld.global.nc.b32 $0, [$1];",
                          arith.addi(g_sc, arith.addi(arith.muli(row, c64(8)),
                                                      arith.extui(i64, arith.muli(h, c32(4))))),
                          result_types=i32)
        w_ok = arith.ori(arith.andi(w, c32(0x00FFFFFF)),
                         arith.shli(arith.extui(i32, ok), c32(24)))
        w = arith.select(arith.cmpi(arith.CmpIPredicate.eq, h, c32(1)), w_ok, w)
        m = arith.addi(s_m, arith.addi(arith.muli(sl, c32(8 * BLK)),
                                       arith.addi(arith.muli(h, c32(4 * BLK)), key)))
        for k in range(4):
            mu.inline_ptx("st.shared.u8 [$0], $1;", arith.addi(m, c32(k * BLK)),
                          arith.shrui(w, c32(8 * k)), has_side_effects=True)
        finish(rope_in_k and "r" in parts)

    gather(*refs, *s_refs, row_base, idx_off, b, slot)


def _cp_blocks(b, g_refs, s_refs, epb, implicit=0, **gather_kw):
    """-> gather(g, slot, after=None): _cp_gather of key block g into slot (the window
    ring's rows b*128 + g*64 + j for g < NW, else the rows of the compressed ids, list
    positions (g - NW)*64 ..), then after(window) in the same branch (the caller's
    barrier arrival). g_refs = (win nope, win rope, cmp nope, cmp rope, idx, block_table,
    win_scale, cmp_scale, win_pos, t); implicit, gather_kw: _cp_gather's.
    DSV4_ATTN_ABLATE=copy: no copies."""
    wn_g, wr_g, cn_g, cr_g, idx_g, *rest = g_refs
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    copy = ((lambda *a, **k: None) if "copy" in _ablated() else
            functools.partial(_cp_gather, **gather_kw))

    def gather(g, slot, after=lambda window: None):
        @pl.when(g < NW)
        def _():
            copy(True, (wn_g, wr_g, idx_g, *rest), s_refs, i32(b * WINDOW + g * BLK),
                 i32(0), i32(b), i32(slot), epb, implicit)
            after(True)

        @pl.when(g >= NW)
        def _():
            off = (g - NW) * BLK if implicit else b * idx_g.shape[1] + (g - NW) * BLK
            copy(False, (cn_g, cr_g, idx_g, *rest), s_refs, i32(0), i32(off), i32(b),
                 i32(slot), epb, implicit)
            after(False)
    return gather


def _cp_issuer(b, g_refs, s_refs, epb, implicit=0, parts="nr", rope_in_k=False):
    """gather="cpasync" counterpart of _issuer: issue(g, slot, wbar, cbar) copies block g
    into slot with its meta (the calling warpgroup waits for its copies) and arrives once
    on its barrier (wbar / cbar: one arrival per block). g_refs, implicit:
    _cp_blocks'; parts, rope_in_k: _cp_gather's (double_k)."""
    gather = _cp_blocks(b, g_refs, s_refs, epb, implicit, parts=parts,
                        rope_in_k=rope_in_k)

    def issue(g, slot, wbar, cbar):
        gather(g, slot, lambda window: plgpu.barrier_arrive((wbar if window else cbar).at[slot]))
    return issue


def _wait_block(g, slot, wbar, cbar):
    @pl.when(g < NW)
    def _():
        plgpu.barrier_wait(wbar.at[slot])

    @pl.when(g >= NW)
    def _():
        plgpu.barrier_wait(cbar.at[slot])


def _dequant(n_s, r_s, m_s, k_s, slot, chunks, rope, swizzled=False, n_slot=None):
    """K[:, 64j:64j+64] = e4m3 * 2^(e_j - 127) (exact in bf16) for j in chunks; rope as is.
    swizzled: n_s is [2, 8, 64, 64] chunk-major, tiled (8, 64) and 64-byte swizzled
    (gather="cpasync" writes it so): conflict-free loads. n_slot: n_s's slot when it is
    not `slot` (m_s's; the double_k kernel has one FP8 slot)."""
    n_slot = slot if n_slot is None else n_slot
    for j in chunks:
        if swizzled:
            x = plgpu.load(n_s.at[n_slot, j], layout=WG)
        else:   # row stride of 512 B: bank conflicts, accepted (optimized=False)
            x = plgpu.load(n_s.at[slot, :, j], layout=WG, optimized=False)
        e = plgpu.load(m_s.at[slot, j], layout=ROW).astype(jnp.int32)
        f = lax.bitcast_convert_type(jnp.clip(e, 1, 254) << 23, jnp.float32)
        kx = x.astype(jnp.float32) * lax.broadcast_in_dim(f, (BLK, 64), [0])
        k_s[:, pl.ds(j * 64, 64)] = kx.astype(jnp.bfloat16)
    if rope:
        k_s[:, pl.ds(NOPE, ROPE)] = plgpu.load(r_s.at[slot], layout=WG, optimized=False)


def _bias(m_s, slot, keys=None):
    """0 / -inf per key of the block (or of its `keys` slice), from the validity byte (COL
    layout)."""
    ref = m_s.at[slot, 7] if keys is None else m_s.at[slot, 7, keys]
    ok = plgpu.load(ref, layout=COL).astype(jnp.int32)
    return jnp.where(ok != 0, 0.0, -jnp.inf).astype(jnp.float32)


def _online_update(s, m_new, m, l, acc):
    """The online-softmax step for scores s [64 heads, n keys] with the new running row max
    m_new: -> (P f32, l, acc rescaled, alpha: the rescale, which the seesaw kernel
    publishes for the consumer that did not score the block)."""
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)     # all-masked block so far
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    return p, l, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), alpha


def _scores_softmax(q_s, k_s, p_s, bias, m, l, acc):
    """S = q K^T / sqrt(512) + bias, online-softmax update; P (bf16) -> p_s."""
    def qk(acc_ref):
        if "qk" not in _ablated():
            plgpu.wgmma(acc_ref, q_s, k_s.T)
        return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32)) * (1.0 / math.sqrt(D))
    s = s + lax.broadcast_in_dim(bias, s.shape, [1])
    m_new = jnp.maximum(m, s.max(axis=1))
    p, l, acc, _ = _online_update(s, m_new, m, l, acc)
    p_s[...] = p.astype(jnp.bfloat16)
    plgpu.commit_smem()
    return m_new, l, acc


def _pv(p_s, k_s, c, acc, in_place=True):
    """acc + P V for output column half c (dynamic): [64 heads, 256] f32. in_place: the
    wgmma adds into acc itself (a fresh accumulator added afterwards held two [64, 256]
    f32 tiles, 256 registers a thread, and spilled: sm_90a SASS, 2026-11-26). The
    interpreter cannot run that form (a wgmma effect inside lax.cond), so interpreted
    calls take the fresh-accumulator form (the same sums, rounded in another order)."""
    if "pv" in _ablated():
        return acc

    def half(h):
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, p_s, k_s.at[:, pl.ds(h * (D // 2), D // 2)])

        def fresh(acc_ref):
            mma(acc_ref)
            return acc_ref[...]
        if in_place:
            return lambda a: pl.run_state(mma)(plgpu.ACC.init(a))
        return lambda a: a + pl.run_scoped(fresh, plgpu.ACC((HT, D // 2), jnp.float32))
    return lax.cond(c == 0, half(0), half(1), acc)


SPLIT = BLK // 2          # qk_split: keys per consumer warpgroup
# qk_split stores each consumer's 32 columns of P into one shared tile, so the bf16 tiles
# (q, K, P: every wgmma operand, whose swizzles must agree) are tiled 32 wide instead of 64
TILED32 = (plgpu.TilingTransform((8, SPLIT)), plgpu.SwizzleTransform(2 * SPLIT))


def _scores_softmax_split(q_s, k_s, p_s, x_s, xbar, pfull, bias, c, m, l, acc):
    """qk_split: consumer c scores only keys [32c, 32c + 32) (S_c [64 heads, 32]), the two
    exchange their row maxima through x_s, and each stores its P_c (bf16) in its 32
    columns of the shared P tile p_s [64, 64] (then both run P V over all 64 keys).
    l stays this consumer's partial sum (the two are added up after the key loop); m is
    the same in both. Ends once both P halves are in SMEM."""
    def qk(h):
        def f(acc_ref):
            plgpu.wgmma(acc_ref, q_s, k_s.at[pl.ds(h * SPLIT, SPLIT)].T)
            return acc_ref[...]
        return lambda: pl.run_scoped(f, plgpu.ACC((HT, SPLIT), jnp.float32))
    s = lax.cond(c == 0, qk(0), qk(1)) * (1.0 / math.sqrt(D))
    s = s + lax.broadcast_in_dim(bias, s.shape, [1])
    m_c = s.max(axis=1)
    m_new = jnp.maximum(m, jnp.maximum(m_c, _exchange(x_s, xbar, c, m_c)))
    p, l, acc, _ = _online_update(s, m_new, m, l, acc)
    for h in range(2):   # p_s [64 heads, 64 keys]: this consumer's 32 columns
        @pl.when(c == h)
        def _():
            p_s[:, pl.ds(h * SPLIT, SPLIT)] = p.astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.barrier_arrive(pfull)
    plgpu.barrier_wait(pfull)
    return m_new, l, acc


def _exchange(x_s, xbar, c, v):
    """Consumer c publishes a row vector [64] in x_s[c] and returns the other's."""
    for h in range(2):
        @pl.when(c == h)
        def _():
            x_s[h] = v
    plgpu.commit_smem()
    plgpu.barrier_arrive(xbar)
    plgpu.barrier_wait(xbar)
    return lax.cond(c == 0, lambda: plgpu.load(x_s.at[1], layout=ROW),
                    lambda: plgpu.load(x_s.at[0], layout=ROW))


def _init_carry():
    m0 = plgpu.layout_cast(jnp.full((HT,), -jnp.inf, jnp.float32), ROW)
    l0 = plgpu.layout_cast(jnp.full((HT,), 0.0, jnp.float32), ROW)
    a0 = plgpu.layout_cast(jnp.full((HT, D // 2), 0.0, jnp.float32), WG)
    return a0, m0, l0


def _store_half(out, q_s, o_g, s_id, b, ht, c):
    """out [64 heads, 256] f32 -> bf16 through q_s columns of half c -> o_g[s_id, b, rows
    of head tile ht, half c] (8-row strips, TMA)."""
    def store(h):
        def f():
            q_s[:, pl.ds(h * (D // 2), D // 2)] = out.astype(jnp.bfloat16)
        return f
    lax.cond(c == 0, store(0), store(1))
    plgpu.commit_smem()
    for r in range(HT // 8):   # 8-row strips of one half: contiguous in the tiled SMEM
        for h in range(2):
            @pl.when(c == h)
            def _():
                plgpu.copy_smem_to_gmem(q_s.at[pl.ds(r * 8, 8), pl.ds(h * (D // 2), D // 2)],
                                        o_g.at[s_id, b, pl.ds(ht * HT + r * 8, 8),
                                               pl.ds(h * (D // 2), D // 2)])


def _cluster_merge(acc, m, l, q_s, k_s, p_s, v_s, o_g, b, ht, c, s_id, cbar, rbar):
    """merge="cluster" (2 key splits, a cluster of 2 CTAs): CTA s finalises output column
    half s. Consumer c != s sends its half's normalised partial (bf16, as the XLA merge
    reads it) into the other CTA's q_s half and its log-sum-exp (f32 bits as two bf16 side
    tiles) into that CTA's p_s, by st.async into distributed SMEM (rbar completes there);
    consumer c == s parks its own partial in k_s, merges the two 64 columns at a time
    (merge_splits' formula, with the kernel's approximate exp) and stores the final half.
    No partials in HBM, no XLA merge. Needs q_s / k_s / p_s free in both CTAs: `cbar`."""
    inv = 1.0 / jnp.where(l > 0, l, 1.0)
    o_own = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    # every consumer of both CTAs is past its key loop: q_s, k_s and p_s are free in both
    plgpu.barrier_arrive(cbar)
    plgpu.barrier_wait(cbar)

    @pl.when(c != s_id)
    def _send():
        for h in range(2):
            @pl.when(c == h)
            def _():
                plgpu.async_store_smem(o_own, q_s.at[:, pl.ds(h * (D // 2), D // 2)], rbar,
                                       cluster_idx=jnp.int32(h), cluster_dim="s")
        bits = lax.bitcast_convert_type(lse, jnp.uint32)
        for k, part in enumerate((bits >> 16, bits & 0xFFFF)):
            t = lax.bitcast_convert_type(part.astype(jnp.uint16), jnp.bfloat16)
            plgpu.async_store_smem(lax.broadcast_in_dim(t, (HT, BLK), [0]), p_s.at[k], rbar,
                                   cluster_idx=c, cluster_dim="s")

    @pl.when(c == s_id)
    def _merge():
        for h in range(2):   # own partial -> k_s (registers stay low for the merge)
            @pl.when(c == h)
            def _():
                k_s[:, pl.ds(h * (D // 2), D // 2)] = o_own
        plgpu.barrier_wait(rbar)
        # the side tiles' rows are constant: a row max recovers each 16-bit half exactly
        half = lambda k: (lax.bitcast_convert_type(plgpu.load(p_s.at[k], layout=WG), jnp.uint16)
                          .astype(jnp.float32).max(axis=1).astype(jnp.uint32))
        lse_peer = lax.bitcast_convert_type((half(0) << 16) | half(1), jnp.float32)
        sk = plgpu.load(v_s, layout=ROW)
        mm = jnp.maximum(sk, jnp.maximum(lse, lse_peer))
        w_own, w_peer = jnp.exp(lse - mm), jnp.exp(lse_peer - mm)
        inv_den = 1.0 / (jnp.exp(sk - mm) + (w_own + w_peer))   # the same in both CTAs
        bc = lambda v: lax.broadcast_in_dim(v, (HT, BLK), [0])
        for h in range(2):
            @pl.when(c == h)
            def _():
                for j in range(D // 2 // BLK):
                    cols = pl.ds(h * (D // 2) + j * BLK, BLK)
                    mix = (bc(w_own) * plgpu.load(k_s.at[:, cols], layout=WG).astype(jnp.float32)
                           + bc(w_peer) * plgpu.load(q_s.at[:, cols], layout=WG).astype(jnp.float32))
                    q_s[:, cols] = (mix * bc(inv_den)).astype(jnp.bfloat16)
                plgpu.commit_smem()
                for r in range(HT // 8):
                    plgpu.copy_smem_to_gmem(q_s.at[pl.ds(r * 8, 8), pl.ds(h * (D // 2), D // 2)],
                                            o_g.at[0, b, pl.ds(ht * HT + r * 8, 8),
                                                   pl.ds(h * (D // 2), D // 2)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _finish(acc, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, c, final):
    """Normalise (sink in the denominator when final, else emit lse) and store the half
    [64 heads, 256] through q_s columns of half c."""
    if final:
        sk = plgpu.load(v_s, layout=ROW)
        mm = jnp.maximum(m, sk)
        den = l * jnp.exp(m - mm) + jnp.exp(sk - mm)
        out = acc * lax.broadcast_in_dim(jnp.exp(m - mm) / den, acc.shape, [0])
    else:
        # one reciprocal per row, then multiplies: dividing the tile was 128 div.full.f32
        # a thread (each several instructions) in the epilogue
        inv = 1.0 / jnp.where(l > 0, l, 1.0)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    _store_half(out, q_s, o_g, s_id, b, ht, c)
    if not final:
        @pl.when(c == 0)
        def _():
            v_s[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_s, lse_g.at[s_id, b, pl.ds(ht * HT, HT)])
    # Only the SMEM reads must finish before the CTA exits (as CUTLASS's tma_store_wait);
    # the writes to GMEM complete before the kernel does.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


SWZ64 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))


def _scratch(p_copies, swizzled=False, qk_split=False):
    # SMEM of the warp-specialised cpasync kernel (of 227 KB an SM): q 64 KB, K 64 KB,
    # FP8 rows 2 x 28 KB, rope rows 2 x 8 KB, P 2 x 8 KB (qk_split: 8), meta 1 KB: ~222 KB.
    # A second bf16 K tile (to dequantise block i+1 while block i's wgmma run) does not fit
    # beside these; the double_k kernel (_attn_call_dk) drops P, rope and one FP8 slot for it.
    # FP8 rows: key-major, 512 B a key (7 chunks of 64 used, the 8th is padding) for the
    # row TMAs; chunk-major + swizzled, 7 chunks (448 B a key), for cp.async
    n_s = (plgpu.SMEM((2, NCH, BLK, 64), jnp.float8_e4m3fn, transforms=SWZ64) if swizzled
           else plgpu.SMEM((2, BLK, 8, 64), jnp.float8_e4m3fn))
    tiled = TILED32 if qk_split else TILED
    return [plgpu.SMEM((HT, D), jnp.bfloat16, transforms=tiled),             # q_s
            plgpu.SMEM((BLK, D), jnp.bfloat16, transforms=tiled),            # k_s
            n_s,
            plgpu.SMEM((2, BLK, ROPE), jnp.bfloat16),                        # r_s
            plgpu.SMEM((2, 8, BLK), jnp.uint8),                              # m_s
            (plgpu.SMEM((HT, BLK), jnp.bfloat16, transforms=tiled) if qk_split   # p_s:
             else plgpu.SMEM((p_copies, HT, BLK), jnp.bfloat16, transforms=tiled)),  # shared
            plgpu.SMEM((HT,), jnp.float32)]                                  # v_s: sink / lse


def _out_types(NS, B, HP):
    return (jax.ShapeDtypeStruct((NS, B, HP, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((NS, B, HP), jnp.float32))


def _params(profile_space=64):
    # Lane lowering: SMEM exactly as declared (the row buffers must stay un-swizzled).
    # Barriers are placed by hand (commit_smem, mbarriers): the automatic ones would add a
    # warpgroup barrier before each of the 129 copies of a block. No reduction scratch:
    # the only reductions are within warps (rows of the WGMMA layout), and the
    # warp-specialised kernel needs those 2 KB of SMEM.
    # DSV4_ATTN_PROFILE=<dir>: Mosaic's in-kernel profiler records the named scopes of the
    # warp-specialised kernel per warpgroup into <dir> (benchmarks/attn_timeline.py).
    # approx_math: exp(x) as ex2.approx.ftz(x * log2 e) (FMUL + MUFU.EX2) instead of the
    # precise expf (~9 SASS instructions: the softmax phase of a block was 577 instructions
    # a consumer thread, 34 exps); the official kernels' exp2f is the approximate one too.
    # Its error (~2^-22 relative) is far below the bf16 rounding of P. DSV4_ATTN_APPROX=0
    # restores the precise exp for A/B runs.
    prof = os.environ.get("DSV4_ATTN_PROFILE", "")
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                approx_math=os.environ.get("DSV4_ATTN_APPROX", "1") != "0",
                                unsafe_no_auto_barriers=True, reduction_scratch_bytes=0,
                                profile_space=profile_space if prof else 0, profile_dir=prof,
                                # (a CTA with > ~10 key blocks fills the 64 ranges: truncate
                                # its trace rather than overwrite the SMEM after it)
                                profile_bounds_check=bool(prof))


def _attn_call(q, wn, wr, cn, cr, crow, meta, n_blocks, sink, *, NS, gather, interpret):
    """Two single-warpgroup CTAs per (request, split, head tile), one per output column half.
    wn [R*128*7, 64] / cn [NB*EPB*7, 64] (direct) are the FP8 rows as 64-byte chunks,
    wr [R*128, 64] / cr [NB*EPB, 64] the rope rows; staged: cn [B, KP, 8, 64], cr [B, KP, 64]."""
    B, HP, _ = q.shape
    n_blk = meta.shape[1]
    bps = -(-n_blk // NS)
    direct = gather == "direct"

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, crow_g, meta_g, nb_g, sink_g, o_g, lse_g,
               q_s, k_s, n_s, r_s, m_s, p_s, v_s, qbar, wbar, cbar):
        b, s_id = lax.axis_index("b"), lax.axis_index("s")
        ht, c = lax.axis_index("h"), lax.axis_index("c")
        g0 = s_id * bps
        n_load = jnp.clip(jnp.minimum(nb_g[b], g0 + bps) - g0, 0, bps)
        issue = _issuer(b, (wn_g, wr_g, cn_g, cr_g, crow_g, meta_g), (n_s, r_s, m_s), direct)
        plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(ht * HT, HT)], q_s, qbar)
        plgpu.copy_gmem_to_smem(sink_g.at[pl.ds(ht * HT, HT)], v_s, qbar)

        @pl.when(n_load > 0)
        def _():
            issue(g0, 0, wbar, cbar)
        plgpu.barrier_wait(qbar)

        def body(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, 2)
            g = g0 + i
            # Every thread is done with the previous step's SMEM reads (n_s / k_s / p_s)
            # before this step's copies and stores.
            plgpu.commit_smem()

            @pl.when(i + 1 < n_load)
            def _():
                issue(g + 1, 1 - slot, wbar, cbar)
            _wait_block(g, slot, wbar, cbar)
            _dequant(n_s, r_s, m_s, k_s, slot, range(NCH), True)
            bias = _bias(m_s, slot)
            plgpu.commit_smem()
            m, l, acc = _scores_softmax(q_s, k_s, p_s.at[0], bias, m, l, acc)
            return _pv(p_s.at[0], k_s, c, acc, in_place=not interpret), m, l

        acc, m, l = lax.fori_loop(0, n_load, body, _init_carry())
        plgpu.commit_smem()   # the last step's wgmma reads of q_s are done
        _finish(acc, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, c, NS == 1)

    return plgpu.kernel(
        kernel,
        out_type=_out_types(NS, B, HP),
        grid=(B, NS, HP // HT, 2), grid_names=("b", "s", "h", "c"),
        scratch_types=(*_scratch(1),
                       plgpu.Barrier(num_arrivals=2),
                       plgpu.Barrier(num_arrivals=N_ROW_COPIES, num_barriers=2),
                       plgpu.Barrier(num_arrivals=N_ROW_COPIES if direct else 3, num_barriers=2)),
        compiler_params=_params(),
        interpret=interpret,
    )(q, wn, wr, cn, cr, crow, meta, n_blocks, sink)


def _env_choice(name, choices):
    """$name (read when a kernel is traced), one of choices (the first is the default)."""
    v = os.environ.get(name, choices[0])
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")
    return v


# The seesaw kernel replaces double_k (auto) for Pro's heads and small batches. GPU us,
# 128K, double_k -> seesaw (H200, session 35 runs 1-5; H100 session 34 run4 alike):
# Flash CSA B = 1 / 4 / 8: 9.7 -> 9.1, 11.5 -> 11.0, 12.5 -> 12.1 (H100 12.9 -> 12.4);
# Pro CSA B = 1 / 32: 11.5 -> 11.0, 42.9 -> 41.9 (H100 46.0 -> 45.2); Pro HCA B = 32 38.9 both;
# but Flash CSA B = 64 29.2 -> 30.8 (H100 31.9 -> 34.9) and Flash HCA B = 64 41.0 -> 42.8:
# with one FP8 staging slot its shorter chain exposes the gathers' latency, which Pro's
# second head tile (the same rows again, from L2) and a lightly loaded GPU hide.
SEESAW_MAX_BATCH = 8


def _seesaw(B, H):
    """$DSV4_ATTN_SEESAW: where double_k would run, "auto" (default) runs the seesaw kernel
    (_attn_call_ss) for more than one head tile (Pro) or B <= SEESAW_MAX_BATCH and
    double_k otherwise; "1" the seesaw always, "0" double_k always. Both give the same
    output bit for bit (GPU tests)."""
    v = _env_choice("DSV4_ATTN_SEESAW", ("auto", "0", "1"))
    return H > HT or B <= SEESAW_MAX_BATCH if v == "auto" else v == "1"


def _dk_overlap():
    """$DSV4_ATTN_DK_AT: "pv" (default) or "qk", where double_k puts the next dequant.
    H100, 128K (session 28 run6 / run7; cpasync kernel -> qk -> pv, us): Flash CSA B=64
    34.9 -> 36.4 -> 33.5, Pro CSA B=32 52.5 -> 48.6 -> 47.6, Flash CSA B=8 13.5 -> 13.0 ->
    13.0; Flash HCA B=64 47.9 -> 49.2 (qk), Pro HCA B=32 47.0 -> 44.3 (qk). Under the
    scores, the dequant's SMEM traffic meets the scores' (q and K read by both consumers)
    and the FP8 rows (one staging slot) have the least time to land."""
    return _env_choice("DSV4_ATTN_DK_AT", ("pv", "qk"))


def _key_blocks(keys, implicit, NS, cpasync=True):
    """Block counts of the warp-specialised kernels -> (kp, bps): the compressed key slots
    (implicit HCA ids: K rounded up to whole blocks) and the key blocks a split takes of
    a request's (the window's NW included; direct / staged: the metadata's block count)."""
    kp = -(-implicit // BLK) * BLK if implicit else keys[0].shape[1]
    n_blk = NW + kp // BLK if cpasync else keys[1].shape[1]
    return kp, -(-n_blk // NS)


def _split_load(used, g0, bps, kp, epb, used_from_t, cpasync=True):
    """Key blocks a CTA loads: its split's share (blocks g0..g0 + bps) of the request's
    used blocks. used: the valid id prefix (cpasync), t (used_from_t: the eligible
    compressed entries, min(kp, (t + 1) * epb // BLOCK_TOKENS), bound the blocks) or the
    block count (direct / staged)."""
    if used_from_t:
        used = jnp.minimum(lax.div(jnp.maximum(used + 1, 0) * epb, BLOCK_TOKENS), kp)
    nb = NW + (used + BLK - 1) // BLK if cpasync else used
    return jnp.clip(jnp.minimum(nb, g0 + bps) - g0, 0, bps)


def _dk_buffers():
    """SMEM of the two-K-tile kernel (221 KB of 227): q_s [64 heads, 512] bf16, k_s two
    bf16 K tiles, n_s one FP8 staging slot (7 chunk-major, 64-byte swizzled [64, 64]
    chunks), m_s [2, 8, 64] meta (scale exponents + validity byte), v_s [64] f32 (sink,
    then the lse)."""
    return (plgpu.SMEM((HT, D), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((2, BLK, D), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((1, NCH, BLK, 64), jnp.float8_e4m3fn, transforms=SWZ64),
            plgpu.SMEM((2, 8, BLK), jnp.uint8),
            plgpu.SMEM((HT,), jnp.float32))


def _launch_ws(kernel, NS, B, HP, profile_space=64):
    """The double_k kernel's launch: three warpgroups a CTA (two consumers, the
    producer), one CTA per (request, split, 64-head tile)."""
    return plgpu.kernel(kernel, out_type=_out_types(NS, B, HP), num_threads=3,
                        thread_name="wg", compiler_params=_params(profile_space),
                        grid=(B, NS, HP // HT), grid_names=("b", "s", "h"))


def _attn_call_dk(q, wn, wr, cn, cr, *args, NS, epb, used_from_t=False, implicit=0):
    """double_k (gather="cpasync", GPU only): the warp-specialised kernel with two bf16 K
    tiles, so that block i+1's dequant runs while one of block i's wgmma is in flight (P V
    by default; the scores with $DSV4_ATTN_DK_AT=qk: _dk_overlap), instead of after block
    i's P V as in _attn_call_ws. What makes the second 64 KB tile
    fit (of 227 KB): P goes to P V from registers (no P tiles: -16 KB), the FP8 rows have
    one staging slot (-28 KB) and the rope rows are copied by the producer straight into
    the K tile (no rope staging: -16 KB): q 64 + K 2 x 64 + FP8 28 + meta 1 = 221 KB.
    Same values and roundings as _attn_call_ws (qk_split off): the same wgmma operands.

    Block i (K tile s = i % 2), consumer c (output columns 256c..):
      wait kfull (both dequants of block i done, both score wgmma of block i-1 done) and
      rbar[s] (its rope landed); bias from m_s[s]; S = q K[s]^T; softmax; P V from
      registers; arrive kfree[s]. Under the wgmma that takes it (P V, or S with "qk"):
      wait block i+1's FP8 rows, dequantise half c of them into K[1-s] (the columns only
      this consumer's P V reads, so the other consumer's P V of block i-1 may still run
      with "qk"), arrive `free` (the FP8 slot may be refilled); once that wgmma is done,
      arrive kfull (block i+1).
    The producer, for block j: wait free (block j-1 dequantised) -> FP8 rows + meta of
    block j; wait kfree[j % 2] (block j-2's P V done by both) -> rope rows of block j into
    K[j % 2]. Each lands a block ahead of its use."""
    B, HP, _ = q.shape
    keys = args[:-2]
    kp, bps = _key_blocks(keys, implicit, NS)
    # where block i+1's dequant goes: under block i's scores ("qk") or its P V ("pv": the
    # FP8 rows have longer to land, and P V reads less SMEM than the scores)
    under_pv = _dk_overlap() == "pv"

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, *refs):
        *key_g, nb_g, sink_g, o_g, lse_g = refs
        b, s_id, ht = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        g0 = s_id * bps
        n_load = _split_load(nb_g[b], g0, bps, kp, epb, used_from_t)

        def scoped(q_s, k_s, n_s, m_s, v_s, qbar, wbar, cbar, rbar, free, kfull, kfree):
            @pl.when(wg == 2)
            def _producer():
                _set_registers(consumer=False)
                g_refs = (wn_g, wr_g, cn_g, cr_g, *key_g)
                s_refs = (n_s, k_s, m_s)
                nope = _cp_issuer(b, g_refs, s_refs, epb, implicit, parts="n", rope_in_k=True)
                rope = _cp_issuer(b, g_refs, s_refs, epb, implicit, parts="r", rope_in_k=True)
                plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(ht * HT, HT)], q_s, qbar)
                plgpu.copy_gmem_to_smem(sink_g.at[pl.ds(ht * HT, HT)], v_s, qbar)

                @pl.loop(0, n_load)
                def _(j):
                    s = lax.rem(j, 2)

                    @pl.when(j >= 1)
                    def _():
                        plgpu.barrier_wait(free)            # block j-1 dequantised
                    nope(g0 + j, s, wbar, cbar)

                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[s])     # block j-2's P V done
                    rope(g0 + j, s, rbar, rbar)

                plgpu.barrier_wait(qbar)

            @pl.when(wg < 2)
            def _consumer():
                _set_registers(consumer=True)
                c = wg

                def dequant(i):
                    """Half c of block i's FP8 rows -> K tile i % 2; its scale exponents
                    from m_s[i % 2]; then the FP8 slot is released."""
                    s = lax.rem(i, 2)
                    _wait_block(g0 + i, s, wbar, cbar)
                    for h, chunks in ((0, range(4)), (1, range(4, NCH))):
                        @pl.when(c == h)
                        def _():
                            _dequant(n_s, None, m_s, k_s.at[s], s, chunks, False, True,
                                     n_slot=0)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(free)

                def body(i, carry):
                    acc, m, l = carry
                    s = lax.rem(i, 2)
                    with jax.named_scope("wait_k"):
                        plgpu.barrier_wait(kfull)
                        plgpu.barrier_wait(rbar.at[s])
                    bias = _bias(m_s, s)

                    def deq_next():
                        with jax.named_scope("deq_next"):
                            @pl.when(i + 1 < n_load)
                            def _():
                                dequant(i + 1)

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_s, k_s.at[s].T)
                        if not under_pv:
                            deq_next()
                        return acc_ref[...]
                    with jax.named_scope("qk_softmax"):
                        sc = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32))
                        if not under_pv:
                            @pl.when(i + 1 < n_load)
                            def _():
                                plgpu.barrier_arrive(kfull)
                        sc = sc * (1.0 / math.sqrt(D)) + lax.broadcast_in_dim(bias, sc.shape, [1])
                        m_new = jnp.maximum(m, sc.max(axis=1))
                        p, l, acc, _ = _online_update(sc, m_new, m, l, acc)
                        p = p.astype(jnp.bfloat16)

                    with jax.named_scope("pv"):
                        def half(h):
                            def mma(acc_ref):
                                plgpu.wgmma(acc_ref, p, k_s.at[s, :, pl.ds(h * (D // 2), D // 2)])
                                if under_pv:
                                    deq_next()
                            return lambda a: pl.run_state(mma)(plgpu.ACC.init(a))
                        acc = lax.cond(c == 0, half(0), half(1), acc)
                        plgpu.barrier_arrive(kfree.at[s])
                        if under_pv:
                            @pl.when(i + 1 < n_load)
                            def _():
                                plgpu.barrier_arrive(kfull)
                    return acc, m_new, l

                # (block 0 dequantised before this wait, while q lands, measured the same:
                # session 31 run6)
                plgpu.barrier_wait(qbar)

                @pl.when(n_load > 0)
                def _():
                    dequant(0)
                    plgpu.barrier_arrive(kfull)
                acc, m, l = lax.fori_loop(0, n_load, body, _init_carry())
                with jax.named_scope("finish"):
                    # both consumers are done reading q_s (their last scores) before either
                    # stages its output through it
                    plgpu.barrier_arrive(kfull)
                    plgpu.barrier_wait(kfull)
                    _finish(acc, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, c, NS == 1)

        pl.run_scoped(
            scoped,
            *_dk_buffers(),
            plgpu.Barrier(num_arrivals=2),                    # qbar
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # wbar: FP8 rows + meta landed
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # cbar
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # rbar: rope rows in K[s]
            plgpu.Barrier(num_arrivals=2),                    # free: the FP8 slot
            plgpu.Barrier(num_arrivals=2),                    # kfull
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # kfree: K[s] read by P V
            collective_axes="wg",
        )

    return _launch_ws(kernel, NS, B, HP)(q, wn, wr, cn, cr, *args)


# The seesaw kernel (_attn_call_ss): the FP8 staging slot's two regions (chunks 0-3: the
# block's owner dequantises them before its scores; chunks 4-6: the previous block's owner,
# under its scores), and the meta slots (4 blocks may be in flight between a meta copy and
# the last read of that slot's previous block).
REG_A, REG_B = (0, 4), (4, NCH)
META_SLOTS = 4


def _cp_retire(pending, fence=False):
    """Wait until at most `pending` of this thread's cp.async groups are in flight (the
    older ones are done); fence: make them visible to the async proxy (the wgmma)."""
    @plgpu.inline_mgpu()
    def retire(ctx):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mu
        mu.inline_ptx(f"cp.async.wait_group {pending};", has_side_effects=True)
        if fence:
            mu.inline_ptx("fence.proxy.async.shared::cta;", has_side_effects=True)
    retire()


def _cp_part(b, g_refs, s_refs, epb, implicit, parts, chunks, meta):
    """-> issue(g, slot): start (no wait: one cp.async group, _cp_retire) the copies of
    one part of key block g: parts "n" the nope chunks `chunks` (and the meta into
    m_s[slot] if meta), "r" the rope rows into K tile `slot`."""
    return _cp_blocks(b, g_refs, s_refs, epb, implicit, parts=parts,
                      rope_in_k=True, nope_chunks=chunks, meta=meta, commit=True)


def _ss_buffers(meta_slots=META_SLOTS):
    """SMEM of the seesaw kernel (~223 KB of 227): q_s [64, 448] bf16 (q's nope columns;
    its rope columns live in registers), k_s two bf16 K tiles, n_s one FP8 staging slot
    (two regions), m_s [4, 8, 64] meta, v_s [64] f32 (sink, then the lse), p_s [64, 64]
    bf16 (q's rope columns until both consumers loaded them, then the published P), x_s
    [3, 64] f32 (m, alpha, l after the published block), t_s [2] i32 (the tile ids)."""
    return (plgpu.SMEM((1, HT, NOPE), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((2, BLK, D), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((1, NCH, BLK, 64), jnp.float8_e4m3fn, transforms=SWZ64),
            plgpu.SMEM((meta_slots, 8, BLK), jnp.uint8),
            plgpu.SMEM((HT,), jnp.float32),
            plgpu.SMEM((HT, BLK), jnp.bfloat16, transforms=TILED),
            plgpu.SMEM((3, HT), jnp.float32),
            plgpu.SMEM((2,), jnp.int32))


def _attn_call_ss(q, wn, wr, cn, cr, *args, NS, epb, used_from_t=False, implicit=0):
    """seesaw (where _seesaw says: Pro's heads or B <= 8 by default; gather="cpasync", GPU
    only): q.k once a key block (FlashMLA's protocol; double_k computes the full scores in
    both consumers, 1.5x the tensor work). Consumer c owns blocks c, c + 2, ... (K tile c): it scores its block,
    runs the softmax from the statistics after the other's block, publishes P (bf16, p_s)
    and (m, alpha, l) (x_s), and adds P V of its output half from registers; the other
    consumer rescales its half by alpha and adds P V with P from SMEM. Same operands,
    order and roundings as double_k, so the same output bit for bit. Block i, consumer
    c = i % 2, o = 1 - c:
      A  (the K tile free: block i-2's P V done by both) dequantise chunks 0-3 of block i;
      B  the other's block i-1: wait pub[o], rescale, P V from p_s, release its tile;
      C  wait kfull[c] (chunks 0-3 by c, 4-6 by o) and rbar[c] (rope rows);
      D  scores (q nope from SMEM, q rope from registers);
      E  softmax, publish; F  P V of its half from registers, release tile c; under it
         (or under the scores: $DSV4_ATTN_SS_DEQ_AT=qk), chunks 4-6 of block i+1 into the
         other tile (once block i-1's P V are done by both).
    Chunks 4-6 of block 0: consumer 1 before its first block. SMEM: a P buffer (8 KB)
    only fits with q's rope columns in registers (+16 a consumer thread). The producer,
    per block j: chunks 0-3 + meta (after chunks 0-3 of j-1 are dequantised), chunks 4-6
    (after those of j-1), rope rows into tile j % 2 (after block j-2's P V); each part is
    one cp.async group, announced (landA / landB / rbar) once the next part is issued
    (chunks 4-6 as soon as they land with $DSV4_ATTN_SS_B=eager). q_s is indexed by
    a tile id read back from SMEM (always 0): as a constant address ptxas hoisted its 28
    wgmma descriptors out of the block loop (812 B of spills -> 176).
    GPU tests: bit-identical to double_k. Where it is faster and where slower: the comment
    above _seesaw. Why it loses at Flash B=64: the shorter chain exposes the row gathers'
    latency (one FP8 staging slot gives a region's copy about one block's chain minus a
    dequant to land, double_k's about twice that; SMEM has no room for a second slot;
    MOSAIC_GPU_NOTES.md, session 34)."""
    B, HP, _ = q.shape
    keys = args[:-2]
    kp, bps = _key_blocks(keys, implicit, NS)
    scale = 1.0 / math.sqrt(D)
    # where chunks 4-6 of block i+1 are dequantised: under block i's scores ("qk": 176 B of
    # spills, the scores' 32 accumulator registers live beside the dequant's) or its P V
    # ("pv", default: no spills; 1-4% faster, session 34 run4); $DSV4_ATTN_SS_DEQ_AT
    deq_at = _env_choice("DSV4_ATTN_SS_DEQ_AT", ("pv", "qk"))
    # when the producer announces chunks 4-6 of block j: once the rope rows are issued
    # ("lazy", default: the rope's gate, block j-2's P V, can hold them back although they
    # are needed under block j-1's P V) or as soon as they land ("eager": the producer
    # waits for them before the rope's gate); $DSV4_ATTN_SS_B
    eager_b = _env_choice("DSV4_ATTN_SS_B", ("lazy", "eager")) == "eager"
    # meta slots: a profiled build ($DSV4_ATTN_PROFILE) has 2, to make room for the
    # profiler's ~3 KB; a block's meta may then overwrite that of the block two back while
    # its bias is read, so its outputs may be wrong: it is for timelines only
    ms = 2 if os.environ.get("DSV4_ATTN_PROFILE") else META_SLOTS

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, *refs):
        *key_g, nb_g, sink_g, o_g, lse_g = refs
        b, s_id, ht = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        g0 = s_id * bps
        n = _split_load(nb_g[b], g0, bps, kp, epb, used_from_t)

        def scoped(q_s, k_s, n_s, m_s, v_s, p_s, x_s, t_s, qbar, landA, landB, rbar, freeA,
                   freeB, kfull, kfree, pub, done):
            @pl.when(wg == 2)
            def _producer():
                _set_registers(consumer=False)
                g_refs = (wn_g, wr_g, cn_g, cr_g, *key_g)
                s_refs = (n_s, k_s, m_s)
                heads = pl.ds(ht * HT, HT)
                plgpu.copy_gmem_to_smem(q_g.at[b, heads, pl.ds(0, NOPE)], q_s.at[0], qbar)
                plgpu.copy_gmem_to_smem(q_g.at[b, heads, pl.ds(NOPE, ROPE)], p_s, qbar)
                plgpu.copy_gmem_to_smem(sink_g.at[heads], v_s, qbar)
                part_a = _cp_part(b, g_refs, s_refs, epb, implicit, "n", REG_A, True)
                part_b = _cp_part(b, g_refs, s_refs, epb, implicit, "n", REG_B, False)
                part_r = _cp_part(b, g_refs, s_refs, epb, implicit, "r", (0, 0), False)

                @pl.loop(0, n)
                def _(j):
                    s = lax.rem(j, 2)

                    @pl.when(j >= 1)
                    def _():
                        plgpu.barrier_wait(freeA)          # chunks 0-3 of j-1 dequantised
                    part_a(g0 + j, lax.rem(j, ms))

                    @pl.when(j >= 1)
                    def _():
                        _cp_retire(1, fence=True)          # block j-1's rope rows
                        plgpu.barrier_arrive(rbar.at[1 - s])
                        plgpu.barrier_wait(freeB)          # chunks 4-6 of j-1 dequantised
                    part_b(g0 + j, lax.rem(j, ms))
                    _cp_retire(1)
                    plgpu.barrier_arrive(landA.at[s])
                    if eager_b:   # chunks 4-6 announced as they land, before the rope's gate
                        _cp_retire(0)
                        plgpu.barrier_arrive(landB.at[s])

                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[s])    # block j-2's P V done by both
                    part_r(g0 + j, s)
                    if not eager_b:
                        _cp_retire(1)
                        plgpu.barrier_arrive(landB.at[s])

                @pl.when(n >= 1)
                def _():
                    _cp_retire(0, fence=True)
                    plgpu.barrier_arrive(rbar.at[lax.rem(n - 1, 2)])
                plgpu.barrier_wait(qbar)

            def consumer(c):
                o = 1 - c
                cols = pl.ds(c * HALF, HALF)
                _set_registers(consumer=True)
                # the tile ids, read back every block: as constants ptxas hoists every
                # wgmma descriptor out of the loop and spills (seesaw_probe.py)
                t_s[c] = jnp.int32(c)

                def ids():
                    tc = t_s[c]
                    return tc, 1 - tc

                plgpu.barrier_wait(qbar)
                # [64 heads, 64] bf16; DSV4_ATTN_ABLATE=qrope: the wgmma reads p_s instead
                # (wrong values: times the kernel without these 16 registers a thread)
                q_rope = (p_s if "qrope" in _ablated() else
                          plgpu.load(p_s, (), layout=WG))

                def dequant(i, tile, chunks, land, free, full):
                    plgpu.barrier_wait(land)
                    _dequant(n_s, None, m_s, k_s.at[tile], lax.rem(i, ms),
                             range(*chunks), False, True, n_slot=0)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(free)
                    plgpu.barrier_arrive(full)

                def other(carry):
                    """The other's latest block (tile to): -> acc, m, l after it."""
                    acc = carry[0]
                    _, to = ids()
                    plgpu.barrier_wait(pub.at[o])
                    alpha = plgpu.load(x_s.at[1], (), layout=ROW)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                    def mma(acc_ref):
                        plgpu.wgmma(acc_ref, p_s, k_s.at[to, :, cols])
                    acc = pl.run_state(mma)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(kfree.at[to])
                    return (acc, plgpu.load(x_s.at[0], (), layout=ROW),
                            plgpu.load(x_s.at[2], (), layout=ROW))

                def own(i, carry, prev):
                    tc, to = ids()

                    @pl.when(i >= 2)
                    def _():
                        plgpu.barrier_wait(kfree.at[tc])   # block i-2's P V done by both
                    with jax.named_scope("deq_own"):
                        dequant(i, tc, REG_A, landA.at[c], freeA, kfull.at[c])
                    if prev:
                        with jax.named_scope("other"):
                            carry = other(carry)
                    acc, m, l = carry
                    with jax.named_scope("wait_k"):
                        plgpu.barrier_wait(kfull.at[c])
                        plgpu.barrier_wait(rbar.at[c])
                    bias = _bias(m_s, lax.rem(i, ms))

                    def deq_next():
                        @pl.when(i + 1 < n)
                        def _():
                            with jax.named_scope("deq_next"):
                                if prev:
                                    plgpu.barrier_wait(kfree.at[to])   # block i-1's P V
                                dequant(i + 1, to, REG_B, landB.at[o], freeB, kfull.at[o])

                    def qk(acc_ref):
                        # q_s's index read back too (0): its 28 descriptors stay in the loop
                        plgpu.wgmma(acc_ref, q_s.at[tc - c], k_s.at[tc, :, pl.ds(0, NOPE)].T)
                        plgpu.wgmma(acc_ref, q_rope, k_s.at[tc, :, pl.ds(NOPE, ROPE)].T)
                        if deq_at == "qk":
                            deq_next()
                        return acc_ref[...]
                    with jax.named_scope("qk_softmax"):
                        sc = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32))
                        sc = sc * scale + lax.broadcast_in_dim(bias, sc.shape, [1])
                        m_new = jnp.maximum(m, sc.max(axis=1))
                        # alpha: the rescale applied here, for the other consumer
                        p, l, acc, alpha = _online_update(sc, m_new, m, l, acc)
                        p = p.astype(jnp.bfloat16)
                        # p_s / x_s were last read by this consumer's P V of block i-1
                        p_s[...] = p
                        x_s[0] = m_new
                        x_s[1] = alpha
                        x_s[2] = l
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(pub.at[c])
                    with jax.named_scope("pv"):
                        def mma(acc_ref):
                            plgpu.wgmma(acc_ref, p, k_s.at[tc, :, cols])
                            if deq_at == "pv":
                                deq_next()
                        acc = pl.run_state(mma)(plgpu.ACC.init(acc))
                        plgpu.barrier_arrive(kfree.at[tc])
                    return acc, m_new, l

                carry = _init_carry()
                one = lambda x: x.astype(jnp.int32)
                if c == 0:
                    # block 0 (0 or 1 times), blocks 2, 4, ..., then block n-1 if it is odd
                    carry = lax.fori_loop(0, jnp.minimum(n, 1),
                                          lambda _, cr: own(0, cr, prev=False), carry)
                    carry = lax.fori_loop(1, (n + 1) // 2,
                                          lambda k, cr: own(2 * k, cr, prev=True), carry)
                    carry = lax.fori_loop(0, one((n >= 2) & (n % 2 == 0)),
                                          lambda _, cr: other(cr), carry)
                else:
                    @pl.when(n >= 1)
                    def _():   # chunks 4-6 of block 0 (into tile 0)
                        _, to = ids()
                        dequant(0, to, REG_B, landB.at[0], freeB, kfull.at[0])
                    carry = lax.fori_loop(0, n // 2,
                                          lambda k, cr: own(2 * k + 1, cr, prev=True), carry)
                    carry = lax.fori_loop(0, n % 2, lambda _, cr: other(cr), carry)
                acc, m, l = carry
                with jax.named_scope("finish"):
                    # both consumers are past their last wgmma: tile 0 stages the output
                    plgpu.barrier_arrive(done)
                    plgpu.barrier_wait(done)
                    _finish(acc, m, l, k_s.at[0], v_s, o_g, lse_g, s_id, b, ht, jnp.int32(c),
                            NS == 1)

            for cc in (0, 1):
                @pl.when(wg == cc)
                def _(cc=cc):
                    consumer(cc)

        pl.run_scoped(
            scoped,
            *_ss_buffers(ms),
            plgpu.Barrier(num_arrivals=3),                    # qbar: q nope, q rope, sink
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # landA[c]: chunks 0-3 + meta
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # landB[j % 2]: chunks 4-6
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # rbar[c]: rope rows in K[c]
            plgpu.Barrier(num_arrivals=1),                    # freeA: chunks 0-3 free
            plgpu.Barrier(num_arrivals=1),                    # freeB: chunks 4-6 free
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # kfull[c]: both regions
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # kfree[s]: both P V
            plgpu.Barrier(num_arrivals=1, num_barriers=2),    # pub[c]: P, statistics
            plgpu.Barrier(num_arrivals=2),                    # done
            collective_axes="wg",
        )

    # (profiled: 48 ranges a warpgroup, ~7 a key block, to fit the SMEM left)
    return _launch_ws(kernel, NS, B, HP, profile_space=48)(q, wn, wr, cn, cr, *args)


def _attn_call_ws(q, wn, wr, cn, cr, *args, NS, gather, interpret, qk_split=False, epb=None,
                  used_from_t=False, implicit=0, cluster_merge=False):
    """Warp-specialised: one CTA per (request, split, head tile) with 3 warpgroups. wg 2
    issues the row copies (double-buffered, released by the consumers' `free` barrier);
    wg 0 / 1 own output column halves 0 / 1, dequantise half of the K tile each (chunks
    0-3 / chunks 4-6 + rope), meet on `kfull` before the scores (both compute the same
    full scores) and on `kfree` once both P V products have read the tile.
    args: crow, meta, n_blocks, sink (direct / staged: _prep's per-key metadata) or, for
    cpasync, idx, block_table, win_scale, cmp_scale, win_pos, t, used, sink (the producer
    derives the metadata; epb = compressed entries per pool block; _ids_used). used_from_t:
    `used` holds t, and the bound is min(KP, (t + 1) * epb // BLOCK_TOKENS) (ids_prefix).
    implicit = K > 0 (cpasync, used_from_t): HCA ids derived in-kernel (_cp_gather); idx is
    not read (the block table stands in) and KP = K rounded up to whole key blocks.
    cluster_merge (NS == 2): the two splits of a (request, head tile) run as a cluster and
    merge in-kernel (_cluster_merge); the output is then o [1, B, HP, 512], final."""
    B, HP, _ = q.shape
    keys = args[:-2]
    direct = gather == "direct"
    cpasync = gather == "cpasync"
    kp, bps = _key_blocks(keys, implicit, NS, cpasync)
    # copy barriers: row TMAs complete them (N_ROW_COPIES or 3 a block), or (cpasync) the
    # producer warpgroup's one arrival after its cp.async copies landed
    n_w = 1 if cpasync else N_ROW_COPIES
    n_c = 1 if cpasync else N_ROW_COPIES if direct else 3
    ablated = _ablated()

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, *refs):
        *key_g, nb_g, sink_g, o_g, lse_g = refs
        b, s_id, ht = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        g0 = s_id * bps
        n_load = _split_load(nb_g[b], g0, bps, kp, epb, used_from_t, cpasync)

        def scoped(q_s, k_s, n_s, r_s, m_s, p_s, v_s, qbar, wbar, cbar, free, kfull, kfree,
                   *extra_refs):   # qk_split: x_s, xbar, pfull; cluster_merge: clbar, rbar
            x_s, xbar, pfull = extra_refs[:3] if qk_split else (None,) * 3
            clbar, rbar = extra_refs[-2:] if cluster_merge else (None,) * 2
            @pl.when(wg == 2)
            def _producer():
                _set_registers(consumer=False)
                g_refs = (wn_g, wr_g, cn_g, cr_g, *key_g)
                issue = (_cp_issuer(b, g_refs, (n_s, r_s, m_s), epb, implicit) if cpasync else
                         _issuer(b, g_refs, (n_s, r_s, m_s), direct))
                plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(ht * HT, HT)], q_s, qbar)
                plgpu.copy_gmem_to_smem(sink_g.at[pl.ds(ht * HT, HT)], v_s, qbar)

                def release(i):   # block i's buffers are free again (consumers done)
                    slot = lax.rem(i, 2)
                    # Observing the (long completed) copy barrier too is free on the GPU;
                    # the interpreter wants every phase seen by every warpgroup using it.
                    _wait_block(g0 + i, slot, wbar, cbar)
                    plgpu.barrier_wait(free.at[slot])

                @pl.loop(0, n_load)
                def _(i):
                    with jax.named_scope("release"):
                        @pl.when(i >= 2)
                        def _():
                            release(i - 2)
                    with jax.named_scope("issue"):
                        issue(g0 + i, lax.rem(i, 2), wbar, cbar)

                for k in (2, 1):
                    @pl.when(n_load >= k)
                    def _():
                        release(n_load - k)
                plgpu.barrier_wait(qbar)

            @pl.when(wg < 2)
            def _consumer():
                _set_registers(consumer=True)
                c = wg

                def body(i, carry):
                    acc, m, l = carry
                    slot = lax.rem(i, 2)
                    with jax.named_scope("wait_copy"):
                        _wait_block(g0 + i, slot, wbar, cbar)

                    with jax.named_scope("wait_kfree"):
                        @pl.when(i > 0)
                        def _():
                            plgpu.barrier_wait(kfree)   # both P V of block i-1 read k_s

                    with jax.named_scope("deq"):
                        @pl.when((c == 0) & ("deq" not in ablated))
                        def _():
                            _dequant(n_s, r_s, m_s, k_s, slot, range(4), False, cpasync)

                        @pl.when((c == 1) & ("deq" not in ablated))
                        def _():
                            _dequant(n_s, r_s, m_s, k_s, slot, range(4, NCH), True, cpasync)
                    with jax.named_scope("kfull"):
                        # (read before `free` lets the producer refill the slot)
                        bias = _bias(m_s, slot, pl.ds(c * SPLIT, SPLIT) if qk_split else None)
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(free.at[slot])
                        plgpu.barrier_arrive(kfull)
                        plgpu.barrier_wait(kfull)
                    with jax.named_scope("qk_softmax"):
                        if qk_split:
                            m, l, acc = _scores_softmax_split(
                                q_s, k_s, p_s, x_s, xbar, pfull, bias, c, m, l, acc)
                        else:
                            m, l, acc = _scores_softmax(q_s, k_s, p_s.at[c], bias, m, l, acc)
                    with jax.named_scope("pv"):
                        acc = _pv(p_s if qk_split else p_s.at[c], k_s, c, acc,
                                  in_place=not interpret)
                        plgpu.barrier_arrive(kfree)
                    return acc, m, l

                # (Waiting for q only before block 0's scores, so that its dequant overlaps
                # the q copy, measured 1-2% slower at B >= 32 and added spills: H200,
                # 2026-11-26, session 21 run5.)
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(qbar)
                acc, m, l = lax.fori_loop(0, n_load, body, _init_carry())

                with jax.named_scope("finish"):
                    @pl.when(n_load > 0)
                    def _():
                        plgpu.barrier_wait(kfree)   # both are done reading q_s
                    if qk_split:   # each consumer summed only its keys' P
                        l = l + _exchange(x_s, xbar, c, l)
                    if cluster_merge:
                        _cluster_merge(acc, m, l, q_s, k_s, p_s, v_s, o_g, b, ht, c, s_id,
                                       clbar, rbar)
                    else:
                        _finish(acc, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, c, NS == 1)

        pl.run_scoped(
            scoped,
            *_scratch(2, cpasync, qk_split),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=n_w, num_barriers=2),
            plgpu.Barrier(num_arrivals=n_c, num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),    # free
            plgpu.Barrier(num_arrivals=2),                    # kfull
            plgpu.Barrier(num_arrivals=2),                    # kfree
            # qk_split: the row-vector exchange and its barrier, and "both P halves stored"
            *([plgpu.SMEM((2, HT), jnp.float32), plgpu.Barrier(num_arrivals=2),
               plgpu.Barrier(num_arrivals=2)] if qk_split else []),
            # cluster_merge: both CTAs' consumers are past their loops; the partial and
            # the two side tiles landed. A Barrier's count is per warpgroup here (init
            # count = num_arrivals * 128), and each async_store_smem arrives from the
            # sender's 128 threads: 3. (3 * 128 expected 49152 arrivals: the H100 hang of
            # session 23, found afterwards in the PTX.)
            *([plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=2),
               plgpu.Barrier(num_arrivals=3)] if cluster_merge else []),
            collective_axes="wg",
        )

    if cluster_merge:
        if NS != 2 or qk_split:
            raise ValueError(f"cluster_merge needs 2 splits and no qk_split, got NS={NS}")
        grid = dict(grid=(B, HP // HT), grid_names=("b", "h"), cluster=(2,),
                    cluster_names=("s",))
    else:
        grid = dict(grid=(B, NS, HP // HT), grid_names=("b", "s", "h"))
    return plgpu.kernel(
        kernel,
        out_type=_out_types(1 if cluster_merge else NS, B, HP),
        num_threads=3, thread_name="wg",
        compiler_params=_params(),
        interpret=interpret,
        **grid,
    )(q, wn, wr, cn, cr, *args)
