"""Pure-JAX grouped expert matmul over row tiles (the kernels' reference and XLA path).

    y_RN[r, n] = sum_k x_RK[r, k] * dequant(w)[tile_expert_S[r // tm], n, k]     (f32)

Rows are grouped in tiles of `tm`: every row of tile s uses expert tile_expert_S[s]; a
tile whose expert id lies outside [0, E) is empty (its rows are exactly 0).
`ragged_reference` is the same product for rows sorted by expert with group sizes,
through jax.lax.ragged_dot: an independent formulation the tests check the tiled path
against.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.formats import dequant_bf16
from pallas_kernels.quant_matmul.reference import _take


def tiled_reference(x_RK, tile_expert_S, w, tm):
    """f32 [R, N]; R = S * tm. Dequantises the S gathered experts (memory S x N x K: a
    reference, not a prefill path)."""
    S = tile_expert_S.shape[0]
    E = w.shape[0]
    valid_S = (tile_expert_S >= 0) & (tile_expert_S < E)
    W_SNK, _ = dequant_bf16(_take(w, jnp.where(valid_S, tile_expert_S, 0)))
    x_SMK = x_RK.astype(jnp.bfloat16).reshape(S, tm, -1)
    y = jnp.einsum("smk,snk->smn", x_SMK, W_SNK, preferred_element_type=jnp.float32)
    return jnp.where(valid_S[:, None, None], y, 0.0).reshape(S * tm, -1)


def ragged_reference(x_PK, group_sizes_E, w):
    """Rows sorted by expert, group_sizes_E[e] rows for expert e (sum <= P; rows past the
    sum are 0) -> f32 [P, N], via lax.ragged_dot on the dequantised bf16 experts."""
    W_ENK, _ = dequant_bf16(w)
    return jax.lax.ragged_dot(x_PK.astype(jnp.bfloat16), W_ENK.transpose(0, 2, 1),
                              group_sizes_E.astype(jnp.int32),
                              preferred_element_type=jnp.float32)
