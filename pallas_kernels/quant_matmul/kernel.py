"""Weight-streaming grouped quantised matmul for decode, Pallas Mosaic-GPU (Hopper, sm_90a).

    y_GMN[g, m, n] = sum_k x_GMK[g, m, k] * dequant(w)[expert_G[g], n, k]      (f32 acc)

Decode is memory bound: each CTA streams one weight tile column over (part of) K exactly
as stored (e4m3 bytes, or packed e2m1 nibbles + e8m0 bytes), dequantises it in registers
to bf16 (exact: the scales are powers of two) and multiplies it with the few activation
rows. A and B are swapped so the weight tile is the wgmma M side:

    per CTA (group g, weight rows n0:n0+tn, K range of split s), per K step of 128:
      W tile e4m3 [tn, 128 k]  --TMA-->  SMEM (STAGES deep)           x tile bf16 [M, 128 k]
      -> registers, * 2^(scale-127), -> bf16 [tn, 128 k] in SMEM
      -> acc^T [tn, M] += W_tile @ x_tile^T                            (wgmma, f32)
    out[s, g, n0:n0+tn, :] = acc^T                                     (TMA store)
  then in XLA: y_GMN = (out[0] + out[1] + ...).transpose(0, 2, 1)   (f32 [S, G, N, M],
  small; written as adds so the sum fuses into the consumer)

Empty groups (expert id outside [0, E)) issue no weight copies and store zeros.

FP4 (e2m1, packed 2 per byte, element 2k in the low nibble, one e8m0 per 32 along K):
x is de-interleaved in XLA (fp4_x_layout), so y = W_lo @ x_even + W_hi @ x_odd and the
nibbles never need reordering. Per step: packed tile uint8 [tn, tkp B] (2 tkp k); the
CTA's scales uint8 [tn, nk * tkp/16] are loaded once. Each 16-byte column chunk (one
scale block) is decoded with integer arithmetic (Hopper has no e2m1 casts: the 3
magnitude bits placed under the f16 exponent give e2m1 * 2^-14 exactly) into its own
bf16 SMEM tile [tn, 16] per nibble half, multiplied with the matching x chunk [M, 16].
That decode is ALU bound (~10 instructions per weight), so FP4 reaches ~1/3 of the copy
bandwidth where FP8 reaches ~2/3 (see benchmarks/results/quant_matmul.md).
"""
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4_jax.quant import Fp4Weight, Fp8Weight

# Defaults from the H100 sweep (benchmarks/results/quant_matmul.md)
TN = 128          # FP8 weight rows (n) per CTA: the wgmma M side (64 when M > 128)
TN_FP4 = 64       # FP4 weight rows per CTA (the in-register decode is ALU bound: more CTAs)
TK = 128          # k per FP8 pipeline step (one FP8 scale block)
TKP = 64          # packed bytes per FP4 pipeline step (128 k, 4 scale blocks)
STAGES = 2        # weight tiles in flight per CTA (fewer, smaller CTAs per SM measured faster)
CTAS_PER_SM = {"fp8": 2, "fp4": 3}   # K-split target
NUM_SMS = 132     # H100 SXM
WG = plgpu.Layout.WGMMA
# Default of the `reg_a` knob (dequantised rows into the wgmma from registers): on since the
# H100 A/B of 2026-11-22 (4-10% less kernel time, 4 Flash layers 1.65 -> 1.60 ms pipelined);
# DSV4_REG_A=0 turns it off process-wide for A/B runs without code changes.
REG_A = os.environ.get("DSV4_REG_A", "1") == "1"


def check_inputs(x_GMK, expert_G, w, for_kernel=True):
    """Shape / dtype validation with errors that name the problem (`for_kernel`: also the
    kernel's tiling constraints)."""
    if not isinstance(w, (Fp8Weight, Fp4Weight)):
        raise TypeError(f"w must be dsv4_jax.quant.Fp8Weight or Fp4Weight, got {type(w).__name__}")
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


def _steps(fmt, K, tkp=TKP):
    return K // TK if fmt == "fp8" else K // (2 * tkp)


def _valid_split(fmt, K, s, tkp=TKP):
    """FP4 CTAs load their scales [tn, nk*tkp/16] with one TMA: a 16-byte multiple, at
    most 256 wide."""
    KT = _steps(fmt, K, tkp)
    if KT % s:
        return False
    nsc = KT // s * (tkp // 16)
    return fmt == "fp8" or (nsc % 16 == 0 and nsc <= 256)


