"""Top-k selection as a set: the contract of kernel.topk_select, in pure JAX.

scores [B, N] f32 -> ids [B, k] int32: the ids of the k largest scores of each row (ties:
the lower id wins, as lax.top_k), scores of -inf left out, listed in ascending id order,
then -1 padded. Order is not score order: the consumers (sparse attention, the notebooks'
"which blocks were picked") use the set, and ascending ids read the pool in address order.
"""
import jax.numpy as jnp
from jax import lax


def topk_select_reference(scores_BN, k):
    B, N = scores_BN.shape
    s = scores_BN.astype(jnp.float32)
    if N < k:
        s = jnp.pad(s, ((0, 0), (0, k - N)), constant_values=-jnp.inf)
    vals, ids = lax.top_k(s, k)
    ids = jnp.where(vals == -jnp.inf, jnp.iinfo(jnp.int32).max, ids)
    ids = jnp.sort(ids, axis=1)
    return jnp.where(ids == jnp.iinfo(jnp.int32).max, -1, ids).astype(jnp.int32)
