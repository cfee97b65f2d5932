"""The decode step's indexer call: kernel scores, then the top-k selection kernel.

    ids_BK = topk_keys(q_BHD, w_BH, keys, block_table, t_B, topk, fmt=, interpret=, tuning=)
ids [B, topk] int32: the entries with the topk largest scores, ascending, -1 padded (ties:
the lower id). The selection kernel (pallas_kernels/topk_select, a radix select) reads the
scoring kernel's untrimmed rows in place: XLA's lax.top_k sorts each row instead (57 us
against 242 at B = 64, 32K entries a row, H100).
"""
from pallas_kernels.indexer_decode.kernel import EPB
from pallas_kernels.indexer_decode.scores import score_keys
from pallas_kernels.topk_select import topk_select


def topk_keys(q_BHD, w_BH, keys, block_table, t_B, topk, *, fmt="fp4", interpret=False,
              tuning=None):
    """Top-k entry ids [B, topk] int32 of the index scores (scores.score_keys: keys the pool's
    dict of fields in format fmt), ascending, -1 padded. The same set as
    reference.indexer_topk_reference up to ties at the k-th score. interpret: a bool, or
    plgpu.InterpretGPUParams; tuning: scores.Tuning."""
    s = score_keys(q_BHD, w_BH, keys, block_table, t_B, fmt=fmt, interpret=interpret,
                   tuning=tuning, trim=False)
    return topk_select(s, topk, n=block_table.shape[1] * EPB,
                       interpret=interpret is not None and interpret is not False)
