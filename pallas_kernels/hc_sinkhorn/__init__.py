"""mHC mixing matrix (row softmax + Sinkhorn) as one Pallas (Triton-backend) kernel.

    C_MNN = sinkhorn_softmax(logits_MNN, iters, eps[, interpret=True])
    C_MNN = sinkhorn_softmax_reference(logits_MNN, iters, eps)
"""
from pallas_kernels.hc_sinkhorn.kernel import sinkhorn_softmax
from pallas_kernels.hc_sinkhorn.reference import sinkhorn_softmax_reference
