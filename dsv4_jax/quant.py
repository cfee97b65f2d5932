"""The model's numerics: the one matmul entry point over the weight types of
pallas_kernels/formats.py (Fp8Weight, Fp4Weight, NvFp4Weight, WeightRows, plain arrays),
and the activation quantisation the checkpoints were trained for (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.formats import (E2M1_TABLE, QUANT_TYPES, Fp4Weight, Fp8Weight,  # noqa: F401
                                     NvFp4Weight, WeightRows, dequant, dequant_bf16,
                                     encode_fp4_np, encode_fp8_np, encode_nvfp4_np,
                                     fp4_block_sim, fp8_block_sim, is_quantized,
                                     pack_e2m1_np, unpack_e2m1)
from pallas_kernels.quant_matmul import grouped_matmul

MATMUL_IMPLS = ("xla", "pallas", "interpret")

# XLA options every program computing the model must compile with. By default XLA-GPU
# (xla_allow_excess_precision=True) deletes f32 -> f8 -> f32 and f32 -> bf16 -> f32 convert
# chains (its SimplifyFPConversions pass): the FP8 activation simulation and every bf16
# rounding point of the reference then silently vanish on the GPU, while the CPU keeps
# them: fp8_block_sim compiled for an H100 with the default has no f8 convert left and
# returns plain bf16 values. Notebooks that jit model code on a GPU pass these too:
# jax.jit(f, compiler_options=dsv4_jax.EXACT_COMPILER_OPTIONS).
EXACT_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


# ---------------------------------------------------------------------------------------
# Numerics switch
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Numerics:
    """How activations are computed. `act_quant`: simulate the FP8/FP4 activation, KV and
    indexer rounding the checkpoint was trained with. `dtype`: activation dtype between ops
    (bf16 like the reference; f32 for tight comparisons). `gpu`: trace the GPU-only
    kernels (the mHC comb matrix, the norm + FP8 simulation); None: when jax's default
    backend is a GPU; True lowers them from a CPU process (ahead-of-time for a GPU)."""
    act_quant: bool = True
    dtype: str = "bfloat16"
    matmul: str = "xla"  # quantised linears/experts: "xla" | "pallas" | "interpret"
    gpu: bool | None = None
    # The Pallas matmul's FP4 decode exact for every e8m0 scale byte (slower); by default it
    # is exact for scale bytes 59..192, which every trained weight meets (loading checks).
    exact_fp4: bool = False
    # The Sinkhorn iterations of the mHC mixing matrices (the XLA form; the GPU kernel
    # hc_sinkhorn loops itself) as a loop instead of unrolled. None: a loop except on a GPU
    # backend. On CPU the loop compiles a third faster and runs no slower (tiny preset, f32,
    # B = 1: step compile 6.3 -> 3.8 s, 27 -> 16 ms a step); on XLA-GPU a loop launches
    # kernels every iteration (unrolled: ~11 a site), but the unrolled gradient compiles
    # for many minutes (training: True).
    sinkhorn_loop: bool | None = None
    # Prefill (many rows): the routed experts of a chunk sorted into expert row tiles through
    # the grouped expert matmul (each expert's weights read once a tile, at tensor-core
    # rate) when `matmul` is a kernel; False: the loop over all experts with a combine mask
    # (the former path, kept for benchmarks/prefill_bench.py's comparison).
    grouped_prefill: bool = True
    # A request's chunk of at least this many rows attends through the sparse prefill
    # attention kernel when the cache kernels are on (CacheSpec.kernels): its window band and
    # its own top-k / compressed entries, no [T, all keys] mask; 0: never (the dense chunk
    # attention). Shorter chunks (and the kernels off) take the dense form. Off by default:
    # the kernel trapped (CUDA_ERROR_ILLEGAL_INSTRUCTION) on an H100, and its fix has not
    # run on a GPU yet (docs/KERNELS.md, "Prefill").
    sparse_prefill_rows: int = 0

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"Numerics.dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.matmul not in MATMUL_IMPLS:
            raise ValueError(f"Numerics.matmul must be one of {MATMUL_IMPLS}, got {self.matmul!r}")
        if self.sparse_prefill_rows < 0:
            raise ValueError(f"Numerics.sparse_prefill_rows must be >= 0, got "
                             f"{self.sparse_prefill_rows}")

    @property
    def jdtype(self):
        return jnp.dtype(self.dtype)

    @property
    def on_gpu(self) -> bool:
        """Whether to trace the GPU-only kernels (see `gpu`)."""
        return jax.default_backend() == "gpu" if self.gpu is None else self.gpu

    @property
    def sinkhorn_as_loop(self) -> bool:
        """Whether sinkhorn_reduce runs as a loop (see `sinkhorn_loop`)."""
        if self.sinkhorn_loop is None:
            return jax.default_backend() != "gpu"
        return self.sinkhorn_loop

    @property
    def bf16_operands(self) -> bool:
        """Quantised matmuls take bf16 operands (f32 accumulation): exact for the weights
        (power-of-two scales) and for FP8-simulated activations; bf16 activations
        otherwise, as in the reference. False only for f32 runs without simulation."""
        return self.act_quant or self.dtype == "bfloat16"


# Most token rows the weight-streaming kernel takes per call (they are its wgmma N side, and
# it pays only while weight bytes dominate); more rows (prefill) go to XLA.
KERNEL_MAX_ROWS = 128


def _kernel_ok(w, nm: Numerics) -> bool:
    """Whether the weight-streaming kernel takes this weight (its tiling: 128-row tiles,
    128-wide K steps for FP8, 512 for FP4); other shapes stay in XLA."""
    if nm.matmul == "xla" or not isinstance(w, (Fp8Weight, Fp4Weight)):
        return False
    kstep = 128 if isinstance(w, Fp8Weight) else 512
    return w.shape[-2] % 128 == 0 and w.shape[-1] % kstep == 0


@functools.partial(jax.jit, static_argnames=("impl", "rows", "exact_fp4"))
def _grouped_matmul_jit(x_GMK, expert_G, w, impl, rows, exact_fp4=False):
    """The kernel behind one jit: layers with equal shapes then share one lowered kernel
    in the step's module (43 Flash layers would otherwise lower ~500 copies). Only the
    first `rows` (real) rows of each group come back."""
    return grouped_matmul(x_GMK, expert_G, w, impl=impl, rows=rows, exact_fp4=exact_fp4)


def grouped_linear(x_GMK, expert_G, w, nm: Numerics):
    """y[g] = x[g] @ W[expert_G[g]].T -> f32 [G, M, out]; W stacked [E, out, in]; an
    expert index outside [0, E) gives zero rows; expert_G=None: group g uses expert g
    (no id array: an iota would be a kernel of its own every step). x must already be
    act-quant simulated.
    The Pallas weight-streaming kernel when `nm.matmul` asks for it (reads the stored
    bytes once), else gather + exact bf16 dequantisation + einsum in XLA. A `WeightRows`
    view of stacked weights (params.ROW_MERGES: experts' w1 + w3 as one [E, 2I, in]): the
    product with the whole stored weight, columns sliced, so the two views' calls are one
    call after XLA's CSE."""
    if isinstance(w, WeightRows):
        return grouped_linear(x_GMK, expert_G, w.w, nm)[..., w.start:w.stop]
    if _kernel_ok(w, nm) and nm.bf16_operands and x_GMK.shape[1] <= KERNEL_MAX_ROWS:
        M = x_GMK.shape[1]
        Mp = -(-M // 8) * 8
        xp = jnp.pad(x_GMK.astype(jnp.bfloat16), ((0, 0), (0, Mp - M), (0, 0)))
        ids = None if expert_G is None else expert_G.astype(jnp.int32)
        return _grouped_matmul_jit(xp, ids, w, impl=nm.matmul, rows=M,
                                   exact_fp4=nm.exact_fp4)
    E = w.shape[0]
    if expert_G is None:
        expert_G = jnp.arange(x_GMK.shape[0], dtype=jnp.int32)
    ok = (expert_G >= 0) & (expert_G < E)
    Wg = jax.tree.map(lambda a: a[jnp.clip(expert_G, 0, E - 1)], w)
    if nm.bf16_operands:
        W, post = dequant_bf16(Wg)
        y = jnp.einsum("gmi,goi->gmo", x_GMK.astype(jnp.bfloat16), W,
                       preferred_element_type=jnp.float32)
        y = y if post is None else y * post[:, None, None]
    else:
        y = jnp.einsum("gmi,goi->gmo", x_GMK.astype(jnp.float32), dequant(Wg, jnp.float32),
                       preferred_element_type=jnp.float32)
    return jnp.where(ok[:, None, None], y, 0.0)


def f32_dot_bf16(x, w_OI):
    """f32 x @ W.T for a bf16 weight [out, in], f32-exact, reading W once as stored (no f32
    copy in HBM): x is split exactly into three bf16 parts (hi + mid + lo carry all 24
    mantissa bits; a bf16 x is its own one part), multiplied as rows against W with f32
    accumulation, and summed.
    Other weight dtypes: a plain f32 matmul. A `WeightRows` view: the product with the whole
    stored weight, columns sliced (the same bits as the view's rows multiplied alone in the
    tests on CPU; on GPU XLA's dot merger already ran such dots as one)."""
    if isinstance(w_OI, WeightRows):
        return f32_dot_bf16(x, w_OI.w)[..., w_OI.start:w_OI.stop]
    if w_OI.dtype != jnp.bfloat16:
        return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w_OI.astype(jnp.float32),
                          precision="highest")
    if x.dtype == jnp.bfloat16:
        # one exact part (the other two would be zeros): one dot, no stacked operand (an
        # XLA kernel of its own at decode sizes)
        return jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32)
    r = x.astype(jnp.float32)
    parts = []
    for _ in range(3):
        p = r.astype(jnp.bfloat16)
        parts.append(p)
        r = r - p.astype(jnp.float32)
    x3 = jnp.stack(parts, axis=-2)  # [..., 3, in]
    y3 = jnp.einsum("...si,oi->...so", x3, w_OI, preferred_element_type=jnp.float32)
    return y3[..., 0, :] + y3[..., 1, :] + y3[..., 2, :]


