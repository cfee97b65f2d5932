"""The weight-streaming grouped quantised matmul on Blackwell (sm_100a): tcgen05 MMA with
the accumulator in tensor memory (TMEM).

    y_GMN[g, m, n] = sum_k x_GMK[g, m, k] * dequant(w)[expert_G[g], n, k]      (f32 acc)

The same contract, grid (group, 128 weight rows, K split), TMA streams, FP8 / FP4 decode
and outputs (f32 partials [S, G, N, M], summed and transposed in XLA) as kernel.py; what
differs:
- wgmma does not exist on sm_100. tcgen05.mma takes its A operand from SMEM or TMEM only
  (no registers), so each step's dequantised bf16 weight tile [128, k] goes to an SMEM
  slot, and the MMA (issued by one thread, asynchronous) accumulates acc^T [128, M] f32 in
  TMEM: no accumulator registers, so a CTA always takes 128 weight rows (the MMA's M).
- The MMA of step j runs while step j+1 is dequantised: it signals an mbarrier
  (tcgen05.commit) that frees its x / weight SMEM slot; the slot's next TMA is issued
  once that barrier is seen.
- Not the native block-scaled MMA (kind::mxf8f6f4): the weights' formats would match
  (e4m3 + e8m0 per 128 x 128 is MXFP8 with each scale repeated over four 32-k blocks;
  e2m1 + e8m0 per 32 k is MXFP4 exactly), but both operands of a block-scaled MMA must be
  FP8 / FP4 (Mosaic GPU at jax 0.11.2 also needs both of one type for FP4), and this
  contract's activations are bf16: quantising them would change the result.

Per CTA (group g, weight rows n0:n0+128, K range of split s), per K step j (slot j % ST):
    W tile [128, 128 k] e4m3 / [128, 128 B] packed e2m1  --TMA-->  SMEM ring
    x tile bf16 [M, 128 k] / [2, 8, M, 16] (fp4_x_layout) --TMA-->  SMEM ring
    -> registers, dequantised (kernel.py's decode) -> bf16 SMEM slot wb[j % ST]
    -> acc^T [128, M] (TMEM) += wb @ x^T                     (tcgen05.mma, async)
    out[s, g, n0:n0+128, :] = acc^T  (TMEM -> registers -> SMEM -> TMA)

Interpreted (interpret given), the FP4 decode is decode.fp4_decode_jnp (the interpreter
runs no inline PTX); the rest is the program the GPU runs.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.formats import Fp8Weight
from pallas_kernels.quant_matmul.decode import (PLACE_LOG2, fp4_decode, fp4_decode_jnp,
                                                fp4_swar_form, scale_words)
from pallas_kernels.quant_matmul.kernel import _u8, fp4_x_layout
from pallas_kernels.quant_matmul.tiling import (SMEM_BUDGET, TK, TKP, Tuning, check_inputs,
                                                default_splits, steps, valid_split)

WG = plgpu.Layout.WGMMA
TN = 128          # weight rows a CTA: the tcgen05 MMA's M (its accumulator's TMEM lanes)
STAGES = 3        # x / weight / dequantised tiles in flight (fewer where SMEM is short)
NUM_SMS = 148     # B200


def smem_bytes(fmt, M, stages, nk):
    """One CTA's stream buffers: per stage the weight tile, the x tile and the dequantised
    bf16 weight tile; FP4 also the CTA's scales."""
    if fmt == "fp8":
        return stages * (TN * TK + M * TK * 2 + TN * TK * 2)
    return stages * (TN * TKP + M * TKP * 4 + TN * TKP * 4) + TN * nk * (TKP // 16)


def choose_stages(fmt, M, nk, max_stages=STAGES):
    """The deepest ring (<= max_stages, <= nk) within the SMEM budget."""
    for st in range(max(1, min(max_stages, nk)), 0, -1):
        if smem_bytes(fmt, M, st, nk) <= SMEM_BUDGET:
            return st
    raise ValueError(f"{fmt} tiles for M={M} do not fit in shared memory")


def _stream_call(fmt, x, ex_G, w, sc, *, G, M, N, K, splits, stages, interpret, form=None):
    """f32 partials [S, G, N, M] (kernel._stream_call's operands and outputs)."""
    E = w.shape[0]
    nk = steps(fmt, K) // splits
    place = form == "place"
    NC = TKP // 16
    tr8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    tr16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tr32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    if fmt == "fp8":
        bufs = dict(w_s=plgpu.SMEM((stages, TN, TK), w.dtype, transforms=tr8),
                    x_s=plgpu.SMEM((stages, M, TK), jnp.bfloat16, transforms=tr16),
                    wb_s=plgpu.SMEM((stages, TN, TK), jnp.bfloat16, transforms=tr16))
    else:
        trw = (plgpu.TilingTransform((8, TKP)), plgpu.SwizzleTransform(TKP))
        bufs = dict(w_s=plgpu.SMEM((stages, TN, TKP), jnp.uint8, transforms=trw),
                    x_s=plgpu.SMEM((stages, 2, NC, M, 16), jnp.bfloat16, transforms=tr32),
                    wb_s=plgpu.SMEM((stages, 2, NC, TN, 16), jnp.bfloat16, transforms=tr32),
                    sc_s=plgpu.SMEM((TN, nk * NC), jnp.uint8))
    identity = ex_G is None

    def kernel(*refs, bar, sbar, mbar, acc_t):
        x_g, ex_g, w_g, sc_g, o_g = refs[:1] + (None,) + refs[1:] if identity else refs
        g = lax.axis_index("g")
        nt = lax.axis_index("n")
        sp = lax.axis_index("s")
        e = g if identity else ex_g[g]
        valid = (e >= 0) & (e < E)             # empty group: no copies, zero output
        e = jnp.where(valid, e, 0)
        k0 = sp * nk
        rows = pl.ds(nt * TN, TN)

        def stream(w_s, x_s, wb_s, sc_s=None):
            def issue(j, slot):
                if fmt == "fp8":
                    kk = pl.ds((k0 + j) * TK, TK)
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, kk], w_s.at[slot], bar.at[slot])
                    plgpu.copy_gmem_to_smem(x_g.at[g, :, kk], x_s.at[slot], bar.at[slot])
                else:
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, pl.ds((k0 + j) * TKP, TKP)],
                                            w_s.at[slot], bar.at[slot])
                    for h in range(2):
                        plgpu.copy_gmem_to_smem(x_g.at[g, h, pl.ds((k0 + j) * NC, NC)],
                                                x_s.at[slot, h], bar.at[slot])

            def dequant(j, slot):
                """Weights of step j (w_s[slot]) -> bf16 wb_s[slot]."""
                if fmt == "fp8":
                    sc_raw = sc_g[e, (nt * TN) // 128, k0 + j]
                    # 2^(e-127) splat (built as a vector: scalar bitcasts do not lower)
                    s = lax.bitcast_convert_type(
                        lax.broadcast(sc_raw.astype(jnp.int32) << 23, (64, TK)), jnp.float32)
                    for r in range(TN // 64):           # 64 rows at a time: registers
                        r64 = pl.ds(64 * r, 64)
                        wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                        wb_s[slot, r64] = (wv * s).astype(jnp.bfloat16)
                    return
                c0 = j * NC
                scl = plgpu.load(sc_s.at[:, pl.ds(c0 - lax.rem(c0, 8), 8)], layout=WG,
                                 optimized=False).astype(jnp.int32)          # [128, 8]
                b_all = plgpu.load(w_s.at[slot], layout=WG)                   # [128, 128]
                if interpret is None:
                    sa_all, sb_all = scale_words(scl, form)
                for c in range(NC):                     # 16 packed bytes = one scale block
                    b = b_all[:, 16 * c:16 * (c + 1)]
                    halves = (fp4_decode(b, sa_all, sb_all, col=c, form=form)
                              if interpret is None else fp4_decode_jnp(b, scl[:, c], form=form))
                    for h, wv in enumerate(halves):
                        wb_s[slot, h, c] = wv

            def mma(j, slot):
                """acc_t (+)= wb_s[slot] @ x_s[slot]^T; mbar[slot] when it is done."""
                if fmt == "fp8":
                    plgpu.tcgen05_mma(acc_t, wb_s.at[slot], x_s.at[slot].T, mbar.at[slot],
                                      accumulate=j > 0)
                    return
                last = 2 * NC - 1
                for i, (h, c) in enumerate((h, c) for h in range(2) for c in range(NC)):
                    plgpu.tcgen05_mma(acc_t, wb_s.at[slot, h, c], x_s.at[slot, h, c].T,
                                      mbar.at[slot] if i == last else None,
                                      accumulate=True if i > 0 else j > 0)

            @pl.when(valid)
            def _():
                if fmt == "fp4":
                    plgpu.copy_gmem_to_smem(sc_g.at[e, rows, pl.ds(k0 * NC, nk * NC)],
                                            sc_s, sbar)
                for j in range(stages):
                    issue(j, j)
                if fmt == "fp4":
                    plgpu.barrier_wait(sbar)

                @pl.loop(0, nk)
                def _(j):
                    slot = lax.rem(j, stages)
                    plgpu.barrier_wait(bar.at[slot])
                    # wb_s[slot]'s last reader, MMA j - stages, was seen done at step j - 1
                    dequant(j, slot)
                    plgpu.commit_smem()                  # the MMA reads wb_s (async proxy)
                    mma(j, slot)
                    # MMA j + 1 - stages done: its slot takes step j + 1's tiles
                    old = j + 1 - stages

                    @pl.when(old >= 0)
                    def _():
                        plgpu.barrier_wait(mbar.at[lax.rem(old, stages)])

                    @pl.when((old >= 0) & (j + 1 < nk))
                    def _():
                        issue(j + 1, lax.rem(j + 1, stages))

                # the MMAs not yet seen done (each mbar phase is waited on exactly once)
                for old in range(max(0, nk - stages + 1), nk):
                    plgpu.barrier_wait(mbar.at[old % stages])

        pl.run_scoped(stream, **bufs)      # the stream buffers are freed here

        def store(o_s):
            @pl.when(valid)
            def _():
                acc = plgpu.async_load_tmem(acc_t)
                plgpu.wait_load_tmem()
                # "place": the weights came * 2^-64 (exact power of two either way)
                o_s[...] = acc * jnp.float32(2.0 ** PLACE_LOG2) if place else acc

            @pl.when(~valid)
            def _():
                o_s[...] = jnp.zeros((TN, M), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[sp, g, rows])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((TN, M), jnp.float32))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, G, N, M), jnp.float32),
        grid=(G, N // TN, splits), grid_names=("g", "n", "s"),
        scratch_types=dict(
            bar=plgpu.Barrier(num_arrivals=2 if fmt == "fp8" else 3, num_barriers=stages),
            sbar=plgpu.Barrier(num_arrivals=1),
            mbar=plgpu.Barrier(num_arrivals=1, num_barriers=stages, orders_tensor_core=True),
            acc_t=plgpu.TMEM((TN, M), jnp.float32),
        ),
        interpret=interpret,
    )(*((x, w, sc) if identity else (x, ex_G, w, sc)))


