"""Mosaic-GPU (Hopper) gathers of quantised KV entries with fused dequantisation.

Cache layout: pallas_kernels/CACHE_LAYOUT.md (nope e4m3 [..., 448], e8m0 scale u8 [..., 8],
rope bf16 [..., 64]). Every gather writes bf16 rows [B, K, 512]; rows that address nothing
(padding index, unused block, empty window slot) come back as zeros.

Tiling: one CTA (one warpgroup) dequantises T (up to 4) tiles of 8 output rows, issuing
all their copies before computing the first. The tile is held as a
(64, 64) register array in the WGMMA layout: tile row 8 * r + j is 64-dim block j of output
row r (j < 7: FP8 nope block, j = 7: the bf16 rope dims). One scale per tile row, so the
dequantisation is a row-broadcast multiply, exactly the shape that layout supports.
Per output row: one TMA copy of its 448 nope bytes (an (8, 64) box: see _gather_rows) and
one of its 128 rope bytes, addressed with scalar indices read from GMEM (Hopper has no TMA gather); its 8 scale
bytes are read as scalars (8 bytes is under TMA's 16-byte minimum). The finished tile is
staged in SMEM and written with one contiguous 8 KiB TMA store. Latency is hidden by the
T tiles in flight per CTA and several CTAs per SM rather than an explicit pipeline.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 8  # output rows per CTA tile
NOPE, ROPE, BLK = 448, 64, 64
WG = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)


def _check_pool(nope, scale, rope, what):
    lead = nope.shape[:-1]
    if (nope.shape[-1] != NOPE or scale.shape != (*lead, 8) or rope.shape != (*lead, ROPE)
            or nope.dtype != jnp.float8_e4m3fn or scale.dtype != jnp.uint8
            or rope.dtype != jnp.bfloat16 or len(lead) != 2):
        raise ValueError(
            f"{what}: expected nope e4m3 [N, E, 448], scale u8 [N, E, 8], rope bf16 [N, E, 64]; "
            f"got {nope.dtype}{nope.shape}, {scale.dtype}{scale.shape}, {rope.dtype}{rope.shape}")


def _tiles_per_cta(K):
    """Tiles of 8 rows per CTA: more bytes in flight per CTA (the kernel's registers cap the
    CTAs per SM), as long as the request's rows split evenly."""
    for t in (4, 2, 1):
        if (K // ROWS) % t == 0:
            return t


def _gather_rows(src_fn, scalars, nope, scale, rope, B, K, *, interpret, tiles=None):
    """out[b, k] = dequant(pool[major, minor]) where (valid, major, minor) = src_fn(*scalar
    refs, b, k) is evaluated in-kernel on scalars; invalid rows are zeros."""
    if K % ROWS:
        raise ValueError(f"gather: rows per request K={K} must be a multiple of {ROWS}")
    T = tiles or _tiles_per_cta(K)
    N, E, _ = nope.shape
    # Free view as 64-byte rows: entry f = rows [7f, 7f + 7). Each CTA row copies the 8-row
    # (512 B) window from 7f: Lane-level TMA wants copies of a multiple of 128 bytes, and
    # the 8th row (the next entry's first block, zero-filled past the end) lands on the
    # tile row that the rope overwrites anyway.
    nope_rows = nope.reshape(N * E * 7, BLK)
    n_sc = len(scalars)
    shape = (ROWS * 8, BLK)

    def body(*refs):
        sc_refs = refs[:n_sc]
        nope_g, scale_g, rope_g, out_g, q_s, o_s, bar = refs[n_sc:]
        b = lax.axis_index("b")
        t0 = lax.axis_index("t") * T
        rowid = plgpu.broadcasted_iota(jnp.int32, (ROWS * 8,), 0, layout=ROW)
        # Issue every tile's copies before computing any: per tile, the scalar index loads
        # (independent, so they overlap), then the TMA issues (inline asm that later loads
        # cannot move above), then the scale loads, whose latency overlaps the copies.
        tiles = []
        for u in range(T):
            srcs = []
            for r in range(ROWS):
                valid, major, minor = src_fn(*sc_refs, b, (t0 + u) * ROWS + r)
                srcs.append((valid, jnp.where(valid, major, 0), jnp.where(valid, minor, 0)))
            for r, (valid, major, minor) in enumerate(srcs):
                flat = major * E + minor
                plgpu.copy_gmem_to_smem(nope_g.at[pl.ds(flat * 7, 8)],
                                        q_s.at[u, pl.ds(8 * r, 8)], bar.at[u])
                plgpu.copy_gmem_to_smem(rope_g.at[major, minor], o_s.at[u, 8 * r + 7], bar.at[u])
            ebits = jnp.zeros((ROWS * 8,), jnp.int32)  # biased exponent per tile row
            keep = jnp.zeros((ROWS * 8,), jnp.int32)  # 1 on the tile rows of valid rows
            for r, (valid, major, minor) in enumerate(srcs):
                for j in range(7):
                    e = scale_g[major, minor, j].astype(jnp.int32)
                    ebits = jnp.where(rowid == 8 * r + j, e, ebits)
                keep = jnp.where((rowid >> 3) == r, valid.astype(jnp.int32), keep)
            tiles.append((ebits, keep))
        is_rope = lax.broadcast_in_dim((rowid & 7) == 7, shape, [0])
        for u, (ebits, keep) in enumerate(tiles):
            plgpu.barrier_wait(bar.at[u])
            factor = lax.bitcast_convert_type(ebits << 23, jnp.float32)  # 2^(e - 127)
            q = plgpu.load(q_s.at[u], layout=WG, optimized=False).astype(jnp.float32)
            ro = plgpu.load(o_s.at[u], layout=WG, optimized=False).astype(jnp.float32)
            x = q * lax.broadcast_in_dim(factor, shape, [0])
            keep2 = lax.broadcast_in_dim(keep, shape, [0]) > 0
            out = jnp.where(keep2, jnp.where(is_rope, ro, x), 0.0)  # +0, never -0, when empty
            o_s[u] = out.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[u], out_g.at[b, pl.ds((t0 + u) * ROWS * 8, ROWS * 8)])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B, K * 8, BLK), jnp.bfloat16),
        grid=(B, K // (ROWS * T)),
        grid_names=("b", "t"),
        scratch_types=(
            plgpu.SMEM((T, ROWS * 8, BLK), jnp.float8_e4m3fn),  # q_s: nope bytes
            plgpu.SMEM((T, ROWS * 8, BLK), jnp.bfloat16),  # o_s: rope in, output tile out
            plgpu.Barrier(num_arrivals=2 * ROWS, num_barriers=T),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*scalars, nope_rows, scale, rope)
    return out.reshape(B, K, NOPE + ROPE)


def gather_topk(pool, block_table, idx_BK, *, interpret=None):
    """pool {cmp_nope [NB,EPB,448], cmp_scale [NB,EPB,8], cmp_rope [NB,EPB,64]},
    block_table int32 [B, MAXB], idx_BK int32 [B, K] (entry index, -1 = padding)
    -> bf16 [B, K, 512]; entry i of request b is pool[block_table[b, i // EPB], i % EPB]."""
    nope, scale, rope = pool["cmp_nope"], pool["cmp_scale"], pool["cmp_rope"]
    _check_pool(nope, scale, rope, "gather_topk")
    B, K = idx_BK.shape
    EPB = nope.shape[1]
    if block_table.shape[0] != B:
        raise ValueError(f"gather_topk: block_table rows {block_table.shape[0]} != batch {B}")
    maxb = block_table.shape[1]

    def src(bt_g, idx_g, b, k):
        i = idx_g[b, k]
        ok = (i >= 0) & (i < maxb * EPB)
        ic = jnp.where(ok, i, 0)
        blk = bt_g[b, lax.div(ic, EPB)]
        return ok & (blk >= 0), blk, lax.rem(ic, EPB)

    return _gather_rows(src, (block_table.astype(jnp.int32), idx_BK.astype(jnp.int32)),
                        nope, scale, rope, B, K, interpret=interpret)


def gather_all(pool, block_table, n_entries_B, max_entries, *, interpret=None):
    """All entries 0..max_entries-1 of each request (HCA): bf16 [B, max_entries, 512];
    entries i >= n_entries_B[b] are zeros. max_entries must be a multiple of 8."""
    nope, scale, rope = pool["cmp_nope"], pool["cmp_scale"], pool["cmp_rope"]
    _check_pool(nope, scale, rope, "gather_all")
    B = n_entries_B.shape[0]
    EPB = nope.shape[1]
    maxb = block_table.shape[1]
    if max_entries > maxb * EPB:
        raise ValueError(f"gather_all: max_entries {max_entries} > block table capacity "
                         f"{maxb} blocks x {EPB} entries")

    def src(bt_g, n_g, b, k):
        ok = k < n_g[b]
        blk = bt_g[b, lax.div(k, EPB)]
        return ok & (blk >= 0), blk, lax.rem(k, EPB)

    return _gather_rows(src, (block_table[:B].astype(jnp.int32), n_entries_B.astype(jnp.int32)),
                        nope, scale, rope, B, max_entries, interpret=interpret)


def gather_window(win, *, interpret=None):
    """win {win_nope [R,128,448], win_scale [R,128,8], win_rope [R,128,64], win_pos [R,128]}
    -> bf16 [R, 128, 512] in slot order; empty slots (win_pos < 0) are zeros."""
    nope, scale, rope, pos = win["win_nope"], win["win_scale"], win["win_rope"], win["win_pos"]
    _check_pool(nope, scale, rope, "gather_window")
    R, W, _ = nope.shape

    def src(pos_g, b, k):
        return pos_g[b, k] >= 0, b, k

    return _gather_rows(src, (pos.astype(jnp.int32),), nope, scale, rope, R, W,
                        interpret=interpret)
