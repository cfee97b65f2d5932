"""The NNX module tree computes exactly the functional forward and round-trips its params."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax import config, model, params as P
from dsv4_jax.nnx_model import DeepSeekV4
from dsv4_jax.quant import Numerics


def test_nnx_model_equals_functional_forward():
    cfg = config.tiny()
    params = P.init_params(cfg, int(np.random.default_rng().integers(1 << 30)))
    tokens = jnp.asarray(np.random.default_rng().integers(0, cfg.vocab_size, (1, 140)), jnp.int32)
    nm = Numerics(True, "bfloat16")
    m = DeepSeekV4.from_params(cfg, params)
    want = jax.jit(lambda p, t: model.forward(p, t, cfg, nm))(params, tokens)
    graphdef, state = nnx.split(m)

    @jax.jit
    def run(state, t):
        return nnx.merge(graphdef, state)(t, nm)

    np.testing.assert_array_equal(np.asarray(run(state, tokens)), np.asarray(want))
    back = m.to_params()
    assert set(back) == set(params)
    for k in params:
        for a, b in zip(jax.tree.leaves(back[k]), jax.tree.leaves(params[k])):
            assert a is b  # the same arrays, no copies
