"""The mHC mixing-matrix kernel (softmax + Sinkhorn, Pallas Triton backend) against its
reference and against the model's CPU form."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from dsv4_jax import layers as L
from pallas_kernels.hc_sinkhorn import sinkhorn_softmax, sinkhorn_softmax_reference


def _logits(M, rng):
    return jnp.asarray(rng.standard_normal((M, 4, 4)) * 3, jnp.float32)


@pytest.mark.parametrize("M", [1, 3, 8, 21])
def test_interpret_matches_reference(M):
    rng = np.random.default_rng()
    x = _logits(M, rng)
    for iters in (1, 2, 20):
        got = np.asarray(sinkhorn_softmax(x, iters, 1e-6, interpret=True))
        ref = np.asarray(sinkhorn_softmax_reference(x, iters, 1e-6))
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7)
    # the iteration count matters (a kernel that ignored it would pass the loop above
    # only if the matrices converged; told apart here)
    one = np.asarray(sinkhorn_softmax(x, 1, 1e-6, interpret=True))
    assert not np.allclose(one, np.asarray(sinkhorn_softmax_reference(x, 2, 1e-6)),
                           rtol=1e-4, atol=0)


def test_reference_is_the_model_cpu_form():
    rng = np.random.default_rng()
    x = _logits(6, rng)
    model = L.sinkhorn_reduce(jax.nn.softmax(x, -1) + 1e-6, 20, 1e-6)
    np.testing.assert_array_equal(np.asarray(sinkhorn_softmax_reference(x, 20, 1e-6)),
                                  np.asarray(model))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        sinkhorn_softmax(jnp.ones((2, 3, 3)), 20, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="iters"):
        sinkhorn_softmax(jnp.ones((2, 4, 4)), 0, 1e-6, interpret=True)


def test_lowers_for_cuda():
    """The Triton lowering runs on this CPU machine against an abstract H100."""
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        for M in (1, 5, 64):
            txt = jax.jit(lambda x: sinkhorn_softmax(x, 20, 1e-6)).trace(
                jax.ShapeDtypeStruct((M, 4, 4), jnp.float32)).lower(
                    lowering_platforms=("cuda",)).as_text()
            assert "triton" in txt


@pytest.mark.gpu
def test_gpu_matches_reference():
    rng = np.random.default_rng()
    for M in (1, 7, 256):
        x = _logits(M, rng)
        got = np.asarray(sinkhorn_softmax(x, 20, 1e-6))
        ref = np.asarray(jax.jit(lambda v: sinkhorn_softmax_reference(v, 20, 1e-6))(x))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
