"""Pure-JAX reference: RMSNorm, then the FP8 activation simulation padded to kernel rows."""
import jax
import jax.numpy as jnp

from pallas_kernels.formats import fp8_block_sim


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



def hc_norm_fp8_reference(X_MND, s_MK, q_MK, scale, base, w_D, N: int, eps: float,
                          rms_eps: float, hc_eps: float, rows: int):
    """The mHC collapse weights from the raw sums, the collapse (bf16), then
    rms_norm_fp8_reference: the ops of layers.hc_weights / hc_collapse / rms_norm."""
    D = X_MND.shape[-1]
    m = s_MK[:, :N].astype(jnp.float32) * jax.lax.rsqrt(
        q_MK[:, :1].astype(jnp.float32) / (N * D) + rms_eps)
    pre = jax.nn.sigmoid(m * scale[0] + base[:N]) + hc_eps                   # [M, N]
    Xf = X_MND.astype(jnp.float32)
    x = pre[:, 0, None] * Xf[:, 0]
    for i in range(1, N):
        x = x + pre[:, i, None] * Xf[:, i]
    return rms_norm_fp8_reference(x.astype(jnp.bfloat16), w_D, eps, rows)
