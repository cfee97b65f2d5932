"""RMSNorm + FP8 activation simulation + row padding as one kernel (pallas_kernels/norm_fp8),
with and without an mHC site's collapse in front, against the references, and the wiring:
linear(..., xq=), layers.norm_act / hc_site in the model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from dsv4_jax import config, layers as L, model, params as P, quant as Q
from dsv4_jax.layers import norms
from pallas_kernels.formats import fp8_block_sim
from dsv4_jax.quant import EXACT_COMPILER_OPTIONS as EXACT, Numerics
from pallas_kernels.norm_fp8 import (hc_norm_fp8, hc_norm_fp8_reference, rms_norm_fp8,
                                     rms_norm_fp8_reference)

BF16 = jnp.bfloat16


@pytest.mark.parametrize("M,D,with_w", [(1, 4096, True), (3, 1024, True), (8, 512, False),
                                        (5, 7168, True), (13, 256, True)])
def test_interpret_matches_reference(M, D, with_w):
    rng = np.random.default_rng(101)
    x = jnp.asarray(rng.standard_normal((M, D)) * rng.uniform(0.01, 30), BF16)
    w = jnp.asarray(rng.standard_normal(D), BF16) if with_w else None
    rows = -(-M // 8) * 8
    y, yq = rms_norm_fp8(x, w, eps=1e-6, rows=rows, interpret=True)
    ry, ryq = rms_norm_fp8_reference(x, w, 1e-6, rows)
    assert y.shape == (M, D) and yq.shape == (rows, D) and y.dtype == yq.dtype == BF16
    y, yq, ry, ryq = (np.asarray(a, np.float32) for a in (y, yq, ry, ryq))
    # y: the norm up to the order of the sum of squares (<= 1 bf16 ulp)
    np.testing.assert_allclose(y, ry, rtol=2 ** -7, atol=0)
    # yq: exactly the simulation of the kernel's own y, zero rows past M
    own = np.asarray(fp8_block_sim(jnp.asarray(y, BF16), 128), np.float32)
    np.testing.assert_array_equal(yq[:M], own)
    assert (yq[M:] == 0).all()
    same = (y == ry).all(-1)          # rows whose norm came out identical
    np.testing.assert_array_equal(yq[:M][same], ryq[:M][same])
    assert not np.array_equal(yq[:M], y)   # the simulation did round something


def test_bad_inputs_raise():
    x = jnp.ones((2, 256), BF16)
    with pytest.raises(ValueError, match="D % 128"):
        rms_norm_fp8(jnp.ones((2, 200), BF16), None, eps=1e-6, rows=8, interpret=True)
    with pytest.raises(ValueError, match="rows=1 < M=2"):
        rms_norm_fp8(x, None, eps=1e-6, rows=1, interpret=True)
    with pytest.raises(ValueError, match="w must be"):
        rms_norm_fp8(x, jnp.ones(128, BF16), eps=1e-6, rows=8, interpret=True)


def test_lowers_for_cuda():
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    S = jax.ShapeDtypeStruct
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        for M, D in ((1, 4096), (5, 1024), (64, 7168)):
            txt = jax.jit(lambda x, w: rms_norm_fp8(x, w, eps=1e-6, rows=-(-M // 8) * 8)).trace(
                S((M, D), BF16), S((D,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in txt


def test_linear_with_presimulated_rows():
    """linear(x, w, xq=padded simulation of x) gives linear(x, w) bit for bit, on the
    matmul kernel (interpreted) and on the XLA path; a wrong xq is refused."""
    rng = np.random.default_rng(102)
    W = rng.standard_normal((256, 512)).astype(np.float32)
    w = Q.Fp8Weight(*map(jnp.asarray, Q.encode_fp8_np(W)))
    x = jnp.asarray(rng.standard_normal((1, 3, 512)), BF16)
    xq = jnp.pad(fp8_block_sim(x.reshape(3, 512), 128), ((0, 5), (0, 0)))
    for m in ("interpret", "xla"):
        nm = Numerics(True, "bfloat16", matmul=m)
        f = jax.jit(lambda x, xq: (Q.linear(x, w, nm, out_dtype=jnp.float32),
                                   Q.linear(x, w, nm, out_dtype=jnp.float32, xq=xq)))
        a, b = jax.block_until_ready(f(x, xq))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=m)
    with pytest.raises(ValueError, match="xq must be"):
        Q.linear(x, w, Numerics(True, "bfloat16"), xq=xq[:3])
    with pytest.raises(ValueError, match="xq must be"):
        Q.linear(x, w, Numerics(False, "bfloat16"), xq=xq)


@pytest.mark.slow  # ~70 s: the interpreted kernel in the whole forward
def test_model_forward_through_the_norm_kernel(monkeypatch):
    """The whole forward with act-quant and the matmul kernels (interpreted): every norm
    that feeds a quantised matmul goes through rms_norm_fp8 (attn, q and ffn norms), and
    the logits equal those of the same run with the kernel turned off (XLA's three
    kernels), to rounding: with the FP8 simulation on, a single flipped rounding anywhere
    in the tiny random model moves the logits by several percent, so the bound is that
    amplified level (seeded). One layer of each kind (SWA, CSA, HCA) and the MTP block: the
    norm sites are per layer (counted from cfg)."""
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1)
    seed = 7
    params = P.init_params(cfg, seed)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, 5)), jnp.int32)
    nm = Numerics(True, "bfloat16", matmul="interpret")
    monkeypatch.setattr(norms, "NORM_FP8_ROWS", 64)
    fwd = jax.jit(lambda p, t: model.forward(p, t, cfg, nm))
    jaxpr = str(jax.make_jaxpr(lambda p, t: model.forward(p, t, cfg, nm))(params, tokens))
    # per layer: the attn and ffn sites' collapse + norm (hc_norm_fp8) and q_norm
    assert jaxpr.count("name=hc_norm_fp8") == 2 * cfg.num_hidden_layers, jaxpr.count("hc_norm_fp8")
    assert jaxpr.count("name=rms_norm_fp8") == cfg.num_hidden_layers, jaxpr.count("rms_norm_fp8")
    got = np.asarray(jax.block_until_ready(fwd(params, tokens)))
    monkeypatch.setattr(norms, "NORM_FP8_ROWS", 0)
    jax.clear_caches()
    fwd0 = jax.jit(lambda p, t: model.forward(p, t, cfg, nm))
    assert "norm_fp8" not in str(jax.make_jaxpr(lambda p, t: model.forward(p, t, cfg, nm))(
        params, tokens))
    want = np.asarray(jax.block_until_ready(fwd0(params, tokens)))
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    assert np.isfinite(got).all() and rel < 0.2 and agree >= 0.6, (seed, rel, agree)


@pytest.mark.gpu
def test_gpu_matches_reference():
    """On the GPU (Triton's own f32 -> e4m3 and bf16 conversions): yq is the simulation of
    the kernel's y bit for bit, y within 1 bf16 ulp of the XLA norm. The XLA side compiles
    with EXACT_COMPILER_OPTIONS: by default XLA-GPU deletes the f32 -> e4m3 -> f32 round trip
    (the first GPU run of this test failed on exactly that)."""
    rng = np.random.default_rng(103)
    for M, D in ((1, 4096), (7, 1024), (64, 4096), (3, 7168)):
        x = jnp.asarray(rng.standard_normal((M, D)) * 4, BF16)
        w = jnp.asarray(rng.standard_normal(D), BF16)
        rows = -(-M // 8) * 8
        y, yq = rms_norm_fp8(x, w, eps=1e-6, rows=rows)
        ry, _ = jax.jit(lambda x, w: rms_norm_fp8_reference(x, w, 1e-6, rows),
                        compiler_options=EXACT)(x, w)
        y32 = np.asarray(y, np.float32)
        np.testing.assert_allclose(y32, np.asarray(ry, np.float32), rtol=2 ** -7, atol=0)
        own = np.asarray(jax.jit(lambda v: fp8_block_sim(v, 128), compiler_options=EXACT)(y),
                         np.float32)
        np.testing.assert_array_equal(np.asarray(yq, np.float32)[:M], own)
        assert (np.asarray(yq, np.float32)[M:] == 0).all()



def _site(M, N, D, rng):
    X = jnp.asarray(rng.standard_normal((M, N, D)), BF16)
    fn = jnp.asarray(rng.standard_normal((2 * N + N * N, N * D)) * 0.05, jnp.float32)
    s, q = L.hc_sums(X, fn)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32)
    base = jnp.asarray(rng.standard_normal(2 * N + N * N), jnp.float32)
    w = jnp.asarray(rng.standard_normal(D), BF16)
    return X, fn, s, q, scale, base, w


@pytest.mark.parametrize("M,D", [(1, 512), (3, 1024), (9, 256)])
def test_hc_interpret_matches_reference(M, D):
    rng = np.random.default_rng(104)
    X, _, s, q, scale, base, w = _site(M, 4, D, rng)
    rows = -(-M // 8) * 8
    kw = dict(eps=1e-6, rms_eps=1e-6, hc_eps=1e-6, rows=rows)
    y, yq = hc_norm_fp8(X, s, q, scale, base, w, N=4, interpret=True, **kw)
    ry, ryq = hc_norm_fp8_reference(X, s, q, scale, base, w, 4, **kw)
    # Within 2 bf16 ulps (ordered bit distance), or f32 noise where the collapse cancels.
    # The kernel's collapse weights can differ from XLA's by an f32 ulp (sigmoid, fused
    # multiply-adds): a collapsed value on a bf16 rounding boundary then rounds one ulp apart
    # before the norm, whose own rounding can add one more; a value that nearly cancels
    # (|x| << its terms) keeps its terms' f32 rounding: many ulps, at ~1e-8 absolute in rows
    # of RMS ~1 (a scan over 1080 random cases: 1005 identical, 66 at 1 ulp, 7 at 2, two at
    # 18 / 34 ulps at |y| ~ 1e-8). rtol=2**-7 had failed ~1 run in 5.
    def order(a):   # bf16 bits -> integers in the values' order, ulp apart (+0 = -0)
        b = np.asarray(jax.lax.bitcast_convert_type(a, jnp.int16), np.int32)
        return np.where(b < 0, -(b & 0x7FFF), b)
    ulps = np.abs(order(y) - order(ry))
    y, yq, ry, ryq = (np.asarray(a, np.float32) for a in (y, yq, ry, ryq))
    rms = np.sqrt((ry ** 2).mean(-1, keepdims=True))
    assert ((ulps <= 2) | (np.abs(y - ry) <= 2.0 ** -20 * rms)).all(), ulps.max()
    assert (ulps == 0).mean() > 0.9     # and mostly bit-identical
    own = np.asarray(fp8_block_sim(jnp.asarray(y, BF16), 128), np.float32)
    np.testing.assert_array_equal(yq[:M], own)
    assert (yq[M:] == 0).all()
    same = (y == ry).all(-1)
    np.testing.assert_array_equal(yq[:M][same], ryq[:M][same])
    # the collapse weights matter: another base gives another row
    other, _ = hc_norm_fp8_reference(X, s, q, scale, base.at[1].add(2.0), w, 4, **kw)
    assert not np.allclose(np.asarray(other, np.float32), ry, rtol=1e-2)


def test_hc_site_kernel_path_equals_xla_path(monkeypatch):
    """layers.hc_site with the kernel (interpreted) against the same site with it off."""
    from dsv4_jax import config
    cfg = config.tiny()
    rng = np.random.default_rng(105)
    N, D = cfg.hc_mult, cfg.hidden_size
    X, fn, _, _, scale, base, w = _site(2, N, D, rng)
    X = X.reshape(2, 1, N, D)
    nm = Numerics(True, "bfloat16", matmul="interpret")
    monkeypatch.setattr(norms, "NORM_FP8_ROWS", 64)
    f = lambda: jax.block_until_ready(jax.jit(
        lambda X: L.hc_site(X, fn, scale, base, w, cfg, nm))(X))
    got = f()
    monkeypatch.setattr(norms, "NORM_FP8_ROWS", 0)
    want = f()
    assert want[4] is None and got[4].shape == (8, D)
    for g, wnt, name in zip(got[:4], want[:4], ("pre", "post", "comb", "x")):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(wnt, np.float32),
                                   rtol=2 ** -7 if name == "x" else 0, atol=0, err_msg=name)
    xq = np.asarray(fp8_block_sim(got[3].reshape(2, D), 128), np.float32)
    np.testing.assert_array_equal(np.asarray(got[4], np.float32)[:2], xq)


def test_hc_bad_inputs_raise():
    rng = np.random.default_rng(106)
    X, _, s, q, scale, base, w = _site(2, 4, 256, rng)
    kw = dict(N=4, eps=1e-6, rms_eps=1e-6, hc_eps=1e-6, rows=8, interpret=True)
    with pytest.raises(ValueError, match="needs X"):
        hc_norm_fp8(X[:, :3], s, q, scale, base, w, **kw)
    with pytest.raises(ValueError, match="w \\[256\\]"):
        hc_norm_fp8(X, s, q, scale, base, w[:128], **kw)
    with pytest.raises(ValueError, match="rows=1 < M=2"):
        hc_norm_fp8(X, s, q, scale, base, w, **dict(kw, rows=1))


def test_hc_lowers_for_cuda():
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        for M, D in ((1, 4096), (64, 7168)):
            txt = jax.jit(lambda X, s, q, a, b, w: hc_norm_fp8(
                X, s, q, a, b, w, N=4, eps=1e-6, rms_eps=1e-6, hc_eps=1e-6,
                rows=-(-M // 8) * 8)).trace(
                    S((M, 4, D), BF16), S((M, 24), f32), S((M, 24), f32), S((3,), f32),
                    S((24,), f32), S((D,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in txt


@pytest.mark.gpu
def test_gpu_hc_matches_reference():
    rng = np.random.default_rng(107)
    for M, D in ((1, 4096), (8, 4096), (3, 7168)):
        X, _, s, q, scale, base, w = _site(M, 4, D, rng)
        kw = dict(eps=1e-6, rms_eps=1e-6, hc_eps=1e-6, rows=-(-M // 8) * 8)
        y, yq = hc_norm_fp8(X, s, q, scale, base, w, N=4, **kw)
        ry, _ = jax.jit(lambda *a: hc_norm_fp8_reference(*a, 4, **kw),
                        compiler_options=EXACT)(X, s, q, scale, base, w)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32),
                                   rtol=2 ** -7, atol=0)
        own = np.asarray(jax.jit(lambda v: fp8_block_sim(v, 128), compiler_options=EXACT)(y),
                         np.float32)
        np.testing.assert_array_equal(np.asarray(yq, np.float32)[:M], own)


def test_new_kernels_are_on_by_default():
    """Decode-sized norms feeding the matmul kernels take the norm kernel (interpreted
    here): norm_act returns the padded FP8 simulation."""
    assert norms.NORM_FP8_ROWS == 64
    nm = Numerics(True, "bfloat16", matmul="interpret")
    assert L.norm_act(jnp.ones((1, 1, 256), BF16), None, config.tiny(), nm)[1] is not None
