"""Sparse decode attention (window ring + selected compressed entries + sink) as a Pallas
Mosaic-GPU kernel (Hopper, sm_90a). Semantics: see reference.py.

The kernel reads FP8 nope rows and BF16 rope rows straight from the cache (never a bf16
copy) and dequantises them in SMEM: K tile bf16 [64 keys, 512] = e4m3 * 2^(e-127) (exact)
| rope. Per block of 64 keys:
 - window blocks: the ring's rows are contiguous per request: one bulk copy each for nope
   and rope;
 - compressed blocks (gather="direct", the default): one copy per selected row straight
   from the paged pool (448 B nope + 128 B rope), with the physical row ids read as
   scalars in-kernel. These are plain `cp.async.bulk` copies (oob_mode=PROMISE_IN_BOUNDS,
   un-swizzled SMEM: 16-byte alignment suffices). The earlier fault came from the tensor
   TMA path, whose destinations must be 128-byte aligned (448-byte rows are not) and which
   Mosaic takes when the SMEM tile gets a swizzled layout or the copy may go out of bounds;
 - gather="staged" (the previous version, kept to compare): XLA first gathers the selected
   rows into a staging buffer (576 B written + read again per key), whole-block copies.
Per-key metadata stays in XLA, 8 bytes per key next to 584 bytes of cache: the physical
row id (block table lookup of the index, i32) and `meta` [.., 8, 64] u8 per block = the 7
scale exponents + a validity byte in place of the format's unused 8th exponent. The scale
bytes cannot be copied per row in-kernel (8 B < the 16-byte minimum of a bulk copy).
Heads are the wgmma M rows (64 per CTA). Grid (b, split, head tile, column half):
 - column half c: the f32 accumulator [64, 512] is too big for one warpgroup, so two CTAs
   share the keys (the second read is served by L2) and each owns 256 output columns;
   both compute the same full scores;
 - split s: flash-decoding over key blocks when B * H/64 * 2 is too small to fill the chip;
   partial outputs are merged in XLA.
"""
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WINDOW = 128
D = 512
NOPE = 448
ROPE = 64
BLK = 64        # keys per step (the reference's online-softmax block)
HT = 64         # heads per CTA (wgmma M)
NW = WINDOW // BLK
GATHERS = ("direct", "staged")
SEMANTICS = {"lane": plgpu.LoweringSemantics.Lane, "warpgroup": plgpu.LoweringSemantics.Warpgroup}


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


def gather_rows_fp8(pool_ND, rows):
    """pool[rows] for an FP8 pool, gathered through a uint8 view: XLA's float normalisation
    otherwise upcasts the WHOLE pool to f16 before a float8 gather (seen in the HLO)."""
    u8 = lax.bitcast_convert_type(pool_ND, jnp.uint8)[rows]
    return lax.bitcast_convert_type(u8, pool_ND.dtype)


