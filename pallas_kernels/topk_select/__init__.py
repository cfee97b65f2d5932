"""Exact top-k selection (radix select) as a Pallas Triton kernel, and its pure-JAX contract."""
from pallas_kernels.topk_select.kernel import topk_select
from pallas_kernels.topk_select.reference import topk_select_reference
