"""Grouped quantised matmul for decode: weight-streaming Mosaic-GPU kernel + XLA reference.

    y_GMN = grouped_matmul(x_GMK, expert_G, w, impl="pallas" | "interpret" | "xla")
"""
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quant_matmul.kernel import check_inputs, default_splits, grouped_matmul_pallas
from pallas_kernels.quant_matmul.reference import grouped_matmul_reference


def grouped_matmul(x_GMK, expert_G, w, *, impl="pallas", **kernel_kw):
    """y[g, m, n] = sum_k x[g, m, k] * dequant(w)[expert_G[g], n, k], f32 [G, M, N].

    x_GMK bf16 [G, M, K] (M a multiple of 8, 8..256); expert_G int32 [G] (ids outside
    [0, E) mark empty groups: zero rows, weights not read); w Fp8Weight [E, N, K] or
    Fp4Weight. impl: "pallas" (Hopper kernel), "interpret" (the same kernel on the
    Mosaic-GPU interpreter, CPU), "xla" (dequantise + einsum). The kernel needs N % 128
    == 0 and K % 128 == 0 (FP8) / K % 512 == 0 (FP4); `kernel_kw` are tuning knobs
    (splits, stages, tn, tkp, reg_a, decode). Edges: with decode "cvt" (the FP8 default) an
    e8m0 scale byte 0 (2^-127) reads as 0 and FP4 scale bytes >= 241 overflow; the "swar"
    decodes ("swar-shfl" is the FP4 default) are exact for every scale byte 0..254 (e4m3
    NaN codes come out as finite numbers there), except that the default FP4 program
    ($DSV4_QMM_FP4_PTX "place") is exact for bytes 59..192 and reads bytes >= 193 (2^66)
    as inf ($DSV4_QMM_FP4_PTX=mad: every byte; `load` warns about such scales). Real
    checkpoints use none of these edges.
    expert_G=None: group g uses expert g (the kernel then reads no id array); rows=r: only
    the first r rows of each group come back, f32 [G, r, N] (every impl)."""
    if impl == "xla":
        if expert_G is None:
            expert_G = jnp.arange(x_GMK.shape[0], dtype=jnp.int32)
        check_inputs(x_GMK, expert_G, w, for_kernel=False)
        rows = kernel_kw.get("rows")
        return grouped_matmul_reference(x_GMK, expert_G, w)[:, :rows]
    if impl == "interpret":
        return grouped_matmul_pallas(x_GMK, expert_G, w, interpret=plgpu.InterpretGPUParams(),
                                     **kernel_kw)
    if impl == "pallas":
        return grouped_matmul_pallas(x_GMK, expert_G, w, **kernel_kw)
    raise ValueError(f"impl must be 'pallas', 'interpret' or 'xla', got {impl!r}")
