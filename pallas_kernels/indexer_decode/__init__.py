"""Lightning indexer at decode: the Mosaic-GPU scoring kernel + the top-k selection kernel,
and the pure-JAX path.

    ids_BK = topk_keys(q_BHD, w_BH, keys, block_table, t_B, topk, fmt="fp4",
                       interpret=False, tuning=None)          # the decode step's call
    scores_BN = score_keys(q_BHD, w_BH, keys, block_table, t_B, fmt="fp4")
    ids_BK = indexer_topk_reference(q_BHD, w_BH, keys, block_table, t_B, topk, fmt="fp4")

Files: kernel.py (the scoring kernel), dequant.py (its key dequantisation), scores.py (each
key format's entry point and the CTA split), topk.py (scores + top-k), reference.py.
"""
from pallas_kernels.indexer_decode.reference import (indexer_scores_reference,
                                                     indexer_topk_reference, topk_reference)
from pallas_kernels.indexer_decode.scores import (Tuning, indexer_scores, indexer_scores_fp8,
                                                  indexer_scores_nvfp4, score_keys)
from pallas_kernels.indexer_decode.topk import topk_keys
