"""mHC: manifold-constrained hyper-connections. The residual is N streams X [..., N, D];
each site mixes them into its sublayer's input and its output back into the streams.

    s_n, q = hc_sums(X_ND, fn)                     # raw sums of a site, f32
    pre_N, post_N, comb_NN = hc_weights(X_ND, fn, scale, base, cfg[, nm])
    pre, post, comb, x_D, xq = hc_site(X_ND, fn, scale, base, norm_w, cfg, nm)
    x_D = hc_collapse(X_ND, pre_N, dtype);  X_ND = hc_expand(f_D, X_ND, post_N, comb_NN, dtype)
    y_D = hc_head(X_ND, fn, scale, base, cfg, dtype)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import hc_sinkhorn
from pallas_kernels.norm_fp8 import hc_norm_fp8

from ..config import Config
from ..quant import Numerics
from .norms import norm_act, norm_fp8_ok

F32 = jnp.float32

# mHC sums of at most this many token rows (decode) take one variadic reduction; larger
# inputs (prefill) the einsum + a sum, whose operands XLA never broadcasts. (At 64 rows on
# an H200 the einsum + sum took 86 us a decode step against the reduction's 110, with 16
# more kernels: within the step's noise.)
HC_FUSED_ROWS = 64


def hc_sums(X, fn):
    """X [..., N, D], fn [n, N*D] -> (s [..., n] = flat . fn^T, q [..., k] whose column 0
    is sum(flat^2)), f32, flat = X's N streams side by side: the raw sums an mHC site
    normalises (m = s * rsqrt(q[..., :1] / (N*D) + eps)). For decode-sized inputs both come
    out of ONE variadic reduction (q then repeats the sum n times): XLA-GPU makes it one
    kernel where the dot and the sum were two (one fewer per mHC site). Same products,
    summed in another order than the einsum."""
    flat = X.reshape(*X.shape[:-2], -1).astype(F32)
    fn = fn.astype(F32)
    if math.prod(flat.shape[:-1]) > HC_FUSED_ROWS:
        return (jnp.einsum("...i,oi->...o", flat, fn, precision="highest"),
                jnp.sum(flat * flat, -1, keepdims=True))
    prod = flat[..., None, :] * fn                                          # [..., n, ND]
    sq = jnp.broadcast_to((flat * flat)[..., None, :], prod.shape)
    # (a concatenated [fn; flat] operand was materialised by XLA instead: two kernels)
    return jax.lax.reduce((prod, sq), (np.float32(0), np.float32(0)),
                          lambda a, b: (a[0] + b[0], a[1] + b[1]), (prod.ndim - 1,))


def hc_project(X, fn, eps: float):
    """m [..., n] = (flat . fn^T) * rsqrt(mean(flat^2) + eps) (see hc_sums)."""
    s, q = hc_sums(X, fn)
    return s * jax.lax.rsqrt(q[..., :1] / (X.shape[-2] * X.shape[-1]) + eps)


def hc_weights(X, fn, scale, base, cfg: Config, nm: Numerics = Numerics()):
    """X [..., N, D] -> pre [..., N], post [..., N], comb [..., N, N] (all f32)."""
    return _hc_mix(X, *hc_sums(X, fn), scale, base, cfg, nm)


def hc_site(X, fn, scale, base, norm_w, cfg: Config, nm: Numerics):
    """An mHC site before its sublayer: X [..., N, D] -> (pre, post, comb (hc_weights),
    x = rms_norm(hc_collapse(X, pre), norm_w) [..., D], xq (norm_act: x's padded FP8
    simulation or None)). Where norm_act would run its kernel, the collapse runs in that
    kernel too (pallas_kernels/norm_fp8.hc_norm_fp8, from the site's raw sums): no XLA
    kernel for the collapse."""
    s, q = hc_sums(X, fn)
    pre, post, C = _hc_mix(X, s, q, scale, base, cfg, nm)
    if not norm_fp8_ok((*X.shape[:-2], X.shape[-1]), nm):
        x, xq = norm_act(hc_collapse(X, pre, nm.jdtype), norm_w, cfg, nm)
        return pre, post, C, x, xq
    N, D = X.shape[-2:]
    rows = math.prod(X.shape[:-2])
    y, yq = hc_norm_fp8(X.reshape(rows, N, D), s.reshape(rows, -1), q.reshape(rows, -1), scale,
                        base, norm_w, N=N, eps=cfg.rms_norm_eps, rms_eps=cfg.rms_norm_eps,
                        hc_eps=cfg.hc_eps, rows=-(-rows // 8) * 8,
                        interpret=nm.matmul == "interpret")
    return pre, post, C, y.reshape(*X.shape[:-2], D), yq


def _hc_mix(X, s, q, scale, base, cfg: Config, nm: Numerics):
    """hc_weights from the site's raw sums (hc_sums)."""
    N = cfg.hc_mult
    m = s * jax.lax.rsqrt(q[..., :1] / (N * X.shape[-1]) + cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(m[..., :N] * scale[0] + base[:N]) + cfg.hc_eps
    post = 2 * jax.nn.sigmoid(m[..., N:2 * N] * scale[1] + base[N:2 * N])
    if nm.on_gpu:
        # one small kernel from the raw sums (normalisation, logits, softmax, Sinkhorn)
        # instead of ~12 XLA kernels, and no XLA kernel for the logits before it
        C = hc_sinkhorn.mhc_comb(s.reshape(-1, s.shape[-1]), q.reshape(-1, q.shape[-1]),
                                 scale, base, N=N, nd=N * X.shape[-1],
                                 iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                                 rms_eps=cfg.rms_norm_eps)
        return pre, post, C.reshape(*m.shape[:-1], N, N)
    C = (m[..., 2 * N:] * scale[2] + base[2 * N:]).reshape(*m.shape[:-1], N, N)
    C = jax.nn.softmax(C, -1) + cfg.hc_eps
    return pre, post, sinkhorn_reduce(C, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                      loop=nm.sinkhorn_as_loop)


def sinkhorn_reduce(C, iters: int, eps: float, loop: bool = False):
    """Column normalisation, then (iters - 1) x (row, column) normalisations of C [..., N, N].
    (On GPU, hc_weights runs the logits, softmax and this loop as one kernel:
    pallas_kernels/hc_sinkhorn. XLA-GPU splits this form into ~11 kernels; written as N^2
    scalar arrays it fuses into one kernel whose single thread runs the whole division
    chain, 50-100 us per site.)"""
    C = C / (C.sum(-2, keepdims=True) + eps)

    def row_col(_, C):
        C = C / (C.sum(-1, keepdims=True) + eps)
        return C / (C.sum(-2, keepdims=True) + eps)

    if loop:  # the gradient of the unrolled form stalls XLA-GPU's fusion for minutes
        return jax.lax.fori_loop(0, iters - 1, row_col, C)
    for i in range(iters - 1):
        C = row_col(i, C)
    return C


# hc_collapse / hc_expand mix N = 4 streams: written as N explicit f32 multiply-adds (not
# einsums), so XLA fuses them into the neighbouring elementwise / norm kernels instead of
# launching a reduction and a GEMM kernel per mHC site (decode: 4 kernels per layer).
def hc_collapse(X, pre, dtype):
    """sum_i pre[i] X[i]: [..., N, D] -> [..., D]."""
    Xf = X.astype(F32)
    y = pre[..., 0, None] * Xf[..., 0, :]
    for i in range(1, X.shape[-2]):
        y = y + pre[..., i, None] * Xf[..., i, :]
    return y.astype(dtype)


def hc_expand(f, X, post, C, dtype):
    """X_new[j] = post[j] f + sum_i C[i, j] X[i]."""
    Xf = X.astype(F32)
    mix = C[..., 0, :, None] * Xf[..., 0, None, :]  # [..., N(j), D]
    for i in range(1, X.shape[-2]):
        mix = mix + C[..., i, :, None] * Xf[..., i, None, :]
    y = post[..., :, None] * f.astype(F32)[..., None, :] + mix
    return y.astype(dtype)


def hc_head(X, fn, scale, base, cfg: Config, dtype):
    m = hc_project(X, fn, cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(m * scale[0] + base) + cfg.hc_eps
    return hc_collapse(X, pre, dtype)
