"""Pure-JAX sparse decode attention (window ring + selected compressed entries + sink).

Also the decode step's path when kernels are off. Semantics (ARCHITECTURE.md 4 and 10):
K = V = the dequantised 512-dim entry; s = q.K / sqrt(512); one softmax over the window
slots with t-127 <= win_pos <= t (win_pos >= 0) plus the compressed entries idx >= 0; the
sink only joins the denominator; p is rounded to bf16 before P.V (as the reference kernel).

Shapes: q_BHD [B, H, 512] bf16; window ring win_nope [R, 128, 448] e4m3, win_scale
[R, 128, 8] u8, win_rope [R, 128, 64] bf16, win_pos [R, 128] i32; compressed pool
cmp_nope [NB, EPB, 448], cmp_scale [NB, EPB, 8], cmp_rope [NB, EPB, 64]; block_table
[R, MAXB]; idx_BK [B, K] i32 compressed entry ids (-1 = none); t_B [B]; sink_H [H] f32.
Request b uses row b of the window ring and of the block table.
"""
import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels import formats as kvformat

WINDOW = 128


def gather_keys(win, cmp, block_table, idx_BK, t_B):
    """-> (keys_BND f32 dequantised [B, 128 + K, 512], valid_BN bool)."""
    win_nope, win_scale, win_rope, win_pos = win
    cmp_nope, cmp_scale, cmp_rope = cmp
    B = idx_BK.shape[0]
    EPB = cmp_nope.shape[1]
    t = t_B.astype(jnp.int32)[:, None]
    pos = win_pos[:B]
    win_valid = (pos >= 0) & (pos <= t) & (pos >= t - (WINDOW - 1))
    kw = kvformat.dequantize_kv(win_nope[:B], win_scale[:B], win_rope[:B], jnp.float32)
    blk = jnp.take_along_axis(block_table[:B], jnp.maximum(idx_BK, 0) // EPB, axis=1)
    blk = jnp.maximum(blk, 0)
    slot = jnp.maximum(idx_BK, 0) % EPB
    # Gather the FP8 rows through a uint8 view: a float8 gather makes XLA upcast the whole
    # pool to f16 first.
    nope = lax.bitcast_convert_type(lax.bitcast_convert_type(cmp_nope, jnp.uint8)[blk, slot],
                                    cmp_nope.dtype)
    kc = kvformat.dequantize_kv(nope, cmp_scale[blk, slot], cmp_rope[blk, slot], jnp.float32)
    keys = jnp.concatenate([kw, kc], axis=1)
    valid = jnp.concatenate([win_valid, idx_BK >= 0], axis=1)
    return keys, valid


def sparse_decode_attention_reference(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H):
    """-> out [B, H, 512] bf16. win = (nope, scale, rope, pos); cmp = (nope, scale, rope)."""
    keys, valid = gather_keys(win, cmp, block_table, idx_BK, t_B)
    q = q_BHD.astype(jnp.float32)
    s = jnp.einsum("bhd,bnd->bhn", q, keys, precision=lax.Precision.HIGHEST)
    s = s / math.sqrt(q.shape[-1])
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    sink = sink_H.astype(jnp.float32)[None, :, None]
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
    p = jnp.exp(s - m)
    den = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
    p16 = p.astype(jnp.bfloat16).astype(jnp.float32)
    o = jnp.einsum("bhn,bnd->bhd", p16, keys, precision=lax.Precision.HIGHEST) / den
    return o.astype(jnp.bfloat16)


def hca_indices(t_B, max_entries, ratio=128):
    """All visible compressed entries of an HCA layer as an index list [B, max_entries]."""
    n = (t_B.astype(jnp.int32) + 1) // ratio
    ids = jnp.arange(max_entries, dtype=jnp.int32)[None, :]
    return jnp.where(ids < n[:, None], ids, -1)
