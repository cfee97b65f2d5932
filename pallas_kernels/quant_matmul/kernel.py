"""Weight-streaming grouped quantised matmul for decode, Pallas Mosaic-GPU (Hopper, sm_90a).

    y_GMN[g, m, n] = sum_k x_GMK[g, m, k] * dequant(w)[expert_G[g], n, k]      (f32 acc)

Decode is memory bound: each CTA streams one weight tile column over (part of) K exactly
as stored (e4m3 bytes, or packed e2m1 nibbles + e8m0 bytes), dequantises it in registers
to bf16 (exact: the scales are powers of two) and multiplies it with the few activation
rows. A and B are swapped so the weight tile is the wgmma M side, fed from registers:

    per CTA (group g, weight rows n0:n0+tn, K range of split s), per K step:
      W tile [tn, 128 k] e4m3 / [tn, 128 B] packed e2m1  --TMA-->  SMEM (2 deep)
      x tile bf16 [M, 128 k] / [2, 8, M, 16] (fp4_x_layout)       --TMA-->  SMEM
      -> registers, dequantised -> bf16 [tn, k] (the wgmma's A operand)
      -> acc^T [tn, M] += W @ x^T                                     (wgmma, f32)
    out[s, g, n0:n0+tn, :] = acc^T                                     (TMA store)
  then in XLA: y_GMN = (out[0] + out[1] + ...).transpose(0, 2, 1)   (f32 [S, G, N, M],
  small; written as adds so the sum fuses into the consumer)

Empty groups (expert id outside [0, E)) issue no weight copies and store zeros.

FP8: e4m3 -> f32, * 2^(e-127) (an f32 splat from the scale byte's bits), -> bf16. (An
integer decode of FP8 measured no faster: it is not bound by the conversions.) An e8m0
scale byte 0 (2^-127) reads as 0.
FP4 (e2m1, packed 2 per byte, element 2k in the low nibble, one e8m0 per 32 along K): x
is de-interleaved in XLA (fp4_x_layout), so y = W_lo @ x_even + W_hi @ x_odd and the
nibbles never need reordering. Each 16-byte column chunk (one scale block) is decoded by
decode.py's PTX into a bf16 tile [tn, 16] per nibble half. The CTA's scales [tn, nk * 8]
come with one TMA before the stream.

Weights from registers into the wgmma: 4-10% less kernel time than through SMEM (H100).
The Mosaic GPU interpreter takes no register A operand and runs no inline PTX: interpreted
(interpret given), the dequantised tile goes through SMEM and the FP4 decode is
decode.fp4_decode_jnp (the same values); the rest is the shipped program.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.formats import Fp8Weight
from pallas_kernels.quant_matmul.decode import (PLACE_LOG2, fp4_decode, fp4_decode_jnp,
                                                fp4_swar_form, scale_words)
from pallas_kernels.quant_matmul.tiling import (STAGES, TK, TKP, TN, Tuning, check_inputs,
                                                choose_stages, default_splits, fp4_rows,
                                                steps, valid_split)

WG = plgpu.Layout.WGMMA


def _u8(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


def fp4_x_layout(x_GMK):
    """bf16 [G, M, K] -> [G, 2, K/32, M, 16]: x[g, m, 32c + 2i + h] at [g, h, c, m, i], i.e.
    de-interleaved (h = 0: even k, the low nibbles) in chunks of 16 packed columns (one
    e8m0 scale block), each chunk an [M, 16] wgmma operand."""
    G, M, K = x_GMK.shape
    return x_GMK.reshape(G, M, K // 32, 16, 2).transpose(0, 4, 2, 1, 3)


def _stream_call(fmt, x, ex_G, w, sc, *, G, M, N, K, tn, splits, stages, interpret,
                 form=None):
    """f32 partials [S, G, N, M] (transposed outputs, one per K split).

    fmt "fp8": x bf16 [G, M, K], w e4m3 [E, N, K], sc uint8 [E, N/128, K/128].
    fmt "fp4": x bf16 fp4_x_layout [G, 2, K/32, M, 16], w uint8 [E, N, K/2],
               sc uint8 [E, N, K/32]; form: decode.FP4_PROGRAMS' key."""
    E = w.shape[0]
    nk = steps(fmt, K) // splits                   # K steps per CTA
    reg_a = interpret is None
    place = form == "place"
    NC = TKP // 16                                 # FP4 scale blocks per step
    tr8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    tr16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tr32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    if fmt == "fp8":
        bufs = dict(w_s=plgpu.SMEM((stages, tn, TK), w.dtype, transforms=tr8),
                    x_s=plgpu.SMEM((stages, M, TK), jnp.bfloat16, transforms=tr16))
        wb = plgpu.SMEM((tn, TK), jnp.bfloat16, transforms=tr16)
    else:
        trw = (plgpu.TilingTransform((8, TKP)), plgpu.SwizzleTransform(TKP))
        bufs = dict(w_s=plgpu.SMEM((stages, tn, TKP), jnp.uint8, transforms=trw),
                    x_s=plgpu.SMEM((stages, 2, NC, M, 16), jnp.bfloat16, transforms=tr32),
                    sc_s=plgpu.SMEM((tn, nk * NC), jnp.uint8))
        wb = plgpu.SMEM((2, NC, tn, 16), jnp.bfloat16, transforms=tr32)
    if not reg_a:  # the interpreter: dequantised rows staged in SMEM for the wgmma
        bufs["wb_s"] = wb

    identity = ex_G is None   # group g uses expert g (no id operand to build per call)

    def kernel(*refs, bar, sbar):
        x_g, ex_g, w_g, sc_g, o_g = refs[:1] + (None,) + refs[1:] if identity else refs
        g = lax.axis_index("g")
        nt = lax.axis_index("n")
        sp = lax.axis_index("s")
        e = g if identity else ex_g[g]
        valid = (e >= 0) & (e < E)             # empty group: no copies, zero output
        e = jnp.where(valid, e, 0)
        k0 = sp * nk
        rows = pl.ds(nt * tn, tn)

        def stream(w_s, x_s, wb_s=None, sc_s=None):
            def issue(j, slot):
                if fmt == "fp8":
                    kk = pl.ds((k0 + j) * TK, TK)
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, kk], w_s.at[slot], bar.at[slot])
                    plgpu.copy_gmem_to_smem(x_g.at[g, :, kk], x_s.at[slot], bar.at[slot])
                else:
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, pl.ds((k0 + j) * TKP, TKP)],
                                            w_s.at[slot], bar.at[slot])
                    for h in range(2):     # (one 5-D copy would exceed the TMA's dims)
                        plgpu.copy_gmem_to_smem(x_g.at[g, h, pl.ds((k0 + j) * NC, NC)],
                                                x_s.at[slot, h], bar.at[slot])

            def fp8_step(acc_ref, j, slot, sc_raw):
                # 2^(e-127) splat (built as a vector: scalar bitcasts do not lower)
                s = lax.bitcast_convert_type(
                    lax.broadcast(sc_raw.astype(jnp.int32) << 23, (64, TK)), jnp.float32)
                for r in range(tn // 64):           # 64 rows at a time: register pressure
                    r64 = pl.ds(64 * r, 64)
                    wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                    if reg_a:
                        plgpu.wgmma(acc_ref.at[r64], (wv * s).astype(jnp.bfloat16),
                                    x_s.at[slot].T)
                    else:
                        wb_s[r64] = (wv * s).astype(jnp.bfloat16)
                if not reg_a:
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, wb_s, x_s.at[slot].T)

            def fp4_step(acc_ref, j, slot):
                # The 8 scale columns [tn, 8] of this step's 8 scale blocks
                c0 = j * NC
                scl = plgpu.load(sc_s.at[:, pl.ds(c0 - lax.rem(c0, 8), 8)], layout=WG,
                                 optimized=False).astype(jnp.int32)
                b_all = plgpu.load(w_s.at[slot], layout=WG)                      # [tn, 128]
                if reg_a:
                    sa_all, sb_all = scale_words(scl, form)                      # [tn, 8]
                for c in range(NC):                 # 16 packed bytes = one scale block
                    b = b_all[:, 16 * c:16 * (c + 1)]
                    if reg_a:   # straight from registers into the wgmma
                        for h, wv in enumerate(fp4_decode(b, sa_all, sb_all, col=c, form=form)):
                            plgpu.wgmma(acc_ref, wv, x_s.at[slot, h, c].T)
                    else:
                        for h, wv in enumerate(fp4_decode_jnp(b, scl[:, c], form=form)):
                            wb_s[h, c] = wv
                if reg_a:
                    return
                plgpu.commit_smem()
                for h in range(2):
                    for c in range(NC):
                        plgpu.wgmma(acc_ref, wb_s.at[h, c], x_s.at[slot, h, c].T)

            def mma(acc_ref):
                @pl.when(valid)
                def _():
                    if fmt == "fp4":
                        plgpu.copy_gmem_to_smem(sc_g.at[e, rows, pl.ds(k0 * NC, nk * NC)],
                                                sc_s, sbar)
                    for j in range(stages):
                        issue(j, j)
                    if fmt == "fp4":
                        plgpu.barrier_wait(sbar)

                    def body(j, sc_raw):
                        slot = lax.rem(j, stages)
                        if fmt == "fp8":
                            # next step's scale byte, loaded early so its latency hides
                            sc_next = sc_g[e, (nt * tn) // 128, k0 + jnp.minimum(j + 1, nk - 1)]
                        plgpu.barrier_wait(bar.at[slot])
                        if fmt == "fp8":
                            fp8_step(acc_ref, j, slot, sc_raw)
                        else:
                            fp4_step(acc_ref, j, slot)
                        plgpu.wgmma_wait(0)          # frees this stage's slot

                        @pl.when(j + stages < nk)
                        def _():
                            issue(j + stages, slot)
                        return sc_next if fmt == "fp8" else sc_raw

                    init = sc_g[e, (nt * tn) // 128, k0] if fmt == "fp8" else jnp.int32(0)
                    lax.fori_loop(0, nk, body, init)
                return acc_ref[...]

            return pl.run_scoped(mma, plgpu.ACC((tn, M), jnp.float32))

        acc = pl.run_scoped(stream, **bufs)      # the stream buffers are freed here

        def store(o_s):
            # "place": the weights came * 2^-64 (exact power of two either way)
            o_s[...] = acc * jnp.float32(2.0 ** PLACE_LOG2) if place else acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[sp, g, rows])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((tn, M), jnp.float32))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, G, N, M), jnp.float32),
        grid=(G, N // tn, splits), grid_names=("g", "n", "s"),
        scratch_types=dict(
            bar=plgpu.Barrier(num_arrivals=2 if fmt == "fp8" else 3, num_barriers=stages),
            sbar=plgpu.Barrier(num_arrivals=1),
        ),
        interpret=interpret,
    )(*((x, w, sc) if identity else (x, ex_G, w, sc)))


