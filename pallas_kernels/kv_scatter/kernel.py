"""Mosaic-GPU (Hopper) quantise-and-scatter of new KV rows into the cache, in place.

Cache layout: docs/KV_CACHE.md. Numerics: pallas_kernels/formats.py (bit-exact).

Two entry points, both functional (arrays in, arrays out) and in place under
`jax.jit(..., donate_argnums=...)`: the cache arrays become `jax.new_ref` refs that the
kernel writes, and `jax.freeze` hands them back, so XLA aliases the buffers.
  append_window(win, kv_BD, pos_B)                      sliding-window ring, slot pos % 128
  flush_compressed(pool, idx_pool, entry_BD, key_BK, flush_B, entry_idx_B, block_table_RM)
                                                        compressed entry + indexer key

Tiling: one CTA (one warpgroup) handles 8 rows. The 8 x 512 bf16 rows are one (64, 64)
register tile in the WGMMA layout: tile row 8 * r + j is 64-dim block j of row r, so the
per-block amax is a row reduction and the scale a row broadcast. Rows come in with one 1 KiB
TMA copy each; quantised nope (448 B) and rope (128 B) go out with one TMA store each, to
the destination computed from scalars read in-kernel (no host branching; inactive rows
write nothing). The 8 e8m0 scale bytes and the window position are plain scalar stores
(TMA moves at least 16 bytes).

Indexer key (flush only), per format:
  fp4/nvfp4: keys are tiled so that one tile row is one scale block (32 or 16 dims) and
    rows 0..31 hold dims 0..63, rows 32..63 dims 64..127 of the keys; the e2m1 codes (integer
    threshold arithmetic, no FP4 cast on sm_90) go through SMEM, and the split-half bytes
    are lo | hi << 4 of the two SMEM halves.
  fp8: tile row = 16 dims; the per-key amax is a row max then a max over the key's 8 rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats as kf
from pallas_kernels.interpret import gpu_interpret_params

ROWS = 8  # rows per CTA
NOPE, ROPE, BLK = 448, 64, 64
WG = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
F32 = jnp.float32
I32 = jnp.int32


def _bcast(v, n):
    return lax.broadcast_in_dim(v, (ROWS * 8, n), [0])


def _pow2_exponent(y):
    """Biased exponent of 2^ceil(log2(y)) for normal positive f32 y (as kvformat)."""
    bits = lax.bitcast_convert_type(y, I32)
    return ((bits >> 23) & 0xFF) + jnp.where((bits & 0x7FFFFF) != 0, 1, 0)


def _exp2(e):
    return lax.bitcast_convert_type(e << 23, F32)


def _e2m1_codes(v):
    """f32 tile -> e2m1 codes int32 (as kvformat.e2m1_encode)."""
    a = jnp.abs(v)
    one, zero = jnp.ones_like(v, dtype=I32), jnp.zeros_like(v, dtype=I32)
    mag = zero
    for thr, incl in ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                      (2.5, False), (3.5, True), (5.0, False)):
        mag = mag + jnp.where(a >= thr if incl else a > thr, one, zero)
    neg = lax.bitcast_convert_type(v, I32) < 0
    return mag + jnp.where(neg, one * 8, zero)


def _row_max(x):
    return jnp.max(jnp.abs(x), axis=1)


def _quantize_tile(x):
    """(64, 64) f32 tile of 8 kv rows -> (e4m3 tile, biased exponent per tile row (64,))."""
    amax = jnp.maximum(_row_max(x), jnp.float32(kf.FP8_AMAX_FLOOR))
    e = _pow2_exponent(amax * kf.INV_E4M3_MAX)
    v = x * _bcast(_exp2(254 - e), BLK)
    return jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn), e




def _scatter_call(kv_BD, scalars, dst_fn, refs, key_BK=None, fmt=None, *, interpret):
    """Quantise rows of kv_BD and write row b to (major, minor) = dst_fn(...) of the cache
    refs (nope_rows, scale, rope[, pos][, idx fields...]) when valid."""
    B = kv_BD.shape[0]
    n_sc = len(scalars)
    kv_rows = kv_BD.astype(jnp.bfloat16).reshape(B * 8, BLK)  # row b = rows [8b, 8b + 8)
    has_key = key_BK is not None
    n_refs = len(refs)
    E = refs[1].shape[1]  # entries per major index (128 for the window, EPB for pools)

    def body(*args):
        sc = args[:n_sc]
        kv_g = args[n_sc]
        i = n_sc + 1
        if has_key:
            key_g = args[i]
            i += 1
        cache = args[i:i + n_refs]
        x_s, q_s, e_s, bar = args[i + n_refs:i + n_refs + 4]
        kscr = args[i + n_refs + 4:]
        nope_g, scale_g, rope_g = cache[:3]
        c = lax.axis_index("c")
        bs = [jnp.minimum(c * ROWS + r, B - 1) for r in range(ROWS)]
        for r in range(ROWS):
            plgpu.copy_gmem_to_smem(kv_g.at[pl.ds(bs[r] * 8, 8)], x_s.at[pl.ds(8 * r, 8)], bar)
        if has_key:
            _load_key(key_g, bs, kscr, bar, fmt)
        # destinations (scalar loads) while the rows are in flight
        dsts = []
        for r in range(ROWS):
            valid, major, minor, extra = dst_fn(*sc, bs[r])
            dsts.append((valid & (c * ROWS + r < B), major, minor, extra))
        plgpu.barrier_wait(bar)

        x = plgpu.load(x_s, layout=WG, optimized=False).astype(F32)
        q, e = _quantize_tile(x)
        q_s[...] = q
        e_s[...] = e
        if has_key:
            _quantize_key(kscr, fmt)
        plgpu.commit_smem()

        for r, (valid, major, minor, extra) in enumerate(dsts):
            @pl.when(valid)
            def _():
                flat = major * E + minor
                plgpu.copy_smem_to_gmem(q_s.at[pl.ds(8 * r, 7)], nope_g.at[pl.ds(flat * 7, 7)])
                plgpu.copy_smem_to_gmem(x_s.at[8 * r + 7], rope_g.at[major, minor])
                for j in range(7):
                    scale_g[major, minor, j] = e_s[8 * r + j].astype(jnp.uint8)
                scale_g[major, minor, 7] = jnp.uint8(127)
                for ref_idx, val in extra:
                    cache[ref_idx][major, minor] = val
                if has_key:
                    _store_key(kscr, cache[3:], r, major, minor, fmt)
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((ROWS * 8, BLK), jnp.bfloat16),  # x_s: input rows (rope read from here)
        plgpu.SMEM((ROWS * 8, BLK), jnp.float8_e4m3fn),  # q_s: quantised nope
        plgpu.SMEM((ROWS * 8,), I32),  # e_s: exponent per tile row
        plgpu.Barrier(num_arrivals=ROWS * (1 + (_KEY_COPIES[fmt] if has_key else 0))),
    ]
    inputs = [*scalars, kv_rows]
    if has_key:
        scratch += _key_scratch(fmt)
        w = _KEY_W[fmt]
        kshape = (B, 8, 16) if fmt == "fp8" else (B, 2, 64 // w, w)  # TMA box views
        inputs.append(key_BK.astype(F32).reshape(kshape))
    plgpu.kernel(
        body,
        out_type=(),
        grid=(pl.cdiv(B, ROWS),),
        grid_names=("c",),
        scratch_types=tuple(scratch),
        compiler_params=LANE,
        interpret=gpu_interpret_params(interpret),
    )(*inputs, *refs)


# ---------------------------------------------------------------- indexer-key stages
# Key tile rows for the 8 keys of a CTA (a (64, w) register tile, WGMMA layout):
#   fp4  : w = 32, row 32h + 2k + q = key k, dims 64h + 32q + [0, 32)  (scale block 2h + q);
#          rows 16..31 and 48..63 are unused
#   nvfp4: w = 16, row 32h + 4k + q = key k, dims 64h + 16q + [0, 16)  (scale block 4h + q)
#   fp8  : w = 16, row 8k + q       = key k, dims 16q + [0, 16)
# For fp4/nvfp4 the rows of half h (from row 32h) are dims 64h.. of keys 0..7 in natural
# order, so lo | hi << 4 of the two halves is the split-half packing. Each key half
# (64 dims, 256 B) is one TMA copy.
_KEY_COPIES = {"fp4": 2, "nvfp4": 2, "fp8": 1, None: 0}
_KEY_W = {"fp4": 32, "nvfp4": 16, "fp8": 16}


def _key_scratch(fmt):
    w = _KEY_W[fmt]
    s = [plgpu.SMEM((ROWS * 8, w), F32)]  # k_s: key tile
    if fmt in ("fp4", "nvfp4"):
        s += [plgpu.SMEM((ROWS * 8, w), I32),  # codes tile
              plgpu.SMEM((ROWS * 64 // w, w), jnp.uint8),  # packed bytes, [key, 64] as rows
              plgpu.SMEM((ROWS * 8,), I32 if fmt == "fp4" else jnp.float8_e4m3fn)]  # scales
    else:
        s += [plgpu.SMEM((ROWS * 8, w), jnp.float8_e4m3fn),  # keys e4m3, [key, 128]
              plgpu.SMEM((ROWS * 8,), F32)]  # row amax, then per-key scale at row 8k
    return s


def _load_key(key_g, bs, kscr, bar, fmt):
    k_s = kscr[0]
    for r in range(ROWS):
        if fmt == "fp8":
            plgpu.copy_gmem_to_smem(key_g.at[bs[r]], k_s.at[pl.ds(8 * r, 8)], bar)
        else:
            n = 64 // _KEY_W[fmt]  # tile rows per key half
            for h in range(2):
                plgpu.copy_gmem_to_smem(key_g.at[bs[r], h], k_s.at[pl.ds(32 * h + n * r, n)], bar)


def _quantize_key(kscr, fmt):
    w = _KEY_W[fmt]
    k = plgpu.load(kscr[0], layout=WG, optimized=False)
    if fmt == "fp4":
        amax = jnp.maximum(_row_max(k), jnp.float32(kf.FP4_AMAX_FLOOR))
        e = _pow2_exponent(amax * kf.INV_E2M1_MAX)
        codes = _e2m1_codes(k * _bcast(_exp2(254 - e), w))
        kscr[3][...] = e
    elif fmt == "nvfp4":
        s = jnp.minimum(_row_max(k) * kf.INV_E2M1_MAX, 448.0).astype(jnp.float8_e4m3fn)
        sf = s.astype(F32)
        safe = jnp.where(sf > 0, sf, 1.0)
        codes = _e2m1_codes(k / _bcast(safe, w))
        codes = jnp.where(_bcast(sf, w) > 0, codes, jnp.zeros_like(codes))
        kscr[3][...] = s
    else:  # fp8: per-key amax = max over the key's 8 tile rows (through SMEM scalars)
        kscr[2][...] = _row_max(k)
        rowid = plgpu.broadcasted_iota(I32, (ROWS * 8,), 0, layout=ROW)
        scale = jnp.zeros((ROWS * 8,), F32)
        for r in range(ROWS):
            amax = kscr[2][8 * r]
            for j in range(1, 8):
                amax = jnp.maximum(amax, kscr[2][8 * r + j])
            scale = jnp.where((rowid >> 3) == r, amax * kf.INV_E4M3_MAX, scale)
        safe = jnp.where(scale > 0, scale, 1.0)
        v = jnp.clip(k / _bcast(safe, w), -448.0, 448.0)
        q = jnp.where(_bcast(scale, w) > 0, v, jnp.zeros_like(v)).astype(jnp.float8_e4m3fn)
        kscr[1][...] = q
        kscr[2][...] = scale
        return
    kscr[1][...] = codes  # through SMEM: lo and hi nibbles live in different threads
    nh = ROWS * 64 // w  # rows of one half: [key, 64 dims] in natural order
    half = plgpu.Layout.WG_STRIDED((nh, w), vec_size=2)
    lo = plgpu.load(kscr[1].at[pl.ds(0, nh)], layout=half, optimized=False)
    hi = plgpu.load(kscr[1].at[pl.ds(32, nh)], layout=half, optimized=False)
    kscr[2][...] = (lo | (hi << 4)).astype(jnp.uint8)


def _store_key(kscr, idx_refs, r, major, minor, fmt):
    if fmt == "fp8":
        keys_g, sc_g = idx_refs
        plgpu.copy_smem_to_gmem(kscr[1].at[pl.ds(8 * r, 8)], keys_g.at[major, minor])
        sc_g[major, minor, 0] = kscr[2][8 * r]
        return
    codes_g, *sc_g = idx_refs   # fp4: idx_scale [.., 4]; nvfp4: idx_scale_lo / _hi [.., 4]
    n = 64 // _KEY_W[fmt]
    plgpu.copy_smem_to_gmem(kscr[2].at[pl.ds(n * r, n)], codes_g.at[major, minor])
    for h in range(2):
        for q in range(n):
            v = kscr[3][32 * h + n * r + q]
            if fmt == "fp4":
                sc_g[0][major, minor, n * h + q] = v.astype(jnp.uint8)
            else:
                sc_g[h][major, minor, q] = v


# ---------------------------------------------------------------- public entry points
def _check_main(nope, scale, rope, what):
    lead = nope.shape[:-1]
    if (len(lead) != 2 or nope.shape[-1] != NOPE or scale.shape != (*lead, 8)
            or rope.shape != (*lead, ROPE) or nope.dtype != jnp.float8_e4m3fn
            or scale.dtype != jnp.uint8 or rope.dtype != jnp.bfloat16):
        raise ValueError(
            f"{what}: expected nope e4m3 [N, E, 448], scale u8 [N, E, 8], rope bf16 [N, E, 64]; "
            f"got {nope.dtype}{nope.shape}, {scale.dtype}{scale.shape}, {rope.dtype}{rope.shape}")


def _check_rows(x, n, what):
    if x.ndim != 2 or x.shape[1] != n:
        raise ValueError(f"{what}: expected [B, {n}], got shape {x.shape}")


def append_window(win, kv_BD, pos_B, *, interpret=False):
    """Write kv rows (bf16 [B, 512]) of requests b = 0..B-1 into their window ring at slot
    pos_B[b] % 128, quantised; pos_B[b] = -1 writes nothing. Returns the updated `win`
    ({win_nope, win_scale, win_rope, win_pos}); in place when the caller donates it."""
    nope, scale, rope, pos = win["win_nope"], win["win_scale"], win["win_rope"], win["win_pos"]
    _check_main(nope, scale, rope, "append_window")
    _check_rows(kv_BD, NOPE + ROPE, "append_window kv_BD")
    R, W, _ = nope.shape
    B = kv_BD.shape[0]
    if pos_B.shape != (B,) or B > R or pos.shape != (R, W):
        raise ValueError(f"append_window: pos_B {pos_B.shape} / win_pos {pos.shape} do not "
                         f"match B={B} rows, R={R} window rows")

    def dst(pos_g, b):
        p = pos_g[b]
        return p >= 0, b, lax.rem(jnp.maximum(p, 0), W), [(3, p)]

    refs = [jax.new_ref(nope.reshape(R * W * 7, BLK)), jax.new_ref(scale),
            jax.new_ref(rope), jax.new_ref(pos)]
    _scatter_call(kv_BD, (pos_B.astype(I32),), dst, refs, interpret=interpret)
    n, s, ro, p = (jax.freeze(x) for x in refs)
    return {**win, "win_nope": n.reshape(R, W, NOPE), "win_scale": s, "win_rope": ro,
            "win_pos": p}


def flush_compressed(pool, idx_pool, entry_BD, key_BK, flush_B, entry_idx_B, block_table_RM,
                     *, fmt="fp4", interpret=False):
    """Quantise and write compressed entries (bf16 [B, 512]) and, when `idx_pool` is given,
    indexer keys (f32 [B, 128], format `fmt`) of rows with flush_B[b] != 0 to entry
    entry_idx_B[b] of request b: pool[block_table[b, i // EPB], i % EPB]. Rows without
    flush, or whose block is unused (-1), write nothing. Returns (pool, idx_pool)."""
    nope, scale, rope = pool["cmp_nope"], pool["cmp_scale"], pool["cmp_rope"]
    _check_main(nope, scale, rope, "flush_compressed")
    _check_rows(entry_BD, NOPE + ROPE, "flush_compressed entry_BD")
    NB, EPB, _ = nope.shape
    B = entry_BD.shape[0]
    if flush_B.shape != (B,) or entry_idx_B.shape != (B,) or block_table_RM.shape[0] < B:
        raise ValueError(f"flush_compressed: flush {flush_B.shape}, entry_idx "
                         f"{entry_idx_B.shape}, block_table {block_table_RM.shape} vs B={B}")
    maxb = block_table_RM.shape[1]

    def dst(fl_g, ei_g, bt_g, b):
        i = ei_g[b]
        ok = (fl_g[b] != 0) & (i >= 0) & (i < maxb * EPB)
        ic = jnp.where(ok, i, 0)
        blk = bt_g[b, lax.div(ic, EPB)]
        return ok & (blk >= 0), jnp.maximum(blk, 0), lax.rem(ic, EPB), []

    refs = [jax.new_ref(nope.reshape(NB * EPB * 7, BLK)), jax.new_ref(scale), jax.new_ref(rope)]
    names = ()
    if idx_pool is not None:
        _check_rows(key_BK, kf.INDEX_DIM, "flush_compressed key_BK")
        fields = kf.index_key_fields(fmt)
        names = tuple(fields)
        if set(idx_pool) != set(names):
            raise ValueError(f"flush_compressed: idx_pool has fields {sorted(idx_pool)}, "
                             f"format {fmt!r} stores {sorted(names)}")
        for nm, (suffix, dt) in fields.items():
            a = idx_pool[nm]
            if a.shape != (NB, EPB, *suffix) or a.dtype != dt:
                raise ValueError(f"flush_compressed: idx_pool[{nm!r}] is {a.dtype}{a.shape}, "
                                 f"format {fmt!r} needs {jnp.dtype(dt)}{(NB, EPB, *suffix)}")
            if nm == "idx_keys":
                a = a.reshape(NB, EPB, 8, 16)  # TMA box views: the key's SMEM rows
            elif nm == "idx_codes":
                a = a.reshape(NB, EPB, 64 // _KEY_W[fmt], _KEY_W[fmt])
            refs.append(jax.new_ref(a))
    scalars = (flush_B.astype(I32), entry_idx_B.astype(I32), block_table_RM.astype(I32))
    _scatter_call(entry_BD, scalars, dst, refs, key_BK if idx_pool is not None else None,
                  fmt if idx_pool is not None else None, interpret=interpret)
    out = [jax.freeze(x) for x in refs]
    pool = {**pool, "cmp_nope": out[0].reshape(NB, EPB, NOPE), "cmp_scale": out[1],
            "cmp_rope": out[2]}
    if idx_pool is not None:
        new = dict(zip(names, out[3:]))
        for nm in ("idx_keys", "idx_codes"):
            if nm in new:
                new[nm] = new[nm].reshape(NB, EPB, -1)
        idx_pool = {**idx_pool, **new}
    return pool, idx_pool
