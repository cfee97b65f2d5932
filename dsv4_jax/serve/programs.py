"""The serving step programs: the engine's cached step with the per-row sampler in the
same XLA program, so the logits never leave it and one launch does both.

    run = step_and_sample(engine)
    cache, (tok_B, logprob_B, top_ids_BK, top_lp_BK) = run(state, cache, tokens_BT,
                                                          slots_B, pos_B, nvalid_B,
                                                          table_RM, rows, steps_B)

One compilation per (B, T): a prefill chunk [1, C] and the decode step [R, 1]. Single
device only; a mesh or pipeline engine serves through its own step program and the
separate sampler (serve.sampling.sample_rows), which `run_step` picks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..cache import CacheSpec
from ..decode import STEP_COMPILER_OPTIONS
from ..nnx_model import apply_step
from ..quant import Numerics
from .sampling import TOP_LOGPROBS, _sample_rows, sample_rows


@functools.lru_cache(maxsize=None)
def step_and_sample(graphdef, cs: CacheSpec, nm: Numerics):
    """jit: (state, cache, tokens [B, T], slots / pos / nvalid [B], table [R, MAXB], rows
    {name: [B]}, steps [B]) -> (new cache, sample_rows' outputs), the cache donated."""
    apply = functools.partial(apply_step, graphdef, cs=cs, nm=nm)

    def run(state, cache, tokens, slots, pos, nvalid, table, rows, steps):
        logits, cache = apply(state, cache, tokens, slots, pos, nvalid, table)
        return cache, _sample_rows(logits, rows, steps, n_top=TOP_LOGPROBS)
    return jax.jit(run, donate_argnums=(1,), compiler_options=STEP_COMPILER_OPTIONS)


def run_step(eng, tokens, slots, pos, nvalid, rows, steps):
    """One step of the engine with sampling -> device arrays (tokens [B], logprobs [B],
    top ids [B, K], top logprobs [B, K]); the engine's cache is updated."""
    if eng.mesh is None and eng.pipeline is None:
        prog = step_and_sample(eng.graphdef, eng.cs, eng.nm)
        i32 = lambda a: jnp.asarray(a, jnp.int32)
        eng.cache, out = prog(eng.state, eng.cache, i32(tokens), i32(slots), i32(pos),
                              i32(nvalid), jnp.asarray(eng.bm.table), rows, i32(steps))
        return out
    return sample_rows(eng._run(tokens, slots, pos, nvalid), rows, jnp.asarray(steps, jnp.int32),
                       n_top=TOP_LOGPROBS)
