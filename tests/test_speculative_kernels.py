"""Speculative decoding with the Pallas kernels on (the Mosaic GPU interpreter on CPU):
the MTP block's chained drafts step through the T == 1 kernel path, the verify and the
prefill through the chunk path. Greedy tokens equal those of the same engine with the
kernels off, and those of greedy decoding without speculation."""
import numpy as np

from dsv4_jax import config, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics

SIM = Numerics(act_quant=True, dtype="bfloat16")


def test_speculative_with_kernels_interpreted():
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1)
    params = P.init_params(cfg, 3901)
    rng = np.random.default_rng(3902)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (126, 9)]
    out = {}
    for kernels in ("interpret", "off"):
        cs = CacheSpec.for_numerics(SIM, max_requests=2, num_blocks=8, max_blocks=2,
                                    kernels=kernels, attention_backend="triton")
        eng = Engine(cfg, params, numerics=SIM, cache_spec=cs, prefill_chunk=64,
                     progress=False)
        out[kernels] = eng.generate(prompts, max_new_tokens=5, speculative_tokens=2)
        assert eng.acceptance["overall"] >= 1
    assert out["interpret"] == out["off"]
    plain = eng.generate(prompts, max_new_tokens=5)   # kernels off, no speculation
    assert out["off"] == plain
