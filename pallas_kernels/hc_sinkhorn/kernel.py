"""The mHC mixing matrix (row softmax, then 20 Sinkhorn rounds on a 4 x 4 matrix per token)
as ONE small Pallas kernel (Triton backend: a warp's lanes hold the entries, row and column
sums are shuffles).

Why a kernel: XLA-GPU either splits the loop into ~11 reduction kernels per mHC site, or,
written as 16 scalar arrays, fuses it into one kernel in which a single thread evaluates
the whole 20-round division chain: 50-100 us per site on the H100 (profile of a Flash step,
benchmarks/step_anatomy.py --profile). Here each round is a few shuffles and one division
per lane: one launch of a few microseconds.

Numerics: the same operations in the same order as the reference; exp and division may
round differently in the last bit (Triton's f32 exp / divide), so results agree to ~1e-6
relative, not bitwise.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _kernel(x_ref, o_ref, *, iters, eps):
    x = x_ref[...].astype(jnp.float32)  # [R, N, N]
    x = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    c = x / jnp.sum(x, axis=-1, keepdims=True) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    o_ref[...] = jax.lax.fori_loop(0, iters - 1, round_, c)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "interpret"))
def sinkhorn_softmax(logits_MNN, iters: int, eps: float, interpret: bool = False):
    """f32 [M, N, N] logits -> f32 [M, N, N] doubly-stochastic-ish mixing matrices
    (see reference.sinkhorn_softmax_reference). N must be a power of two (mHC: 4)."""
    M, N, N2 = logits_MNN.shape
    if N != N2 or N & (N - 1):
        raise ValueError(f"sinkhorn_softmax needs square power-of-two matrices, got {N}x{N2}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    R = min(8, pl.next_power_of_2(M))  # matrices per program (Triton blocks are powers of 2)
    Mp = pl.cdiv(M, R) * R
    x = logits_MNN.astype(jnp.float32)
    if Mp != M:  # zero logits are harmless (softmax of zeros), sliced off below
        x = jnp.pad(x, ((0, Mp - M), (0, 0), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, iters=iters, eps=eps),
        out_shape=jax.ShapeDtypeStruct((Mp, N, N), jnp.float32),
        grid=(Mp // R,),
        in_specs=[pl.BlockSpec((R, N, N), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((R, N, N), lambda i: (i, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
    )(x)
    return out[:M]
