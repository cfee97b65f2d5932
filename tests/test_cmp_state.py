"""The compressor state stored as one packed f32 array per compressed layer (LayerCache.cst,
cache.cmp_state_parts): its layout, the accessor, the errors, and its contents after cached
prefill + decode against the state computed independently from the whole-sequence
forward (tiny preset, CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, layers as L, model, params as P
from dsv4_jax.cache import (CacheSpec, cache_structs, cmp_state_parts, compressor_state,
                            init_cache, join_cmp_state, split_cmp_state)
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics

F32 = Numerics(act_quant=False, dtype="float32")


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_one_state_array_per_compressed_layer(preset):
    cfg = config.get_preset(preset)
    cs = CacheSpec(max_requests=3, num_blocks=4, max_blocks=2)
    structs = cache_structs(cfg, cs)
    c, ci = cfg.head_dim, cfg.index_head_dim
    for i in range(cfg.num_hidden_layers):
        r, lc = cfg.layer_ratio(i), structs[i]
        if r == 0:
            assert lc.cst is None
            continue
        assert lc.cst.dtype == jnp.float32
        assert lc.cst.shape == (3, r, 6 * c + 6 * ci if r == 4 else 2 * c)
    # Flash: 21 CSA layers (8 state arrays before -> 1) and 20 HCA layers (2 -> 1)
    if preset == "flash":
        assert len(jax.tree.leaves(structs)) == 545 - 21 * 7 - 20 * 1


def test_split_join_and_initial_values():
    cfg = config.tiny()
    rng = np.random.default_rng(202)
    for r in (4, 128):
        parts = cmp_state_parts(cfg, r)
        width = sum(w for _, w in parts)
        x = jnp.asarray(rng.standard_normal((2, r, width)), jnp.float32)
        named = split_cmp_state(x, cfg, r)
        assert list(named) == [n for n, _ in parts]
        o = 0
        for n, w in parts:  # each part is its slice of the last axis, in storage order
            np.testing.assert_array_equal(np.asarray(named[n]), np.asarray(x[..., o:o + w]))
            o += w
        np.testing.assert_array_equal(np.asarray(join_cmp_state(named, cfg, r)), np.asarray(x))
    cs = CacheSpec(max_requests=2, num_blocks=4, max_blocks=2)
    cache = init_cache(cfg, cs)
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_ratio(i) == 0:
            continue
        for n, v in compressor_state(cache, cfg, i).items():
            want = -np.inf if n in ("pv_z", "ipv_z") else 0.0
            assert (np.asarray(v) == want).all(), (i, n)


def test_bad_state_input_errors():
    cfg = config.tiny()
    parts = dict(split_cmp_state(jnp.zeros((2, 4, 6 * cfg.head_dim + 6 * cfg.index_head_dim)),
                                 cfg, 4))
    with pytest.raises(ValueError, match=r"must be \[\.\.\., 4, "):
        split_cmp_state(jnp.zeros((2, 4, 7)), cfg, 4)
    with pytest.raises(ValueError, match=r"must be \[\.\.\., 128, "):
        split_cmp_state(jnp.zeros((2, 4, 2 * cfg.head_dim)), cfg, 128)
    del parts["ipv_z"]
    with pytest.raises(ValueError, match="has parts"):
        join_cmp_state(parts, cfg, 4)
    with pytest.raises(ValueError, match="no compressor state"):
        cmp_state_parts(cfg, 0)
    cache = init_cache(cfg, CacheSpec(max_requests=1, num_blocks=2, max_blocks=2))
    swa = cfg.compress_ratios.index(0)
    with pytest.raises(ValueError, match="sliding-window layer"):
        compressor_state(cache, cfg, swa)


def _attention_inputs(params, tokens, cfg, nm):
    """The whole-sequence forward's attention input x [B, T, D] of every layer."""
    xs = {}
    X = model.embed(params, tokens, cfg, nm)
    for i in range(cfg.num_hidden_layers):
        r = cfg.layer_ratio(i)

        def attn(ap, x, i=i, r=r):
            xs[i] = x
            return L.attention_prefill(ap, x, cfg, nm, r), None
        X, _ = model.block(L.block_params(params, f"layers.{i}."), X, tokens, i, cfg, nm, attn)
    return model.head(params, X, cfg, nm), xs


