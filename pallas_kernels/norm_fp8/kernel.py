"""RMSNorm + the FP8 activation simulation + row padding as ONE small Pallas kernel (Triton
backend), for the normalised activations that feed a weight-streaming matmul at decode.

XLA spends three kernels on this chain: the sum of squares, the per-128 amax of the
normalised row, then normalise + quantise + pad to 8 rows (the amax needs the whole
normalised block, the normalisation the whole row's sum). One program per output row
here: pass 1 sums the squares in 128-wide blocks, pass 2 normalises each block, stores the
bf16 row, and quantises the block (e4m3, power-of-two scale per 128, amax floor 1e-4,
exactly kvformat.fp8_block_sim). Rows past M are zero in the padded output.

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


def _kernel(*refs, M, D, eps, has_w):
    if has_w:
        x_ref, w_ref, y_ref, q_ref = refs
    else:
        (x_ref, y_ref, q_ref), w_ref = refs, None
    live = pl.program_id(0) < M        # rows M.. of yq are padding: zeros
    nb = D // BLOCK

    def ss(j, acc):
        xb = x_ref[0, pl.ds(j * BLOCK, BLOCK)].astype(jnp.float32)
        return acc + xb * xb
    r = lax.rsqrt(jnp.sum(lax.fori_loop(0, nb, ss, jnp.zeros((BLOCK,), jnp.float32))) / D
                  + eps)

    @pl.loop(0, nb)
    def _(j):
        cols = pl.ds(j * BLOCK, BLOCK)
        yb = x_ref[0, cols].astype(jnp.float32) * r
        if has_w:
            yb = yb * w_ref[cols].astype(jnp.float32)
        yb = yb.astype(jnp.bfloat16)
        y_ref[0, cols] = yb
        yf = yb.astype(jnp.float32)
        amax = jnp.maximum(jnp.max(jnp.abs(yf)), AMAX_FLOOR)
        bits = lax.bitcast_convert_type(jnp.full((BLOCK,), amax * INV_E4M3_MAX, jnp.float32),
                                        jnp.int32)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)  # 2^ceil(log2)
        inv = lax.bitcast_convert_type((254 - e) << 23, jnp.float32)              # 1 / s
        s = lax.bitcast_convert_type(e << 23, jnp.float32)                        # s
        qv = jnp.clip(yf * inv, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        q_ref[0, cols] = jnp.where(live, qv * s, 0.0).astype(jnp.bfloat16)


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
    clamp = lambda m: (jnp.minimum(m, M - 1), 0)   # rows M.. recompute row M-1 (not stored)
    in_specs = [pl.BlockSpec((1, D), clamp)]
    args = [x_MD]
    if w_D is not None:
        in_specs.append(pl.BlockSpec((D,), lambda m: (0,)))
        args.append(w_D)
    return pl.pallas_call(
        functools.partial(_kernel, M=M, D=D, eps=eps, has_w=w_D is not None),
        out_shape=(jax.ShapeDtypeStruct((M, D), jnp.bfloat16),
                   jax.ShapeDtypeStruct((rows, D), jnp.bfloat16)),
        grid=(rows,),
        in_specs=in_specs,
        # y: the padding programs write row M-1's own values again (identical bytes)
        out_specs=(pl.BlockSpec((1, D), clamp), pl.BlockSpec((1, D), lambda m: (m, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(*args)
