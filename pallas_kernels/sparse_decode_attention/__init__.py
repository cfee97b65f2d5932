"""Sparse decode attention (window ring + selected compressed entries + sink) for one new
token a request. Semantics and argument shapes: reference.py (the pure-JAX path).

backend="mosaic" (Hopper, sm_90a): a warp-specialised Pallas Mosaic-GPU kernel, one CTA per
(request, key split, 64-head tile): a producer warpgroup copies the selected FP8 / BF16
rows with cp.async (gather.py), two consumer warpgroups dequantise them into bf16 K tiles
in SMEM and run the wgmma (consumer.py). Two kernels share that frame: double_k.py (two K
tiles, both consumers score every block) and seesaw.py (each block scored once); which one
runs: use_seesaw. Key splits (flash-decoding) when there are too few CTAs to fill the
GPU: inputs.default_splits; their merge: merge.py.
On Blackwell (sm_100: no wgmma) backend="mosaic" runs blackwell.py instead: tcgen05 MMA
with the scores and the output accumulator in TMEM, block pairs of 128 keys a step.
backend="triton": the portable kernel for GPUs without wgmma (triton.py).

Files: layout.py (shapes, SMEM layouts, compiler settings), inputs.py (XLA side), gather.py,
consumer.py, double_k.py, seesaw.py, blackwell.py, merge.py, triton.py, reference.py.
"""
import dataclasses

from pallas_kernels.arch import is_blackwell
from pallas_kernels.sparse_decode_attention import blackwell, double_k, seesaw, triton
from pallas_kernels.sparse_decode_attention.inputs import default_splits, prepare_inputs
from pallas_kernels.interpret import gpu_interpret_params
from pallas_kernels.sparse_decode_attention.layout import BLOCK_TOKENS, HT
from pallas_kernels.sparse_decode_attention.merge import (MAX_SPLITS, MERGE_KERNEL_MIN_BATCH,
                                                          merge_splits, merge_splits_kernel)
from pallas_kernels.sparse_decode_attention.reference import (hca_indices,
                                                              sparse_decode_attention_reference)

__all__ = ["AttentionTuning", "sparse_decode_attention", "sparse_decode_attention_reference",
           "hca_indices", "prepare_inputs", "default_splits", "merge_splits",
           "merge_splits_kernel", "use_seesaw", "BACKENDS"]

BACKENDS = ("mosaic", "triton")

# The seesaw kernel for Pro's heads (two head tiles) and small batches; double_k for Flash
# at B > 8. GPU us, 128K, double_k -> seesaw (H200; the H100 alike): Flash CSA B = 1 / 4 / 8:
# 9.7 -> 9.1, 11.5 -> 11.0, 12.5 -> 12.1; Pro CSA B = 1 / 32: 11.5 -> 11.0, 42.9 -> 41.9;
# Pro HCA B = 32 38.9 both; but Flash CSA B = 64 29.2 -> 30.8 and Flash HCA B = 64 41.0 ->
# 42.8 (seesaw.py says why).
SEESAW_MAX_BATCH = 8


