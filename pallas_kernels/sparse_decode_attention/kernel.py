"""Sparse decode attention (window ring + selected compressed entries + sink) as a Pallas
Mosaic-GPU kernel (Hopper, sm_90a). Semantics: see reference.py.

The kernel reads FP8 nope rows and BF16 rope rows (never a bf16 copy of the nope part) and
dequantises them in SMEM: K tile bf16 [64 keys, 512] = e4m3 * 2^(e-127) (exact) | rope.
The window ring is read in place (its rows are contiguous per request). The selected
compressed rows are first gathered by XLA into a staging buffer in their stored format
(576 B per key written + read again): a per-row TMA gather of 448-byte rows straight from
the pool was tried and faults on the GPU (Mosaic infers a swizzled SMEM layout for the
tile and tensor-TMA destinations must then be 128-byte aligned; 448-byte rows are not).
This is the main known inefficiency: see benchmarks/results/indexer_attention.md.
Heads are the wgmma M rows (64 per CTA). Grid (b, split, head tile, column half):
 - column half c: the f32 accumulator [64, 512] is too big for one warpgroup, so two CTAs
   share the keys (the second read is served by L2) and each owns 256 output columns;
   both compute the same full scores;
 - split s: flash-decoding over key blocks when B * H/64 * 2 is too small to fill the chip;
   partial outputs are merged in XLA.
Tiny per-key metadata (scale factors 2^(e-127) as f32, the 0/-inf mask) is prepared in
XLA: 36 bytes per key next to 584 bytes of cache.
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


def _prep(win, cmp, block_table, idx_BK, t_B):
    """Per-key metadata: rows [B, NK] i32, sf [B, NK/64, 8, 64] f32, bias [B, NK] f32,
    n_blocks [B] i32 (window blocks + compressed blocks up to the last valid index)."""
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
    cmp_rows = blk * EPB + safe % EPB
    win_rows = jnp.arange(B, dtype=jnp.int32)[:, None] * WINDOW + jnp.arange(WINDOW)[None, :]
    rows = jnp.concatenate([win_rows, cmp_rows], axis=1)
    e = jnp.concatenate([win_scale[:B], cmp_scale.reshape(-1, 8)[cmp_rows]], axis=1)
    sf = lax.bitcast_convert_type(jnp.clip(e.astype(jnp.int32), 1, 254) << 23, jnp.float32)
    NK = WINDOW + KP
    sf = sf.reshape(B, NK // BLK, BLK, 8).transpose(0, 1, 3, 2)
    bias = jnp.where(jnp.concatenate([win_ok, cmp_ok], axis=1), 0.0, -jnp.inf).astype(jnp.float32)
    # Valid compressed ids come first (top-k output, HCA prefix): later blocks are skipped.
    last = jnp.max(jnp.where(cmp_ok, jnp.arange(KP)[None, :] + 1, 0), axis=1)
    n_blocks = WINDOW // BLK + -(-last // BLK)
    return rows, sf, bias, n_blocks.astype(jnp.int32)


def gather_rows_fp8(pool_ND, rows):
    """pool[rows] for an FP8 pool, gathered through a uint8 view: XLA's float normalisation
    otherwise upcasts the WHOLE pool to f16 before a float8 gather (seen in the HLO)."""
    u8 = lax.bitcast_convert_type(pool_ND, jnp.uint8)[rows]
    return lax.bitcast_convert_type(u8, pool_ND.dtype)


def default_splits(B, H, n_blk, num_sms=132):
    ctas = B * -(-H // HT) * 2
    return int(max(1, min(n_blk, -(-num_sms // ctas))))


def sparse_decode_attention(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *,
                            splits=None, interpret=None):
    """-> out [B, H, 512] bf16. Same arguments as reference.sparse_decode_attention_reference.
    -1 entries anywhere are masked; key blocks after the last valid id are skipped, so lists
    with valid ids first (top-k output, HCA prefix) do the least work."""
    H = q_BHD.shape[1]
    args, NS = prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, splits=splits)
    o, lse = _attn_call(*args, NS=NS, interpret=interpret)
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


def prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *, splits=None):
    """The XLA side of the op (checks, per-key metadata, staging gather) -> (kernel args, NS)."""
    win_nope, win_scale, win_rope, win_pos = win
    cmp_nope, cmp_scale, cmp_rope = cmp
    B, H, Dq = q_BHD.shape
    if Dq != D:
        raise ValueError(f"q must be [B, H, {D}], got {q_BHD.shape}")
    if win_nope.shape[1:] != (WINDOW, NOPE) or win_nope.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"win_nope must be float8_e4m3fn [R, 128, 448], got {win_nope.dtype} {win_nope.shape}")
    if cmp_nope.shape[2:] != (NOPE,) or cmp_nope.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"cmp_nope must be float8_e4m3fn [NB, EPB, 448], got {cmp_nope.dtype} {cmp_nope.shape}")
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
    rows, sf, bias, n_blocks = _prep(win, cmp, block_table, idx_BK, t_B)
    n_blk = rows.shape[1] // BLK
    NS = splits or default_splits(B, HP, n_blk)
    # Staging gather of the selected compressed rows (FP8 + BF16, as stored): Mosaic's TMA
    # needs 128-byte aligned SMEM destinations and a 448-byte row copy cannot give that.
    cmp_rows = rows[:, WINDOW:]
    staged_nope = gather_rows_fp8(cmp_nope.reshape(-1, NOPE), cmp_rows)       # [B, KP, 448]
    staged_rope = cmp_rope.reshape(-1, ROPE)[cmp_rows]                         # [B, KP, 64]
    return (q, win_nope, win_rope, staged_nope, staged_rope, sf, bias, n_blocks, sink), NS


def _attn_call(q, wn, wr, cn, cr, sf, bias, n_blocks, sink, *, NS, interpret):
    B, HP, _ = q.shape
    n_heads_t = HP // HT
    n_blk = bias.shape[1] // BLK
    bps = -(-n_blk // NS)
    scale = 1.0 / math.sqrt(D)
    final = NS == 1
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(q_g, wn_g, wr_g, cn_g, cr_g, sf_g, bias_g, nb_g, sink_g, o_g, lse_g,
               q_s, k_s, n_s, r_s, sf_s, b_s, p_s, v_s, qbar, bar):
        b = lax.axis_index("b")
        s_id = lax.axis_index("s")
        ht = lax.axis_index("h")
        c = lax.axis_index("c")
        heads = pl.ds(ht * HT, HT)
        g0 = s_id * bps
        n_load = jnp.clip(jnp.minimum(nb_g[b], g0 + bps) - g0, 0, bps)

        def issue(g, slot):
            # Whole [64, ...] blocks: the window ring's rows are contiguous per request and
            # the compressed rows were gathered into a staging buffer (see module doc).
            @pl.when(g < WINDOW // BLK)
            def _():
                keys = pl.ds(g * BLK, BLK)
                plgpu.copy_gmem_to_smem(wn_g.at[b, keys], n_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(wr_g.at[b, keys], r_s.at[slot], bar.at[slot])

            @pl.when(g >= WINDOW // BLK)
            def _():
                keys = pl.ds((g - WINDOW // BLK) * BLK, BLK)
                plgpu.copy_gmem_to_smem(cn_g.at[b, keys], n_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(cr_g.at[b, keys], r_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(sf_g.at[b, g], sf_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(bias_g.at[b, pl.ds(g * BLK, BLK)], b_s.at[slot], bar.at[slot])

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

            @pl.when(i + 1 < n_load)
            def _():
                issue(g0 + i + 1, 1 - slot)
            plgpu.barrier_wait(bar.at[slot])

            # Dequantise: K[:, 64j:64j+64] = e4m3 * 2^(e_j - 127) (exact in bf16), rope as is.
            for j in range(NOPE // 64):
                x = plgpu.load(n_s.at[slot, :, pl.ds(j * 64, 64)], layout=WG)
                f = plgpu.load(sf_s.at[slot, j], layout=ROW)
                kx = x.astype(jnp.float32) * lax.broadcast_in_dim(f, (BLK, 64), [0])
                k_s[:, pl.ds(j * 64, 64)] = kx.astype(jnp.bfloat16)
            k_s[:, pl.ds(NOPE, ROPE)] = plgpu.load(r_s.at[slot], layout=WG)
            plgpu.commit_smem()

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_s.T)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((HT, BLK), jnp.float32)) * scale
            bias = plgpu.load(b_s.at[slot], layout=COL)
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

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((NS, B, HP, D), jnp.bfloat16),
                  jax.ShapeDtypeStruct((NS, B, HP), jnp.float32)),
        grid=(B, NS, n_heads_t, 2), grid_names=("b", "s", "h", "c"),
        scratch_types=dict(
            q_s=plgpu.SMEM((HT, D), jnp.bfloat16, transforms=tr),
            k_s=plgpu.SMEM((BLK, D), jnp.bfloat16, transforms=tr),
            n_s=plgpu.SMEM((2, BLK, NOPE), jnp.float8_e4m3fn),
            r_s=plgpu.SMEM((2, BLK, ROPE), jnp.bfloat16),
            sf_s=plgpu.SMEM((2, 8, BLK), jnp.float32),
            b_s=plgpu.SMEM((2, BLK), jnp.float32),
            p_s=plgpu.SMEM((HT, BLK), jnp.bfloat16, transforms=tr),
            v_s=plgpu.SMEM((HT,), jnp.float32),
            qbar=plgpu.Barrier(num_arrivals=2),
            bar=plgpu.Barrier(num_arrivals=4, num_barriers=2),
        ),
        interpret=interpret,
    )(q, wn, wr, cn, cr, sf, bias, n_blocks, sink)
