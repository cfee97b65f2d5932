"""RMSNorm + FP8 activation simulation + row padding as one Pallas (Triton-backend) kernel.

    y_MD, yq_RD = rms_norm_fp8(x_MD, w_D, eps=, rows=[, interpret=True])
    y_MD, yq_RD = rms_norm_fp8_reference(x_MD, w_D, eps, rows)
"""
from pallas_kernels.norm_fp8.kernel import rms_norm_fp8
from pallas_kernels.norm_fp8.reference import rms_norm_fp8_reference