def grouped_matmul_blackwell(x_GMK, expert_G, w, *, rows=None, exact_fp4=False, tuning=None,
                             interpret=None):
    """The Blackwell kernel path: f32 [G, M, N], the contract of
    pallas_kernels.quant_matmul.grouped_matmul. tuning: tiling.Tuning (tn must be None or
    128 here). interpret: None or plgpu.InterpretGPUParams."""
    tuning = tuning or Tuning()
    check_inputs(x_GMK, jax.ShapeDtypeStruct(x_GMK.shape[:1], jnp.int32)
                 if expert_G is None else expert_G, w)
    G, M, K = x_GMK.shape
    E, N, _ = w.shape
    if expert_G is None and G > E:
        raise ValueError(f"expert_G=None (group g uses expert g) needs G <= E, got G={G}, "
                         f"E={E}")
    fmt = "fp8" if isinstance(w, Fp8Weight) else "fp4"
    if fmt == "fp4" and K % 512:
        raise ValueError(f"the FP4 kernel needs K % 512 == 0 (scale rows in 16-byte "
                         f"units), got K={K}")
    if tuning.tn not in (None, TN) or N % TN:
        raise ValueError(f"the Blackwell kernel takes {TN} weight rows a CTA (N % {TN} == 0), "
                         f"got tn={tuning.tn}, N={N}")
    S = tuning.splits or default_splits(fmt, G, N, K, TN, num_sms=NUM_SMS)
    if not valid_split(fmt, K, S):
        raise ValueError(f"splits={S} is not a valid K split for {fmt} K={K}")
    nk = steps(fmt, K) // S
    st = choose_stages(fmt, M, nk, max_stages=tuning.stages or STAGES)
    ex = None if expert_G is None else expert_G.astype(jnp.int32)
    if fmt == "fp8":
        args = (x_GMK, ex, w.w, _u8(w.scale))
    else:
        args = (fp4_x_layout(x_GMK), ex, _u8(w.packed), _u8(w.scale))
    part = _stream_call(fmt, *args, G=G, M=M, N=N, K=K, splits=S, stages=st,
                        interpret=interpret,
                        form=fp4_swar_form(exact_fp4) if fmt == "fp4" else None)
    if rows is not None:
        if not 1 <= rows <= M:
            raise ValueError(f"rows must be in [1, M={M}], got {rows}")
        part = part[..., :rows]
    # the split sum as adds of static slices: they fuse into the consumer (kernel.py)
    y = part[0]
    for i in range(1, S):
        y = y + part[i]
    return y.transpose(0, 2, 1)