def default_splits(fmt, G, N, K, tn=TN, tkp=TKP, num_sms=NUM_SMS):
    """K splits per (group, n tile): the most that keep the grid within CTAS_PER_SM."""
    ok = [s for s in range(1, _steps(fmt, K, tkp) + 1) if _valid_split(fmt, K, s, tkp)]
    if not ok:
        raise ValueError(f"no valid K split for {fmt} K={K}")
    fits = [s for s in ok if G * (N // tn) * s <= CTAS_PER_SM[fmt] * num_sms]
    return max(fits) if fits else min(ok)


SMEM_BUDGET = 225 * 1024


def _smem_bytes(fmt, tn, M, stages, nk, tkp=TKP):
    if fmt == "fp8":
        per_stage = tn * TK + M * TK * 2
        fixed = tn * TK * 2
    else:
        per_stage = tn * tkp + M * tkp * 2 * 2
        fixed = tn * tkp * 2 * 2 + tn * nk * (tkp // 16)
    return per_stage * stages + fixed


def choose_stages(fmt, tn, M, nk, max_stages=STAGES, tkp=TKP):
    """Pipeline depth: up to `max_stages` weight tiles in flight, within the SMEM budget."""
    st = max(1, min(max_stages, nk))
    while st > 1 and _smem_bytes(fmt, tn, M, st, nk, tkp) > SMEM_BUDGET:
        st -= 1
    if _smem_bytes(fmt, tn, M, st, nk, tkp) > SMEM_BUDGET:
        raise ValueError(f"{fmt} tiles for M={M} do not fit in shared memory")
    return st


def _u8(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


def fp4_x_layout(x_GMK):
    """bf16 [G, M, K] -> [G, 2, K/32, M, 16]: x[g, m, 32c + 2i + h] at [g, h, c, m, i], i.e.
    de-interleaved (h = 0: even k, the low nibbles) in chunks of 16 packed columns (one
    e8m0 scale block), each chunk an [M, 16] wgmma operand."""
    G, M, K = x_GMK.shape
    return x_GMK.reshape(G, M, K // 32, 16, 2).transpose(0, 4, 2, 1, 3)


def _stream_call(fmt, x, ex_G, w, sc, *, G, M, N, K, tn, splits, stages, interpret, tkp=TKP,
                 reg_a=False):
    """f32 partials [S, G, N, M] (transposed outputs, one per K split).

    fmt "fp8": x bf16 [G, M, K], w e4m3 [E, N, K], sc uint8 [E, N/128, K/128].
    fmt "fp4": x bf16 fp4_x_layout [G, 2, K/32, M, 16], w uint8 [E, N, K/2],
               sc uint8 [E, N, K/32]."""
    E = w.shape[0]
    nk = _steps(fmt, K, tkp) // splits             # K steps per CTA
    NC = tkp // 16                                 # FP4 scale blocks per step
    tr8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    tr16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tr32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    if fmt == "fp8":
        bufs = dict(w_s=plgpu.SMEM((stages, tn, TK), jnp.float8_e4m3fn, transforms=tr8),
                    x_s=plgpu.SMEM((stages, M, TK), jnp.bfloat16, transforms=tr16))
        wb = plgpu.SMEM((tn, TK), jnp.bfloat16, transforms=tr16)
    else:
        trw = (plgpu.TilingTransform((8, tkp)), plgpu.SwizzleTransform(tkp))
        bufs = dict(w_s=plgpu.SMEM((stages, tn, tkp), jnp.uint8, transforms=trw),
                    x_s=plgpu.SMEM((stages, 2, NC, M, 16), jnp.bfloat16, transforms=tr32),
                    sc_s=plgpu.SMEM((tn, nk * NC), jnp.uint8))
        wb = plgpu.SMEM((2, NC, tn, 16), jnp.bfloat16, transforms=tr32)
    if not reg_a:  # dequantised bf16 rows staged for the wgmma
        bufs["wb_s"] = wb

    def kernel(x_g, ex_g, w_g, sc_g, o_g, bar, sbar):
        g = lax.axis_index("g")
        nt = lax.axis_index("n")
        sp = lax.axis_index("s")
        e = ex_g[g]
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
                    plgpu.copy_gmem_to_smem(w_g.at[e, rows, pl.ds((k0 + j) * tkp, tkp)],
                                            w_s.at[slot], bar.at[slot])
                    for h in range(2):     # (one 5-D copy would exceed the TMA's dims)
                        plgpu.copy_gmem_to_smem(x_g.at[g, h, pl.ds((k0 + j) * NC, NC)],
                                                x_s.at[slot, h], bar.at[slot])

            def fp8_step(acc_ref, j, slot, sc_raw):
                # 2^(e-127) splat (built as a vector: scalar bitcasts do not lower)
                s = lax.bitcast_convert_type(
                    lax.broadcast(sc_raw.astype(jnp.int32) << 23, (64, TK)), jnp.float32)
                if reg_a:  # dequantised rows go from registers straight into the wgmma
                    for r in range(tn // 64):
                        r64 = pl.ds(64 * r, 64)
                        wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                        plgpu.wgmma(acc_ref.at[r64], (wv * s).astype(jnp.bfloat16),
                                    x_s.at[slot].T)
                    return
                for r in range(tn // 64):           # 64 rows at a time: register pressure
                    r64 = pl.ds(64 * r, 64)
                    wv = plgpu.load(w_s.at[slot, r64], layout=WG).astype(jnp.float32)
                    wb_s[r64] = (wv * s).astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, wb_s, x_s.at[slot].T)

            def fp4_step(acc_ref, j, slot):
                # 8 scale columns [tn, 8] holding this step's NC -> f32 multipliers
                # 2^(e-127) * 2^14 (undoing the f16 bias trick below); one per-row vector per
                # scale block by a masked row sum (a strided SMEM column load does not lower).
                c0 = j * NC
                scl = plgpu.load(sc_s.at[:, pl.ds(c0 - lax.rem(c0, 8), 8)], layout=WG,
                                 optimized=False)
                mult_all = lax.bitcast_convert_type((scl.astype(jnp.int32) + 14) << 23,
                                                    jnp.float32)
                col = plgpu.broadcasted_iota(jnp.int32, (tn, 8), 1, layout=WG) - lax.rem(c0, 8)
                b_all = plgpu.load(w_s.at[slot], layout=WG)                      # [tn, tkp]
                for c in range(NC):                 # 16 packed bytes = one scale block
                    b = b_all[:, 16 * c:16 * (c + 1)].astype(jnp.int32)           # [tn, 16]
                    mult = jnp.where(col == c, mult_all, 0.0).sum(axis=1)         # [tn]
                    mult = lax.broadcast_in_dim(mult, (tn, 16), [0])
                    # e2m1 magnitude bits m under the f16 exponent (m << 9) encode exactly
                    # e2m1(m) * 2^-14 (m = 1 is an f16 subnormal, kept by the cvt to f32);
                    # the sign goes to bit 15. Low nibble: bits 0-3, high: bits 4-7.
                    for h, f16 in ((0, ((b & 7) << 9) | ((b & 8) << 12)),
                                   (1, ((b & 0x70) << 5) | ((b & 0x80) << 8))):
                        f16 = lax.bitcast_convert_type(f16.astype(jnp.int16), jnp.float16)
                        wb = (f16.astype(jnp.float32) * mult).astype(jnp.bfloat16)
                        if reg_a:  # straight from registers into the wgmma
                            plgpu.wgmma(acc_ref, wb, x_s.at[slot, h, c].T)
                        else:
                            wb_s[h, c] = wb
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
                        plgpu.wgmma_wait(0)          # frees wb_s and this stage's slot

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
            o_s[...] = acc
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
    )(x, ex_G, w, sc)


def grouped_matmul_pallas(x_GMK, expert_G, w, *, splits=None, stages=None, tn=None,
                          tkp=None, reg_a=None, interpret=None):
    """The kernel path: f32 [G, M, N]. See the module docstring. `splits` (K splits per
    output tile), `stages` (pipeline depth), `tn` (64 or 128 weight rows per CTA) and
    `tkp` (FP4: 64 or 128 packed bytes per step) are tuning knobs; the defaults are the
    best measured on the H100. `reg_a`: feed the dequantised weight rows to the wgmma from
    registers instead of storing them to SMEM first (default $DSV4_REG_A, on; GPU-tested
    against the reference). The Mosaic-GPU interpreter cannot run a register lhs, so in
    interpret mode the SMEM path runs whatever `reg_a` says."""
    check_inputs(x_GMK, expert_G, w)
    G, M, K = x_GMK.shape
    E, N, _ = w.shape
    fmt = "fp8" if isinstance(w, Fp8Weight) else "fp4"
    if fmt == "fp4" and K % 512:
        raise ValueError(f"the FP4 kernel needs K % 512 == 0 (scale rows in 16-byte "
                         f"units), got K={K}")
    # acc [tn, M] f32 lives in registers: 64 rows when M > 128
    tn = tn or (64 if M > 128 else TN_FP4 if fmt == "fp4" else TN)
    if tn not in (64, 128) or N % tn:
        raise ValueError(f"tn must be 64 or 128 and divide N={N}, got {tn}")
    tkp = tkp or TKP
    if tkp not in (64, 128):
        raise ValueError(f"tkp must be 64 or 128, got {tkp}")
    S = splits or default_splits(fmt, G, N, K, tn, tkp)
    if not _valid_split(fmt, K, S, tkp):
        raise ValueError(f"splits={S} is not a valid K split for {fmt} K={K}")
    nk = _steps(fmt, K, tkp) // S
    st = choose_stages(fmt, tn, M, nk, tkp=tkp, **({"max_stages": stages} if stages else {}))
    ex = expert_G.astype(jnp.int32)
    if fmt == "fp8":
        args = (x_GMK, ex, w.w, _u8(w.scale))
    else:
        args = (fp4_x_layout(x_GMK), ex, _u8(w.packed), _u8(w.scale))
    part = _stream_call(fmt, *args, G=G, M=M, N=N, K=K, tn=tn, splits=S, stages=st,
                        interpret=interpret, tkp=tkp,
                        reg_a=not interpret and (REG_A if reg_a is None else reg_a))
    # The split sum as adds of static slices (not a reduce): XLA fuses elementwise adds into
    # the consumer's fusion, where a reduce would be a kernel of its own after every call.
    y = part[0]
    for i in range(1, S):
        y = y + part[i]
    return y.transpose(0, 2, 1)
