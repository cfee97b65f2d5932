"""Pure-JAX (XLA) gathers with dequantisation: the reference and the fallback path."""
from __future__ import annotations

import jax.numpy as jnp

from dsv4_jax import kvformat


def _dequant(nope, scale, rope, valid):
    x = kvformat.dequantize_kv(nope, scale, rope, jnp.bfloat16)
    return jnp.where(valid[..., None], x, jnp.zeros((), jnp.bfloat16))


def _entries(pool, block_table, idx, valid):
    EPB = pool["cmp_nope"].shape[1]
    maxb = block_table.shape[1]
    valid = valid & (idx >= 0) & (idx < maxb * EPB)
    ic = jnp.where(valid, idx, 0)
    blk = jnp.take_along_axis(block_table, ic // EPB, axis=1)
    valid = valid & (blk >= 0)
    blk = jnp.where(valid, blk, 0)
    e = ic % EPB
    return _dequant(pool["cmp_nope"][blk, e], pool["cmp_scale"][blk, e],
                    pool["cmp_rope"][blk, e], valid)


def gather_topk(pool, block_table, idx_BK):
    return _entries(pool, block_table[: idx_BK.shape[0]], idx_BK, jnp.ones(idx_BK.shape, bool))


def gather_all(pool, block_table, n_entries_B, max_entries):
    B = n_entries_B.shape[0]
    idx = jnp.broadcast_to(jnp.arange(max_entries, dtype=jnp.int32), (B, max_entries))
    return _entries(pool, block_table[:B], idx, idx < n_entries_B[:, None])


def gather_window(win):
    return _dequant(win["win_nope"], win["win_scale"], win["win_rope"], win["win_pos"] >= 0)
