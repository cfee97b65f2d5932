"""Training a small DeepSeek-V4 model on the pure-JAX forward (optional extra `train`:
optax). Data: the Python standard library's source (PSF licence), a byte-level BPE
tokenizer with the DSV4 chat special tokens, AdamW on f32 master weights with FP8/FP4
fake quantisation, export to the release on-disk format that `dsv4_jax.load` reads.

    python -m training all --out runs/small        # prepare + train + export (docs/TRAINING.md)
"""
