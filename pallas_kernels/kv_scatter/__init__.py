"""Quantise-and-scatter of new KV rows into the cache: Mosaic-GPU kernel (kernel.py, in place
through refs) and pure-JAX/XLA path (reference.py, `.at[].set`), bit-identical caches.

    win = append_window(win, kv_BD, pos_B, impl="pallas" | "xla", interpret=False)
    pool, idx_pool = flush_compressed(pool, idx_pool, entry_BD, key_BK, flush_B, entry_idx_B,
                                      block_table_RM, fmt="fp4", impl=, interpret=)

Both paths update in place when the caller donates the cache; both are launch-latency
bound at decode batch sizes (one row per request). interpret: a bool, or
plgpu.InterpretGPUParams (the Mosaic GPU interpreter, CPU).
"""
from pallas_kernels.kv_scatter import kernel, reference


def append_window(win, kv_BD, pos_B, *, impl="pallas", interpret=False):
    if impl == "pallas":
        return kernel.append_window(win, kv_BD, pos_B, interpret=interpret)
    _check_impl(impl)
    return reference.append_window(win, kv_BD, pos_B)


def flush_compressed(pool, idx_pool, entry_BD, key_BK, flush_B, entry_idx_B, block_table_RM,
                     *, fmt="fp4", impl="pallas", interpret=False):
    args = (pool, idx_pool, entry_BD, key_BK, flush_B, entry_idx_B, block_table_RM)
    if impl == "pallas":
        return kernel.flush_compressed(*args, fmt=fmt, interpret=interpret)
    _check_impl(impl)
    return reference.flush_compressed(*args, fmt=fmt)


def _check_impl(impl):
    if impl != "xla":
        raise ValueError(f"kv_scatter: impl must be 'pallas' or 'xla', got {impl!r}")


__all__ = ["append_window", "flush_compressed", "kernel", "reference"]