def default_splits(B, H, n_blk, num_sms=132):
    ctas = B * -(-H // HT) * 2
    return int(max(1, min(n_blk, -(-num_sms // ctas))))


def sparse_decode_attention(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *,
                            splits=None, gather="direct", semantics="lane", interpret=None):
    """-> out [B, H, 512] bf16. Same arguments as reference.sparse_decode_attention_reference.
    -1 entries anywhere are masked; key blocks after the last valid id are skipped, so lists
    with valid ids first (top-k output, HCA prefix) do the least work. gather: "direct"
    (rows copied from the pool in-kernel) or "staged" (XLA staging gather, to compare).
    semantics: Mosaic lowering, "lane" (SMEM exactly as declared, un-swizzled row buffers;
    each copy arrives on its barrier from all 128 threads) or "warpgroup" (layout inference
    swizzles the row buffers per 512-B row; one arrival per copy)."""
    H = q_BHD.shape[1]
    args, NS = prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H,
                              splits=splits, gather=gather)
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {tuple(SEMANTICS)}, got {semantics!r}")
    o, lse = _attn_call(*args, NS=NS, gather=gather, semantics=semantics, interpret=interpret)
    sink = args[-1]
    if NS == 1:
        out = o[0]
    else:   # merge the splits' (o_s, lse_s) with the sink in the denominator
        m = jnp.maximum(jnp.max(lse, axis=0), sink[None, :])                  # [B, HP]
        wgt = jnp.exp(lse - m[None])                                          # [NS, B, HP]
        den = jnp.sum(wgt, axis=0) + jnp.exp(sink[None, :] - m)
        out = jnp.einsum("sbh,sbhd->bhd", wgt, o.astype(jnp.float32)) / den[..., None]
        out = out.astype(jnp.bfloat16)
    return out[:, :H]


def prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *, splits=None,
                   gather="direct"):
    """The XLA side of the op (checks, per-key metadata, and for gather="staged" the staging
    gather) -> (kernel args, NS)."""
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
    if win_nope.shape[0] < B or block_table.shape[0] < B or idx_BK.shape[0] != B or t_B.shape != (B,):
        raise ValueError("window ring / block table need >= B rows; idx and t need B rows")
    if sink_H.shape != (H,):
        raise ValueError(f"attn_sink must be [H]={H}, got {sink_H.shape}")
    HP = -(-H // HT) * HT
    q = q_BHD.astype(jnp.bfloat16)
    sink = sink_H.astype(jnp.float32)
    if HP != H:   # tiny test shapes: pad heads to the 64-row wgmma tile
        q = jnp.pad(q, ((0, 0), (0, HP - H), (0, 0)))
        sink = jnp.pad(sink, (0, HP - H))
    crow, meta, n_blocks = _prep(win, cmp, block_table, idx_BK, t_B)
    n_blk = meta.shape[1]
    NS = splits or default_splits(B, HP, n_blk)
    if gather == "staged":
        # Staging gather of the selected compressed rows (FP8 padded to 512 B, BF16 rope).
        cn = gather_rows_fp8(cmp_nope.reshape(-1, NOPE), crow)               # [B, KP, 448]
        cn = jnp.pad(cn, ((0, 0), (0, 0), (0, 64))).reshape(B, -1, 8, 64)
        cr = cmp_rope.reshape(-1, ROPE)[crow]                                 # [B, KP, 64]
    else:   # the pools as flat arrays of 64-byte chunks / rope rows (free reshapes)
        cn, cr = cmp_nope.reshape(-1, 64), cmp_rope.reshape(-1, ROPE)
    wn, wr = win_nope.reshape(-1, 64), win_rope.reshape(-1, ROPE)
    return (q, wn, wr, cn, cr, crow, meta, n_blocks, sink), NS


def _attn_call(q, wn, wr, cn, cr, crow, meta, n_blocks, sink, *, NS, gather, semantics,
               interpret):
    """wn [R*128*7, 64] / cn [NB*EPB*7, 64] (direct) are the FP8 rows as 64-byte chunks,
    wr [R*128, 64] / cr [NB*EPB, 64] the rope rows; staged: cn [B, KP, 8, 64], cr [B, KP, 64]."""
    B, HP, _ = q.shape
    n_heads_t = HP // HT
    n_blk = meta.shape[1]
    bps = -(-n_blk // NS)
    scale = 1.0 / math.sqrt(D)
    final = NS == 1
    direct = gather == "direct"
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    NCH = NOPE // 64          # 64-byte chunks of a stored nope row

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, crow_g, meta_g, nb_g, sink_g, o_g, lse_g,
               q_s, k_s, n_s, r_s, m_s, p_s, v_s, qbar, wbar, cbar):
        b = lax.axis_index("b")
        s_id = lax.axis_index("s")
        ht = lax.axis_index("h")
        c = lax.axis_index("c")
        heads = pl.ds(ht * HT, HT)
        g0 = s_id * bps
        n_load = jnp.clip(jnp.minimum(nb_g[b], g0 + bps) - g0, 0, bps)

        def copy_rows(rows, nope_g, rope_g, slot, bar):
            # One row = an [8, 64] box of 64-byte chunks from chunk 7 * row: the row's 448
            # bytes plus the next row's first 64 (a multiple of 128 bytes, as the copy
            # needs; past the pool's end the tensor copy fills zeros). SMEM rows are 512 B
            # apart, so every destination is 128-byte aligned.
            for j, row in enumerate(rows):
                plgpu.copy_gmem_to_smem(nope_g.at[pl.ds(row * NCH, 8)], n_s.at[slot, j], bar)
                plgpu.copy_gmem_to_smem(rope_g.at[pl.ds(row, 1)], r_s.at[slot, pl.ds(j, 1)], bar)

        def issue(g, slot):
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

        plgpu.copy_gmem_to_smem(q_g.at[b, heads], q_s, qbar)
        plgpu.copy_gmem_to_smem(sink_g.at[heads], v_s, qbar)

        @pl.when(n_load > 0)
        def _():
            issue(g0, 0)
        plgpu.barrier_wait(qbar)

        m0 = plgpu.layout_cast(jnp.full((HT,), -jnp.inf, jnp.float32), ROW)
        l0 = plgpu.layout_cast(jnp.full((HT,), 0.0, jnp.float32), ROW)
        a0 = plgpu.layout_cast(jnp.full((HT, D // 2), 0.0, jnp.float32), WG)

        def body(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, 2)
            g = g0 + i
            # Every thread is done with the previous step's SMEM reads (n_s / k_s / p_s)
            # before this step's copies and stores (no automatic barriers, see below).
            plgpu.commit_smem()

            @pl.when(i + 1 < n_load)
            def _():
                issue(g + 1, 1 - slot)

            @pl.when(g < NW)
            def _():
                plgpu.barrier_wait(wbar.at[slot])

            @pl.when(g >= NW)
            def _():
                plgpu.barrier_wait(cbar.at[slot])

            # Dequantise: K[:, 64j:64j+64] = e4m3 * 2^(e_j - 127) (exact in bf16), rope as is.
            for j in range(NCH):
                # 512-B row stride: bank conflicts, accepted (optimized=False allows them).
                x = plgpu.load(n_s.at[slot, :, j], layout=WG, optimized=False)
                e = plgpu.load(m_s.at[slot, j], layout=ROW).astype(jnp.int32)
                f = lax.bitcast_convert_type(jnp.clip(e, 1, 254) << 23, jnp.float32)
                kx = x.astype(jnp.float32) * lax.broadcast_in_dim(f, (BLK, 64), [0])
                k_s[:, pl.ds(j * 64, 64)] = kx.astype(jnp.bfloat16)
            k_s[:, pl.ds(NOPE, ROPE)] = plgpu.load(r_s.at[slot], layout=WG, optimized=False)
            ok = plgpu.load(m_s.at[slot, 7], layout=COL).astype(jnp.int32)
            bias = jnp.where(ok != 0, 0.0, -jnp.inf).astype(jnp.float32)
            plgpu.commit_smem()

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_s.T)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32)) * scale
            s = s + lax.broadcast_in_dim(bias, s.shape, [1])
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)     # all-masked block so far
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p_s[...] = p.astype(jnp.bfloat16)
            plgpu.commit_smem()

            def pv(half):
                def f(acc_ref):
                    plgpu.wgmma(acc_ref, p_s, k_s.at[:, pl.ds(half * (D // 2), D // 2)])
                    return acc_ref[...]
                return lambda: pl.run_scoped(f, plgpu.ACC((HT, D // 2), jnp.float32))
            acc = acc + lax.cond(c == 0, pv(0), pv(1))
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, n_load, body, (a0, m0, l0))
        if final:
            sk = plgpu.load(v_s, layout=ROW)
            mm = jnp.maximum(m, sk)
            den = l * jnp.exp(m - mm) + jnp.exp(sk - mm)
            out = acc * lax.broadcast_in_dim(jnp.exp(m - mm) / den, acc.shape, [0])
        else:
            l_safe = jnp.where(l > 0, l, 1.0)
            out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        plgpu.commit_smem()   # the last step's wgmma reads of q_s are done
        q_s[:, pl.ds(0, D // 2)] = out.astype(jnp.bfloat16)   # q no longer needed: staging
        plgpu.commit_smem()
        for r in range(HT // 8):   # 8-row strips of the left half: contiguous in the tiled SMEM
            plgpu.copy_smem_to_gmem(q_s.at[pl.ds(r * 8, 8), pl.ds(0, D // 2)],
                                    o_g.at[s_id, b, pl.ds(ht * HT + r * 8, 8),
                                           pl.ds(c * (D // 2), D // 2)])
        if not final:
            @pl.when(c == 0)
            def _():
                v_s[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(v_s, lse_g.at[s_id, b, heads])
        plgpu.wait_smem_to_gmem(0)

    n_rows = 2 * BLK + 1                   # copies per block, row by row
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((NS, B, HP, D), jnp.bfloat16),
                  jax.ShapeDtypeStruct((NS, B, HP), jnp.float32)),
        grid=(B, NS, n_heads_t, 2), grid_names=("b", "s", "h", "c"),
        scratch_types=dict(
            q_s=plgpu.SMEM((HT, D), jnp.bfloat16, transforms=tr),
            k_s=plgpu.SMEM((BLK, D), jnp.bfloat16, transforms=tr),
            n_s=plgpu.SMEM((2, BLK, 8, 64), jnp.float8_e4m3fn),   # 512 B per key, plain
            r_s=plgpu.SMEM((2, BLK, ROPE), jnp.bfloat16),
            m_s=plgpu.SMEM((2, 8, BLK), jnp.uint8),
            p_s=plgpu.SMEM((HT, BLK), jnp.bfloat16, transforms=tr),
            v_s=plgpu.SMEM((HT,), jnp.float32),
            qbar=plgpu.Barrier(num_arrivals=2),
            wbar=plgpu.Barrier(num_arrivals=n_rows, num_barriers=2),
            cbar=plgpu.Barrier(num_arrivals=n_rows if direct else 3, num_barriers=2),
        ),
        # Barriers are placed by hand (commit_smem): the automatic ones would add a
        # warpgroup barrier before each of the 129 copies of a block.
        compiler_params=plgpu.CompilerParams(lowering_semantics=SEMANTICS[semantics],
                                             unsafe_no_auto_barriers=True),
        interpret=interpret,
    )(q, wn, wr, cn, cr, crow, meta, n_blocks, sink)
