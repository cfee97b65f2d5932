"""Shared test setup (imported by test modules): a tiny Engine with two requests prefilled
to random lengths (one past a CSA/HCA block boundary), their next blocks reserved, and the
arguments of one decode step of both (attention_cached's after (lc, x))."""
import jax.numpy as jnp
import numpy as np

from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine


def two_prefilled_requests(cfg, params, nm, seed: int = 601, **cache_kw):
    """-> (eng, cs, x [2, 1, D] bf16 random (seeded), args (tok_pos, valid, slots, pos, nvalid,
    block_table)). cache_kw: more CacheSpec fields (e.g. index_format)."""
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=4, max_blocks=2, **cache_kw)
    eng = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=64)
    rng = np.random.default_rng(seed)
    lens = [int(rng.integers(130, 200)), int(rng.integers(5, 128))]
    for n in lens:
        eng.prefill(eng.bm.admit(n), rng.integers(0, cfg.vocab_size, n))
    eng.bm.ensure_many({0: lens[0] + 1, 1: lens[1] + 1})
    x = jnp.asarray(rng.standard_normal((2, 1, cfg.hidden_size)), jnp.bfloat16)
    pos = jnp.asarray(lens, jnp.int32)
    args = (pos[:, None], jnp.ones((2, 1), bool), jnp.arange(2), pos, jnp.ones(2, jnp.int32),
            jnp.asarray(eng.bm.table))
    return eng, cs, x, args
