"""The XLA side of the op: input checks, head padding, the id list's bound and the key
splits. Semantics and shapes of the arguments: reference.py."""
import jax.numpy as jnp

from pallas_kernels.sparse_decode_attention.layout import BLK, D, HT, NOPE, NW, ROPE, WINDOW


def check_and_pad(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H):
    """Check the arguments; -> (q [B, HP, 512] bf16, sink [HP] f32, heads padded to the
    64-row wgmma tile, and the pools as 64-byte chunks / rope rows (free reshapes): wn
    [R * 128 * 7, 64], wr [R * 128, 64], cn [NB * EPB * 7, 64], cr [NB * EPB, 64])."""
    win_nope, win_scale, win_rope, win_pos = win
    cmp_nope, cmp_scale, cmp_rope = cmp
    B, H, Dq = q_BHD.shape
    if Dq != D:
        raise ValueError(f"q must be [B, H, {D}], got {q_BHD.shape}")
    if win_nope.shape[1:] != (WINDOW, NOPE) or win_nope.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"win_nope must be float8_e4m3fn [R, 128, 448], got {win_nope.dtype} "
                         f"{win_nope.shape}")
    if cmp_nope.shape[2:] != (NOPE,) or cmp_nope.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"cmp_nope must be float8_e4m3fn [NB, EPB, 448], got {cmp_nope.dtype} "
                         f"{cmp_nope.shape}")
    if cmp_rope.shape != cmp_nope.shape[:2] + (ROPE,) or cmp_scale.shape != cmp_nope.shape[:2] + (8,):
        raise ValueError(f"cmp_rope / cmp_scale must be [NB, EPB, 64] / [NB, EPB, 8], got "
                         f"{cmp_rope.shape} / {cmp_scale.shape}")
    if (win_nope.shape[0] < B or block_table.shape[0] < B or t_B.shape != (B,)
            or (idx_BK is not None and idx_BK.shape[0] != B)):
        raise ValueError("window ring / block table need >= B rows; idx and t need B rows")
    if sink_H.shape != (H,):
        raise ValueError(f"attn_sink must be [H]={H}, got {sink_H.shape}")
    HP = -(-H // HT) * HT
    q = q_BHD.astype(jnp.bfloat16)
    sink = sink_H.astype(jnp.float32)
    if HP != H:   # small test shapes: pad heads to the 64-row wgmma tile
        q = jnp.pad(q, ((0, 0), (0, HP - H), (0, 0)))
        sink = jnp.pad(sink, (0, HP - H))
    wn, wr = win_nope.reshape(-1, 64), win_rope.reshape(-1, ROPE)
    cn, cr = cmp_nope.reshape(-1, 64), cmp_rope.reshape(-1, ROPE)
    return q, sink, (wn, wr, cn, cr)


def pad_ids(idx_BK):
    """idx [B, K] -> int32 [B, KP], padded with -1 to whole key blocks."""
    K = idx_BK.shape[1]
    return jnp.pad(idx_BK.astype(jnp.int32), ((0, 0), (0, -K % BLK)), constant_values=-1)


def ids_used(idx_BK):
    """-> (idx [B, KP] i32 padded with -1 to whole key blocks, used [B] i32 = 1 + the
    position of the last valid id: a request runs NW + ceil(used / 64) key blocks)."""
    idx = pad_ids(idx_BK)
    KP = idx.shape[1]
    return idx, jnp.max(jnp.where(idx >= 0, jnp.arange(KP)[None, :] + 1, 0), axis=1)


def default_splits(B, H, n_blk, num_sms=132, ctas_per_tile=1, ctas_per_sm=1):
    """Key-block splits (flash-decoding) per (request, head tile): the count that needs the
    fewest key blocks run one after another on an SM, waves included; ties: fewer splits
    (less merging). One CTA fits per SM (its SMEM). E.g. Flash B=64, 10 blocks: 2 splits
    (128 CTAs, one wave of 5 blocks), where filling the SMs (3 splits: 192 CTAs, 2 waves
    x 4 blocks = 8) ran a second, partial wave."""
    ctas = B * -(-H // HT) * ctas_per_tile
    slots = num_sms * ctas_per_sm

    def serial_blocks(s):
        return -(-ctas * s // slots) * -(-n_blk // s)
    return int(min(range(1, max(1, n_blk) + 1), key=lambda s: (serial_blocks(s), s)))


def prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *, splits=None,
                   ids_prefix=False, implicit=0):
    """-> ((q, wn, wr, cn, cr, idx, block_table, win_scale, cmp_scale, win_pos, t, used,
    sink), NS): the Mosaic kernels' arguments (the producer derives each key's row, scale
    exponents and validity itself) and the key splits.
    used: 1 + the position of the last valid id (XLA's one small fusion), or with
    ids_prefix t itself (the kernel derives the bound from t: no XLA work).
    implicit = K > 0 (ids_prefix, idx_BK None): the HCA ids are derived in-kernel; the
    block table stands in for idx, passed but never read (a constant array here became a
    broadcast kernel of its own)."""
    win_nope, win_scale, win_rope, win_pos = win
    cmp_nope, cmp_scale, cmp_rope = cmp
    if implicit and not (ids_prefix and idx_BK is None):
        raise ValueError("implicit HCA ids need ids_prefix and idx_BK=None")
    B = q_BHD.shape[0]
    q, sink, (wn, wr, cn, cr) = check_and_pad(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H)
    HP = q.shape[1]
    if implicit:
        idx, used = block_table.astype(jnp.int32), t_B.astype(jnp.int32)
        KP = -(-implicit // BLK) * BLK
    else:
        idx, used = ((pad_ids(idx_BK), t_B.astype(jnp.int32)) if ids_prefix
                     else ids_used(idx_BK))
        KP = idx.shape[1]
    NS = splits or default_splits(B, HP, NW + KP // BLK)
    keys = (idx, block_table.astype(jnp.int32), win_scale.reshape(-1, 8),
            cmp_scale.reshape(-1, 8), win_pos.astype(jnp.int32), t_B.astype(jnp.int32))
    return (q, wn, wr, cn, cr, *keys, used, sink), NS
