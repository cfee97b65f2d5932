"""Weight-streaming grouped quantised matmul for decode, Pallas Mosaic-GPU (Hopper, sm_90a).

    y_GMN[g, m, n] = sum_k x_GMK[g, m, k] * dequant(w)[expert_G[g], n, k]      (f32 acc)

Decode is memory bound: each CTA streams one weight tile column over (part of) K exactly
as stored (e4m3 bytes, or packed e2m1 nibbles + e8m0 bytes), dequantises it in registers
to bf16 (exact: the scales are powers of two) and multiplies it with the few activation
rows. A and B are swapped so the weight tile is the wgmma M side:

    per CTA (group g, weight rows n0:n0+128, K range of split s), per K step of 128:
      W tile e4m3 [128 n, 128 k]  --TMA-->  SMEM (NS stages)        x tile bf16 [M, 128 k]
      -> registers, * 2^(scale-127), -> bf16 [128 n, 128 k] in SMEM
      -> acc^T [128 n, M] += W_tile @ x_tile^T                         (wgmma, f32)
    out[s, g, n0:n0+128, :] = acc^T                                    (TMA store)
  then in XLA: y_GMN = sum_s out[s].transpose(0, 2, 1)  (tiny: f32 [S, G, N, M])

Empty groups (expert id outside [0, E)) issue no weight copies and store zeros.

FP4 (e2m1, packed 2 per byte, element 2k in the low nibble, one e8m0 per 32 along K):
x is de-interleaved in XLA (x_even, x_odd), so y = W_lo @ x_even + W_hi @ x_odd and the
nibbles never need reordering. Per step: packed tile uint8 [128 n, 64 B] (128 k) and
its scales uint8 [128 n, 4]; each 16-byte column chunk (one scale block) is decoded with
integer arithmetic (Hopper has no e2m1 casts) into its own bf16 SMEM tile [128, 16] for
each nibble half, and multiplied with the matching 16 columns of x_even / x_odd.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4_jax.quant import Fp4Weight, Fp8Weight

TN = 128          # weight rows (n) per CTA: the wgmma M side
TK = 128          # k per pipeline step (one FP8 scale block; 64 packed FP4 bytes)
NUM_SMS = 132     # H100 SXM
WG = plgpu.Layout.WGMMA
ROW = WG.reduce(1)


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


def default_splits(G, N, K, num_sms=NUM_SMS):
    """K splits per (group, n tile): enough CTAs for ~2 per SM, each still streaming
    several K steps. Must divide K // TK."""
    KT = K // TK
    ctas = G * (N // TN)
    best = 1
    for s in range(1, KT + 1):
        if KT % s == 0 and ctas * s <= 2 * num_sms:
            best = s
    return best


def _u8(a):
    return lax.bitcast_convert_type(a, jnp.uint8)


def _pow2(e_u8, shape):
    """e8m0 byte (scalar) -> f32 2^(e-127) splat to `shape` (e = 0 gives 0, not 2^-127).
    Built as a vector: Mosaic GPU does not lower scalar bitcasts."""
    bits = lax.broadcast(e_u8.astype(jnp.int32) << 23, shape)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _fp8_call(x_GMK, ex_G, w_ENK, sc_ENK, *, splits, stages, interpret):
    """f32 partials [S, G, N, M] from e4m3 weights + e8m0 (uint8) 128x128 block scales."""
    G, M, K = x_GMK.shape
    E, N, _ = w_ENK.shape
    KT = K // TK
    nk = KT // splits
    stages = max(1, min(stages, nk))
    tr8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    tr16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_g, ex_g, w_g, sc_g, o_g, w_s, x_s, wb_s, o_s, bar):
        g = lax.axis_index("g")
        nt = lax.axis_index("n")
        sp = lax.axis_index("s")
        e = ex_g[g]
        valid = (e >= 0) & (e < E)
        e = jnp.where(valid, e, 0)
        k0 = sp * nk
        rows = pl.ds(nt * TN, TN)

        def issue(j, slot):
            kk = pl.ds((k0 + j) * TK, TK)
            plgpu.copy_gmem_to_smem(w_g.at[e, rows, kk], w_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(x_g.at[g, :, kk], x_s.at[slot], bar.at[slot])

        def mma(acc_ref):
            @pl.when(valid)
            def _():
                for j in range(stages):
                    issue(j, j)

                def body(j, sc_raw):
                    slot = lax.rem(j, stages)
                    # next step's scale byte, loaded early so its latency hides
                    sc_next = sc_g[e, nt, k0 + jnp.minimum(j + 1, nk - 1)]
                    plgpu.barrier_wait(bar.at[slot])
                    wv = plgpu.load(w_s.at[slot], layout=WG).astype(jnp.float32)
                    wb_s[...] = (wv * _pow2(sc_raw, (TN, TK))).astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, wb_s, x_s.at[slot].T)
                    plgpu.wgmma_wait(0)

                    @pl.when(j + stages < nk)
                    def _():
                        issue(j + stages, slot)
                    return sc_next

                lax.fori_loop(0, nk, body, sc_g[e, nt, k0])
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((TN, M), jnp.float32))
        o_s[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[sp, g, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, G, N, M), jnp.float32),
        grid=(G, N // TN, splits), grid_names=("g", "n", "s"),
        scratch_types=dict(
            w_s=plgpu.SMEM((stages, TN, TK), jnp.float8_e4m3fn, transforms=tr8),
            x_s=plgpu.SMEM((stages, M, TK), jnp.bfloat16, transforms=tr16),
            wb_s=plgpu.SMEM((TN, TK), jnp.bfloat16, transforms=tr16),
            o_s=plgpu.SMEM((TN, M), jnp.float32),
            bar=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ),
        interpret=interpret,
    )(x_GMK, ex_G, w_ENK, sc_ENK)


def grouped_matmul_pallas(x_GMK, expert_G, w, *, splits=None, stages=4, interpret=None):
    """The kernel path: f32 [G, M, N]. See the module docstring."""
    check_inputs(x_GMK, expert_G, w)
    G, M, K = x_GMK.shape
    E, N, _ = w.shape
    S = splits or default_splits(G, N, K)
    if (K // TK) % S:
        raise ValueError(f"splits={S} must divide K/{TK}={K // TK}")
    ex = expert_G.astype(jnp.int32)
    if isinstance(w, Fp8Weight):
        part = _fp8_call(x_GMK, ex, w.w, _u8(w.scale), splits=S, stages=stages,
                         interpret=interpret)
    else:
        part = _fp4_call(x_GMK, ex, _u8(w.packed), _u8(w.scale), splits=S, stages=stages,
                         interpret=interpret)
    return part.sum(0).transpose(0, 2, 1)


def _fp4_call(*args, **kw):
    raise NotImplementedError("FP4 kernel not written yet")
