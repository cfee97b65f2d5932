"""Sparse decode attention (window + compressed entries + sink): Mosaic-GPU kernel and the
pure-JAX path."""
from pallas_kernels.sparse_decode_attention.kernel import (prepare_inputs,
                                                           sparse_decode_attention)
from pallas_kernels.sparse_decode_attention.reference import (hca_indices,
                                                              sparse_decode_attention_reference)
