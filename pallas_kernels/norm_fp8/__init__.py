"""RMSNorm + FP8 activation simulation + row padding as one Pallas (Triton-backend) kernel.

    y_MD, yq_RD = rms_norm_fp8(x_MD, w_D, eps=, rows=[, interpret=True])
    y_MD, yq_RD = rms_norm_fp8_reference(x_MD, w_D, eps, rows)
    y_MD, yq_RD = hc_norm_fp8(X_MND, s_MK, q_MK, scale, base, w_D, N=, eps=, rms_eps=,
                              hc_eps=, rows=)     # an mHC site's collapse first
    y_MD, yq_RD = hc_norm_fp8_reference(X_MND, s_MK, q_MK, scale, base, w_D, N, eps,
                                        rms_eps, hc_eps, rows)
"""
from pallas_kernels.norm_fp8.kernel import hc_norm_fp8, rms_norm_fp8
from pallas_kernels.norm_fp8.reference import hc_norm_fp8_reference, rms_norm_fp8_reference
