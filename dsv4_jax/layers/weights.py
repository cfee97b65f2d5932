"""A block's weights by name: the entries of a params dict under a prefix, with the merged
weights of the decode form (params.merge_x_proj, params.ROW_MERGES) shown as row views
under the names of their parts.

    bp = block_params(params, "layers.3.")      # {"attn.wq_a": ..., "ffn.gate.weight": ...}
"""
from __future__ import annotations

import numpy as np

from ..params import ROW_MERGES, X_PROJ, X_PROJ_PARTS
from ..quant import WeightRows


def block_params(p: dict, prefix: str) -> dict:
    """The entries of p under `prefix`, the prefix stripped. An attention block stored in
    decode form (params.merge_x_proj: "x_proj_merged" among its keys) also shows the five
    weights it holds under their own names, as row views (`x_proj_views`), so that
    block_params(ap, "compressor.") etc. look the same in either form."""
    if X_PROJ in p:
        p = {**p, **x_proj_views(p)}
    if any(k.endswith(tuple(ROW_MERGES)) for k in p):
        p = {**p, **row_merge_views(p)}
    n = len(prefix)
    return {k[n:]: v for k, v in p.items() if k.startswith(prefix)}


def x_proj_views(ap: dict) -> dict:
    """The five weights of an attention block's x_proj_merged [rows, D] (names and row
    order: params.X_PROJ_PARTS) as WeightRows views. The row split is read off the block
    itself, no config needed: each compressor's wkv and wgate have as many rows as its
    `ape` has columns; weights_proj has the rows left. Every matmul with a view multiplies
    x by the whole merged weight and slices (quant.f32_dot_bf16): the compressor, indexer
    compressor and indexer calls are then one and the same dot, which XLA computes once."""
    w = ap[X_PROJ]
    c, ci = ap["compressor.ape"].shape[-1], ap["indexer.compressor.ape"].shape[-1]
    sizes = (c, c, ci, ci, w.shape[0] - 2 * c - 2 * ci)
    if sizes[-1] <= 0:
        raise ValueError(f"{X_PROJ} has {w.shape[0]} rows, fewer than the compressors' "
                         f"{2 * c + 2 * ci}")
    ends = np.cumsum(sizes)
    return {k: WeightRows(w, int(e - n), int(e)) for k, n, e in zip(X_PROJ_PARTS, sizes, ends)}


def row_merge_views(p: dict) -> dict:
    """The ROW_MERGES weights among p's keys (a whole tree, or one block's keys relative to
    "layers.N.") as WeightRows views under the names of their parts. Splits: wqkv_a = wq_a
    rows, then wkv's (as many as kv_norm has); shared_experts.w13 and experts.w13 (stacked
    [E, 2I, D]) = w1 rows, then w3's (half each). A matmul with a view multiplies by the
    whole stored weight and slices (quant.linear, quant.grouped_linear): the two views'
    calls are one and the same kernel, which XLA computes once."""
    out = {}
    for k, w in p.items():
        for m, (a, b) in ROW_MERGES.items():
            if not (k == m or k.endswith("." + m)):
                continue
            base = k[:len(k) - len(m)]   # "" or "layers.N."
            rows = w.shape[-2]
            nb = (p[base + "attn.kv_norm.weight"].shape[0] if m == "attn.wqkv_a"
                  else rows // 2)
            out[base + a] = WeightRows(w, 0, rows - nb)
            out[base + b] = WeightRows(w, rows - nb, rows)
    return out
