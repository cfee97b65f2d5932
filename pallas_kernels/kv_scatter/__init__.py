"""Quantise-and-scatter of new KV rows into the cache (Mosaic GPU kernel + XLA reference)."""
from pallas_kernels.kv_scatter.kernel import append_window, flush_compressed

__all__ = ["append_window", "flush_compressed"]
