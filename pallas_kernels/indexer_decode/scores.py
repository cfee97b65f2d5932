"""Index scores from each key format's pool: input checks, the CTA split, the kernel call.

    scores_BW = score_keys(q_BHD, w_BH, keys, block_table, t_B, fmt=, interpret=, tuning=,
                           trim=)
q_BHD [B, 64, 128] (Hadamard'd, FP4-simulated: exact in bf16), w_BH [B, 64] f32 (already
scaled), keys: the pool's dict of fields (reference.py), block_table int32 [R >= B, MAXB]
(row b for request b, -1 unused), t_B int32 [B] -> f32 [B, MAXB * 32] (-inf where
i >= (t_b + 1) // 4); trim=False: the kernel's whole output [B, W >= MAXB * 32], -inf past
the table, without the slice (a copy kernel in XLA).
"""
import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.arch import is_blackwell
from pallas_kernels.indexer_decode import blackwell
from pallas_kernels.indexer_decode.dequant import CHUNK
from pallas_kernels.interpret import gpu_interpret_params
from pallas_kernels.indexer_decode.kernel import DIM, EPB, N_HEADS, scores_call

# Chunks of 64 entries a CTA (default_chunks_per_cta): 16 once the call has >= 8192 chunks
# in all at B >= 32, 32 from CPC32_MIN_CHUNKS (tables of >= 32 chunks). Fewer CTAs re-load q
# and the head weights less and the tail is short. H100, GPU time, scores bit-identical:
# 8 -> 16 chunks at B = 64, 32K: fp4 25.5 -> 24.2 us, nvfp4 27.8 -> 26.3, fp8 32.6 -> 28.6;
# 16 -> 32 at B = 64, 128K: fp4 86.8 -> 85.8, fp8 110.3 -> 107.6 (fp8 at 32K: slower). B = 32
# at 32K (4096 chunks) stays at 8 (fp4 13.7 against 14.5 with 16). The rule counts the
# table's capacity, not the requests' lengths, hence also B >= 32.
CPC16_MIN_CHUNKS = 8192
CPC16_MIN_BATCH = 32
CPC32_MIN_CHUNKS = {"fp4": 16384, "nvfp4": 16384, "fp8": 32768}


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The scoring kernel's split (static; None: the measured defaults).
    chunks_per_cta: chunks of 64 entries a CTA (default_chunks_per_cta).
    chunks_per_step: chunks a loop iteration, dividing chunks_per_cta
      (default_chunks_per_step)."""
    chunks_per_cta: int | None = None
    chunks_per_step: int | None = None


def default_chunks_per_cta(B, n_chunks, num_sms=132, fmt="fp4"):
    """Chunks of 64 entries per CTA: enough CTAs to fill the chip twice, at most 8;
    from CPC16_MIN_BATCH requests and CPC16_MIN_CHUNKS chunks in all, 16, and 32 from
    CPC32_MIN_CHUNKS[fmt] (tables of >= 32 chunks)."""
    if (B >= CPC16_MIN_BATCH and n_chunks >= 16
            and B * n_chunks >= CPC16_MIN_CHUNKS):
        return 32 if n_chunks >= 32 and B * n_chunks >= CPC32_MIN_CHUNKS[fmt] else 16
    return max(1, min(8, (B * n_chunks) // (2 * num_sms)))


def default_chunks_per_step(fmt, cpc):
    """Chunks a loop iteration: 2 (the iteration's barrier, TMA issue, wait and block-table
    prefetch paid once for both: fp4 B = 64 at 128K 90.8 -> 87.6 us, H100), except for odd
    CTA spans and for fp8 keys at >= 16 chunks a CTA (their ring slots are twice as large:
    110.5 -> 116.6 us)."""
    if cpc % 2 or (fmt == "fp8" and cpc >= 16):
        return 1
    return 2




def _check_common(q, w, block_table, t):
    """The checks every key format shares: q, the head weights, block table, positions."""
    B = q.shape[0]
    if q.shape[1:] != (N_HEADS, DIM):
        raise ValueError(f"indexer q must be [B, {N_HEADS}, {DIM}], got {q.shape}")
    if w.shape != (B, N_HEADS):
        raise ValueError(f"indexer weights must be [B, {N_HEADS}] = {(B, N_HEADS)}, got {w.shape}")
    if block_table.ndim != 2 or block_table.shape[0] < B:
        raise ValueError(f"block_table must be [R >= B, MAXB], got {block_table.shape} for B={B}")
    if t.shape != (B,):
        raise ValueError(f"positions t must be [B]={B}, got {t.shape}")


def _check_codes(codes):
    if codes.dtype != jnp.uint8 or codes.shape[1:] != (EPB, 64):
        raise ValueError(f"idx_codes must be uint8 [NB, {EPB}, 64], got {codes.dtype} {codes.shape}")


def _grid(B, block_table, t_B, tuning, fmt):
    """The block table and positions as the kernel reads them and the CTA split. No XLA
    work: the kernel clamps columns past the table to its last one, redirects -1 (unused)
    blocks to block 0 (their entries are masked) and finds each request's eligible count
    from t itself. -> (bt, t, n_max, cpc, n_ctas, G)"""
    tuning = tuning or Tuning()
    bt = block_table.astype(jnp.int32)         # rows >= B are never read
    MAXB = bt.shape[1]
    n_max = MAXB * EPB
    n_chunks = -(-n_max // CHUNK)
    cpc = tuning.chunks_per_cta or default_chunks_per_cta(B, n_chunks, fmt=fmt)
    n_ctas = -(-n_chunks // cpc)
    G = tuning.chunks_per_step or default_chunks_per_step(fmt, cpc)
    return bt, t_B.astype(jnp.int32), n_max, cpc, n_ctas, G


def _scores(qh, w, codes, scales, bt, t, fmt, n_max, cpc, n_ctas, G, interpret, trim):
    if is_blackwell():   # sm_100: the tcgen05 kernel (blackwell.py), whole 2-chunk steps
        cpc = blackwell.blackwell_chunks_per_cta(cpc)
        out = blackwell.scores_call(qh, w, codes, scales, bt, t, fmt=fmt, cpc=cpc,
                                    n_ctas=-(-(-(-n_max // CHUNK)) // cpc),
                                    interpret=gpu_interpret_params(interpret))
        return out[:, :n_max] if trim else out
    out = scores_call(qh, w, codes, scales, bt, t, fmt=fmt, cpc=cpc, n_ctas=n_ctas, G=G,
                      interpret=gpu_interpret_params(interpret))
    return out[:, :n_max] if trim else out


def indexer_scores(q_BHD, w_BH, idx_codes, idx_scale, block_table, t_B, *, interpret=False,
                   tuning=None, trim=True):
    """Scores from an `fp4` key pool: idx_codes uint8 [NB, 32, 64] (split-half e2m1),
    idx_scale uint8 [NB, 32, 4] (e8m0 per 32 dims, viewed as one u32 an entry). Exact keys
    for scale bytes 59..192 (dequant.PLACE_LOG2)."""
    _check_common(q_BHD, w_BH, block_table, t_B)
    _check_codes(idx_codes)
    if idx_scale.dtype != jnp.uint8 or idx_scale.shape != idx_codes.shape[:2] + (4,):
        raise ValueError(f"fp4 idx_scale must be uint8 [NB, {EPB}, 4], got {idx_scale.dtype} "
                         f"{idx_scale.shape}")
    bt, t, n_max, cpc, n_ctas, G = _grid(q_BHD.shape[0], block_table, t_B, tuning, "fp4")
    scale_u32 = lax.bitcast_convert_type(idx_scale, jnp.uint32)        # [NB, 32]
    return _scores(q_BHD.astype(jnp.bfloat16), w_BH.astype(jnp.float32), idx_codes,
                   (scale_u32,), bt, t, "fp4", n_max, cpc, n_ctas, G, interpret, trim)


def indexer_scores_nvfp4(q_BHD, w_BH, idx_codes, idx_scale_lo, idx_scale_hi, block_table, t_B,
                         *, interpret=False, tuning=None, trim=True):
    """Scores from an `nvfp4` key pool: idx_codes uint8 [NB, 32, 64] (split-half e2m1),
    idx_scale_lo / idx_scale_hi e4m3 [NB, 32, 4] (per 16 dims of dims 0..63 / 64..127).
    Keys exact in bf16 (e2m1 * e4m3 has at most 6 significant bits)."""
    _check_common(q_BHD, w_BH, block_table, t_B)
    _check_codes(idx_codes)
    for nm, a in (("idx_scale_lo", idx_scale_lo), ("idx_scale_hi", idx_scale_hi)):
        if a.dtype != jnp.float8_e4m3fn or a.shape != idx_codes.shape[:2] + (4,):
            raise ValueError(f"nvfp4 {nm} must be float8_e4m3fn [NB, {EPB}, 4], got {a.dtype} "
                             f"{a.shape}")
    bt, t, n_max, cpc, n_ctas, G = _grid(q_BHD.shape[0], block_table, t_B, tuning, "nvfp4")
    words = tuple(lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.uint8), jnp.uint32)
                  for a in (idx_scale_lo, idx_scale_hi))                  # [NB, 32] each
    return _scores(q_BHD.astype(jnp.bfloat16), w_BH.astype(jnp.float32), idx_codes, words,
                   bt, t, "nvfp4", n_max, cpc, n_ctas, G, interpret, trim)


def indexer_scores_fp8(q_BHD, w_BH, idx_keys, idx_scale, block_table, t_B, *, interpret=False,
                       tuning=None, trim=True):
    """Scores from an `fp8` key pool: idx_keys e4m3 [NB, 32, 128], idx_scale f32
    [NB, 32, 1] (key = e4m3 * scale)."""
    _check_common(q_BHD, w_BH, block_table, t_B)
    if idx_keys.dtype != jnp.float8_e4m3fn or idx_keys.shape[1:] != (EPB, DIM):
        raise ValueError(f"fp8 idx_keys must be float8_e4m3fn [NB, 32, 128], got "
                         f"{idx_keys.dtype} {idx_keys.shape}")
    if idx_scale.shape != idx_keys.shape[:2] + (1,):
        raise ValueError(f"fp8 idx_scale must be [NB, 32, 1], got {idx_scale.shape}")
    bt, t, n_max, cpc, n_ctas, G = _grid(q_BHD.shape[0], block_table, t_B, tuning, "fp8")
    return _scores(q_BHD.astype(jnp.bfloat16), w_BH.astype(jnp.float32), idx_keys,
                   (idx_scale[..., 0].astype(jnp.float32),), bt, t, "fp8", n_max, cpc, n_ctas,
                   G, interpret, trim)


def score_keys(q_BHD, w_BH, keys, block_table, t_B, *, fmt="fp4", interpret=False,
               tuning=None, trim=True):
    """Kernel scores from a pool given as its dict of fields, any of the three key formats."""
    kw = dict(interpret=interpret, tuning=tuning, trim=trim)
    if fmt == "fp4":
        return indexer_scores(q_BHD, w_BH, keys["idx_codes"], keys["idx_scale"], block_table,
                              t_B, **kw)
    if fmt == "nvfp4":
        return indexer_scores_nvfp4(q_BHD, w_BH, keys["idx_codes"], keys["idx_scale_lo"],
                                    keys["idx_scale_hi"], block_table, t_B, **kw)
    if fmt == "fp8":
        return indexer_scores_fp8(q_BHD, w_BH, keys["idx_keys"], keys["idx_scale"], block_table,
                                  t_B, **kw)
    raise ValueError(f"unknown indexer key format {fmt!r}; expected fp4, nvfp4 or fp8")
