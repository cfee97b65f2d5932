"""Sparse prefill attention: many query rows, each attending its window band plus its own
compressed entries (CSA top-k ids, or every visible entry for HCA), with the sink.
Semantics and shapes: reference.py; the Hopper kernel: kernel.py.

    out_RHD = sparse_prefill_attention(q_RHD, win_KD, wbias_K, ents_ND, ids_RL, ncmp_R,
                                       woff_R, coff_R, sink_H, impl="pallas")
    win_KD, wbias_K = window_table(ring_WD, ring_pos_W, kv_TD, pos0, nvalid)
"""
import jax.numpy as jnp

from pallas_kernels.interpret import gpu_interpret_params
from pallas_kernels.sparse_prefill_attention.kernel import BLK, D, HALF, HT, _call
from pallas_kernels.sparse_prefill_attention.reference import (
    WINDOW, sparse_prefill_attention_reference, window_table)

IMPLS = ("pallas", "interpret", "xla")


def sparse_prefill_attention(q_RHD, win_KD, wbias_K, ents_ND, ids_RL, ncmp_R, woff_R,
                             coff_R, sink_H, *, impl="pallas", window=WINDOW, bf16_p=True):
    """-> f32 [R, H, 512] (reference.py). impl: "pallas" (Hopper kernel), "interpret" (the
    kernel on the Mosaic GPU interpreter), "xla" (the blocked reference). ids_RL None: HCA
    (row r's entries are ents_ND[coff[r] : coff[r] + ncmp[r]]). The kernel rounds p to
    bf16 (bf16_p must be True) and takes window % 64 == 0."""
    if q_RHD.shape[-1] != D or win_KD.shape[-1] != D or ents_ND.shape[-1] != D:
        raise ValueError(f"head dim must be {D}: q {q_RHD.shape}, win {win_KD.shape}, "
                         f"ents {ents_ND.shape}")
    if impl == "xla":
        return sparse_prefill_attention_reference(q_RHD, win_KD, wbias_K, ents_ND, ids_RL,
                                                  ncmp_R, woff_R, coff_R, sink_H,
                                                  bf16_p=bf16_p, window=window)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not bf16_p or window % BLK:
        raise ValueError(f"the kernel rounds p to bf16 and needs window % {BLK} == 0")
    R, H, _ = q_RHD.shape
    HP = -(-H // HT) * HT
    q = jnp.pad(q_RHD.astype(jnp.bfloat16), ((0, 0), (0, HP - H), (0, 0)))
    sink = jnp.pad(sink_H.astype(jnp.float32), (0, HP - H))
    NW = win_KD.shape[0]
    ents = ents_ND if ents_ND.shape[0] else jnp.zeros((1, D), win_KD.dtype)
    kt = jnp.concatenate([win_KD.astype(jnp.bfloat16), ents.astype(jnp.bfloat16)])
    kt = kt.reshape(-1, 2, HALF)           # [NK, 2, 256]: a row's TMA box is at most 256 wide
    ids = None
    if ids_RL is not None:
        L = ids_RL.shape[1]
        ids = jnp.pad(ids_RL.astype(jnp.int32), ((0, 0), (0, -L % BLK)), constant_values=-1)
    i32 = lambda a: a.astype(jnp.int32)
    out = _call(q, kt, wbias_K.astype(jnp.float32), ids, i32(ncmp_R), i32(woff_R),
                i32(coff_R) + NW, sink, window=window,
                interpret=gpu_interpret_params(impl == "interpret"))
    return out[:, :H]


__all__ = ["IMPLS", "WINDOW", "sparse_prefill_attention", "sparse_prefill_attention_reference",
           "window_table"]
