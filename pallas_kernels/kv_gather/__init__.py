"""Gathers of quantised KV entries with fused dequantisation (Mosaic GPU kernel + XLA reference)."""
from pallas_kernels.kv_gather.kernel import gather_all, gather_topk, gather_window

__all__ = ["gather_all", "gather_topk", "gather_window"]
