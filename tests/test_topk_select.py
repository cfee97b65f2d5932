"""Exact top-k selection kernel (Pallas Triton, interpreted on CPU) against an independent
numpy statement of the contract: the k largest scores' ids (ties: the lower id), -inf never
selected, ascending, -1 padded. (Its use on the indexer's untrimmed scores, k above and
below the eligible count: tests/test_indexer_decode.py::test_topk_keys_*.)"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_select import topk_select, topk_select_reference


def numpy_topk_set(s, k):
    out = np.full((s.shape[0], k), -1, np.int32)
    for b, row in enumerate(s):
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]  # stable: lower id first
        keep = np.sort(order[row[order] > -np.inf])
        out[b, :len(keep)] = keep
    return out


def random_scores(rng, B, N, *, ties=True):
    s = rng.standard_normal((B, N)).astype(np.float32) * rng.uniform(0.1, 1e3)
    if ties:   # coarse values: many equal scores, some straddling the k-th
        s = np.round(s * 4) / 4
    return s


def run(s, k, **kw):
    return np.asarray(topk_select(jnp.asarray(s), k, interpret=True, **kw))


@pytest.mark.parametrize("B,N,k,tile,bits,segments", [
    (2, 1000, 64, None, 2, 1), (3, 300, 512, None, 2, None), (2, 4096, 512, None, 4, 1),
    (1, 77, 77, None, 1, 1), (2, 1000, 100, None, 2, 1), (2, 700, 50, None, 4, 1),
    # several programs per row + the second stage: segments shorter than k, a ragged last
    (2, 1000, 64, 128, 2, 3), (1, 2000, 300, 512, 2, 7),
    # three stages: 20 segments' 20000 candidates > MAX_KEYS are split again (the ids
    # carried through a split stage), then one program picks among 3 x 1000
    (1, 20000, 1000, 8192, 2, 20)])
def test_kernel_matches_numpy(B, N, k, tile, bits, segments):
    rng = np.random.default_rng(N * 7 + k)
    s = random_scores(rng, B, N)
    s[0, rng.integers(N // 2, N):] = -np.inf            # fewer eligible than usual
    out = run(s, k, tile=tile, bits=bits, segments=segments)
    assert np.array_equal(out, numpy_topk_set(s, k))
    assert np.array_equal(out, np.asarray(topk_select_reference(jnp.asarray(s), k)))


def test_edge_rows():
    """All -inf; fewer finite than k; every score equal (ties decide all); +0.0 / -0.0
    mixed (equal, so the lower ids win); huge and tiny magnitudes of both signs."""
    rng = np.random.default_rng(1)
    N, k = 200, 64
    s = random_scores(rng, 6, N, ties=False)
    s[0] = -np.inf
    s[1, 10:] = -np.inf
    s[2] = 3.0
    s[3] = np.where(rng.random(N) < 0.5, 0.0, -0.0).astype(np.float32)
    s[3, :5] = -1.0
    # (normal numbers only: a flush-to-zero reference would call denormals zero)
    s[4] = rng.choice(np.array([-3e38, -1e-30, 1e-30, 3e38, -2e-37, 2e-37], np.float32), N)
    out = run(s, k, tile=64, segments=1)
    ref = numpy_topk_set(s, k)
    assert np.array_equal(out, ref)
    assert np.array_equal(run(s, k, tile=64, segments=3), ref)   # ties across segments
    assert (out[0] == -1).all() and (out[1, :10] == np.arange(10)).all()
    assert (out[1, 10:] == -1).all()
    assert np.array_equal(out[2], np.arange(k)) and np.array_equal(out[3], np.arange(5, 5 + k))


def test_scores_decide():
    """The same scores shuffled move the selection with them (catches a kernel that ignores
    its input or the tie rule)."""
    rng = np.random.default_rng(2)
    s = random_scores(rng, 1, 600, ties=False)
    perm = rng.permutation(600)
    a, b = run(s, 100, tile=128, segments=1), run(s[:, perm], 100, tile=128, segments=1)
    assert np.array_equal(np.sort(perm[b[0]]), a[0])


def test_bad_arguments_raise():
    s = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="\\[B, N\\]"):
        topk_select(s[0], 8)
    with pytest.raises(ValueError, match="float32"):
        topk_select(s.astype(jnp.bfloat16), 8)
    with pytest.raises(ValueError, match="k must be"):
        topk_select(s, 0)
    with pytest.raises(ValueError, match="tile"):
        topk_select(s, 8, tile=100)
    with pytest.raises(ValueError, match="tile"):
        topk_select(s, 32, tile=16)                      # a tile must hold k keys
    with pytest.raises(ValueError, match="bits"):
        topk_select(s, 8, bits=3)
    with pytest.raises(ValueError, match="n must be"):
        topk_select(s, 8, n=65)
    with pytest.raises(ValueError, match="segments"):
        topk_select(s, 8, segments=0)
    with pytest.raises(ValueError, match="segments"):          # 20000 keys in one program
        topk_select(jnp.zeros((1, 20000), jnp.float32), 8, segments=1)


def test_default_segments():
    from pallas_kernels.topk_select.kernel import default_segments, default_tile
    assert default_tile(512) == 4096 and default_tile(1024) == 8192 and default_tile(600) == 8192
    assert default_segments(1056, 512) == 1 and default_segments(4096, 512) == 1
    assert default_segments(8224, 512) == 3 and default_segments(8224, 1024) == 2
    assert default_segments(32800, 512) == 9 and default_segments(32800, 1024) == 5


@pytest.mark.parametrize("B,N,k", [(64, 32768, 512), (1, 1056, 512), (8, 65536, 1024)])
def test_cuda_lowering(B, N, k):
    from jax._src.mesh import AbstractDevice, AbstractMesh
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        lowered = jax.jit(functools.partial(topk_select, k=k)).trace(
            jax.ShapeDtypeStruct((B, N), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,k,segments", [(64, 32768, 512, None), (1, 1056, 512, None),
                                            (3, 8000, 1024, None), (1, 16384, 512, 1),
                                            (2, 32800, 512, 5), (2, 262144, 512, None)])
def test_gpu_kernel_matches_numpy(B, N, k, segments):
    rng = np.random.default_rng(N + k)
    s = random_scores(rng, B, N)
    s[0, N // 3:] = -np.inf
    f = functools.partial(topk_select, k=k, segments=segments)
    out = np.asarray(jax.jit(f)(jnp.asarray(s)))
    assert np.array_equal(out, numpy_topk_set(s, k))
