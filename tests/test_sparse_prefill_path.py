"""The prefill chunk attention through the sparse prefill attention path (decode.
attention_cached with the cache kernels on and Numerics.sparse_prefill_rows) against the
dense chunk attention it replaces, tiny preset, CPU: whole prompts past several CSA and
HCA blocks and the window wrap, at several chunk sizes (chunk-invariance), and one layer
of each kind through the kernel itself on the Mosaic GPU interpreter, two requests packed
in one chunk with padding rows."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, decode as D, layers as L, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.layers.indexer import indexer_scores, topk_ids_blocked, topk_mask
from dsv4_jax.quant import Numerics

from cached_decode_setup import two_prefilled_requests


@pytest.fixture(scope="module")
def tiny():
    # the tiny preset's widths; one layer of each kind (SWA, CSA, HCA) to keep compiles short
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1)
    return cfg, P.init_params(cfg, 4901)


def test_blocked_topk_ids_are_the_dense_top_k():
    """topk_ids_blocked (query blocks of 3 rows here) picks the set topk_mask picks, valid
    ids first, for rows with fewer eligible entries than k too."""
    rng = np.random.default_rng(4902)
    B, T, nI, c, n, k = 2, 7, 4, 16, 20, 6
    qI = jnp.asarray(rng.standard_normal((B, T, nI, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, nI)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, n, c)), jnp.float32)
    nvis = jnp.asarray(rng.integers(0, n + 1, (B, T)), jnp.int32)
    import dsv4_jax.layers.indexer as I
    old = I.SCORE_BLOCK_ELEMS
    I.SCORE_BLOCK_ELEMS = 3 * B * nI * n
    try:
        ids = np.asarray(topk_ids_blocked(qI, w, keys, nvis, k))
    finally:
        I.SCORE_BLOCK_ELEMS = old
    elig = jnp.arange(n)[None, None] < nvis[..., None]
    want, _ = topk_mask(indexer_scores(qI, w, keys), elig, k)
    want = np.asarray(want)
    for b in range(B):
        for t in range(T):
            m = min(k, int(nvis[b, t]))
            got = np.zeros(n, bool)
            got[ids[b, t, :m]] = True
            assert np.array_equal(got, want[b, t]), (b, t)


def _prefill_logits(cfg, params, nm, chunk, prompts):
    # the kernels' cache formats (FP8 rows, FP4 indexer keys) under f32 numerics
    cs = CacheSpec(max_requests=2, num_blocks=8, max_blocks=3, kernels="interpret",
                   dtype="float32")
    eng = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=chunk, progress=False)
    return [np.asarray(eng.prefill(eng.bm.admit(len(p) + 1), p)) for p in prompts]


def test_prefill_through_sparse_path_equals_dense(tiny, monkeypatch):
    """A prompt of 300 tokens (75 CSA blocks, top-16 of them chosen per row; two HCA
    blocks; the 128-row window wrapped within a chunk and across chunks) prefilled in
    chunks of 100 rows: the sparse path gives the dense path's logits to f32 rounding (so
    the chunk-invariance is the dense path's: FP8 cache codes that flip with the chunking).
    f32 numerics without the activation simulation: the path's blocked pure-JAX form (the
    kernel rounds to bf16; it runs on the interpreter below and in
    test_sparse_prefill_attention.py)."""
    cfg, params = tiny
    rng = np.random.default_rng(4903)
    prompts = [rng.integers(0, cfg.vocab_size, 300)]
    traced = []
    real = L.attention.sparse_chunk_attention
    monkeypatch.setattr(L.attention, "sparse_chunk_attention",
                        lambda *a: traced.append(a[-1]) or real(*a))
    dense = Numerics(act_quant=False, dtype="float32", sparse_prefill_rows=0)
    sparse = dataclasses.replace(dense, sparse_prefill_rows=32)
    for chunk in (100,):
        want = _prefill_logits(cfg, params, dense, chunk, prompts)
        assert not traced
        got = _prefill_logits(cfg, params, sparse, chunk, prompts)
        # every layer of the chunk program took the sparse path (chunks of >= 32 rows)
        assert len(traced) == cfg.num_hidden_layers, (chunk, len(traced))
        traced.clear()
        for g, w in zip(got, want):
            err = np.abs(g - w).max() / np.abs(w).max()
            # (f32 rounding, through FP8 cache codes it can flip downstream: ~3e-4; the
            # dense path's own change with the chunk size is ~1e-2 here)
            assert err < 2e-3, (chunk, err)


@pytest.fixture(scope="module")
def prefilled(tiny):
    """Two requests prefilled (dense path) to random lengths, request 0 past an HCA block
    and the window wrap: cached_decode_setup's, shared by the layer tests."""
    cfg, params = tiny
    return two_prefilled_requests(cfg, params, Numerics(True, "bfloat16"), seed=4904)


@pytest.mark.parametrize("ratio", [4, pytest.param(128, marks=pytest.mark.slow)])  # ~30 s
def test_sparse_prefill_kernel_interpreted_in_the_layer(tiny, prefilled, ratio):
    """One CSA / HCA layer's attention_cached on a chunk of 5 rows of two requests (request
    0 past an HCA block and the window wrap, request 1 with 3 real rows): the interpreted
    kernel path against the dense one, bf16 with the trained FP8 simulation; the cache
    writes are bit-identical."""
    cfg, params = tiny
    nm_dense = Numerics(True, "bfloat16", sparse_prefill_rows=0)
    # 5 rows: past the decode kernels' KERNEL_ROWS, so both forms take the chunk path
    nm_sparse = dataclasses.replace(nm_dense, sparse_prefill_rows=5)
    eng, cs, _, args = prefilled
    _, _, slots, pos, _, _ = args
    T = 5
    nvalid = jnp.asarray([5, 3], jnp.int32)
    eng.bm.ensure_many({0: int(pos[0]) + 5, 1: int(pos[1]) + 3})
    tok_pos = pos[:, None] + jnp.arange(T)[None]
    valid = jnp.arange(T)[None] < nvalid[:, None]
    rng = np.random.default_rng(4905)
    x = jnp.asarray(rng.standard_normal((2, T, cfg.hidden_size)), jnp.bfloat16)
    csk = dataclasses.replace(cs, kernels="interpret")
    i = cfg.compress_ratios.index(ratio)
    ap = L.block_params(params, f"layers.{i}.attn.")
    a = (tok_pos, valid, slots, pos, nvalid, jnp.asarray(eng.bm.table)[slots])

    def run(nm):
        f = jax.jit(lambda ap, lc, x: D.attention_cached(ap, lc, x, *a, cfg, csk, nm, ratio))
        return jax.block_until_ready(f(ap, eng.cache[i], x))

    (y0, c0), (y1, c1) = run(nm_dense), run(nm_sparse)
    for va, vb in zip(jax.tree.leaves(c0), jax.tree.leaves(c1)):
        va, vb = np.asarray(va), np.asarray(vb)
        assert np.array_equal(va.view(np.uint8) if va.dtype.itemsize == 1 else va,
                              vb.view(np.uint8) if vb.dtype.itemsize == 1 else vb)
    m = np.asarray(valid)
    y0, y1 = np.asarray(y0, np.float32)[m], np.asarray(y1, np.float32)[m]
    assert np.isfinite(y1).all()
    err = np.linalg.norm(y0 - y1) / np.linalg.norm(y0)
    # the attention core agrees to ~0.3% (bf16 P against the running max); wo_b's FP8
    # input rounding amplifies it (as in test_kernel_decode)
    assert err < 0.05, err
