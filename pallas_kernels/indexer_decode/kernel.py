"""Lightning-indexer scoring at decode as Pallas Mosaic-GPU kernels (Hopper, sm_90a).

Entry points: indexer_scores (fp4 pool), indexer_scores_nvfp4 and indexer_scores_fp8
(nvfp4 / fp8 pools; all three GPU-tested on an H200, 2026-11-26), score_keys (dict dispatch over
the three formats), topk_from_scores (XLA top-k), topk_keys / indexer_topk (scores + XLA
top-k, or select="kernel": the pallas_kernels.topk_select kernel, the decode step's default
since its H100 proof on 2026-11-25).

For each request b (one query token at position t_b):
    score[b, i] = sum_h w[b, h] * relu(qI[b, h] . K_i)     for i < (t_b + 1) // 4, else -inf
K_i is read straight from the `fp4` indexer key pool (split-half packed e2m1 nibbles + one
e8m0 exponent per 32 dims, see pallas_kernels/CACHE_LAYOUT.md) and dequantised in-kernel
(Hopper has no e2m1 casts: by default each nibble's bits are placed into a bf16 by prmt /
shift / mask, _e2m1_place; prmt lookup tables, _e2m1_lut, are the alternative). The top-k
is a separate kernel (pallas_kernels/topk_select) reading this kernel's untrimmed score
row, or XLA's lax.top_k.

Kernel shape pipeline, per CTA (request b, a range of `cpc` chunks of 64 entries):
    codes u8 [64 e, 64 bytes]   (2 pool blocks, TMA)    scale u32 [64 e] (4 e8m0 bytes)
    -> low / high nibbles: K_half bf16 [64 e, 64] (exact: e2m1 * 2^k)  in registers (kreg)
    -> S^T [64 e, 64 h] = sum_half K_half @ q_half^T               (2 wgmma, f32 acc)
    -> score [64 e] = sum_h relu(S^T) * w[h]                          (f32)
Split-half packing: byte j holds dim j (low nibble) and dim j + 64 (high nibble).
(An earlier variant viewed the codes as u32 words; XLA turns that width-changing bitcast
into a pass over the whole pool, and it measured 435 us vs 333 us at B=64 / 128K: removed.)
"""
import functools
import math
import os

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

N_HEADS = 64
DIM = 128
EPB = 32          # indexer entries per pool block (128 tokens / ratio 4)
CHUNK = 64        # entries per kernel step (two pool blocks): the wgmma M tile
RATIO = 4
DEQUANTS = ("bits", "e4m3", "fp8mma", "lut", "lutbf", "place")


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


def _check(q, w, codes, scale, block_table, t):
    _check_common(q, w, block_table, t)
    _check_codes(codes)
    if scale.dtype != jnp.uint8 or scale.shape != codes.shape[:2] + (4,):
        raise ValueError(f"fp4 idx_scale must be uint8 [NB, {EPB}, 4], got {scale.dtype} {scale.shape}")


# Every key format takes 16 chunks a CTA once the call has this many chunks in all (>= ~8
# CTAs an SM of 16 chunks): fewer CTAs re-load q and the head weights, and the tail is
# short. H100 (GPU time, 128K): fp4 B = 64 91.9 -> 89.7 us, B = 32 47.7 -> 45.8 (session
# 26 run3); nvfp4 B = 64 100.7 -> 99.7, B = 32 52.1 -> 51.1 (session 27 run4); fp8 B = 64
# 114.0 -> 110.4, B = 32 59.7 -> 56.5 (session 27 run5); scores bit-identical. B = 8
# (4096 chunks) went 13.3 -> 15.5 (fp4) and 15.0 -> 16.5 (nvfp4) with 16 and stays at 8.
# Like the rest of the rule this counts the table's capacity, not the requests' lengths,
# so it also asks B >= 32 (a B = 8 cache sized for 1M would pass the chunk count while its
# requests may be as short as the slower 128K case).
# Since session 30 the fp4 / nvfp4 keys take 32 there (>= 512 CTAs, about one wave at 4 an
# SM; half the q / head-weight loads again). H100, 128K unless said, GPU time, 16 -> 32
# chunks (session 30 run8 / run9, scores bit-identical): fp4 B = 64 86.8 / 87.3 -> 85.8 /
# 86.1 us, B = 32 44.8 / 44.9 -> 43.9 / 43.9, B = 64 at 64K 45.7 -> 45.2; nvfp4 B = 64 96.8 /
# 95.8 -> 96.2 / 96.3 (even), B = 32 49.4 / 49.1 -> 48.9 / 48.6, B = 64 at 64K 49.5 -> 48.8.
# 64 chunks (256 CTAs at B = 32) was slower (50.5 us).
# Since session 31: 16 chunks from 8192 chunks in all (was 16384), and fp8 keys take 32 from
# 32768. H100, GPU time, 8 -> 16 chunks (session 31 run4 / run5, scores bit-identical):
# B = 64 at 32K fp4 25.5 -> 24.2 us, nvfp4 27.8 -> 26.3, fp8 32.6 -> 28.6 (72% -> 82% of
# the ceiling); B = 32 at 64K fp4 25.3 -> 23.9, nvfp4 27.7 -> 26.0. B = 32 at 32K (4096
# chunks) stays at 8: fp4 13.7 against 14.5 with 16, nvfp4 14.8 against 15.8. fp8, B = 64
# at 128K, 16 -> 32: 110.3 -> 107.6 us (85.4% -> 87.6%); at 32K 32 was slower (33.3).
CPC16_MIN_CHUNKS = 8192
CPC16_MIN_BATCH = 32
CPC32_MIN_CHUNKS = {"fp4": 16384, "nvfp4": 16384, "fp8": 32768}


