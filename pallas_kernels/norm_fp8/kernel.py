"""RMSNorm + the FP8 activation simulation + row padding as ONE small Pallas kernel (Triton
backend), for the normalised activations that feed a weight-streaming matmul at decode.

XLA spends three kernels on this chain: the sum of squares, the per-128 amax of the
normalised row, then normalise + quantise + pad to 8 rows (the amax needs the whole
normalised block, the normalisation the whole row's sum). One program per output row
here, the row held in registers as [D/128, 128] tiles: the sum of squares, then each tile
normalised, stored as bf16 and quantised per 128-wide block (e4m3, power-of-two scale,
amax floor 1e-4, exactly kvformat.fp8_block_sim) with whole-tile reductions. Rows past M
are zero in the padded output. (The first version looped over 128-wide blocks, a small
reduction each: ~20 us a call on the H100.)

Numerics: yq is fp8_block_sim of the kernel's own y, bit for bit; y is layers.rms_norm up
to the order of the sum of squares (a last-bit difference in the scale can move a bf16
rounding, and then an e4m3 rounding).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 128                        # FP8 activation scale block
INV_E4M3_MAX = 1.0 / 448.0
AMAX_FLOOR = 1e-4


def _tile_rows(nb: int) -> int:
    """128-wide blocks per tile: the largest power of two dividing nb, at most 32 (Triton
    tiles are powers of two; D = 4096: one [32, 128] tile, 7168: 7 x [8, 128])."""
    return min(nb & -nb, 32)


def _kernel(*refs, M, D, eps, has_w):
    if has_w:
        x_ref, w_ref, y_ref, q_ref = refs
    else:
        (x_ref, y_ref, q_ref), w_ref = refs, None
    G = _tile_rows(D // BLOCK)
    _norm_rows(lambda t: x_ref[0, pl.ds(t * G, G), :].astype(jnp.float32), M, D, eps, w_ref,
               y_ref, q_ref)


def _norm_rows(tile, M, D, eps, w_ref, y_ref, q_ref):
    """This program's row, as D // 128 blocks of 128 (refs [.., D // 128, 128]) taken G
    at a time: tile(t) -> f32 [G, 128] = blocks t*G .. t*G+G-1 of the input row. The tiles
    stay in registers between the sum of squares and the normalisation; every reduction is
    a whole-tile one (no per-block loop: a loop of 32 small reductions cost ~20 us)."""
    G = _tile_rows(D // BLOCK)
    live = pl.program_id(0) < M        # rows M.. of yq are padding: zeros
    xs = [tile(t) for t in range(D // BLOCK // G)]
    ss = xs[0] * xs[0]
    for xb in xs[1:]:
        ss = ss + xb * xb
    r = lax.rsqrt(jnp.sum(jnp.sum(ss, axis=1)) / D + eps)   # (2 steps: a 2-d -> scalar sum trips
    # sharding checks when traced under an abstract mesh)
    for t, xb in enumerate(xs):
        _norm_sim_store(xb, r, w_ref, y_ref, q_ref, pl.ds(t * G, G), live)


def _norm_sim_store(xb, r, w_ref, y_ref, q_ref, blocks, live):
    """Blocks [G, 128]: y = bf16(xb * r [* w]) -> y_ref; its e4m3 simulation (power-of-two
    scale per block from its amax, as kvformat.fp8_block_sim) -> q_ref (zeros if not live)."""
    yb = xb * r
    if w_ref is not None:
        yb = yb * w_ref[blocks, :].astype(jnp.float32)
    yb = yb.astype(jnp.bfloat16)
    y_ref[0, blocks, :] = yb
    yf = yb.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(yf), axis=1, keepdims=True), AMAX_FLOOR)   # [G, 1]
    bits = lax.bitcast_convert_type(amax * INV_E4M3_MAX, jnp.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)  # 2^ceil(log2)
    inv = lax.bitcast_convert_type((254 - e) << 23, jnp.float32)              # 1 / s
    s = lax.bitcast_convert_type(e << 23, jnp.float32)                        # s
    qv = jnp.clip(yf * inv, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    q_ref[0, blocks, :] = jnp.where(live, qv * s, 0.0).astype(jnp.bfloat16)


def _hc_kernel(X_ref, s_ref, q_ref, scale_ref, base_ref, w_ref, y_ref, yq_ref, *, M, N, D,
               eps, rms_eps, hc_eps):
    """hc_norm_fp8's program for one output row: the mHC collapse weights from the site's
    raw sums, the collapse (rounded to bf16, as layers.hc_collapse), then as _kernel."""
    # pre_i = sigmoid((s_i * rsqrt(q / (N*D) + rms_eps)) * scale_0 + base_i) + hc_eps, [1] each
    rr = lax.rsqrt(q_ref[0, pl.ds(0, 1)] / (N * D) + rms_eps)
    pre = [jax.nn.sigmoid(s_ref[0, pl.ds(i, 1)] * rr * scale_ref[pl.ds(0, 1)]
                          + base_ref[pl.ds(i, 1)]) + hc_eps for i in range(N)]
    G = _tile_rows(D // BLOCK)

    def collapse(t):
        blocks = pl.ds(t * G, G)
        acc = pre[0] * X_ref[0, 0, blocks, :].astype(jnp.float32)
        for i in range(1, N):
            acc = acc + pre[i] * X_ref[0, i, blocks, :].astype(jnp.float32)
        return acc.astype(jnp.bfloat16).astype(jnp.float32)

    _norm_rows(collapse, M, D, eps, w_ref, y_ref, yq_ref)


@functools.partial(jax.jit, static_argnames=("eps", "rows", "interpret"))
def rms_norm_fp8(x_MD, w_D, *, eps: float, rows: int, interpret: bool = False):
    """x [M, D] (any float), w [D] or None -> (y bf16 [M, D], yq bf16 [rows, D]); see
    reference.rms_norm_fp8_reference. D must be a multiple of 128, rows >= M."""
    M, D = x_MD.shape
    if D % BLOCK:
        raise ValueError(f"rms_norm_fp8 needs D % {BLOCK} == 0, got x {x_MD.shape}")
    if rows < M:
        raise ValueError(f"rms_norm_fp8: rows={rows} < M={M}")
    if w_D is not None and w_D.shape != (D,):
        raise ValueError(f"rms_norm_fp8: w must be [{D}], got {w_D.shape}")
    nb = D // BLOCK                                # rows seen as [nb, 128] blocks (free views)
    clamp = lambda m: (jnp.minimum(m, M - 1), 0, 0)  # rows M.. recompute row M-1 (not stored)
    in_specs = [pl.BlockSpec((1, nb, BLOCK), clamp)]
    args = [x_MD.reshape(M, nb, BLOCK)]
    if w_D is not None:
        in_specs.append(pl.BlockSpec((nb, BLOCK), lambda m: (0, 0)))
        args.append(w_D.reshape(nb, BLOCK))
    y, yq = pl.pallas_call(
        functools.partial(_kernel, M=M, D=D, eps=eps, has_w=w_D is not None),
        out_shape=(jax.ShapeDtypeStruct((M, nb, BLOCK), jnp.bfloat16),
                   jax.ShapeDtypeStruct((rows, nb, BLOCK), jnp.bfloat16)),
        grid=(rows,),
        in_specs=in_specs,
        # y: the padding programs write row M-1's own values again (identical bytes)
        out_specs=(pl.BlockSpec((1, nb, BLOCK), clamp),
                   pl.BlockSpec((1, nb, BLOCK), lambda m: (m, 0, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(*args)
    return y.reshape(M, D), yq.reshape(rows, D)


@functools.partial(jax.jit, static_argnames=("N", "eps", "rms_eps", "hc_eps", "rows",
                                             "interpret"))
def hc_norm_fp8(X_MND, s_MK, q_MK, scale, base, w_D, *, N: int, eps: float, rms_eps: float,
                hc_eps: float, rows: int, interpret: bool = False):
    """An mHC site's collapse + RMSNorm + FP8 simulation in one kernel: X [M, N, D] (the
    residual streams), s [M, 2N + N^2] / q [M, >= 1] (the site's raw sums, layers.hc_sums),
    scale [3], base [2N + N^2], w [D] -> (y bf16 [M, D] = rms_norm(hc_collapse(X, pre), w),
    yq bf16 [rows, D]) with pre = sigmoid(s[:, :N] * rsqrt(q[:, :1] / (N*D) + rms_eps) *
    scale[0] + base[:N]) + hc_eps (layers.hc_weights). See reference.hc_norm_fp8_reference."""
    M, N_, D = X_MND.shape
    K = s_MK.shape[1]
    if N_ != N or N & (N - 1) or D % BLOCK or K != 2 * N + N * N:
        raise ValueError(f"hc_norm_fp8 needs X [M, {N} (a power of two), D % {BLOCK} == 0] "
                         f"and s [M, 2N + N^2]; got X {X_MND.shape}, s {s_MK.shape}")
    if (s_MK.shape[0] != M or q_MK.ndim != 2 or q_MK.shape[0] != M or scale.shape != (3,)
            or base.shape != (K,) or w_D.shape != (D,)):
        raise ValueError(f"hc_norm_fp8: s/q must be [{M}, .], scale [3], base [{K}], w [{D}]; "
                         f"got {s_MK.shape}, {q_MK.shape}, {scale.shape}, {base.shape}, "
                         f"{w_D.shape}")
    if rows < M:
        raise ValueError(f"hc_norm_fp8: rows={rows} < M={M}")
    nb = D // BLOCK                                # rows seen as [nb, 128] blocks (free views)
    row = lambda m: (jnp.minimum(m, M - 1), 0)
    row3 = lambda m: (jnp.minimum(m, M - 1), 0, 0)
    full = lambda m: (0,)
    y, yq = pl.pallas_call(
        functools.partial(_hc_kernel, M=M, N=N, D=D, eps=eps, rms_eps=rms_eps, hc_eps=hc_eps),
        out_shape=(jax.ShapeDtypeStruct((M, nb, BLOCK), jnp.bfloat16),
                   jax.ShapeDtypeStruct((rows, nb, BLOCK), jnp.bfloat16)),
        grid=(rows,),
        in_specs=[pl.BlockSpec((1, N, nb, BLOCK), lambda m: (jnp.minimum(m, M - 1), 0, 0, 0)),
                  pl.BlockSpec((1, K), row), pl.BlockSpec((1, q_MK.shape[1]), row),
                  pl.BlockSpec((3,), full), pl.BlockSpec((K,), full),
                  pl.BlockSpec((nb, BLOCK), lambda m: (0, 0))],
        out_specs=(pl.BlockSpec((1, nb, BLOCK), row3),
                   pl.BlockSpec((1, nb, BLOCK), lambda m: (m, 0, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(X_MND.reshape(M, N, nb, BLOCK), s_MK.astype(jnp.float32), q_MK.astype(jnp.float32),
      scale.astype(jnp.float32), base.astype(jnp.float32), w_D.reshape(nb, BLOCK))
    return y.reshape(M, D), yq.reshape(rows, D)
