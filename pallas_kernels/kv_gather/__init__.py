"""Gathers of quantised KV entries with fused dequantisation: Mosaic-GPU kernel (kernel.py)
and pure-JAX/XLA path (reference.py), bit-identical outputs.

`impl` picks the path. Default "xla": on the H100 (2026-11-22, see
benchmarks/results/kv_scatter_gather.md) XLA's fused gather+dequant ran 1.2-1.5x faster than
the kernel at B=64; use "pallas" to run the kernel (or to measure it again).
"""
from pallas_kernels.kv_gather import kernel, reference


def gather_topk(pool, block_table, idx_BK, *, impl="xla", interpret=None):
    if impl == "pallas":
        return kernel.gather_topk(pool, block_table, idx_BK, interpret=interpret)
    _check_impl(impl)
    return reference.gather_topk(pool, block_table, idx_BK)


def gather_all(pool, block_table, n_entries_B, max_entries, *, impl="xla", interpret=None):
    if impl == "pallas":
        return kernel.gather_all(pool, block_table, n_entries_B, max_entries, interpret=interpret)
    _check_impl(impl)
    return reference.gather_all(pool, block_table, n_entries_B, max_entries)


def gather_window(win, *, impl="xla", interpret=None):
    if impl == "pallas":
        return kernel.gather_window(win, interpret=interpret)
    _check_impl(impl)
    return reference.gather_window(win)


def _check_impl(impl):
    if impl != "xla":
        raise ValueError(f"kv_gather: impl must be 'pallas' or 'xla', got {impl!r}")


__all__ = ["gather_all", "gather_topk", "gather_window", "kernel", "reference"]