def default_chunks_per_cta(B, n_chunks, num_sms=132, fmt="fp4"):
    """Chunks of 64 entries per CTA: enough CTAs to fill the chip twice, at most 8 chunks;
    from CPC16_MIN_BATCH requests and CPC16_MIN_CHUNKS chunks in all, 16, and 32 from
    CPC32_MIN_CHUNKS[fmt] (tables of >= 32 chunks). Each measured."""
    if (B >= CPC16_MIN_BATCH and n_chunks >= 16
            and B * n_chunks >= CPC16_MIN_CHUNKS):
        return 32 if n_chunks >= 32 and B * n_chunks >= CPC32_MIN_CHUNKS[fmt] else 16
    return max(1, min(8, (B * n_chunks) // (2 * num_sms)))


# The kernels' software pipeline (see _indexer_call_blocks); None in a call means these.
# Chosen on an H200 on 2026-11-26 (benchmarks/indexer_probe.py, GPU time from profiler
# traces, B = 64 / 8 at 128K and B = 1 at 32K): kreg won in every format and case (fp4
# e4m3 at B = 64: 169 us against 176 with overlap and 180 without either; fp8: 109 against
# 134); deeper rings (3, 4) gained nothing once kreg was on.
STAGES = 2
OVERLAP = False
KREG = True
# "manual": Pallas' automatic warpgroup barriers (one before every TMA issue and two around
# every SMEM store: six a chunk) off, one barrier a chunk in their place, and the block-table
# entries for the next issue loaded an iteration ahead (register keys only; see
# _indexer_call_blocks). "auto": Pallas' barriers, block-table loads at the issue. Manual
# measured 118.9 vs 121.9 us (fp4, B = 64, 128K), 20.1 vs 20.9 (B = 8), 107.3 vs 109.2
# (fp8), bit-identical scores (H200, 2026-11-26, gpu_session22.sh PART=2). "warp": manual,
# and the loop's TMA issue (~60 SASS instructions, one lane issuing) runs in warp 0 only
# (plgpu.warp_map); the other three warps skip it: fp4 chunk loop 412 -> 393 instructions
# in warp 0 (one expect-tx arrival instead of 128) and 347 in warps 1-3 (sm_90a SASS).
BARRIERS = "warp"
# w_in_loop: the head weights re-read from SMEM every chunk (8 LDS) instead of held in 16
# registers: 109 -> 93 registers with "place" (compile-only sm_90a), 5 CTAs an SM instead
# of 4 (register-bound), 10 instructions more a chunk. Timed in session 26 (H100, fp4 /
# nvfp4 keys, 128K): B = 64 91.9 -> 90.5 / 100.3 -> 98.9 us, but B = 8 13.3 -> 13.8 /
# 14.7 -> 14.9: a wash, so off.
W_IN_LOOP = False
# chunks_per_step: 2 makes each loop iteration score two chunks from one ring slot of two,
# so its barrier, TMA issue (~50 instructions in warp 0), wait and block-table prefetch
# come once for both (sm_90a SASS: 357 instead of 381 loop instructions a chunk in warp 0).
# None in a call: default_chunks_per_step. Timed on the H100 (2026-11-27, session 28 run1,
# 128K, bit-identical scores): fp4 B = 64 / 32 / 8 90.8 -> 87.6 / 46.3 -> 45.5 / 13.9 ->
# 13.4 us; nvfp4 100.1 -> 97.0 / 51.0 -> 49.7 / 15.0 -> 14.6; fp8 at 16 chunks a CTA
# slower (110.5 -> 116.6 / 56.9 -> 63.1: its ring slots are twice as large, 128 B keys),
# at 8 faster (15.4 -> 14.6).
CHUNKS_PER_STEP = None
# The keys' k order in the wgmma (see WORDS_PERM): "natural" (k index j = code byte j) or
# "words" ("place" with kreg only, fp4 / nvfp4: each thread loads whole words of code
# bytes and q is permuted to match; elsewhere the natural order). Measured on the H100
# (session 33 run1, the scoring kernel alone, 128K): fp4 B = 64 86.3 -> 85.5 us, B = 32
# 43.9 even, B = 8 13.4 -> 13.2, B = 64 at 32K 24.7 -> 23.1; nvfp4 95.4 -> 93.3, 48.9 ->
# 48.2, 14.5 -> 14.2, 26.6 -> 25.5. q's permutation fuses into q's own XLA fusion in the
# decode step (the same kernel count); called alone it is a gather kernel of its own.
KEY_ORDER = "words"
KEY_ORDERS = ("natural", "words")


def default_chunks_per_step(fmt, cpc, manual=True):
    """Chunks a loop iteration: 2 where measured faster (fp4 / nvfp4 keys; fp8 keys below
    16 chunks a CTA), when the pipeline allows it (manual barriers, an even CTA span)."""
    if not manual or cpc % 2 or (fmt == "fp8" and cpc >= 16):
        return 1
    return 2
# The fp4 keys' dequant when a call names none: "place" (bits placed, no tables) measured
# 92.3 us against "lutbf" 100.4 at B = 64, 128K and 13.5 against 15.3 at B = 8; nvfp4
# keys 100.4 against 110.2 and 14.7 against 16.7; B = 1, 32K 2.5-2.6 both (H100,
# 2026-11-26, session 24 run4, bit-identical scores). Before: "lutbf" 119.8 us against
# "lut" 132.7, "e4m3" 168, "bits" 207 and "fp8mma" 212 (H200, B = 64, 128K).
DEQUANT = "place"
NVFP4_DEQUANT = "place"


def _ablated():
    """Stages the kreg kernel leaves out or shrinks, for timing only (wrong scores):
    DSV4_IDX_ABLATE = a "/"-separated list of halfmma (one K = 64 wgmma of the two halves'
    sum instead of two: the tensor work an int8 wgmma would take), nodeq (the code bits
    passed on as they are instead of "place"'s program). What each saves bounds that
    stage's share (benchmarks/indexer_probe.py with the variable set)."""
    return set(filter(None, os.environ.get("DSV4_IDX_ABLATE", "").split("/")))


# "chain" measured on the H100 (session 33 run2, words order, the scoring kernel alone):
# fp4 B = 64, 128K 86.1 -> 84.9 us, B = 32 44.7 -> 43.9, B = 8 13.4 -> 13.3, but B = 64 at
# 32K 23.6 -> 24.0; nvfp4 94.3 -> 92.6, 48.6 -> 47.7, 14.4 -> 14.2, 26.1 -> 26.3.
EPILOGUE = "chain"
EPILOGUES = ("chain", "tree")


def _epilogue_form():
    """How a chunk's scores are reduced over the heads: "chain" (EPILOGUE; one FFMA chain
    over the 8 column tiles, then a tile's 8 heads) or "tree" (Mosaic's reduce of the whole
    [64, 64]); $DSV4_IDX_EPILOGUE at trace time, for A/B runs. The sums' order differs:
    the same values to f32 rounding."""
    form = os.environ.get("DSV4_IDX_EPILOGUE", EPILOGUE)
    if form not in EPILOGUES:
        raise ValueError(f"$DSV4_IDX_EPILOGUE must be one of {EPILOGUES}, got {form!r}")
    return form


def _pipeline(stages, overlap, kreg=None, barriers=None, w_in_loop=None, chunks_per_step=None,
              key_order=None):
    key_order = key_order or os.environ.get("DSV4_IDX_KEY_ORDER", KEY_ORDER)
    if key_order not in KEY_ORDERS:
        raise ValueError(f"key_order ($DSV4_IDX_KEY_ORDER) must be one of {KEY_ORDERS}, got "
                         f"{key_order!r}")
    return dict(chunks_per_step=CHUNKS_PER_STEP if chunks_per_step is None else chunks_per_step,
                key_order=key_order,
                stages=STAGES if stages is None else stages,
                overlap=OVERLAP if overlap is None else overlap,
                kreg=KREG if kreg is None else kreg,
                barriers=BARRIERS if barriers is None else barriers,
                w_in_loop=W_IN_LOOP if w_in_loop is None else w_in_loop)


def _grid(B, block_table, t_B, chunks_per_cta, fmt):
    """The block table and positions as the kernel reads them, and the CTA split (chunks
    of 64 entries). No XLA work: the kernel clamps columns past the table to its last
    one, redirects -1 (unused) blocks to block 0 (their entries are masked) and finds
    each request's eligible count from t itself."""
    bt = block_table.astype(jnp.int32)         # rows >= B are never read
    MAXB = bt.shape[1]
    n_max = MAXB * EPB
    n_chunks = -(-n_max // CHUNK)
    cpc = chunks_per_cta or default_chunks_per_cta(B, n_chunks, fmt=fmt)
    n_ctas = -(-n_chunks // cpc)
    return bt, t_B.astype(jnp.int32), n_max, cpc, n_ctas


def indexer_scores_fp8(q_BHD, w_BH, idx_keys, idx_scale, block_table, t_B, *,
                       chunks_per_cta=None, interpret=None, trim=True, stages=None,
                       overlap=None, kreg=None, barriers=None, w_in_loop=None,
                       chunks_per_step=None, key_order=None):
    """Index scores as indexer_scores, from an `fp8` key pool: idx_keys e4m3 [NB, 32, 128],
    idx_scale f32 [NB, 32, 1] (key = e4m3 * scale). GPU-tested on an H200 (2026-11-26)."""
    B = q_BHD.shape[0]
    _check_common(q_BHD, w_BH, block_table, t_B)
    if idx_keys.dtype != jnp.float8_e4m3fn or idx_keys.shape[1:] != (EPB, DIM):
        raise ValueError(f"fp8 idx_keys must be float8_e4m3fn [NB, 32, 128], got {idx_keys.dtype} {idx_keys.shape}")
    if idx_scale.shape != idx_keys.shape[:2] + (1,):
        raise ValueError(f"fp8 idx_scale must be [NB, 32, 1], got {idx_scale.shape}")
    bt, t, n_max, cpc, n_ctas = _grid(B, block_table, t_B, chunks_per_cta, "fp8")
    out = _indexer_call_blocks(q_BHD.astype(jnp.bfloat16), w_BH.astype(jnp.float32), idx_keys,
                               (idx_scale[..., 0].astype(jnp.float32),), bt, t, fmt="fp8",
                               cpc=cpc, n_ctas=n_ctas, interpret=interpret,
                               **_pipeline(stages, overlap, kreg, barriers, w_in_loop,
                                           chunks_per_step, key_order))
    return out[:, :n_max] if trim else out


# prmt lookup tables indexed by the e2m1 magnitude code 0..7 (values 0, .5, 1, 1.5, 2, 3,
# 4, 6), eight bytes in two words (byte k of the first word = code k, of the second = code
# k + 4). e4m3: the e4m3 byte of each value, then the same with the sign bit. bf16: the low
# bytes of each value's bf16, then the high bytes (the sign is or-ed in after).
_E2M1_E4M3 = (0x3C383000, 0x4C484440, 0xBCB8B080, 0xCCC8C4C0)
_E2M1_BF16 = (0xC0800000, 0xC0804000, 0x3F3F3F00, 0x40404040)
# The bf16 program's table words that prmt needs in registers ($3, $4). The kernel reads
# them from SMEM once a chunk: given as immediates, ptxas re-made each one before every
# use (an IMAD from a uniform register: 34 a chunk).
_BF16_TABLE_REGS = (_E2M1_BF16[0], _E2M1_BF16[2])


def _lut_program(to):
    """The PTX of _e2m1_lut for one register: $2 = two code bytes (b0 | b1 << 8, i.e.
    nibbles lo0, hi0, lo1, hi1), $0 / $1 = the low / high nibbles' pair (e4m3: in the low
    two bytes; bf16: bf16x2). Plain text, so tests can run it on an emulated prmt."""
    prep = ["and.b32 idx, $2, 0x7777;",              # magnitude codes: table indices
            "and.b32 sgn, $2, 0x8888;",              # sign bits -> +4 on the selector:
            "shr.u32 sgn, sgn, 1;",                  #   byte k from the negative table
            "or.b32 sgn, sgn, 0x3210;"]
    if to == "e4m3":   # r: the four values' e4m3 bytes [lo0, hi0, lo1, hi1]; split by half
        t = _E2M1_E4M3
        body = [f"prmt.b32 pos, {t[0]}, {t[1]}, idx;",
                f"prmt.b32 neg, {t[2]}, {t[3]}, idx;",
                "prmt.b32 r, pos, neg, sgn;",
                "prmt.b32 $0, r, 0, 0x5520;",
                "prmt.b32 $1, r, 0, 0x5531;"]
    elif to == "bf16":   # low bytes and signed high bytes of the four values, by half
        # No negative table: byte k of sgn gets nibble k's sign bit at bit 7 (nibble 0's
        # bit 3 via b0 << 4, nibble 1's bit 7 from b0, and so on), or-ed into the high
        # bytes. Two table words (registers in the SASS) a register instead of three.
        t = _E2M1_BF16
        prep = ["and.b32 idx, $2, 0x7777;",
                "shl.b32 sgn, $2, 4;",
                "prmt.b32 sgn, sgn, $2, 0x5140;",
                "and.b32 sgn, sgn, 0x80808080;"]
        body = [f"prmt.b32 lb, $3, {t[1]}, idx;",       # $3, $4: t[0], t[2] as registers
                f"prmt.b32 pos, $4, {t[3]}, idx;",       # (_BF16_TABLE_REGS)
                "or.b32 r, pos, sgn;",
                "prmt.b32 $0, lb, r, 0x6240;",
                "prmt.b32 $1, lb, r, 0x7351;"]
    else:
        raise ValueError(f"to must be 'e4m3' or 'bf16', got {to!r}")
    return "{\n.reg .b32 idx, sgn, pos, neg, r, lb;\n" + "\n".join(prep + body) + "\n}"


# "place": each e2m1 nibble's bits put straight into a bf16 (no tables): magnitude bits
# s e1 e0 m -> bf16 bit 15 (s), exponent bits 8..7 (e1 e0) and mantissa bit 6 (m). That is
# the value * 2^-126 exactly, zero and the 0.5 code (a bf16 subnormal) included: both
# formats' subnormals are linear. The key scale's multiply takes 2^(126 - 64) back and
# the head weights the other 2^64 (_PLACE_LOG2). The H100's bf16 multiply keeps subnormal
# inputs: this path's GPU tests are bit-identical to "bits" on every code, and an e4m3
# placement tried in the attention kernel (session 24 run2b, since removed) was bit-exact
# on every code at scale exponents 1-254.
# Per register of two code bytes b0 | b1 << 8 (nibbles lo0 hi0 lo1 hi1): prmt puts each
# byte in a 16-bit lane with a sign-replicated copy above it (selector 0x9180), so the
# high nibble's sign lands on bit 13 and its magnitude on bits 4-6; << 2 and one mask make
# the bf16 pair. The low nibbles first shift up 4 to become the high ones. 7 instructions
# for 4 values, 4 of them ALU (prmt / and) where "lutbf" spends 9, 8 ALU (the pipe session
# 22's Nsight Compute found throttling).
_PLACE_PROGRAM = "\n".join([
    "{", ".reg .b32 t, a, b;",
    "shl.b32 t, $2, 4;",                 # low nibbles into the bytes' high halves
    "prmt.b32 a, t, 0, 0x9180;",         # [lo0 << 4, sign(lo0) x8, lo1 << 4 | hi0, sign(lo1) x8]
    "prmt.b32 b, $2, 0, 0x9180;",        # [b0, sign(hi0) x8, b1, sign(hi1) x8]
    "shl.b32 a, a, 2;",
    "and.b32 $0, a, 0x81C081C0;",        # bf16 pair of lo0, lo1: s e1 e0 m at bits 15, 8-6
    "shl.b32 b, b, 2;",
    "and.b32 $1, b, 0x81C081C0;",        # bf16 pair of hi0, hi1
    "}"])
# The keys are made k * 2^-64, so that their factor 2^(E - 65) = 2^(E - 127) * 2^126 / 2^64
# stays a bf16 normal for every scale in use: exact for e8m0 exponents E in [59, 192]
# (scales 2^-68 .. 2^65; E >= 193 reads as inf). The scores come * 2^-64 from the f32
# accumulator (a power of two: the same roundings) and the head weights take 2^64 back,
# once a CTA. (A first version scaled q in SMEM instead: 0.1-0.2 us more at B = 1.)
_PLACE_LOG2 = 64


def _e2m1_place(byte_WG):
    """u8 [64, n] code bytes (WGMMA layout) -> (lo, hi): bf16 [64, n] of the low / high
    nibbles' e2m1 values * 2^-126, exact (_PLACE_PROGRAM). Mosaic GPU only (inline PTX)."""
    return _nibble_pairs(byte_WG, _PLACE_PROGRAM, "bf16")


# Key order "words" (built in session 32, GPU-tested and the default since session 33;
# KEY_ORDER): the wgmma's k order is permuted
# within each 16-dim group, so that the code bytes a thread needs are whole 32-bit words of
# a row. In the WGMMA bf16 layout thread t holds k indices 16 c + 8 a + 2 t + e (c = the
# k16 step, a, e in {0, 1}); in WGMMA_LAYOUT_8BIT it holds the code bytes 16 c + 4 t + j.
# So k index w reads the byte (and dims) WORDS_PERM[w] = 16 c + 4 t + 2 a + e, and q's dims
# are permuted the same way in XLA (words_q): the same products, summed in another order.
# The scale blocks (32 dims: fp4, 16: nvfp4) are unions of 16-dim groups, so each k index
# keeps its block. Per chunk and thread: the words come by ldmatrix (2 LDSM.x4 instead of 16
# LDS.U16 of byte pairs), and the low nibbles are shifted once a word instead of a pair:
# sm_90a loop 831 -> 781 SASS instructions per two chunks (fp4; nvfp4 968 -> 918).
_w = np.arange(64)
WORDS_PERM = 16 * (_w // 16) + 4 * ((_w // 2) % 4) + 2 * ((_w // 8) % 2) + _w % 2
del _w


def words_q(q_BHD):
    """q [..., 128] -> q with each 64-dim half in the "words" k order (q[..., WORDS_PERM])."""
    perm = np.concatenate([WORDS_PERM, 64 + WORDS_PERM])
    return q_BHD[..., perm]


# One word of four code bytes b0..b3 (bytes j of WGMMA_LAYOUT_8BIT) -> four bf16 pairs: the
# low nibbles of (b0, b1) and (b2, b3), the high nibbles of the same ("place"'s program,
# with the bytes 2 and 3 taken by the selector 0xB3A2 and one shift of the low nibbles for
# the whole word).
_PLACE_WORDS_PROGRAM = "\n".join([
    "{", ".reg .b32 t, a;",
    "shl.b32 t, $4, 4;",
    "prmt.b32 a, t, 0, 0x9180;", "shl.b32 a, a, 2;", "and.b32 $0, a, 0x81C081C0;",
    "prmt.b32 a, t, 0, 0xB3A2;", "shl.b32 a, a, 2;", "and.b32 $1, a, 0x81C081C0;",
    "prmt.b32 a, $4, 0, 0x9180;", "shl.b32 a, a, 2;", "and.b32 $2, a, 0x81C081C0;",
    "prmt.b32 a, $4, 0, 0xB3A2;", "shl.b32 a, a, 2;", "and.b32 $3, a, 0x81C081C0;",
    "}"])


def _e2m1_place_words(codes_L8):
    """u8 [64, 64] code bytes (WGMMA_LAYOUT_8BIT) -> (lo, hi): bf16 [64, 64] (WGMMA layout)
    of the low / high nibbles' e2m1 values * 2^-126, k index w holding byte WORDS_PERM[w]
    (key order "words"). Mosaic GPU only (inline PTX)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu

    out = plgpu.ShapeDtypeStruct((CHUNK, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,), return_type=(out, out))
    def convert(ctx, x):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        regs = x.registers                   # [1, 4 k16 steps c, 1, 1, 2 row halves, 1...]
        assert regs.shape[1] == 4 and regs.shape[4] == 2 and regs.size == 8, regs.shape
        shape = mgpu.WGMMA_LAYOUT.registers_shape((CHUNK, 64))   # [1, 8 = 2 c + a, 1, 1, 2, ..]
        lo_regs, hi_regs = np.empty(shape, dtype=object), np.empty(shape, dtype=object)
        for idx, reg in np.ndenumerate(regs):
            c = idx[1]
            res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [mu.bitcast(reg, i32)],
                                  _PLACE_WORDS_PROGRAM, "=r,=r,=r,=r,r")
            for k in range(4):
                half, a = divmod(k, 2)
                v = mu.bitcast(llvm.extractvalue(i32, res, [k]),
                               ir.VectorType.get((2,), ir.BF16Type.get()))
                (hi_regs if half else lo_regs)[(idx[0], 2 * c + a) + idx[2:]] = v
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT,
                                          _is_signed=None) for r in (lo_regs, hi_regs))

    return convert(codes_L8)


def _e2m1_lut(byte_WG, to="e4m3", tables=None):
    """u8 [64, n] code bytes (WGMMA layout) -> (lo, hi): [64, n] arrays of the low / high
    nibbles' e2m1 values, exact, as e4m3 (to="e4m3") or bf16 (to="bf16"). Byte-parallel
    on the registers (Mosaic's int4 -> e4m3 conversion, with e2m1 tables): per register of
    two code bytes (four nibbles), five prmt and three or four integer ops give both
    halves' pairs (_lut_program). Mosaic GPU only (no interpreter). to="bf16" needs tables:
    a u32 [2] SMEM ref holding _BF16_TABLE_REGS."""
    if (to == "bf16") != (tables is not None):
        raise ValueError("the bf16 tables come from SMEM (tables=), the e4m3 ones need none")
    return _nibble_pairs(byte_WG, _lut_program(to), to, tables)


def _nibble_pairs(byte_WG, program, to, tables=None):
    """Runs `program` (PTX: $2 = two code bytes b0 | b1 << 8, then the table words if
    tables; $0 / $1 = the low / high nibbles' value pairs) on every register of u8 [64, n]
    code bytes (WGMMA layout) -> (lo, hi) [64, n] arrays of dtype `to` ("e4m3": the pair
    in the low two bytes; "bf16": a bf16x2 word). tables: a u32 SMEM ref whose words are
    passed as register operands."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu

    dtype = {"e4m3": jnp.float8_e4m3fn, "bf16": jnp.bfloat16}[to]
    out = plgpu.ShapeDtypeStruct(byte_WG.shape, dtype, layout=plgpu.Layout.WGMMA)
    arg_types = (plgpu.Layout.WGMMA,) + ((plgpu.RefType(),) if tables is not None else ())

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=(out, out))
    def convert(ctx, x, *tbl_ref):
        del ctx
        i8, i16, i32 = (ir.IntegerType.get_signless(n) for n in (8, 16, 32))
        lo_regs, hi_regs = np.empty_like(x.registers), np.empty_like(x.registers)
        tbl = [memref.load(tbl_ref[0], [mu.c(k, ir.IndexType.get())])
               for k in range(len(tbl_ref) * 2)]
        for idx, reg in np.ndenumerate(x.registers):
            w = arith.extui(i32, mu.bitcast(reg, i16))        # bytes b0 | b1 << 8
            res = llvm.inline_asm(
                llvm.StructType.get_literal([i32, i32]), [w] + tbl,
                program,
                "=r,=r,r" + ",r" * len(tbl))
            for k, regs in enumerate((lo_regs, hi_regs)):
                v = llvm.extractvalue(i32, res, [k])
                if to == "e4m3":
                    v = mu.bitcast(arith.trunci(i16, v), ir.VectorType.get((2,), i8))
                    regs[idx] = mu.bitcast(v, ir.VectorType.get((2,), ir.Float8E4M3FNType.get()))
                else:
                    regs[idx] = mu.bitcast(v, ir.VectorType.get((2,), ir.BF16Type.get()))
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=x.layout, _is_signed=None)
                     for r in (lo_regs, hi_regs))

    return convert(byte_WG, *(() if tables is None else (tables,)))


def _e4m3_bits_to_f32(x_u32, scale=1.0):
    """e4m3 value of the low byte of each u32, times `scale` (f32, exact for power-of-two
    scales): the byte viewed as e4m3 and converted, by the hardware's e4m3 -> f16 on a GPU
    (the NaN byte stays NaN, as in the reference). It was ~12 integer ops a value
    building the f32 bits (nvfp4 chunk loop 602 -> 486 SASS instructions)."""
    e4 = lax.bitcast_convert_type((x_u32 & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
    v = e4.astype(jnp.float32)
    return v if scale == 1.0 else v * jnp.float32(scale)


def indexer_scores_nvfp4(q_BHD, w_BH, idx_codes, idx_scale_lo, idx_scale_hi, block_table, t_B,
                         *, chunks_per_cta=None, interpret=None, trim=True, stages=None,
                         overlap=None, kreg=None, dequant=None, barriers=None,
                         w_in_loop=None, chunks_per_step=None, key_order=None):
    """Index scores as indexer_scores, from an `nvfp4` key pool: idx_codes uint8 [NB, 32, 64]
    (split-half e2m1), idx_scale_lo / idx_scale_hi e4m3 [NB, 32, 4] (per 16 dims of dims
    0..63 / 64..127). Keys dequantised exactly to bf16 (e2m1 * e4m3 has at most 6
    significant bits). GPU-tested on an H200 (2026-11-26). dequant: "place" (the code bits
    placed into bf16, as indexer_scores), "lutbf" / "lut" (the prmt tables, to bf16 /
    e4m3) or "e4m3" (the nibble re-packed); None: NVFP4_DEQUANT ("place")."""
    dequant = NVFP4_DEQUANT if dequant is None else dequant
    if dequant not in ("lut", "lutbf", "place", "e4m3"):
        raise ValueError(f"nvfp4 keys take dequant 'lut', 'lutbf', 'place' or 'e4m3', got "
                         f"{dequant!r}")
    B = q_BHD.shape[0]
    _check_common(q_BHD, w_BH, block_table, t_B)
    _check_codes(idx_codes)
    for nm, a in (("idx_scale_lo", idx_scale_lo), ("idx_scale_hi", idx_scale_hi)):
        if a.dtype != jnp.float8_e4m3fn or a.shape != idx_codes.shape[:2] + (4,):
            raise ValueError(f"nvfp4 {nm} must be float8_e4m3fn [NB, {EPB}, 4], got {a.dtype} {a.shape}")
    bt, t, n_max, cpc, n_ctas = _grid(B, block_table, t_B, chunks_per_cta, "nvfp4")
    words = tuple(lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.uint8), jnp.uint32)
                  for a in (idx_scale_lo, idx_scale_hi))                  # [NB, 32] each
    out = _indexer_call_blocks(q_BHD.astype(jnp.bfloat16), w_BH.astype(jnp.float32),
                               idx_codes, words, bt, t,
                               fmt="nvfp4", cpc=cpc, n_ctas=n_ctas, interpret=interpret,
                               dequant=dequant,
                               **_pipeline(stages, overlap, kreg, barriers, w_in_loop,
                                           chunks_per_step, key_order))
    return out[:, :n_max] if trim else out


def q_fp8_groups(q_BHD):
    """FP4-simulated q [B, 64, 128] -> (e4m3 [B, 4, 64, 32], f32 scales [B, 4, 64] * 2^6) for
    the "fp8mma" path: per 32-dim group, q / qs with qs = 2^(floor(log2 amax) - 2), exact
    in e4m3 (e2m1 codes times 2^0..2^3, at most 6). The 2^6 undoes the keys' e4m3 packing
    (e2m1 * 2^-6). Only for FP4-simulated q (Numerics.act_quant): other values would round.
    """
    B = q_BHD.shape[0]
    qg = q_BHD.astype(jnp.float32).reshape(B, N_HEADS, 4, 32)
    amax = jnp.max(jnp.abs(qg), axis=-1)                                     # [B, 64, 4]
    _, e = jnp.frexp(amax)                                      # amax = m 2^e, m in [.5, 1)
    qs = jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), e - 3), 1.0)
    q8 = (qg / qs[..., None]).astype(jnp.float8_e4m3fn)
    return q8.transpose(0, 2, 1, 3), (qs * 64.0).transpose(0, 2, 1)


def score_keys(q_BHD, w_BH, keys, block_table, t_B, fmt="fp4", dequant=None, **kw):
    """Kernel scores from a pool given as its dict of fields (as in reference.py), any of
    the three key formats. dequant: how e2m1 codes become values (indexer_scores; None:
    DEQUANT); nvfp4 takes "place", "lutbf", "lut" or "e4m3" (None: NVFP4_DEQUANT); fp8 has one path (None or
    "bits" stands for it)."""
    if fmt == "fp4":
        return indexer_scores(q_BHD, w_BH, keys["idx_codes"], keys["idx_scale"], block_table,
                              t_B, dequant=dequant, **kw)
    if fmt == "nvfp4":
        return indexer_scores_nvfp4(q_BHD, w_BH, keys["idx_codes"], keys["idx_scale_lo"],
                                    keys["idx_scale_hi"], block_table, t_B, dequant=dequant,
                                    **kw)
    if dequant not in (None, "bits"):
        raise ValueError(f"dequant={dequant!r} is for fp4 / nvfp4 keys; format {fmt!r} has "
                         "one path")
    if fmt == "fp8":
        return indexer_scores_fp8(q_BHD, w_BH, keys["idx_keys"], keys["idx_scale"], block_table,
                                  t_B, **kw)
    raise ValueError(f"unknown indexer key format {fmt!r}; expected fp4, nvfp4 or fp8")


def indexer_scores(q_BHD, w_BH, idx_codes, idx_scale, block_table, t_B, *,
                   chunks_per_cta=None, interpret=None, trim=True, dequant=None,
                   stages=None, overlap=None, kreg=None, barriers=None, w_in_loop=None,
                   chunks_per_step=None, key_order=None):
    """Index scores [B, MAXB*32] f32 (-inf where i >= (t_b+1)//4) from an `fp4` key pool.

    q_BHD [B, 64, 128] (Hadamard'd, FP4-simulated; rounded to bf16, exact for such values),
    w_BH [B, 64] f32 (already scaled), idx_codes uint8 [NB, 32, 64], idx_scale uint8
    [NB, 32, 4], block_table int32 [R >= B, MAXB] (row b used for request b), t_B int32 [B].
    The stored code bytes are read directly (TMA of uint8 blocks, nibbles split in
    registers); only the 4-byte scales are viewed as one u32 per entry. Ran on the H100 on
    2026-11-22: rel err 8.8e-8 vs the reference, identical top-k.
    trim=False: the kernel's whole output [B, W >= MAXB*32], scores in the first MAXB*32
    columns (past them -inf), without the slice (a copy kernel in XLA).
    dequant: "place" (each nibble's bits placed into a bf16 by prmt / shift / mask, value *
    2^-126, the factor 2^126 / 2^64 on the scale and 2^64 on the head weights; inline
    Mosaic GPU code; the default, DEQUANT; interpreted calls take "e4m3"), "lutbf" (e2m1 ->
    bf16 pairs by prmt lookup tables on whole registers), "lut" (the same
    tables to e4m3, then converted), "bits" (integer ops
    build the f32 bits), "e4m3" (the nibble re-packed as an e4m3 byte, converted by the
    hardware; same values) or "fp8mma"
    (the e4m3 bytes go to an e4m3 wgmma per 32-dim group against q as e4m3 (q_fp8_groups;
    q must be FP4-simulated), scales applied to the group sums). All three GPU-tested on
    an H200 (2026-11-26). stages / overlap / kreg: the software pipeline
    (_indexer_call_blocks; None: STAGES, OVERLAP, KREG). key_order: "natural" or "words"
    (KEY_ORDERS; None: $DSV4_IDX_KEY_ORDER, else KEY_ORDER).
    """
    _check(q_BHD, w_BH, idx_codes, idx_scale, block_table, t_B)
    dequant = DEQUANT if dequant is None else dequant
    if dequant not in DEQUANTS:
        raise ValueError(f"dequant must be one of {DEQUANTS}, got {dequant!r}")
    B = q_BHD.shape[0]
    bt, t, n_max, cpc, n_ctas = _grid(B, block_table, t_B, chunks_per_cta, "fp4")
    scale_u32 = lax.bitcast_convert_type(idx_scale, jnp.uint32)        # [NB, 32]
    q_scale = None
    if dequant == "fp8mma":
        qh, q_scale = q_fp8_groups(q_BHD)
    else:   # the kernel loads dims 0..63 and 64..127 (split-half packing) as two tiles
        qh = q_BHD.astype(jnp.bfloat16)
    out = _indexer_call_blocks(qh, w_BH.astype(jnp.float32), idx_codes, (scale_u32,), bt,
                               t, fmt="fp4", cpc=cpc, n_ctas=n_ctas, interpret=interpret,
                               dequant=dequant, q_scale=q_scale,
                               **_pipeline(stages, overlap, kreg, barriers, w_in_loop,
                                           chunks_per_step, key_order))
    return out[:, :n_max] if trim else out


def _indexer_call_blocks(qh, w, codes, scales, bt, t, *, fmt, cpc, n_ctas, interpret,
                         dequant="bits", q_scale=None, stages=2, overlap=False, kreg=False,
                         barriers="auto", w_in_loop=False, chunks_per_step=None,
                         key_order="natural"):
    """The scoring kernel, reading the stored key blocks: qh bf16 [B, 64 h, 128] (loaded as
    the two tiles of dims 0..63 and 64..127; "fp8mma": q_fp8_groups' [B, 4, 64 h, 32]),
    bt int32 [R >= B, MAXB] (the raw block table, -1 unused), t int32 [B]. fmt "fp4": codes
    uint8 [NB, 32, 64], scales (u32 [NB, 32],) (4 e8m0 bytes per entry). fmt "nvfp4":
    codes as fp4, scales (lo, hi) u32 [NB, 32] (4 e4m3 bytes per entry and half, dims 16q..
    of the half in byte q). fmt "fp8": codes e4m3 [NB, 32, 128], scales
    (f32 [NB, 32],) (applied to the scores: relu(q . k * s) = s * relu(q . k) for s >= 0).
    dequant (fp4 / nvfp4): "bits" builds each value's f32 bits with integer ops; "e4m3"
    re-packs the nibble as an e4m3 byte and lets the hardware convert it; "lut" looks the
    e4m3 bytes up with prmt (_e2m1_lut; same values); "lutbf" looks up bf16 pairs; "place"
    puts the code bits into bf16 (_e2m1_place: values * 2^-126; key factor 2^(E - 65),
    head weights * 2^64).
    stages: depth of the TMA ring of code blocks (chunks in flight + the one in use).
    overlap: the second half's dequant runs while the first half's wgmma is in flight (the
    tensor cores and the ALUs overlap within one warpgroup; no extra SMEM).
    kreg: the dequantised keys go to the wgmma from registers (no k_s in SMEM: 16 KB less a
    CTA, more CTAs an SM); overlap is then implied. Not for "fp8mma".
    barriers "manual" (kreg only; otherwise "auto"): Pallas inserts a warpgroup barrier
    before every TMA issue and around every SMEM store (four copies and one score store a
    chunk: six barriers). Its "unsafe_no_auto_barriers" turns them off; what they protected
    is kept by one barrier at the top of each iteration (every warp is done reading the ring
    slot the next issue overwrites, read an iteration ago), one after -inf fills o_s and one
    before o_s is stored. The issuing lane's block-table loads are made an iteration ahead
    (a loop carry), so no warp waits on them. "warp": as "manual", with the issue inside
    plgpu.warp_map, run by warp 0 only.
    w_in_loop: the head weights re-read from SMEM for every chunk's scores instead of held
    in registers a whole CTA (W_IN_LOOP).
    chunks_per_step (kreg with manual / warp barriers, cpc a multiple of it): chunks a loop
    iteration; a ring slot holds that many, so the iteration's barrier, TMA issue, wait and
    block-table prefetch are paid once for all of them (None: default_chunks_per_step)."""
    if dequant not in DEQUANTS:
        raise ValueError(f"dequant must be one of {DEQUANTS}, got {dequant!r}")
    if len(scales) != (2 if fmt == "nvfp4" else 1):
        raise ValueError(f"format {fmt!r}: got {len(scales)} scale arrays")
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    mma8 = fmt == "fp4" and dequant == "fp8mma"
    if dequant in ("lut", "lutbf", "place") and interpret is not None:
        dequant = "e4m3"   # inline Mosaic GPU code has no interpreter; the same key values
    # The GPU interpreter (jax 0.11.2) takes no register A operand in wgmma: interpreted
    # calls keep the keys in SMEM (the same keys() values; kreg itself is GPU-tested).
    kreg = kreg and not mma8 and interpret is None
    # "words" needs "place" with register keys (GPU only); elsewhere the natural order
    words = key_order == "words" and kreg and dequant == "place" and fmt in ("fp4", "nvfp4")
    if words:
        qh = words_q(qh)   # the wgmma's k index w reads key byte WORDS_PERM[w]
    if barriers not in ("auto", "manual", "warp"):
        raise ValueError(f"barriers must be 'auto', 'manual' or 'warp', got {barriers!r}")
    manual = barriers in ("manual", "warp") and kreg   # SMEM keys need the store barriers
    warp_issue = manual and barriers == "warp"
    G = (default_chunks_per_step(fmt, cpc, manual) if chunks_per_step is None
         else chunks_per_step)
    if G != 1 and not (manual and cpc % G == 0):
        raise ValueError(f"chunks_per_step={G} needs kreg, manual / warp barriers and a CTA "
                         f"span that is a multiple of it (got kreg={kreg}, barriers="
                         f"{barriers!r}, {cpc} chunks a CTA)")
    B = qh.shape[0]
    MAXB = bt.shape[1]
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    n_sc = len(scales)
    ablated = _ablated() if kreg else set()
    epilogue_form = _epilogue_form()
    span = cpc * CHUNK
    span_s = -(-span // 256) * 256   # the -inf fill's layout takes 256-float multiples

    def kernel(*refs, q_s, w_s, c_s, sc_s, o_s, qbar, bar, k_s=None, qs_s=None, tb_s=None):
        if mma8:
            q_g, qs_g, w_g, codes_g, *scale_gs, bt_g, t_g, o_g = refs
        else:
            q_g, w_g, codes_g, *scale_gs, bt_g, t_g, o_g = refs
        b = lax.axis_index("b")
        cta = lax.axis_index("c")
        ne = jnp.minimum(lax.div(jnp.maximum(t_g[b] + 1, 0), RATIO), MAXB * EPB)  # eligible
        first = cta * cpc
        n_load = jnp.clip(lax.div(ne - first * CHUNK + CHUNK - 1, CHUNK), 0, cpc)
        n_steps = lax.div(n_load + G - 1, G)   # loop iterations of G chunks

        def blocks(j):
            """The pool blocks of this CTA's chunk j. Columns past the table (the last CTA's
            padding; j one past the CTA's end) read its last column; -1 reads block 0.
            Either way the entries are past ne and masked."""
            col = 2 * (first + j)
            ids = (bt_g[b, jnp.minimum(col, MAXB - 1)], bt_g[b, jnp.minimum(col + 1, MAXB - 1)])
            return tuple(jnp.maximum(i, 0) for i in ids)

        def step_blocks(i):
            """The pool blocks of step i's G chunks (2 G ids)."""
            return sum((blocks(G * i + g) for g in range(G)), ())

        def issue(i, slot, blks=None):
            """Copies of step i's G chunks (2 G pool blocks) into ring slot `slot`."""
            blks = step_blocks(i) if blks is None else blks
            for k in range(2 * G):
                blk = blks[k]
                rows = pl.ds(k * EPB, EPB)
                plgpu.copy_gmem_to_smem(codes_g.at[blk], c_s.at[slot, rows], bar.at[slot])
                for i, scale_g in enumerate(scale_gs):
                    plgpu.copy_gmem_to_smem(scale_g.at[blk], sc_s.at[slot, i, rows],
                                            bar.at[slot])

        for j0 in range(stages - 1):
            @pl.when(j0 < n_steps)
            def _():
                issue(j0, j0)
        @pl.when(n_load > 0)
        def _():
            if mma8:
                plgpu.copy_gmem_to_smem(q_g.at[b], q_s, qbar)
            else:   # q_s[half] = q[b, :, half * 64 : half * 64 + 64]
                for half in range(2):
                    plgpu.copy_gmem_to_smem(q_g.at[b, :, pl.ds(half * 64, 64)], q_s.at[half],
                                            qbar)
            plgpu.copy_gmem_to_smem(w_g.at[b], w_s, qbar)
            if mma8:
                plgpu.copy_gmem_to_smem(qs_g.at[b], qs_s, qbar)

        o_s[...] = jnp.full((span_s,), -jnp.inf, jnp.float32)
        if tb_s is not None:   # (the barrier after the fill covers these stores too)
            for k, word in enumerate(_BF16_TABLE_REGS):
                tb_s[k] = jnp.uint32(word)
        if manual:
            _wg_barrier()   # the fill lands before any thread's scores

        @pl.when(n_load > 0)
        def _():
            plgpu.barrier_wait(qbar)
        # the head weights, loaded once (garbage if n_load == 0: then no chunk runs)
        # "place": the keys come * 2^-64, so do the scores. The 2^64 goes on the head
        # weights once a CTA (exact), or, with the weights re-read from SMEM every chunk
        # (w_in_loop), on each chunk's scores (the same roundings unless a head's term
        # relu(q . k) w is below 2^-62).
        if not w_in_loop:
            wv0 = plgpu.load(w_s, layout=COL)
            if dequant == "place":
                wv0 = wv0 * jnp.float32(2.0 ** _PLACE_LOG2)

        def epilogue(j, s):
            wv = plgpu.load(w_s, layout=COL) if w_in_loop else wv0
            wb = lax.broadcast_in_dim(wv, s.shape, [1])
            if epilogue_form == "chain":
                # relu(s) w summed over the 8 column tiles of 8 heads as one FFMA chain a
                # register, then over a tile's 8 heads: 48 FMUL / FFMA / FADD a thread a
                # chunk against 52 for Mosaic's 8-accumulator reduce (sm_90a SASS, fp4)
                acc = None
                for c in range(N_HEADS // 8):
                    cols = slice(8 * c, 8 * c + 8)
                    t = jnp.maximum(s[:, cols], 0.0) * wb[:, cols]
                    acc = t if acc is None else acc + t
                score = acc.sum(axis=1)
            else:
                score = (jnp.maximum(s, 0.0) * wb).sum(axis=1)
            if w_in_loop and dequant == "place":
                score = score * jnp.float32(2.0 ** _PLACE_LOG2)
            ids = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=ROW) + (first + j) * CHUNK
            o_s[pl.ds(j * CHUNK, CHUNK)] = jnp.where(ids < ne, score, -jnp.inf)

        def top(j, carry):
            """The iteration's sync, the next step's issue, the wait for step j's data."""
            slot = lax.rem(j, stages)
            ahead = j + stages - 1
            if manual:
                _wg_barrier()   # all warps are done with the slot the issue overwrites

            @pl.when(ahead < n_steps)
            def _():
                if warp_issue:
                    # Only warp 0 runs the issue's ~60 instructions (one lane issues
                    # either way): the other three warps branch past them.
                    @plgpu.warp_map
                    def _(warp):
                        @pl.when(warp == 0)
                        def _():
                            issue(ahead, lax.rem(ahead, stages), carry)
                else:
                    issue(ahead, lax.rem(ahead, stages), carry if manual else None)
            if manual:
                carry = step_blocks(ahead + 1)   # used by the next iteration's issue
            plgpu.barrier_wait(bar.at[slot])

            return slot, carry

        def unpack(slot, g=0):
            """Chunk g of ring slot `slot` -> (keys(half): bf16 [64 e, 64] keys of dims
            half*64.., sc: the [64] per-entry scale words)."""
            rows = pl.ds(g * CHUNK, CHUNK)
            sc = plgpu.load(sc_s.at[slot, 0, rows], layout=ROW)             # [64]
            if fmt != "fp8":
                # (the bit ops below on u16 instead of u32 measured the same: 169.0 vs
                # 168.8 us at B=64, 128K, H200; Mosaic has no shifts on 8-bit types)
                if not words:   # ("words" loads its own layout below)
                    byte8 = plgpu.load(c_s.at[slot, rows], layout=WG)           # [64 e, 64]
                    byte = byte8.astype(jnp.uint32)
                col = plgpu.broadcasted_iota(jnp.int32, (CHUNK, 64), 1, layout=WG)
                if dequant in ("lut", "lutbf"):   # both halves' e2m1 values, from the tables
                    e8_halves = (_e2m1_lut(byte8, "e4m3") if dequant == "lut" else
                                 _e2m1_lut(byte8, "bf16", tables=tb_s))
                elif dequant == "place" and words:   # whole words: bytes 16 c + 4 t + j
                    # of a row in thread t (no "nodeq" ablation for this order)
                    e8_halves = _e2m1_place_words(plgpu.load(
                        c_s.at[slot, rows], layout=plgpu.Layout.WGMMA_8BIT, optimized=False))
                elif dequant == "place":   # both halves' values * 2^-126, no tables
                    e8_halves = (_nibble_pairs(byte8, "{\nmov.b32 $0, $2;\nmov.b32 $1, $2;\n}",
                                               "bf16") if "nodeq" in ablated
                                 else _e2m1_place(byte8))

            def keys(half):
                """Keys of dims half*64.. of this chunk: bf16 [64 e, 64] (WGMMA layout)."""
                if fmt == "fp8":   # e4m3 -> bf16 is exact
                    x = plgpu.load(c_s.at[slot, rows, pl.ds(half * 64, 64)], layout=WG)
                    return x.astype(jnp.float32).astype(jnp.bfloat16)
                if fmt == "fp4" and dequant in ("lut", "lutbf", "place"):
                    # e2m1 values as e4m3 from the prmt tables; exact in f16 and bf16; the
                    # block scale 2^(E-127) in bf16 is exact. "place": values * 2^-126 and
                    # keys * 2^-64, so the factor is 2^(E - 65) (E >= 193: exponent 255, inf).
                    off = 126 - _PLACE_LOG2 if dequant == "place" else 0
                    ex = lambda i: (sc >> (16 * half + 8 * i)) & 0xFF
                    s0, s1 = ((lax.bitcast_convert_type(
                        (jnp.minimum(ex(i) + off, 255) if off else ex(i)) << 23, jnp.float32))
                        for i in range(2))
                    blk = jnp.where(col < 32, lax.broadcast_in_dim(s0, (CHUNK, 64), [0]),
                                    lax.broadcast_in_dim(s1, (CHUNK, 64), [0]))
                    v = e8_halves[half]
                    if dequant == "lut":
                        v = v.astype(jnp.float16).astype(jnp.bfloat16)
                    return v * blk.astype(jnp.bfloat16)
                if dequant in ("lut", "lutbf"):   # nvfp4: true e2m1 values (no 2^-6 to undo)
                    e8, unit = e8_halves[half], 1.0
                elif dequant == "place":   # values * 2^-126, keys * 2^-64: 2^62 back
                    e8, unit = e8_halves[half], 2.0 ** (126 - _PLACE_LOG2)
                elif fmt == "nvfp4" or dequant == "e4m3":
                    unit = 64.0
                    # The nibble s e1 e0 m placed as the e4m3 byte s 0 0 e1 e0 m 0 0 is the
                    # same value * 2^-6 (e = 0 codes land on e4m3's subnormals: exact). The
                    # hardware converts pairs to f16 (cvt.rn.f16x2.e4m3x2).
                    if half == 0:
                        code = ((byte & 8) << 4) | ((byte & 7) << 2)
                    else:
                        code = (byte & 0x80) | ((byte & 0x70) >> 2)
                    e8 = lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn)
                if fmt == "nvfp4":
                    # The half's four e4m3 scales (one u32 per entry: idx_scale_lo / _hi)
                    # decoded from their bits on [64] vectors, * unit (64 undoes the e4m3
                    # re-packing's 2^-6; the lut values need none); the product e2m1 * s (at most 6 significant bits, 2^-10..2688) is exact in
                    # f16 and then in bf16.
                    word = sc if half == 0 else plgpu.load(sc_s.at[slot, 1, rows], layout=ROW)
                    blk = None
                    # lutbf: the values are bf16 already; e2m1 * e4m3 (at most 6 significant
                    # bits) is exact in bf16 too.
                    sdt = jnp.bfloat16 if dequant in ("lutbf", "place") else jnp.float16
                    for part in range(3, -1, -1):
                        s16 = lax.broadcast_in_dim(_e4m3_bits_to_f32(word >> (8 * part), unit),
                                                   (CHUNK, 64), [0]).astype(sdt)
                        blk = s16 if blk is None else jnp.where(col < 16 * (part + 1), s16, blk)
                    if dequant in ("lutbf", "place"):
                        return e8 * blk
                    return (e8.astype(jnp.float16) * blk).astype(jnp.bfloat16)
                elif dequant == "e4m3":
                    # * 64 in f16 and the block scale 2^(E-127) in bf16 are exact. sm_90a
                    # PTX (2026-11-25), a thread per 64-entry chunk: ~300 integer + ~140
                    # float ops + 128 conversions, against ~810 + ~80 + 64 for "bits".
                    s0, s1 = ((lax.bitcast_convert_type(((sc >> (16 * half + 8 * i)) & 0xFF) << 23,
                                                         jnp.float32)) for i in range(2))
                    blk = jnp.where(col < 32, lax.broadcast_in_dim(s0, (CHUNK, 64), [0]),
                                    lax.broadcast_in_dim(s1, (CHUNK, 64), [0]))
                    v = (e8.astype(jnp.float16) * jnp.float16(64.0)).astype(jnp.bfloat16)
                    return v * blk.astype(jnp.bfloat16)
                else:   # "bits": low nibbles are dims 0..63, high 64..127
                    e0 = lax.broadcast_in_dim((sc >> (16 * half)) & 0xFF, (CHUNK, 64), [0])
                    e1 = lax.broadcast_in_dim((sc >> (16 * half + 8)) & 0xFF, (CHUNK, 64), [0])
                    exp_bits = (jnp.where(col < 32, e0, e1) - 1) << 23
                    nib = (byte >> (4 * half)) & 15
                    mag = nib & 7
                    sign = (nib & 8) << 28
                    # e2m1 magnitude m * 2^(e-127) as f32 bits: normal codes (m >= 2) put m's
                    # bits right under the exponent; m == 1 is half the scale; m == 0 is zero.
                    bits = exp_bits + (jnp.where(mag >= 2, mag, 0) << 22)
                    bits = jnp.where(mag == 0, jnp.uint32(0), bits) | sign
                    return lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)

            return keys, sc

        def body(j, carry):
            slot, carry = top(j, carry)
            if mma8:
                sc = plgpu.load(sc_s.at[slot, 0], layout=ROW)               # [64]
                # Per 32-dim group g (the key scale's block; dims g*32.. : byte columns
                # (g % 2) * 32.., low nibbles for g < 2, high for g >= 2): the nibbles as
                # e4m3 bytes (= e2m1 * 2^-6, exact) straight into SMEM, no conversion; the
                # wgmma in e4m3 against q's group as e4m3 (q / qs, exact for FP4-simulated
                # q) sums 32 products exactly in f32; the scales join after:
                # S += (acc_g * 2^(E_g - 127)) * (qs_g * 2^6).
                s = None
                for g in range(4):
                    half, part = divmod(g, 2)
                    bg = plgpu.load(c_s.at[slot, :, pl.ds(part * 32, 32)],
                                    layout=WG).astype(jnp.uint32)               # [64 e, 32]
                    code = (((bg & 8) << 4) | ((bg & 7) << 2) if half == 0 else
                            (bg & 0x80) | ((bg & 0x70) >> 2))
                    k_s[g] = lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn)
                plgpu.commit_smem()
                for g in range(4):
                    def mma(acc_ref, g=g):
                        plgpu.wgmma(acc_ref, k_s.at[g], q_s.at[g].T)
                        return acc_ref[...]
                    acc = pl.run_scoped(mma, plgpu.ACC((CHUNK, N_HEADS), jnp.float32))
                    sk = lax.bitcast_convert_type(((sc >> (8 * g)) & 0xFF) << 23, jnp.float32)
                    qsv = plgpu.load(qs_s.at[g], layout=COL)
                    t = (acc * lax.broadcast_in_dim(sk, acc.shape, [0])) * \
                        lax.broadcast_in_dim(qsv, acc.shape, [1])
                    s = t if s is None else s + t
                epilogue(j, s)
                return carry
            for g in range(G):   # the step's chunks, one after another
                chunk(slot, g, G * j + g)
            return carry

        def chunk(slot, g, j):
            """Scores of chunk j, the g-th of ring slot `slot`, into o_s."""
            keys, sc = unpack(slot, g)
            if kreg:
                # The keys stay in registers as the wgmma's A operand: no SMEM round trip,
                # no fence; the second half's dequant runs under the first half's wgmma.
                def mma(acc_ref):
                    if "halfmma" in ablated:
                        plgpu.wgmma(acc_ref, keys(0) + keys(1), q_s.at[0].T)
                        return acc_ref[...]
                    plgpu.wgmma(acc_ref, keys(0), q_s.at[0].T)
                    plgpu.wgmma(acc_ref, keys(1), q_s.at[1].T)
                    return acc_ref[...]
            else:
                k_s[0] = keys(0)
                if not overlap:
                    k_s[1] = keys(1)
                plgpu.commit_smem()

                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, k_s.at[0], q_s.at[0].T)
                    if overlap:   # runs while the first half's wgmma is in flight
                        k_s[1] = keys(1)
                        plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, k_s.at[1], q_s.at[1].T)
                    return acc_ref[...]
            s = pl.run_scoped(mma, plgpu.ACC((CHUNK, N_HEADS), jnp.float32))   # [64 e, 64 h]
            if fmt == "fp8":
                s = s * lax.broadcast_in_dim(sc, s.shape, [0])
            epilogue(j, s)

        lax.fori_loop(0, n_steps, body, step_blocks(stages - 1) if manual else 0)
        if manual:
            _wg_barrier()   # every thread's scores are in o_s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, span)], o_g.at[b, pl.ds(first * CHUNK, span)])
        plgpu.wait_smem_to_gmem(0)

    if mma8:   # q as e4m3 groups [B, 4, 64 h, 32] + their scales [B, 4, 64 h]
        tr8 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32))
        scratch = dict(q_s=plgpu.SMEM((4, N_HEADS, 32), jnp.float8_e4m3fn, transforms=tr8),
                       qs_s=plgpu.SMEM((4, N_HEADS), jnp.float32))
        k_type = plgpu.SMEM((4, CHUNK, 32), jnp.float8_e4m3fn, transforms=tr8)
        ins = (qh, q_scale, w)
    else:
        scratch = dict(q_s=plgpu.SMEM((2, N_HEADS, 64), jnp.bfloat16, transforms=tr))
        k_type = plgpu.SMEM((2, CHUNK, 64), jnp.bfloat16, transforms=tr)
        ins = (qh, w)
    scratch.update(
        w_s=plgpu.SMEM((N_HEADS,), jnp.float32),
        c_s=plgpu.SMEM((stages, G * CHUNK) + codes.shape[2:], codes.dtype),
        sc_s=plgpu.SMEM((stages, n_sc, G * CHUNK), scales[0].dtype),
        o_s=plgpu.SMEM((span_s,), jnp.float32),
        qbar=plgpu.Barrier(num_arrivals=3),   # q (2 tiles, or q8 + its scales) and w
        bar=plgpu.Barrier(num_arrivals=2 * G * (1 + n_sc), num_barriers=stages),
    )
    if not kreg:
        scratch["k_s"] = k_type
    if dequant == "lutbf":
        scratch["tb_s"] = plgpu.SMEM((2,), jnp.uint32)
    params = plgpu.CompilerParams(unsafe_no_auto_barriers=True) if manual else None
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, n_ctas * span), jnp.float32),
        grid=(B, n_ctas), grid_names=("b", "c"),
        scratch_types=scratch,
        compiler_params=params,
        interpret=interpret,
    )(*ins, codes, *scales, bt, t)


