"""Lightning indexer at decode: Mosaic-GPU scoring kernel + XLA top-k, and the pure-JAX path."""
from pallas_kernels.indexer_decode.kernel import indexer_scores, indexer_topk, topk_from_scores
from pallas_kernels.indexer_decode.reference import (indexer_scores_reference,
                                                     indexer_topk_reference, topk_reference)
