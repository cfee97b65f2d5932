"""Grouped expert matmul for many rows (prefill), Pallas Mosaic-GPU (Hopper, sm_90a).

    y_RN[r, n] = sum_k x_RK[r, k] * dequant(w)[tile_expert_S[r // tm], n, k]     (f32 acc)

Prefill is compute bound: each CTA owns one output tile [tm token rows, tn weight rows]
of one expert and walks K. The weight tile arrives as stored (e4m3 bytes + one e8m0 per
128x128 block, or packed e2m1 nibbles + one e8m0 per 32 k), is dequantised in registers
to bf16 (exact: the scales are powers of two) and written to a double-buffered SMEM tile
that the wgmma reads as its B operand; the activation tile is the A operand:

    per CTA (tile s, weight rows n0:n0+tn), per K step j (128 k):
      W tile [tn, 128] e4m3 / [tn, 64 B] packed e2m1  --TMA-->  SMEM ring (stages deep)
      x tile bf16 [tm, 128] / [2, 4, tm, 16] (fp4_rows_layout)    --TMA-->  SMEM ring
      registers: dequantise W -> bf16 --> wb[j % 2] (SMEM)
      acc [tm, tn] += x @ wb^T                    (wgmma, f32, asynchronous)
      wgmma_wait(1): step j-1's MMA is done -> its ring slot refills with step j-1+stages
    out[s*tm:(s+1)*tm, n0:n0+tn] = acc                                  (TMA store)

So the dequantisation of step j+1 overlaps the MMA of step j, and a weight tile is read
from HBM once per tm rows. The loop body takes two steps (even/odd: the wb buffer and the
FP4 scale columns are then static). Empty tiles (expert id outside [0, E)) issue no
copies and store zeros.

FP8: e4m3 -> f32, * 2^(e-127) (an f32 splat from the scale byte's bits), -> bf16; an
e8m0 scale byte 0 (2^-127) reads as 0.
FP4 (element 2k in the low nibble): x is de-interleaved in XLA (fp4_rows_layout), so
y = x_even @ W_lo^T + x_odd @ W_hi^T per 32-k scale block and the nibbles never need
reordering; the decode is quant_matmul's PTX (decode.fp4_decode, "place" by default:
weights * 2^-64, the accumulator * 2^64 before its store; "mad" with exact_fp4). The
CTA's scales [tn, K/32] come with one TMA before the stream.

The Mosaic GPU interpreter runs no inline PTX: interpreted (interpret given), the FP4
decode is decode.fp4_decode_jnp (the same values); the rest is the shipped program.
"""
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.formats import Fp4Weight, Fp8Weight
from pallas_kernels.quant_matmul.decode import (PLACE_LOG2, fp4_decode, fp4_decode_jnp,
                                                fp4_swar_form, scale_words)