def _wg_barrier():
    """bar.sync over this warpgroup (Mosaic GPU's warpgroup_barrier; GPU only)."""
    from jax.experimental.mosaic.gpu import utils as mu

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        mu.warpgroup_barrier()

    sync()


def topk_from_scores(scores_BN, topk):
    """Top-k entry ids [B, topk] int32 by descending score; -1 where fewer are eligible."""
    B, N = scores_BN.shape
    if N < topk:
        scores_BN = jnp.pad(scores_BN, ((0, 0), (0, topk - N)), constant_values=-jnp.inf)
    vals, ids = lax.top_k(scores_BN, topk)
    return jnp.where(vals == -jnp.inf, -1, ids).astype(jnp.int32)


def indexer_topk(q_BHD, w_BH, idx_codes, idx_scale, block_table, t_B, topk, **kw):
    """topk_keys for an `fp4` pool given as its two arrays."""
    return topk_keys(q_BHD, w_BH, {"idx_codes": idx_codes, "idx_scale": idx_scale},
                     block_table, t_B, topk, fmt="fp4", **kw)


def topk_keys(q_BHD, w_BH, keys, block_table, t_B, topk, *, fmt="fp4", chunks_per_cta=None,
              interpret=None, select="xla", dequant=None, stages=None, overlap=None,
              kreg=None, barriers=None, w_in_loop=None, chunks_per_step=None, key_order=None):
    """Kernel scores (score_keys: keys the pool's dict of fields in format fmt) + top-k:
    entry ids [B, topk] int32, -1 padded. select "xla": lax.top_k (a sort of each row in
    XLA-GPU), ids by descending score; "kernel": the pallas_kernels.topk_select radix-select
    kernel on the untrimmed scores, the same set of ids in ascending order. dequant: as
    indexer_scores (fp4 only)."""
    if select not in ("xla", "kernel"):
        raise ValueError(f"select must be 'xla' or 'kernel', got {select!r}")
    s = score_keys(q_BHD, w_BH, keys, block_table, t_B, fmt=fmt, dequant=dequant,
                   chunks_per_cta=chunks_per_cta, interpret=interpret, trim=select == "xla",
                   stages=stages, overlap=overlap, kreg=kreg, barriers=barriers,
                   w_in_loop=w_in_loop, chunks_per_step=chunks_per_step, key_order=key_order)
    if select == "kernel":
        from pallas_kernels.topk_select import topk_select
        return topk_select(s, topk, n=block_table.shape[1] * EPB,
                           interpret=interpret is not None)
    return topk_from_scores(s, topk)
