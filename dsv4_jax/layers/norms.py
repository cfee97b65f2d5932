"""RMSNorm, and the decode-sized norm that also makes the matmul kernels' FP8 input.

    y = rms_norm(x_D, w_D, eps, out_dtype)
    y, xq_RD = norm_act(x_D, w_D, cfg, nm)   # xq: [ceil(rows/8)*8, D] bf16, or None
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.norm_fp8 import rms_norm_fp8

from ..config import Config
from ..quant import Numerics

F32 = jnp.float32

# Decode-sized norms (at most this many token rows) feeding a weight-streaming matmul run
# as one kernel with the matmul input's FP8 simulation (pallas_kernels/norm_fp8): on an
# H100, 1.5 / 3.2 us of GPU time against XLA's 3.4 / 4.8 us in 3-4 kernels.
NORM_FP8_ROWS = 64


def rms_norm(x, w, eps, out_dtype):
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    if w is not None:
        y = y * w.astype(F32)
    return y.astype(out_dtype)


def norm_fp8_ok(shape, nm: Numerics) -> bool:
    """Whether activations of `shape` [..., D] take the norm_fp8 kernels: FP8-simulated bf16
    inputs of the matmul kernels, decode-sized."""
    return (nm.act_quant and nm.bf16_operands and nm.jdtype == jnp.bfloat16
            and nm.matmul in ("pallas", "interpret") and math.prod(shape[:-1]) <= NORM_FP8_ROWS
            and shape[-1] % 128 == 0 and (nm.on_gpu or nm.matmul == "interpret"))


def norm_act(x, w, cfg: Config, nm: Numerics):
    """rms_norm(x, w) [..., D] and, when the matmul kernels run with the FP8 activation
    simulation (decode sizes), also its simulation padded to kernel rows, xq bf16
    [ceil(rows/8)*8, D], for `linear(..., xq=xq)`: one Pallas kernel where XLA used three
    (sum of squares, amax, quantise + pad). Otherwise xq is None."""
    rows = math.prod(x.shape[:-1])
    if not norm_fp8_ok(x.shape, nm):
        return rms_norm(x, w, cfg.rms_norm_eps, nm.jdtype), None
    y, yq = rms_norm_fp8(x.reshape(rows, x.shape[-1]), w, eps=cfg.rms_norm_eps,
                         rows=-(-rows // 8) * 8, interpret=nm.matmul == "interpret")
    return y.reshape(x.shape), yq
