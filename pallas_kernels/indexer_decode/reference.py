"""Pure-JAX lightning indexer at decode (gather + dequantise + score + top-k).

This is also the path the decode step uses when kernels are off. Shapes:
q_BHD [B, 64, 128], w_BH [B, 64] f32, key pool fields [NB, 32, ...] (format per
docs/KV_CACHE.md), block_table [R >= B, MAXB] (row b for request b),
t_B [B] -> scores [B, MAXB*32] f32 (-inf where i >= (t_b+1)//4), ids [B, topk] (-1 padded).
"""
import jax.numpy as jnp
from jax import lax

from pallas_kernels import formats as kvformat

RATIO = 4


def _gather(pool, bt):
    """pool[bt]; float8 pools go through a uint8 view (a float8 gather makes XLA upcast the
    whole pool to f16 first)."""
    if jnp.dtype(pool.dtype).itemsize == 1 and jnp.issubdtype(pool.dtype, jnp.floating):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(pool, jnp.uint8)[bt], pool.dtype)
    return pool[bt]


def indexer_scores_reference(q_BHD, w_BH, keys, block_table, t_B, fmt="fp4"):
    """keys: dict of the pool's fields (e.g. {"idx_codes", "idx_scale"} for fp4)."""
    B = q_BHD.shape[0]
    bt = block_table[:B].astype(jnp.int32)
    MAXB = bt.shape[1]
    bt = jnp.where(bt < 0, 0, bt)
    gathered = {k: _gather(v, bt) for k, v in keys.items()}          # [B, MAXB, 32, ...]
    k_BND = kvformat.dequantize_index_key(gathered, fmt).reshape(B, MAXB * 32, 128)
    s_BHN = jnp.einsum("bhd,bnd->bhn", q_BHD.astype(jnp.float32), k_BND,
                       precision=lax.Precision.HIGHEST)
    score = jnp.einsum("bh,bhn->bn", w_BH.astype(jnp.float32), jnp.maximum(s_BHN, 0.0),
                       precision=lax.Precision.HIGHEST)
    n_elig = (t_B.astype(jnp.int32) + 1) // RATIO
    mask = jnp.arange(MAXB * 32)[None, :] < n_elig[:, None]
    return jnp.where(mask, score, -jnp.inf)


def topk_reference(scores_BN, topk):
    """ids [B, topk] by descending score (lowest id first on ties); -1 past the eligible."""
    B, N = scores_BN.shape
    if N < topk:
        scores_BN = jnp.pad(scores_BN, ((0, 0), (0, topk - N)), constant_values=-jnp.inf)
    vals, ids = lax.top_k(scores_BN, topk)
    return jnp.where(vals == -jnp.inf, -1, ids).astype(jnp.int32)


def indexer_topk_reference(q_BHD, w_BH, keys, block_table, t_B, topk, fmt="fp4"):
    return topk_reference(indexer_scores_reference(q_BHD, w_BH, keys, block_table, t_B, fmt),
                          topk)
