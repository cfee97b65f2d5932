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
