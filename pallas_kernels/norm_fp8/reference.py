"""Pure-JAX reference: RMSNorm, then the FP8 activation simulation padded to kernel rows."""
import jax
import jax.numpy as jnp

from dsv4_jax.kvformat import fp8_block_sim


def rms_norm_fp8_reference(x_MD, w_D, eps: float, rows: int):
    """x [M, D], w [D] or None -> (y bf16 [M, D] = RMSNorm(x) * w, yq bf16 [rows, D] =
    fp8_block_sim(y, 128) with rows M.. zero). The same ops as layers.rms_norm."""
    xf = x_MD.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    if w_D is not None:
        y = y * w_D.astype(jnp.float32)
    y = y.astype(jnp.bfloat16)
    yq = fp8_block_sim(y, 128)
    return y, jnp.pad(yq, ((0, rows - y.shape[0]), (0, 0)))

