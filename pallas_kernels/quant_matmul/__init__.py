"""Grouped quantised matmul for decode: weight-streaming Mosaic-GPU kernel + XLA reference.

    y_GMN = grouped_matmul(x_GMK, expert_G, w, impl="pallas" | "interpret" | "xla",
                           rows=None, exact_fp4=False, tuning=None)

Files: kernel.py (the Hopper kernel), blackwell.py (the Blackwell one: tcgen05, TMEM
accumulator; impl="pallas" takes it when Mosaic GPU targets sm_100), decode.py (the FP4
decode programs), tiling.py (tiles, K splits, pipeline depth, input checks), reference.py
(the XLA path).
"""
import jax.numpy as jnp

from pallas_kernels.arch import is_blackwell
from pallas_kernels.interpret import gpu_interpret_params
from pallas_kernels.quant_matmul.blackwell import grouped_matmul_blackwell
from pallas_kernels.quant_matmul.decode import PLACE_MAX_SCALE_BYTE, fp4_swar_form
from pallas_kernels.quant_matmul.kernel import grouped_matmul_pallas
from pallas_kernels.quant_matmul.reference import grouped_matmul_reference
from pallas_kernels.quant_matmul.tiling import Tuning, check_inputs, default_splits

IMPLS = ("pallas", "interpret", "xla")


def grouped_matmul(x_GMK, expert_G, w, *, impl="pallas", rows=None, exact_fp4=False,
                   tuning=None):
    """y[g, m, n] = sum_k x[g, m, k] * dequant(w)[expert_G[g], n, k], f32 [G, M, N].

    x_GMK bf16 [G, M, K] (M a multiple of 8, 8..256); expert_G int32 [G] (ids outside
    [0, E) mark empty groups: zero rows, weights not read), or None: group g uses expert g
    (the kernel then reads no id array); w Fp8Weight [E, N, K] or Fp4Weight. rows=r: only
    the first r rows of each group come back, f32 [G, r, N] (every impl).
    impl: "pallas" (the Hopper kernel; on sm_100 the Blackwell one), "interpret" (the
    Hopper kernel on the Mosaic-GPU interpreter, CPU), "xla" (dequantise + einsum). The kernel needs N % 128 == 0 and
    K % 128 == 0 (FP8) / K % 512 == 0 (FP4).
    exact_fp4: the FP4 decode exact for every e8m0 scale byte (decode.py "mad"); the
    default program ("place", faster) is exact for scale bytes 59..192
    (PLACE_MAX_SCALE_BYTE) and reads larger ones as inf; no trained weight has them.
    FP8: a scale byte 0 (2^-127) reads as 0. tuning: tiling.Tuning (static)."""
    if impl == "xla":
        if expert_G is None:
            expert_G = jnp.arange(x_GMK.shape[0], dtype=jnp.int32)
        check_inputs(x_GMK, expert_G, w, for_kernel=False)
        return grouped_matmul_reference(x_GMK, expert_G, w)[:, :rows]
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    interpret = gpu_interpret_params(impl == "interpret")
    if is_blackwell():   # sm_100 (interpreted too: the kernel this target runs)
        return grouped_matmul_blackwell(x_GMK, expert_G, w, rows=rows, exact_fp4=exact_fp4,
                                        tuning=tuning, interpret=interpret)
    return grouped_matmul_pallas(x_GMK, expert_G, w, rows=rows, exact_fp4=exact_fp4,
                                 tuning=tuning, interpret=interpret)


__all__ = ["IMPLS", "PLACE_MAX_SCALE_BYTE", "Tuning", "default_splits", "fp4_swar_form",
           "grouped_matmul", "grouped_matmul_blackwell", "grouped_matmul_reference"]
