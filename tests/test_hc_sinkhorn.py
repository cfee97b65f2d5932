"""The mHC mixing-matrix kernel (from a site's raw sums: softmax + Sinkhorn, Pallas Triton
backend, interpreted on CPU) against its reference, and the reference against the model's
CPU form."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from dsv4_jax import layers as L
from dsv4_jax.quant import Numerics
from pallas_kernels import hc_sinkhorn
from pallas_kernels.hc_sinkhorn import mhc_comb, mhc_comb_reference, sinkhorn_softmax_reference


def _logits(M, rng):
    return jnp.asarray(rng.standard_normal((M, 4, 4)) * 3, jnp.float32)


def test_reference_is_the_model_cpu_form():
    rng = np.random.default_rng(1)
    x = _logits(6, rng)
    model = L.sinkhorn_reduce(jax.nn.softmax(x, -1) + 1e-6, 20, 1e-6)
    np.testing.assert_array_equal(np.asarray(sinkhorn_softmax_reference(x, 20, 1e-6)),
                                  np.asarray(model))


# ---- mhc_comb: the mixing matrices straight from a site's raw sums (layers.hc_sums) ----
def _site(M, rng, N=4, D=64):
    """Random raw sums of one mHC site: X [M, N, D], fn [2N + N^2, N*D] -> (s, q), scale,
    base, from layers.hc_sums itself (so q has the shape the model passes)."""
    X = jnp.asarray(rng.standard_normal((M, N, D)), jnp.float32)
    fn = jnp.asarray(rng.standard_normal((2 * N + N * N, N * D)) * 0.05, jnp.float32)
    s, q = L.hc_sums(X, fn)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32)
    base = jnp.asarray(rng.standard_normal(2 * N + N * N), jnp.float32)
    return s, q, scale, base, N * D


@pytest.mark.parametrize("M", [1, 21])
def test_mhc_comb_interpret_matches_reference(M):
    """One program (M = 1) and three with a padded last one (M = 21); 1, 2 and 20 Sinkhorn
    rounds (the count matters: 1 and 2 differ)."""
    rng = np.random.default_rng(M)
    s, q, scale, base, nd = _site(M, rng)
    for iters in (1, 2, 20):
        kw = dict(N=4, nd=nd, iters=iters, eps=1e-6, rms_eps=1e-6)
        got = np.asarray(mhc_comb(s, q, scale, base, interpret=True, **kw))
        ref = np.asarray(mhc_comb_reference(s, q, scale, base, 4, nd, iters, 1e-6, 1e-6))
        assert got.shape == (M, 4, 4)
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7)
        if iters == 1:
            one = got
    assert not np.allclose(one, np.asarray(mhc_comb_reference(s, q, scale, base, 4, nd, 2,
                                                               1e-6, 1e-6)), rtol=1e-4, atol=0)
    # the normalisation, the scale and the base all enter (a kernel ignoring one differs)
    for bad in (dict(q=q * 4), dict(scale=scale.at[2].mul(1.5)), dict(base=base.at[10].add(1))):
        a = {**dict(s=s, q=q, scale=scale, base=base), **bad}
        other = np.asarray(mhc_comb_reference(a["s"], a["q"], a["scale"], a["base"], 4, nd,
                                              20, 1e-6, 1e-6))
        assert not np.allclose(got, other, rtol=1e-4, atol=0), list(bad)


def test_hc_weights_kernel_path_equals_cpu_path(monkeypatch):
    """hc_weights on the GPU path (mhc_comb, interpreted here) against its CPU path, for a
    decode-sized site (one variadic reduction) and a prefill-sized one (einsum + sum)."""
    from dsv4_jax import config
    cfg = config.tiny()
    rng = np.random.default_rng(3)
    real = hc_sinkhorn.mhc_comb
    monkeypatch.setattr(hc_sinkhorn, "mhc_comb", lambda *a, **k: real(*a, **k, interpret=True))
    for rows in (2, L.HC_FUSED_ROWS + 1):
        X = jnp.asarray(rng.standard_normal((1, rows, cfg.hc_mult, cfg.hidden_size)), jnp.bfloat16)
        n = 2 * cfg.hc_mult + cfg.hc_mult ** 2
        fn = jnp.asarray(rng.standard_normal((n, cfg.hc_mult * cfg.hidden_size)) * 0.05, jnp.float32)
        scale = jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32)
        base = jnp.asarray(rng.standard_normal(n), jnp.float32)
        want = L.hc_weights(X, fn, scale, base, cfg, Numerics(gpu=False))
        got = L.hc_weights(X, fn, scale, base, cfg, Numerics(gpu=True))
        for g, w, name in zip(got, want, ("pre", "post", "comb")):
            assert g.shape == w.shape, name
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-7,
                                       err_msg=f"{name} rows={rows}")


def test_hc_sums_one_reduction_equals_einsum():
    """The decode form of the sums (one variadic reduction) against the einsum + sum."""
    rng = np.random.default_rng(4)
    X = jnp.asarray(rng.standard_normal((3, 4, 256)), jnp.float32)
    fn = jnp.asarray(rng.standard_normal((24, 1024)), jnp.float32)
    s, q = L.hc_sums(X, fn)
    flat = np.asarray(X, np.float64).reshape(3, -1)
    np.testing.assert_allclose(np.asarray(s), flat @ np.asarray(fn, np.float64).T, rtol=1e-5,
                               atol=1e-4)
    assert q.shape == s.shape   # the sum of squares repeated in every column
    np.testing.assert_allclose(np.asarray(q), np.repeat((flat ** 2).sum(-1, keepdims=True), 24, 1),
                               rtol=1e-5)


def test_mhc_comb_bad_inputs_are_refused():
    s, q = jnp.ones((2, 24)), jnp.ones((2, 1))
    kw = dict(N=4, nd=64, iters=20, eps=1e-6, rms_eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="2N"):
        mhc_comb(jnp.ones((2, 20)), q, jnp.ones(3), jnp.ones(20), **kw)
    with pytest.raises(ValueError, match="scale"):
        mhc_comb(s, q, jnp.ones(2), jnp.ones(24), **kw)
    with pytest.raises(ValueError, match="iters"):
        mhc_comb(s, q, jnp.ones(3), jnp.ones(24), **dict(kw, iters=0))


def test_mhc_comb_lowers_for_cuda():
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    S = jax.ShapeDtypeStruct
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        for M in (1, 5, 64):
            txt = jax.jit(lambda s, q, a, b: mhc_comb(
                s, q, a, b, N=4, nd=16384, iters=20, eps=1e-6, rms_eps=1e-6)).trace(
                    S((M, 24), jnp.float32), S((M, 24), jnp.float32), S((3,), jnp.float32),
                    S((24,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in txt


@pytest.mark.gpu
def test_gpu_mhc_comb_matches_reference():
    rng = np.random.default_rng(5)
    for M in (1, 7, 64):
        s, q, scale, base, nd = _site(M, rng)
        got = np.asarray(mhc_comb(s, q, scale, base, N=4, nd=nd, iters=20, eps=1e-6,
                                  rms_eps=1e-6))
        ref = np.asarray(jax.jit(lambda *a: mhc_comb_reference(*a, 4, nd, 20, 1e-6, 1e-6))(
            s, q, scale, base))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)


def test_loop_form_matches_the_unrolled_form_and_its_gradient():
    """The loop form (Numerics.sinkhorn_loop: the default off a GPU backend, and training)
    computes what the unrolled form (XLA-GPU's default) does, to a few f32 ulps, and so does
    its gradient."""
    assert Numerics().sinkhorn_as_loop == (jax.default_backend() != "gpu")
    assert not Numerics(sinkhorn_loop=False).sinkhorn_as_loop
    assert Numerics(sinkhorn_loop=True).sinkhorn_as_loop
    rng = np.random.default_rng(2)
    x = _logits(6, rng)
    ct = jnp.asarray(rng.standard_normal((6, 4, 4)), jnp.float32)
    outs = []
    for loop in (False, True):
        f = lambda x: L.sinkhorn_reduce(jax.nn.softmax(x, -1) + 1e-6, 20, 1e-6, loop=loop)
        y, vjp = jax.vjp(jax.jit(f), x)
        outs.append((np.asarray(y), np.asarray(vjp(ct)[0])))
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-5)
    assert np.abs(outs[0][1]).max() > 1e-3  # the gradient is not trivially zero
