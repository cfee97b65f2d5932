"""Lightning indexer at decode: Mosaic-GPU scoring kernels + XLA top-k, and the pure-JAX path."""
from pallas_kernels.indexer_decode.kernel import (indexer_scores, indexer_scores_fp8,
                                                  indexer_scores_nvfp4, indexer_topk,
                                                  score_keys, topk_from_scores, topk_keys)
from pallas_kernels.indexer_decode.reference import (indexer_scores_reference,
                                                     indexer_topk_reference, topk_reference)