def _expected_state(params, xs, cfg, layer, b, n):
    """Compressor state of a request holding tokens 0..n-1 of batch row b (fresh slot),
    from the forward's attention inputs: the current block's a / z rows (zeros past the
    last token), and for CSA the previous complete block's [:c] half (a = 0, z = -inf
    before the first)."""
    r = cfg.layer_ratio(layer)
    ap = L.block_params(params, f"layers.{layer}.attn.")
    want = {}
    for pre, cp, c in [("", "compressor.", cfg.head_dim),
                       ("i", "indexer.compressor.", cfg.index_head_dim)][:2 if r == 4 else 1]:
        x = xs[layer][b:b + 1, :n]
        a, z = (np.asarray(v)[0] for v in L.compressor_project(
            L.block_params(ap, cp), x, r, jnp.arange(n)[None]))  # [n, coff*c]
        start = n // r * r
        st_a, st_z = (np.zeros((r, a.shape[-1]), np.float32) for _ in range(2))
        st_a[:n - start], st_z[:n - start] = a[start:], z[start:]
        want[pre + "st_a"], want[pre + "st_z"] = st_a, st_z
        if r == 4:
            if start >= r:
                prev = slice(start - r, start)
                want[pre + "pv_a"], want[pre + "pv_z"] = a[prev, :c], z[prev, :c]
            else:
                want[pre + "pv_a"] = np.zeros((r, c), np.float32)
                want[pre + "pv_z"] = np.full((r, c), -np.inf, np.float32)
    return want


@pytest.mark.slow  # ~80 s
def test_cached_state_and_logits_match_the_forward():
    """Two requests (190 and 3 tokens: past window wrap, CSA blocks and an HCA block; and
    before the first CSA block) prefilled in chunks, then 3 decode steps (both cross a CSA
    block end): each named state part equals the one computed from the forward's attention
    inputs (to f32 rounding of the cached path; unwritten rows exactly 0, -inf where no
    previous block), and the logits equal the forward's."""
    cfg = config.tiny()
    params = P.init_params(cfg, 201)
    rng = np.random.default_rng(203)
    lens, steps = [190, 3], 3
    tokens = rng.integers(0, cfg.vocab_size, (2, 200)).astype(np.int32)
    cs = CacheSpec.for_numerics(F32, max_requests=2, num_blocks=8, max_blocks=4)
    eng = Engine(cfg, params, numerics=F32, cache_spec=cs, prefill_chunk=64)
    got_lg = {}
    for s, n in enumerate(lens):
        assert eng.bm.admit(n) == s
        got_lg[s, n] = np.asarray(eng.prefill(s, tokens[s, :n]))

    def check_state(cur_lens):
        for i in range(cfg.num_hidden_layers):
            if cfg.layer_ratio(i) == 0:
                continue
            st = compressor_state(eng.cache, cfg, i)
            assert set(st) == {n for n, _ in cmp_state_parts(cfg, cfg.layer_ratio(i))}
            for s, n in enumerate(cur_lens):
                want = _expected_state(params, xs, cfg, i, s, n)
                for k, w in want.items():
                    g = np.asarray(st[k][s])
                    assert g.shape == w.shape, (i, k)
                    np.testing.assert_array_equal(g[w == 0], 0.0, err_msg=f"L{i} {k} slot {s}")
                    scale = np.abs(w[np.isfinite(w)]).max(initial=0)
                    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale,
                                               err_msg=f"L{i} {k} slot {s} len {n}")

    full, xs = jax.jit(lambda p, t: _attention_inputs(p, t, cfg, F32))(params, tokens)
    full = np.asarray(full)
    check_state(lens)
    for t in range(steps):
        lg = np.asarray(eng.decode({s: int(tokens[s, n + t]) for s, n in enumerate(lens)}))
        for s, n in enumerate(lens):
            got_lg[s, n + t + 1] = lg[s]
    check_state([n + steps for n in lens])
    for (s, n), g in got_lg.items():
        w = full[s, n - 1]
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-4, (s, n)
