"""The weight-streaming kernel's tiles, K splits and pipeline depth, and its input checks.

Defaults from H100 sweeps (benchmarks/quant_matmul.py): FP8 128 weight rows a CTA, 128 k a
step (one scale block); FP4 128 packed bytes a step (256 k, 8 scale blocks: the decode's
lane shuffle needs them) with 128 weight rows at M = 8 (G = 64 experts 163.5 -> 156.1 us)
and M = 64 (42.2 -> 39.2) but 64 at M = 16..32 (29.1 -> 27.6 at M = 32); 64 rows whenever
M > 128 (the f32 accumulator [tn, M] lives in registers). 2 weight tiles in flight (fewer,
smaller CTAs an SM measured faster); K split so that the grid fills 2 (FP8) / 3 (FP4)
CTAs an SM.
"""
import dataclasses

import jax.numpy as jnp

from pallas_kernels.formats import Fp4Weight, Fp8Weight

TN = 128          # FP8 weight rows (n) per CTA: the wgmma M side (64 when M > 128)
TK = 128          # k per FP8 pipeline step (one FP8 scale block)
TKP = 128         # packed bytes per FP4 pipeline step (2 k per byte; 8 scale blocks)
STAGES = 2        # weight tiles in flight per CTA
CTAS_PER_SM = {"fp8": 2, "fp4": 3}   # K-split target
NUM_SMS = 132     # H100 / H200 SXM
SMEM_BUDGET = 225 * 1024


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Static tuning of the kernel (None: the measured defaults). splits: K splits per
    output tile (default_splits); stages: the most weight tiles in flight (choose_stages
    may take fewer to fit shared memory); tn: 64 or 128 weight rows a CTA (fp4_rows)."""
    splits: int | None = None
    stages: int | None = None
    tn: int | None = None


def fp4_rows(M):
    """FP4 weight rows a CTA at M token rows."""
    return 64 if 8 < M <= 32 else 128


def check_inputs(x_GMK, expert_G, w, for_kernel=True):
    """Shape / dtype validation with errors that name the problem (`for_kernel`: also the
    kernel's tiling constraints)."""
    if not isinstance(w, (Fp8Weight, Fp4Weight)):
        raise TypeError(f"w must be an Fp8Weight or Fp4Weight (pallas_kernels.formats), got {type(w).__name__}")
    if x_GMK.ndim != 3:
        raise ValueError(f"x_GMK must be [G, M, K], got shape {x_GMK.shape}")
    if x_GMK.dtype != jnp.bfloat16:
        raise ValueError(f"x_GMK must be bfloat16, got {x_GMK.dtype}")
    G, M, K = x_GMK.shape
    if M % 8 or not 8 <= M <= 256:
        raise ValueError(f"M (rows per group) must be a multiple of 8 in [8, 256], got {M}")
    if expert_G.shape != (G,) or not jnp.issubdtype(expert_G.dtype, jnp.integer):
        raise ValueError(f"expert_G must be an integer array of shape ({G},), got "
                         f"{expert_G.dtype} {expert_G.shape}")
    if len(w.shape) != 3:
        raise ValueError(f"w must be stacked experts [E, N, K], got logical shape {w.shape}")
    E, N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"K mismatch: x has K={K}, w has K={Kw}")
    if for_kernel and (N % TN or K % TK):
        raise ValueError(f"N and K must be multiples of {TN} and {TK} for the kernel, "
                         f"got N={N}, K={K} (use impl='xla')")
    if isinstance(w, Fp8Weight):
        nb, kb = -(-N // 128), -(-K // 128)
        if w.w.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"Fp8Weight.w must be float8_e4m3fn, got {w.w.dtype}")
        if w.scale.shape != (E, nb, kb) or w.scale.dtype != jnp.float8_e8m0fnu:
            raise ValueError(f"Fp8Weight.scale must be float8_e8m0fnu {(E, nb, kb)}, "
                             f"got {w.scale.dtype} {w.scale.shape}")
    else:
        if w.packed.dtype not in (jnp.int8, jnp.uint8):
            raise ValueError(f"Fp4Weight.packed must be int8/uint8, got {w.packed.dtype}")
        if K % 32 or w.scale.shape != (E, N, K // 32) or w.scale.dtype != jnp.float8_e8m0fnu:
            raise ValueError(f"Fp4Weight.scale must be float8_e8m0fnu {(E, N, K // 32)}, "
                             f"got {w.scale.dtype} {w.scale.shape}")


def steps(fmt, K):
    """K pipeline steps of the whole K range."""
    return K // TK if fmt == "fp8" else K // (2 * TKP)


def valid_split(fmt, K, s):
    """FP4 CTAs load their scales [tn, nk * 8] with one TMA: a 16-byte multiple, at most
    256 wide."""
    KT = steps(fmt, K)
    if KT % s:
        return False
    nsc = KT // s * (TKP // 16)
    return fmt == "fp8" or (nsc % 16 == 0 and nsc <= 256)


def default_splits(fmt, G, N, K, tn=TN, num_sms=NUM_SMS):
    """K splits per (group, n tile): the most that keep the grid within CTAS_PER_SM."""
    ok = [s for s in range(1, steps(fmt, K) + 1) if valid_split(fmt, K, s)]
    if not ok:
        raise ValueError(f"no valid K split for {fmt} K={K}")
    fits = [s for s in ok if G * (N // tn) * s <= CTAS_PER_SM[fmt] * num_sms]
    return max(fits) if fits else min(ok)


def _smem_bytes(fmt, tn, M, stages, nk, reg_a):
    """Stream buffers of one CTA (the output tile reuses them after the stream)."""
    if fmt == "fp8":
        per_stage = tn * TK + M * TK * 2
        wb = tn * TK * 2                                  # dequantised bf16 tile
        fixed = 0
    else:
        per_stage = tn * TKP + M * TKP * 2 * 2
        wb = tn * TKP * 2 * 2
        fixed = tn * nk * (TKP // 16)                     # the CTA's scales
    return per_stage * stages + fixed + (0 if reg_a else wb)


def choose_stages(fmt, tn, M, nk, max_stages=STAGES, reg_a=True):
    """Pipeline depth: up to `max_stages` weight tiles in flight, within the SMEM budget
    (with `reg_a` the dequantised tile never goes to SMEM, so it is not counted)."""
    st = max(1, min(max_stages, nk))
    while st > 1 and _smem_bytes(fmt, tn, M, st, nk, reg_a) > SMEM_BUDGET:
        st -= 1
    if _smem_bytes(fmt, tn, M, st, nk, reg_a) > SMEM_BUDGET:
        raise ValueError(f"{fmt} tiles for M={M} do not fit in shared memory")
    return st