def linear(x, w, nm: Numerics, *, out_dtype=None, xq=None):
    """y = x @ W.T for any weight format, f32 accumulation. Quantised weights get the FP8
    activation simulation (per token per 128 channels) when `nm.act_quant`; then operands
    are bf16 (exact, see `dequant_bf16`) unless running f32 without simulation; with
    `nm.matmul` = "pallas" the weight-streaming kernel reads FP8/FP4 weights as stored.
    xq: the caller's fp8_block_sim(x) as bf16 [rows padded to a multiple of 8, in]
    (layers.norm_act makes it in the norm's kernel): used as is, with no simulation or
    padding kernels of XLA's before the matmul."""
    out_dtype = out_dtype or nm.jdtype
    if isinstance(w, WeightRows) and is_quantized(w.w):  # a view: the whole weight, sliced
        return linear(x, w.w, nm, out_dtype=out_dtype, xq=xq)[..., w.start:w.stop]
    if not is_quantized(w):  # plain bf16 / f32 weights: f32-exact
        return f32_dot_bf16(x, w).astype(out_dtype)
    rows = math.prod(x.shape[:-1])
    if xq is not None and not (nm.act_quant and xq.shape == (-(-rows // 8) * 8, x.shape[-1])):
        raise ValueError(f"linear: xq must be the act-quant simulation of x [{rows} rows, "
                         f"{x.shape[-1]}] padded to a multiple of 8 rows, got {xq.shape} "
                         f"(act_quant={nm.act_quant})")
    stacked = (w.w if isinstance(w, Fp8Weight) else w.packed).ndim > 2
    if (xq is not None and _kernel_ok(w, nm) and nm.bf16_operands and not stacked
            and rows <= KERNEL_MAX_ROWS):
        wE = jax.tree.map(lambda a: a[None], w)
        y = grouped_linear(xq[None], jnp.zeros((1,), jnp.int32), wE, nm)[0, :rows]
        return y.reshape(*x.shape[:-1], -1).astype(out_dtype)
    if nm.act_quant:
        x = fp8_block_sim(x, 128) if xq is None else xq[:rows].reshape(x.shape).astype(x.dtype)
    if _kernel_ok(w, nm) and nm.bf16_operands and not stacked and rows <= KERNEL_MAX_ROWS:
        wE = jax.tree.map(lambda a: a[None], w)
        y = grouped_linear(x.reshape(1, -1, x.shape[-1]), jnp.zeros((1,), jnp.int32), wE, nm)
        return y[0].reshape(*x.shape[:-1], -1).astype(out_dtype)
    if nm.bf16_operands:
        W, post = dequant_bf16(w)
        y = jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), W,
                       preferred_element_type=jnp.float32)
        y = y if post is None else y * post
    else:
        y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dequant(w, jnp.float32),
                       preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


