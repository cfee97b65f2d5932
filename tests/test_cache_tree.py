"""The cache as a typed pytree (dsv4_jax/cache.py): a Cache of one LayerCache per layer with
the fields of its kind (SWA: win / win_pos; HCA: + cmp / cst; CSA: + idx), absent fields
None and no leaf, and a jitted step returning the same tree (tiny preset, CPU)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, decode as D, params as P
from dsv4_jax.cache import (Cache, CacheSpec, LayerCache, cache_structs, init_cache,
                            init_layer_cache, slot_state, with_slot_state)
from dsv4_jax.quant import Numerics

F32 = Numerics(act_quant=False, dtype="float32")
FIELDS = {"swa": {"win", "win_pos"}, "hca": {"win", "win_pos", "cmp", "cst"},
          "csa": {"win", "win_pos", "cmp", "idx", "cst"}}


def _present(lc: LayerCache) -> set:
    return {f for f in ("win", "win_pos", "cmp", "idx", "cst") if getattr(lc, f) is not None}


def _sig(tree):
    """(path, shape, dtype) of every leaf."""
    return [(jax.tree_util.keystr(p), a.shape, a.dtype)
            for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize("act_quant", [False, True])
def test_init_cache_is_typed_per_layer_kind(act_quant):
    cfg = config.tiny()   # SWA, CSA, HCA, CSA, HCA; the MTP block a window layer
    nm = Numerics(act_quant=act_quant, dtype="float32" if not act_quant else "bfloat16")
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=4, max_blocks=2)
    cache = init_cache(cfg, cs)
    assert type(cache) is Cache and cache.first == 0
    assert len(cache.layers) == cfg.num_hidden_layers == len(cache.ids)
    n_leaves = 0
    for i in range(cfg.num_hidden_layers):
        lc = cache[i]
        assert type(lc) is LayerCache
        assert _present(lc) == FIELDS[cfg.layer_kind(i)], i
        names = {p[0].name for p, _ in jax.tree_util.tree_flatten_with_path(lc)[0]}
        assert names == FIELDS[cfg.layer_kind(i)], i   # None fields add no leaf
        n_leaves += len(jax.tree.leaves(lc))
        assert (np.asarray(lc.win_pos) == -1).all()
    assert len(jax.tree.leaves(cache)) == n_leaves
    # the abstract tree (shardings, programs' arguments) has the same structure
    structs = cache_structs(cfg, cs)
    assert jax.tree.structure(structs) == jax.tree.structure(cache)
    assert [(s.shape, s.dtype) for s in jax.tree.leaves(structs)] == \
        [(a.shape, a.dtype) for a in jax.tree.leaves(cache)]
    mtp = init_layer_cache(cfg, cs, cfg.num_hidden_layers)
    assert type(mtp) is LayerCache and _present(mtp) == FIELDS[
        cfg.layer_kind(cfg.num_hidden_layers)]


def test_cache_parts_and_slot_state():
    cfg = config.tiny()
    cs = CacheSpec.for_numerics(F32, max_requests=2, num_blocks=4, max_blocks=2)
    cache = init_cache(cfg, cs)
    stage = cache.part(range(2, 4))   # a pipeline stage's layers, by global id
    assert stage.first == 2 and stage.ids == range(2, 4) and stage[3] is cache[3]
    with pytest.raises(KeyError, match="layer 1 is not in this cache"):
        stage[1]
    with pytest.raises(KeyError):
        stage.replace_layers({4: cache[4]})
    new = cache.replace_layers({1: cache[1].replace(win_pos=cache[1].win_pos + 5)})
    assert new[0] is cache[0] and (np.asarray(new[1].win_pos) == 4).all()
    # the prefix snapshots' per-slot fields: window and compressor state, no pools
    st = slot_state(cache)
    for i in range(cfg.num_hidden_layers):
        assert _present(st[i]) == FIELDS[cfg.layer_kind(i)] - {"cmp", "idx"}
    back = with_slot_state(new, slot_state(cache))
    assert _sig(back) == _sig(cache) and back[1].win_pos is cache[1].win_pos


def test_jitted_step_round_trips_the_tree():
    """A donated, jitted step (a prefill chunk, then decode) returns a cache of the same
    tree: the same types, leaves, shapes and dtypes."""
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1)
    params = P.init_params(cfg, 71)
    cs = CacheSpec.for_numerics(F32, max_requests=2, num_blocks=8, max_blocks=4)
    cache = init_cache(cfg, cs)
    before = _sig(cache)
    step = jax.jit(functools.partial(D.step, cfg=cfg, cs=cs, nm=F32), donate_argnums=(1,))
    table = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4))
    tokens = jnp.asarray(np.random.default_rng(72).integers(0, cfg.vocab_size, (1, 16)),
                         jnp.int32)
    one = jnp.ones(1, jnp.int32)
    _, cache = step(params, cache, tokens, 0 * one, 0 * one, 16 * one, table)
    assert type(cache) is Cache and all(type(lc) is LayerCache for lc in cache.layers)
    assert _sig(cache) == before
    written = np.asarray(cache[1].win_pos)[0]
    assert (np.sort(written[written >= 0]) == np.arange(16)).all()
    _, cache = step(params, cache, tokens[:, :1].repeat(2, 0), jnp.arange(2),
                    jnp.asarray([16, 0]), jnp.ones(2, jnp.int32), table)
    assert _sig(cache) == before
