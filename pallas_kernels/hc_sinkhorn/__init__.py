"""mHC mixing matrix (row softmax + Sinkhorn) as one Pallas (Triton-backend) kernel.

    C_MNN = sinkhorn_softmax(logits_MNN, iters, eps[, interpret=True])
    C_MNN = sinkhorn_softmax_reference(logits_MNN, iters, eps)
    C_MNN = mhc_comb(s_MK, q_MK, scale, base, N=, nd=, iters=, eps=, rms_eps=)  # from raw sums
    C_MNN = mhc_comb_reference(s_MK, q_MK, scale, base, N, nd, iters, eps, rms_eps)
"""
from pallas_kernels.hc_sinkhorn.kernel import mhc_comb, sinkhorn_softmax
from pallas_kernels.hc_sinkhorn.reference import mhc_comb_reference, sinkhorn_softmax_reference
