"""mHC mixing matrix (row softmax + Sinkhorn) from a site's raw sums as one Pallas
(Triton-backend) kernel.

    C_MNN = mhc_comb(s_MK, q_MK, scale, base, N=, nd=, iters=, eps=, rms_eps=)
    C_MNN = mhc_comb_reference(s_MK, q_MK, scale, base, N, nd, iters, eps, rms_eps)
    C_MNN = sinkhorn_softmax_reference(logits_MNN, iters, eps)     # the matrix part alone
"""
from pallas_kernels.hc_sinkhorn.kernel import mhc_comb
from pallas_kernels.hc_sinkhorn.reference import mhc_comb_reference, sinkhorn_softmax_reference