def use_seesaw(B, H):
    """The Mosaic kernel for B requests of H heads: the seesaw kernel for more than one head
    tile or B <= SEESAW_MAX_BATCH, else double_k. Both give the same output bit for bit."""
    return H > HT or B <= SEESAW_MAX_BATCH


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Static overrides of the shipped choices, for benchmarks and tests (None: the rule).
    splits: key splits a (request, head tile) (inputs.default_splits); seesaw: the seesaw
    kernel (True) or double_k (False) instead of use_seesaw (mosaic only); merge_kernel:
    the splits' merge by the Mosaic merge kernel (True; it refuses more than MAX_SPLITS) or
    XLA (False) instead of the rule (the kernel from MERGE_KERNEL_MIN_BATCH requests up to
    MAX_SPLITS; mosaic only)."""
    splits: int | None = None
    seesaw: bool | None = None
    merge_kernel: bool | None = None

    def __post_init__(self):
        if self.splits is not None and (int(self.splits) != self.splits or self.splits < 1):
            raise ValueError(f"splits must be a positive int or None, got {self.splits!r}")


def sparse_decode_attention(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H, *,
                            backend="mosaic", ids_prefix=False, hca_entries=None,
                            interpret=False, tuning=None):
    """-> out [B, H, 512] bf16. q_BHD [B, H, 512]; win = (nope [R, 128, 448] e4m3, scale
    [R, 128, 8] u8, rope [R, 128, 64] bf16, pos [R, 128] i32); cmp = (nope [NB, EPB, 448],
    scale [NB, EPB, 8], rope [NB, EPB, 64]); block_table [R, MAXB] i32; idx_BK [B, K] i32
    compressed entry ids (-1: none); t_B [B] i32; sink_H [H] f32 (reference.py).
    -1 entries anywhere are masked; key blocks after the last valid id are skipped, so
    lists with valid ids first (top-k output, HCA prefix) do the least work.
    ids_prefix: the caller promises that no valid id sits at a position >= min(K, (t+1) //
    ratio) (ratio = 128 / EPB), true of both top-k paths' output and of hca_indices; the
    Mosaic kernels then bound their key blocks from t in-kernel (one XLA fusion fewer).
    idx_BK=None with hca_entries=K: an HCA layer's ids, hca_indices(t, K, ratio); the Mosaic
    kernels derive them in-kernel from t (no id array).
    interpret: run in the interpreter (True, or a plgpu.InterpretGPUParams for mosaic):
    double_k as it ships but for the cp.async copies (ref copies) and the register /
    in-place wgmma operands (staged through SMEM), which the interpreter cannot run.
    tuning: AttentionTuning (static: pass it through functools.partial before jit)."""
    tuning = tuning or AttentionTuning()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    implicit = 0
    if idx_BK is None:
        if not hca_entries or hca_entries < 1:
            raise ValueError(f"idx_BK=None needs hca_entries >= 1 (the HCA id list's length), "
                             f"got {hca_entries!r}")
        if backend == "mosaic":
            implicit, ids_prefix = int(hca_entries), True
        else:
            idx_BK = hca_indices(t_B, int(hca_entries), BLOCK_TOKENS // cmp[0].shape[1])
    elif hca_entries is not None:
        raise ValueError("hca_entries is for idx_BK=None only")
    B, H = q_BHD.shape[:2]
    if backend == "triton":
        args, NS = triton.prepare(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H,
                                  splits=tuning.splits)
        o, lse = triton.attention(*args, NS=NS, interpret=bool(interpret))
        return (o[0] if NS == 1 else merge_splits(o, lse, args[-1]))[:, :H]
    params = gpu_interpret_params(interpret)
    args, NS = prepare_inputs(q_BHD, win, cmp, block_table, idx_BK, t_B, sink_H,
                              splits=tuning.splits, ids_prefix=ids_prefix, implicit=implicit)
    # Interpreted, the rule's seesaw gives way to double_k (the same output bit for bit on
    # the GPU): the GPU interpreter (jax 0.11.2) deadlocks on the seesaw kernel.
    kernel = (seesaw if (use_seesaw(B, H) and not interpret if tuning.seesaw is None
                         else tuning.seesaw) else double_k)
    if is_blackwell():   # sm_100 (interpreted too: the kernel this target runs)
        kernel = blackwell
    o, lse = kernel.attention(*args, NS=NS, epb=cmp[0].shape[1], used_from_t=ids_prefix,
                              implicit=implicit, interpret=params)
    sink = args[-1]
    merge_kernel = tuning.merge_kernel
    if merge_kernel is None:
        merge_kernel = B >= MERGE_KERNEL_MIN_BATCH and NS <= MAX_SPLITS
    if NS == 1:
        out = o[0]
    elif merge_kernel:
        out = merge_splits_kernel(o, lse, sink, interpret=params)
    else:
        out = merge_splits(o, lse, sink)
    return out[:, :H]
