"""Pure-JAX reference for the mHC mixing matrix: row softmax + eps, then Sinkhorn."""
import jax
import jax.numpy as jnp


def sinkhorn_softmax_reference(logits_MNN, iters: int, eps: float):
    """softmax(logits, -1) + eps, then a column normalisation and (iters - 1) x (row,
    column) normalisations, each dividing by (sum + eps). f32 [M, N, N] -> f32 [M, N, N]."""
    C = jax.nn.softmax(logits_MNN.astype(jnp.float32), -1) + eps
    C = C / (C.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdims=True) + eps)
        C = C / (C.sum(-2, keepdims=True) + eps)
    return C


def mhc_comb_reference(s_MK, q_MK, scale, base, N: int, nd: int, iters: int, eps: float,
                       rms_eps: float):
    """The mHC mixing matrices from a site's raw sums: m = s * rsqrt(q[:, :1] / nd +
    rms_eps), logits = m[:, 2N:] * scale[2] + base[2N:] as [M, N, N], then
    sinkhorn_softmax_reference."""
    m = s_MK.astype(jnp.float32) * jax.lax.rsqrt(q_MK[:, :1].astype(jnp.float32) / nd + rms_eps)
    logits = (m[:, 2 * N:] * scale[2] + base[2 * N:]).reshape(-1, N, N)
    return sinkhorn_softmax_reference(logits, iters, eps)
