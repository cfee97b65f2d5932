"""Pure-JAX grouped quantised matmul (the `impl="xla"` path and the kernels' reference).

    y_GMN[g, m, n] = sum_k x_GMK[g, m, k] * dequant(w)[expert_G[g], n, k]      (f32)

Groups whose expert id lies outside [0, E) are empty: their rows are exactly 0. The
weights are dequantised per group (gather of the used experts, then dequantise), so this
path reads only the experts it uses, like the kernel, but writes their f32 copies.
"""
import jax.numpy as jnp
from jax import lax

from pallas_kernels.formats import Fp4Weight, Fp8Weight


def _gather(a, idx):
    """a[idx]; 1-byte float arrays go through a uint8 view (XLA upcasts a whole float8
    array before gathering from it)."""
    if a.dtype.itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.uint8)[idx], a.dtype)
    return a[idx]


def _take(w, idx_G):
    """The pytree w with every leaf's leading (expert) axis indexed by idx_G."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(_gather(w.w, idx_G), _gather(w.scale, idx_G))
    return Fp4Weight(_gather(w.packed, idx_G), _gather(w.scale, idx_G))


def grouped_matmul_reference(x_GMK, expert_G, w, *, dtype=jnp.float32):
    """Dequantise the gathered experts to `dtype` (f32: the dsv4_jax path; bf16: exact too,
    since the scales are powers of two) and multiply with f32 accumulation -> f32 [G, M, N]."""
    E = w.shape[0]
    valid_G = (expert_G >= 0) & (expert_G < E)
    W_GNK = _take(w, jnp.where(valid_G, expert_G, 0)).dequant(dtype)
    y = jnp.einsum("gmk,gnk->gmn", x_GMK.astype(dtype), W_GNK,
                   preferred_element_type=jnp.float32)
    return jnp.where(valid_G[:, None, None], y, 0.0)