WG = plgpu.Layout.WGMMA
TK = 128            # k per pipeline step: one FP8 scale block, four FP4 ones
NC = TK // 32       # FP4 scale blocks per step
TN = 128            # weight rows (n) per CTA: the wgmma N side
TM = 128            # token rows per CTA: the wgmma M side
STAGES = 3
SMEM_BUDGET = 225 * 1024


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Static tiles (None: the defaults). tm: token rows a tile (64 or 128; the caller's
    row tiles must match), tn: weight rows a CTA (64 or 128), stages: the most K steps in
    flight (fewer if shared memory is short)."""
    tm: int = TM
    tn: int = TN
    stages: int = STAGES


def fp4_rows_layout(x_RK):
    """bf16 [R, K] -> [2, K/32, R, 16]: x[r, 32c + 2i + h] at [h, c, r, i], i.e.
    de-interleaved (h = 0: even k, the low nibbles) per 32-k scale block, each block an
    [R, 16] wgmma operand."""
    R, K = x_RK.shape
    return x_RK.reshape(R, K // 32, 16, 2).transpose(3, 1, 0, 2)


def _smem_bytes(fmt, tm, tn, stages, K):
    if fmt == "fp8":
        per_stage = tn * TK + tm * TK * 2
        fixed = 2 * tn * TK * 2                       # wb, double-buffered
    else:
        per_stage = tn * TK // 2 + tm * TK * 2
        fixed = 2 * tn * TK * 2 + tn * (K // 32)      # wb + the CTA's scales
    return per_stage * stages + fixed


def choose_stages(fmt, tm, tn, K, max_stages):
    st = max(2, min(max_stages, K // TK))
    while st > 2 and _smem_bytes(fmt, tm, tn, st, K) > SMEM_BUDGET:
        st -= 1
    if _smem_bytes(fmt, tm, tn, st, K) > SMEM_BUDGET:
        raise ValueError(f"{fmt} tiles tm={tm} tn={tn} K={K} do not fit in shared memory")
    return st


def check_inputs(x_RK, tile_expert_S, w, tm, tn=TN, for_kernel=True):
    if not isinstance(w, (Fp8Weight, Fp4Weight)):
        raise TypeError(f"w must be an Fp8Weight or Fp4Weight (pallas_kernels.formats), "
                        f"got {type(w).__name__}")
    if x_RK.ndim != 2 or x_RK.dtype != jnp.bfloat16:
        raise ValueError(f"x_RK must be bfloat16 [R, K], got {x_RK.dtype} {x_RK.shape}")
    if len(w.shape) != 3:
        raise ValueError(f"w must be stacked experts [E, N, K], got logical shape {w.shape}")
    E, N, K = w.shape
    R, Kx = x_RK.shape
    if Kx != K:
        raise ValueError(f"K mismatch: x has K={Kx}, w has K={K}")
    S = tile_expert_S.shape[0]
    if tile_expert_S.ndim != 1 or not jnp.issubdtype(tile_expert_S.dtype, jnp.integer):
        raise ValueError(f"tile_expert_S must be an integer vector, got "
                         f"{tile_expert_S.dtype} {tile_expert_S.shape}")
    if R != S * tm:
        raise ValueError(f"x has {R} rows, expected S * tm = {S} * {tm}")
    if not for_kernel:
        return
    if tm not in (64, 128) or tn not in (64, 128):
        raise ValueError(f"tm and tn must be 64 or 128, got tm={tm}, tn={tn}")
    if N % tn:
        raise ValueError(f"N={N} must be a multiple of tn={tn} for the kernel (use impl='xla')")
    if isinstance(w, Fp8Weight):
        if K % (2 * TK):
            raise ValueError(f"the FP8 kernel needs K % {2 * TK} == 0, got K={K}")
    elif K % 512 or K // 32 > 256:
        raise ValueError(f"the FP4 kernel needs K % 512 == 0 and K <= 8192 (the CTA's "
                         f"scale row in one TMA), got K={K}")


def _u8(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


def _call(fmt, x, ex_S, w, sc, *, S, tm, tn, N, K, stages, interpret, form):
    """f32 [S * tm, N]. fmt "fp8": x bf16 [R, K], w e4m3 [E, N, K], sc uint8 [E, N/128,
    K/128]. fmt "fp4": x bf16 fp4_rows_layout [2, K/32, R, 16], w uint8 [E, N, K/2], sc
    uint8 [E, N, K/32]."""
    E = w.shape[0]
    nk = K // TK
    place = form == "place"
    tr8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    tr16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tr32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    if fmt == "fp8":
        bufs = dict(w_s=plgpu.SMEM((stages, tn, TK), w.dtype, transforms=tr8),
                    x_s=plgpu.SMEM((stages, tm, TK), jnp.bfloat16, transforms=tr16),
                    wb_s=plgpu.SMEM((2, tn, TK), jnp.bfloat16, transforms=tr16))
    else:
        trw = (plgpu.TilingTransform((8, TK // 2)), plgpu.SwizzleTransform(TK // 2))
        bufs = dict(w_s=plgpu.SMEM((stages, tn, TK // 2), jnp.uint8, transforms=trw),
                    x_s=plgpu.SMEM((stages, 2, NC, tm, 16), jnp.bfloat16, transforms=tr32),
                    wb_s=plgpu.SMEM((2, 2, NC, tn, 16), jnp.bfloat16, transforms=tr32),
                    sc_s=plgpu.SMEM((tn, K // 32), jnp.uint8))

    def kernel(x_g, ex_g, w_g, sc_g, o_g, bar, sbar):
        nt = lax.axis_index("n")
        s = lax.axis_index("s")
        e = ex_g[s]
        valid = (e >= 0) & (e < E)              # empty tile: no copies, zero output
        e = jnp.where(valid, e, 0)
        wrows = pl.ds(nt * tn, tn)
        xrows = pl.ds(s * tm, tm)

        def stream(w_s, x_s, wb_s, sc_s=None):
            def issue(j, slot):
                if fmt == "fp8":
                    kk = pl.ds(j * TK, TK)
                    plgpu.copy_gmem_to_smem(w_g.at[e, wrows, kk], w_s.at[slot], bar.at[slot])
                    plgpu.copy_gmem_to_smem(x_g.at[xrows, kk], x_s.at[slot], bar.at[slot])
                else:
                    plgpu.copy_gmem_to_smem(w_g.at[e, wrows, pl.ds(j * (TK // 2), TK // 2)],
                                            w_s.at[slot], bar.at[slot])
                    for h in range(2):
                        plgpu.copy_gmem_to_smem(x_g.at[h, pl.ds(j * NC, NC), xrows],
                                                x_s.at[slot, h], bar.at[slot])

            def dequant_fp8(j, slot, par):
                sc_raw = sc_g[e, (nt * tn) // 128, j]
                # 2^(e-127) splat (built as a vector: scalar bitcasts do not lower)
                sv = lax.bitcast_convert_type(
                    lax.broadcast(sc_raw.astype(jnp.int32) << 23, (64, TK)), jnp.float32)
                for r in range(tn // 64):           # 64 rows at a time: register pressure
                    r64 = pl.ds(64 * r, 64)
                    wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                    wb_s[par, r64] = (wv * sv).astype(jnp.bfloat16)

            def dequant_fp4(j, slot, par, words):
                # this step's 4 scale blocks are columns 4 * par .. 4 * par + 3 of the pair's 8
                b_all = plgpu.load(w_s.at[slot], layout=WG)                 # [tn, 64]
                for c in range(NC):
                    b = b_all[:, 16 * c:16 * (c + 1)]
                    col = NC * par + c
                    if interpret is None:
                        halves = fp4_decode(b, words[0], words[1], col=col, form=form)
                    else:
                        halves = fp4_decode_jnp(b, words[:, col], form=form)
                    for h, wv in enumerate(halves):
                        wb_s[par, h, c] = wv

            def mma(acc_ref, slot, par):
                if fmt == "fp8":
                    plgpu.wgmma(acc_ref, x_s.at[slot], wb_s.at[par].T)
                else:
                    for h in range(2):
                        for c in range(NC):
                            plgpu.wgmma(acc_ref, x_s.at[slot, h, c], wb_s.at[par, h, c].T)

            def run(acc_ref):
                @pl.when(valid)
                def _():
                    if fmt == "fp4":
                        plgpu.copy_gmem_to_smem(sc_g.at[e, wrows], sc_s, sbar)
                    for j in range(min(stages, nk)):
                        issue(j, j)
                    if fmt == "fp4":
                        plgpu.barrier_wait(sbar)

                    def step(j, par, words):
                        slot = lax.rem(j, stages)
                        plgpu.barrier_wait(bar.at[slot])
                        if fmt == "fp8":
                            dequant_fp8(j, slot, par)
                        else:
                            dequant_fp4(j, slot, par, words)
                        plgpu.commit_smem()          # wb's stores before the async MMA
                        mma(acc_ref, slot, par)
                        plgpu.wgmma_wait(1)          # step j-1's MMA done: its slot is free

                        @pl.when((j >= 1) & (j - 1 + stages < nk))
                        def _():
                            issue(j - 1 + stages, lax.rem(j - 1 + stages, stages))

                    def body(i, carry):
                        words = None
                        if fmt == "fp4":             # the pair's 8 scale columns [tn, 8]
                            scl = plgpu.load(sc_s.at[:, pl.ds(8 * i, 8)], layout=WG,
                                             optimized=False).astype(jnp.int32)
                            words = scale_words(scl, form) if interpret is None else scl
                        step(2 * i, 0, words)
                        step(2 * i + 1, 1, words)
                        return carry

                    lax.fori_loop(0, nk // 2, body, 0)
                    plgpu.wgmma_wait(0)
                return acc_ref[...]

            return pl.run_scoped(run, plgpu.ACC((tm, tn), jnp.float32))

        acc = pl.run_scoped(stream, **bufs)      # the stream buffers are freed here

        def store(o_s):
            o_s[...] = acc * jnp.float32(2.0 ** PLACE_LOG2) if place else acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[xrows, wrows])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((tm, tn), jnp.float32))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((S * tm, N), jnp.float32),
        # n fastest: the CTAs of one wave share the x tile and the expert's weights in L2
        grid=(N // tn, S), grid_names=("n", "s"),
        scratch_types=dict(
            bar=plgpu.Barrier(num_arrivals=2 if fmt == "fp8" else 3, num_barriers=stages),
            sbar=plgpu.Barrier(num_arrivals=1),
        ),
        interpret=interpret,
    )(x, ex_S, w, sc)


def grouped_expert_matmul_pallas(x_RK, tile_expert_S, w, *, exact_fp4=False, tuning=None,
                                 interpret=None):
    """The kernel path: f32 [R, N] (contract: pallas_kernels.grouped_expert_matmul).
    interpret: None (compile for the GPU) or plgpu.InterpretGPUParams."""
    tuning = tuning or Tuning()
    tm, tn = tuning.tm, tuning.tn
    check_inputs(x_RK, tile_expert_S, w, tm, tn)
    E, N, K = w.shape
    S = tile_expert_S.shape[0]
    fmt = "fp8" if isinstance(w, Fp8Weight) else "fp4"
    st = choose_stages(fmt, tm, tn, K, tuning.stages)
    ex = tile_expert_S.astype(jnp.int32)
    if fmt == "fp8":
        args = (x_RK, ex, w.w, _u8(w.scale))
    else:
        args = (fp4_rows_layout(x_RK), ex, _u8(w.packed), _u8(w.scale))
    return _call(fmt, *args, S=S, tm=tm, tn=tn, N=N, K=K, stages=st, interpret=interpret,
                 form=fp4_swar_form(exact_fp4) if fmt == "fp4" else None)
