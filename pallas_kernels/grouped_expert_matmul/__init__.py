"""Grouped expert matmul for many rows (prefill): Mosaic-GPU wgmma kernel over FP8 / FP4
expert weights dequantised per tile in registers and shared memory, + XLA reference.

    y_RN = grouped_expert_matmul(x_RK, tile_expert_S, w, impl=..., tuning=Tuning(tm=128))
    y_PN = ragged_expert_matmul(x_PK, group_sizes_E, w, impl=..., tuning=...)

Files: kernel.py (the kernel), schedule.py (row tiles from group sizes), reference.py (the
XLA paths: row tiles, and lax.ragged_dot over group sizes).
"""
import jax.numpy as jnp

from pallas_kernels.grouped_expert_matmul.kernel import (TM, TN, Tuning, check_inputs,
                                                         grouped_expert_matmul_pallas)
from pallas_kernels.grouped_expert_matmul.reference import ragged_reference, tiled_reference
from pallas_kernels.grouped_expert_matmul.schedule import (TileLayout, from_tiles, num_tiles,
                                                           tile_layout, to_tiles)
from pallas_kernels.interpret import gpu_interpret_params

IMPLS = ("pallas", "interpret", "xla")


def grouped_expert_matmul(x_RK, tile_expert_S, w, *, impl="pallas", exact_fp4=False,
                          tuning=None):
    """y[r, n] = sum_k x[r, k] * dequant(w)[tile_expert_S[r // tm], n, k], f32 [R, N].

    x_RK bf16 [S * tm, K] (tm = tuning.tm, 128 by default): row tile s uses expert
    tile_expert_S[s] (int [S]; an id outside [0, E) marks an empty tile: zero rows, no
    weights read). w Fp8Weight [E, N, K] (kernel: K % 256 == 0) or Fp4Weight (K % 512 ==
    0, K <= 8192); N % tuning.tn == 0. impl: "pallas" (Hopper kernel), "interpret" (the
    same kernel on the Mosaic GPU interpreter, CPU), "xla" (tiled_reference).
    exact_fp4: quant_matmul's FP4 decode "mad" (exact for every e8m0 byte); the default
    "place" is exact for scale bytes 59..192 (every trained weight). FP8 scale byte 0
    reads as 0."""
    tuning = tuning or Tuning()
    if impl == "xla":
        check_inputs(x_RK, tile_expert_S, w, tuning.tm, for_kernel=False)
        return tiled_reference(x_RK, tile_expert_S, w, tuning.tm)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return grouped_expert_matmul_pallas(x_RK, tile_expert_S, w, exact_fp4=exact_fp4,
                                        tuning=tuning,
                                        interpret=gpu_interpret_params(impl == "interpret"))


def ragged_expert_matmul(x_PK, group_sizes_E, w, *, impl="pallas", exact_fp4=False,
                         tuning=None):
    """Rows sorted by expert (group_sizes_E[e] rows for expert e, in order; rows past the
    sum belong to none and give 0) -> f32 [P, N]. The rows go to tiles of tm (schedule.py:
    a gather), through grouped_expert_matmul, and back (a gather). impl="xla" here is
    lax.ragged_dot on the dequantised experts (ragged_reference)."""
    if impl == "xla":
        return ragged_reference(x_PK, group_sizes_E, w)
    tuning = tuning or Tuning()
    lay = tile_layout(group_sizes_E, x_PK.shape[0], tuning.tm)
    y = grouped_expert_matmul(to_tiles(x_PK.astype(jnp.bfloat16), lay), lay.tile_expert_S,
                              w, impl=impl, exact_fp4=exact_fp4, tuning=tuning)
    return from_tiles(y, lay)


__all__ = ["IMPLS", "TM", "TN", "TileLayout", "Tuning", "from_tiles", "grouped_expert_matmul",
           "num_tiles", "ragged_expert_matmul", "ragged_reference", "tile_layout",
           "tiled_reference", "to_tiles"]