def grouped_matmul_pallas(x_GMK, expert_G, w, *, rows=None, exact_fp4=False, tuning=None,
                          interpret=None):
    """The kernel path: f32 [G, M, N] (see the module docstring; the contract:
    pallas_kernels.quant_matmul.grouped_matmul). tuning: tiling.Tuning. rows: return only
    the first `rows` rows of each group (f32 [G, rows, N]), the real ones of a zero-padded
    x; they are sliced off before the split sum and the transpose, which then become
    elementwise and fuse into the consumer. interpret: None or plgpu.InterpretGPUParams."""
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
    reg_a = interpret is None
    # acc [tn, M] f32 lives in registers: 64 rows when M > 128
    tn = tuning.tn or (64 if M > 128 else fp4_rows(M) if fmt == "fp4" else TN)
    if tn not in (64, 128) or N % tn:
        raise ValueError(f"tn must be 64 or 128 and divide N={N}, got {tn}")
    S = tuning.splits or default_splits(fmt, G, N, K, tn)
    if not valid_split(fmt, K, S):
        raise ValueError(f"splits={S} is not a valid K split for {fmt} K={K}")
    nk = steps(fmt, K) // S
    st = choose_stages(fmt, tn, M, nk, reg_a=reg_a, max_stages=tuning.stages or STAGES)
    ex = None if expert_G is None else expert_G.astype(jnp.int32)
    if fmt == "fp8":
        args = (x_GMK, ex, w.w, _u8(w.scale))
    else:
        args = (fp4_x_layout(x_GMK), ex, _u8(w.packed), _u8(w.scale))
    part = _stream_call(fmt, *args, G=G, M=M, N=N, K=K, tn=tn, splits=S, stages=st,
                        interpret=interpret,
                        form=fp4_swar_form(exact_fp4) if fmt == "fp4" else None)
    if rows is not None:
        if not 1 <= rows <= M:
            raise ValueError(f"rows must be in [1, M={M}], got {rows}")
        part = part[..., :rows]
    # The split sum as adds of static slices (not a reduce): XLA fuses elementwise adds into
    # the consumer's fusion, where a reduce would be a kernel of its own after every call.
    y = part[0]
    for i in range(1, S):
        y = y + part[i]
    return y.transpose(0, 2, 1)
