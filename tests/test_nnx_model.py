"""The NNX module is the model: its forward is the functional forward, its step (the
program Engine runs over the split state) the functional decode step, bit for bit; it
round-trips its parameters and its state's shardings come from the parameter
description."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4_jax import sharding as SH
from dsv4_jax import config, distributed as DI, model, params as P
from dsv4_jax.cache import CacheSpec, init_cache
from dsv4_jax.decode import step as flat_step
from dsv4_jax.nnx_model import DeepSeekV4
from dsv4_jax.programs import Layout, step_program
from dsv4_jax.quant import Numerics

CFG = config.tiny()
NM = Numerics(True, "bfloat16")
PARAMS = P.init_params(CFG, 501)


@pytest.mark.slow  # ~55 s (the module decode step equality stays)
def test_nnx_model_equals_functional_forward():
    tokens = jnp.asarray(np.random.default_rng(502).integers(0, CFG.vocab_size, (1, 140)),
                         jnp.int32)
    m = DeepSeekV4.from_params(CFG, PARAMS)
    want = jax.jit(lambda p, t: model.forward(p, t, CFG, NM))(PARAMS, tokens)
    graphdef, state = nnx.split(m)

    @jax.jit
    def run(state, t):
        return nnx.merge(graphdef, state)(t, NM)

    np.testing.assert_array_equal(np.asarray(run(state, tokens)), np.asarray(want))
    back = m.to_params()
    assert set(back) == set(PARAMS)
    for k in PARAMS:
        for a, b in zip(jax.tree.leaves(back[k]), jax.tree.leaves(PARAMS[k])):
            assert a is b  # the same arrays, no copies


def test_module_decode_step_equals_the_functional_step():
    """programs.step_program (jit over nnx.split state, cache donated) against jit of
    decode.step on the flat tree: the same logits and cache, bit for bit, in the decode
    form too."""
    merged = P.merge_x_proj(PARAMS, CFG)
    cs = CacheSpec.for_numerics(NM, max_requests=2, num_blocks=4, max_blocks=2)
    rng = np.random.default_rng(503)
    tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 1)), jnp.int32)
    table = np.full((2, 2), -1, np.int32)
    table[:, 0] = [0, 1]
    args = (tok, jnp.arange(2), jnp.asarray([0, 0]), jnp.asarray([1, 1]), jnp.asarray(table))
    m = DeepSeekV4.from_params(CFG, merged)
    graphdef, state = nnx.split(m)
    got, gc = step_program(Layout(CFG), graphdef, cs, NM)(state, init_cache(CFG, cs), *args)
    want, wc = jax.jit(functools.partial(flat_step, cfg=CFG, cs=cs, nm=NM))(
        merged, init_cache(CFG, cs), *args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(wc)):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert (step_program(Layout(CFG), graphdef, cs, NM)                  # shared
            is step_program(Layout(CFG), nnx.split(m)[0], cs, NM))


def test_state_shardings_follow_the_parameter_description():
    mesh = DI.make_mesh(1)
    want = SH.param_shardings(CFG, mesh)
    sh = DI.state_shardings(CFG, mesh)
    _, state = nnx.split(DeepSeekV4.from_params(CFG, PARAMS))
    assert jax.tree.structure(sh) == jax.tree.structure(state)
    back = DeepSeekV4.from_params(CFG, {k: v for k, v in want.items()}).to_params()
    assert back == want
