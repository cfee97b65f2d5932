"""The mHC mixing matrix (row softmax, then 20 Sinkhorn rounds on a 4 x 4 matrix per token)
as ONE small Pallas kernel (Triton backend: a warp's lanes hold the entries, row and column
sums are shuffles).

Why a kernel: XLA-GPU either splits the loop into ~11 reduction kernels per mHC site, or,
written as 16 scalar arrays, fuses it into one kernel in which a single thread evaluates
the whole 20-round division chain: 50-100 us per site on the H100 (profile of a Flash step). Here each round is a few shuffles and one division
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


def _sinkhorn(x, iters, eps):
    x = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    c = x / jnp.sum(x, axis=-1, keepdims=True) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, c)


def _proj_kernel(s_ref, q_ref, scale_ref, base_ref, o_ref, *, N, nd, iters, eps, rms_eps):
    R = o_ref.shape[0]
    s = s_ref[:, pl.ds(2 * N, N * N)]                             # [R, N*N] raw projections
    r = jax.lax.rsqrt(q_ref[:, pl.ds(0, 1)] / nd + rms_eps)       # [R, 1]
    x = (s * r) * scale_ref[pl.ds(2, 1)] + base_ref[pl.ds(2 * N, N * N)]
    o_ref[...] = _sinkhorn(x.reshape(R, N, N), iters, eps)


@functools.partial(jax.jit, static_argnames=("N", "nd", "iters", "eps", "rms_eps", "interpret"))
def mhc_comb(s_MK, q_MK, scale, base, *, N: int, nd: int, iters: int, eps: float,
             rms_eps: float, interpret: bool = False):
    """The mHC mixing matrices straight from the site's raw sums (layers.hc_sums), so that
    no XLA kernel sits between that reduction and this one:
        m = s * rsqrt(q[:, 0] / nd + rms_eps);  logits = m[:, 2N:] * scale[2] + base[2N:]
        C = sinkhorn_softmax_reference(logits as [M, N, N])   (the same ops)
    s_MK f32 [M, 2N + N*N] (flat . fn^T), q_MK f32 [M, >= 1] (column 0: sum of flat^2),
    scale f32 [3], base f32 [2N + N*N] -> C f32 [M, N, N] (reference.mhc_comb_reference)."""
    M, K = s_MK.shape
    if N & (N - 1) or K != 2 * N + N * N:
        raise ValueError(f"mhc_comb needs a power-of-two N and s [M, 2N + N^2]; got N={N}, "
                         f"s {s_MK.shape}")
    if q_MK.ndim != 2 or q_MK.shape[0] != M or scale.shape != (3,) or base.shape != (K,):
        raise ValueError(f"mhc_comb: q must be [{M}, >= 1], scale [3], base [{K}]; got "
                         f"{q_MK.shape}, {scale.shape}, {base.shape}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    R = min(8, pl.next_power_of_2(M))
    Mp = pl.cdiv(M, R) * R
    s, q = s_MK.astype(jnp.float32), q_MK.astype(jnp.float32)
    if Mp != M:   # padded rows (q = 0: finite) are sliced off below
        s = jnp.pad(s, ((0, Mp - M), (0, 0)))
        q = jnp.pad(q, ((0, Mp - M), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_proj_kernel, N=N, nd=nd, iters=iters, eps=eps, rms_eps=rms_eps),
        out_shape=jax.ShapeDtypeStruct((Mp, N, N), jnp.float32),
        grid=(Mp // R,),
        in_specs=[pl.BlockSpec((R, K), lambda i: (i, 0)),
                  pl.BlockSpec((R, q.shape[1]), lambda i: (i, 0)),
                  pl.BlockSpec((3,), lambda i: (0,)),
                  pl.BlockSpec((K,), lambda i: (0,))],
        out_specs=pl.BlockSpec((R, N, N), lambda i: (i, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
    )(s, q, scale.astype(jnp.float32), base.astype(jnp.float32))
    return out[:M]
