"""Pure-JAX (XLA) quantise-and-scatter into the KV cache: the reference and fallback path.
Same contract as kernel.py (docs/KV_CACHE.md); written with pallas_kernels.formats and `.at[].set`."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import formats as kvformat


def append_window(win, kv_BD, pos_B):
    R, W, _ = win["win_nope"].shape
    B = kv_BD.shape[0]
    nope, scale, rope = kvformat.quantize_kv(kv_BD)
    valid = pos_B >= 0
    rows = jnp.where(valid, jnp.arange(B), R)  # out of range -> dropped
    slot = jnp.where(valid, pos_B % W, 0)
    upd = lambda a, v: a.at[rows, slot].set(v, mode="drop")
    return {**win, "win_nope": upd(win["win_nope"], nope), "win_scale": upd(win["win_scale"], scale),
            "win_rope": upd(win["win_rope"], rope),
            "win_pos": upd(win["win_pos"], pos_B.astype(jnp.int32))}


def flush_compressed(pool, idx_pool, entry_BD, key_BK, flush_B, entry_idx_B, block_table_RM,
                     *, fmt="fp4"):
    NB, EPB, _ = pool["cmp_nope"].shape
    B = entry_BD.shape[0]
    maxb = block_table_RM.shape[1]
    i = entry_idx_B.astype(jnp.int32)
    ok = (flush_B != 0) & (i >= 0) & (i < maxb * EPB)
    ic = jnp.where(ok, i, 0)
    blk = block_table_RM[jnp.arange(B), ic // EPB]
    ok = ok & (blk >= 0)
    blk = jnp.where(ok, blk, NB)  # out of range -> dropped
    e = ic % EPB
    upd = lambda a, v: a.at[blk, e].set(v, mode="drop")
    nope, scale, rope = kvformat.quantize_kv(entry_BD)
    pool = {**pool, "cmp_nope": upd(pool["cmp_nope"], nope),
            "cmp_scale": upd(pool["cmp_scale"], scale), "cmp_rope": upd(pool["cmp_rope"], rope)}
    if idx_pool is not None:
        fields = kvformat.quantize_index_key(key_BK, fmt)
        idx_pool = {**idx_pool, **{k: upd(idx_pool[k], v) for k, v in fields.items()}}
    return pool, idx_pool
