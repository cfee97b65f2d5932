"""The decode form of the parameter tree (params.merge_x_proj): each CSA block's five
x-projections stored as one `attn.x_proj_merged` weight give the same logits, bit for bit,
as the tree they came from; the step multiplies x by it in one dot; it shards.

Tiny preset, random parameters drawn fresh for every run."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, layers as L, model, params as P
from dsv4_jax.cache import CacheSpec, init_cache
from dsv4_jax.programs import Layout, split, step_program
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics, WeightRows, f32_dot_bf16

from cached_decode_setup import two_prefilled_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = Numerics(act_quant=True, dtype="bfloat16")
T_TOTAL, P_LEN = 112, 100  # prefill chunks, then decode steps that complete 3 CSA blocks


SEED = 43


@pytest.fixture(scope="module")
def tiny():
    # the tiny preset cut to one layer of each kind (SWA, CSA, HCA; hash and routed MoE) and
    # the MTP block: the merge concerns each CSA block by itself, and the whole-model
    # programs below (compiled several times each: CPU compilation is most of this file's
    # time) are ~40% shorter than with the preset's second CSA and HCA layers
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1)
    params = P.init_params(cfg, SEED)
    return cfg, params, P.merge_x_proj(params, cfg)


def _csa_layers(cfg):
    return [i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 4]


def test_merged_tree_layout(tiny):
    cfg, params, merged = tiny
    csa = _csa_layers(cfg)
    assert csa, "the tiny preset has CSA layers"
    rows = sum(P.x_proj_sizes(cfg))
    assert rows == 2 * 2 * cfg.head_dim + 2 * 2 * cfg.index_head_dim + cfg.index_n_heads
    for pre in [f"layers.{i}.attn." for i in csa]:
        for k in P.X_PROJ_PARTS:
            assert pre + k not in merged
            assert pre + k in params  # the input tree is left as it was
        w = merged[pre + P.X_PROJ]
        assert w.shape == (rows, cfg.hidden_size) and w.dtype == jnp.bfloat16
        # rows in X_PROJ_PARTS order, bit for bit
        want = np.concatenate([np.asarray(params[pre + k]) for k in P.X_PROJ_PARTS])
        np.testing.assert_array_equal(np.asarray(w), want)
    # every other parameter is the very same array; nothing else added or removed
    gone = {f"layers.{i}.attn.{k}" for i in csa for k in P.X_PROJ_PARTS}
    added = {f"layers.{i}.attn.{P.X_PROJ}" for i in csa}
    mtp = cfg.num_hidden_layers
    if cfg.layer_ratio(mtp) == 4:
        gone |= {f"mtp.0.attn.{k}" for k in P.X_PROJ_PARTS}
        added |= {f"mtp.0.attn.{P.X_PROJ}"}
    # every block's ROW_MERGES pairs (FP8 in the tiny preset): one weight, rows in order,
    # every stored array (FP8 values and their 128 x 128 block scales) bit for bit
    blocks = [f"layers.{i}." for i in range(cfg.num_hidden_layers)] + ["mtp.0."]
    for b in blocks:
        for m, parts in P.ROW_MERGES.items():
            gone |= {b + n for n in parts}
            added.add(b + m)
            got = jax.tree.leaves(merged[b + m])
            want = [np.concatenate([np.asarray(jax.tree.leaves(params[b + n])[j])
                                    for n in parts], axis=-2) for j in range(len(got))]
            assert len(got) == 2  # FP8: values, scales
            for g, w in zip(got, want):
                np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=b + m)
    assert set(merged) == (set(params) - gone) | added
    assert all(merged[k] is params[k] for k in set(params) - gone)
    # the description of the decode form matches the tree
    ab = P.abstract_params(cfg, x_proj_merged=True)
    assert set(ab) == set(merged)
    for k, s in ab.items():
        got = jax.tree.map(lambda a: (a.shape, a.dtype), merged[k])
        assert got == jax.tree.map(lambda a: (a.shape, a.dtype), s), k
    assert P.x_proj_is_merged(merged) and not P.x_proj_is_merged(params)


def test_merge_twice_is_a_no_op_and_partial_trees_raise(tiny):
    cfg, params, merged = tiny
    again = P.merge_x_proj(merged, cfg)
    assert set(again) == set(merged) and all(again[k] is merged[k] for k in merged)
    i = _csa_layers(cfg)[0]
    part = dict(params)
    del part[f"layers.{i}.attn.indexer.weights_proj.weight"]
    with pytest.raises(ValueError, match="lacks"):
        P.merge_x_proj(part, cfg)
    both = dict(merged)
    both[f"layers.{i}.attn.compressor.wkv.weight"] = params[f"layers.{i}.attn.compressor.wkv.weight"]
    with pytest.raises(ValueError, match="together with"):
        P.merge_x_proj(both, cfg)
    bad = dict(params)
    bad[f"layers.{i}.attn.compressor.wgate.weight"] = bad[
        f"layers.{i}.attn.compressor.wgate.weight"].astype(jnp.float32)
    with pytest.raises(ValueError, match="expected bf16"):
        P.merge_x_proj(bad, cfg)
    # consume=True merges the given dict in place (its references to the five dropped)
    own = dict(params)
    out = P.merge_x_proj(own, cfg, consume=True)
    assert out is own and set(own) == set(merged)
    # a host (numpy) tree stays on the host
    host = {k: jax.tree.map(np.asarray, v) for k, v in params.items()
            if k.startswith(f"layers.{i}.")}
    hm = P.merge_x_proj(host, cfg)
    assert isinstance(hm[f"layers.{i}.attn.{P.X_PROJ}"], np.ndarray)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(hm[f"layers.{i}.attn.wqkv_a"]))
    # the row merges check their parts too
    part = dict(params)
    del part[f"layers.{i}.ffn.shared_experts.w3"]
    with pytest.raises(ValueError, match="lacks"):
        P.merge_x_proj(part, cfg)
    bad = dict(params)
    bad[f"layers.{i}.attn.wkv"] = params[f"layers.{i}.attn.wq_a"]   # wrong rows
    with pytest.raises(ValueError, match="attn.wkv is Fp8Weight"):
        P.merge_x_proj(bad, cfg)


def test_views_multiply_like_the_weights_they_replace(tiny):
    """block_params shows the merged block's five weights under their names; each view
    times x gives the original weight's bits."""
    cfg, params, merged = tiny
    i = _csa_layers(cfg)[0]
    ap0 = L.block_params(params, f"layers.{i}.attn.")
    ap1 = L.block_params(L.block_params(merged, f"layers.{i}.attn."), "")  # views shown
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((2, 5, cfg.hidden_size)),
                    jnp.bfloat16).astype(jnp.float32)
    for k in P.X_PROJ_PARTS:
        v = ap1[k]
        assert isinstance(v, WeightRows) and v.shape == ap0[k].shape, k
        want = jax.jit(f32_dot_bf16)(x, ap0[k])
        got = jax.jit(f32_dot_bf16)(x, v)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=k)
    for sub in ("compressor.", "indexer.", "indexer.compressor."):
        assert set(L.block_params(ap1, sub)) == set(L.block_params(ap0, sub)), sub


@pytest.mark.slow  # ~100 s (the kernel-path equality below stays)
def test_logits_bit_identical(tiny):
    """Whole-sequence prefill (model.forward) and the cached step (a 64-token prefill
    chunk, then single-token decode steps: teacher forcing) give the same bits with the
    merged tree as with the tree it came from (the default numerics: the merge only
    changes the weights' layout)."""
    cfg, params, merged = tiny
    nm = SIM
    tokens = np.random.default_rng(SEED).integers(0, cfg.vocab_size, (2, T_TOTAL)).astype(np.int32)
    fwd = jax.jit(lambda p, t: model.forward(p, t, cfg, nm))
    np.testing.assert_array_equal(np.asarray(fwd(merged, tokens)),
                                  np.asarray(fwd(params, tokens)))
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=6, max_blocks=3)
    run = lambda p, merge: Engine(cfg, p, numerics=nm, cache_spec=cs, prefill_chunk=64,
                                  merge_x_proj=merge).teacher_forced_logits(tokens, P_LEN)
    eng = Engine(cfg, params, numerics=nm, cache_spec=cs)
    assert P.x_proj_is_merged(eng.params)  # the engine steps with the decode form
    want = run(params, False)
    np.testing.assert_array_equal(run(params, True), want)
    np.testing.assert_array_equal(run(merged, False), want)  # a tree merged beforehand


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.slow  # ~110 s (the views and layout tests stay)
def test_kernel_decode_path_bit_identical(tiny):
    """The decode path through the Pallas cache kernels (Mosaic GPU interpreter on CPU),
    where the compressor and indexer projections are read too: one CSA layer's attention
    output and cache writes are the same bits with the merged block."""
    import dataclasses
    from dsv4_jax import decode as D
    cfg, params, merged = tiny
    nm = SIM
    eng, cs, x, args = two_prefilled_requests(cfg, params, nm)
    i = _csa_layers(cfg)[0]
    csk = dataclasses.replace(cs, kernels="interpret")

    def attend(tree):
        ap = L.block_params(tree, f"layers.{i}.attn.")
        f = jax.jit(lambda lc, x, *a: D.attention_cached(ap, lc, x, *a, cfg, csk, nm, 4))
        return jax.block_until_ready(f(eng.cache[i], x, *args))

    (a, ca), (b, cb) = attend(params), attend(merged)
    np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32))
    for va, vb in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):
        np.testing.assert_array_equal(_bits(vb), _bits(va))


def _count_dots(hlo: str) -> int:
    return sum(" dot(" in line for line in hlo.splitlines())


@pytest.mark.slow  # ~45 s
def test_decode_step_multiplies_x_once_per_csa_block(tiny):
    """The three readers of a merged block (compressor, indexer compressor, indexer
    weights) are one dot after XLA's CSE: the decode step has 4 dots fewer per CSA block
    than with the five weights apart (5 -> 1; 3 if the views' dots were not merged), and
    one fewer per ROW_MERGES pair in every layer (wq_a + wkv, shared w1 + w3)."""
    cfg, params, merged = tiny
    cs = CacheSpec.for_numerics(SIM, max_requests=2, num_blocks=6, max_blocks=3)
    cache = init_cache(cfg, cs)
    args = (jnp.zeros((2, 1), jnp.int32), jnp.arange(2, dtype=jnp.int32),
            jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32),
            jnp.zeros((2, 3), jnp.int32))
    n = {}
    for name, p in (("apart", params), ("merged", merged)):
        graphdef, state = split(cfg, p)
        step = step_program(Layout(cfg), graphdef, cs, SIM)
        n[name] = _count_dots(step.lower(state, cache, *args).compile().as_text())
    assert n["apart"] - n["merged"] == (4 * len(_csa_layers(cfg))
                                        + len(P.ROW_MERGES) * cfg.num_hidden_layers), n


_MESH_SCRIPT = r'''
import json, sys
import jax
import numpy as np
from dsv4_jax import config, params as P, distributed as DI, sharding as SH
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics
seed = int(sys.argv[1])
# one layer of each kind and the MTP block (as the `tiny` fixture)
cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                            num_hash_layers=1)
params = P.init_params(cfg, seed)
nm = Numerics(False, "float32")   # f32: one device matches the mesh to 1e-5 (test_sharding)
cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=6, max_blocks=3)
mesh = DI.make_mesh(2, model=2)   # tensor parallel: indexer weights_proj rows are split
tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 80)).astype(np.int32)
i = [l for l in range(cfg.num_hidden_layers) if cfg.layer_ratio(l) == 4][0]
sp = SH.shard_params(params, cfg, mesh)
mp = P.merge_x_proj(sp, cfg)                  # merged on the mesh
key = f"layers.{i}.attn.{P.X_PROJ}"
want_sh = SH.param_shardings(cfg, mesh, x_proj_merged=True)[key]
res = {"merged_sharding_ok": mp[key].sharding.is_equivalent_to(want_sh, 2),
       "merged_replicated": mp[key].sharding.is_fully_replicated,
       "weights_proj_split": not sp[f"layers.{i}.attn.indexer.weights_proj.weight"]
                                 .sharding.is_fully_replicated}
run = lambda p, merge: Engine(cfg, p, numerics=nm, cache_spec=cs, prefill_chunk=64, mesh=mesh,
                              merge_x_proj=merge).teacher_forced_logits(tokens, 70)
apart = run(sp, False)
merged = run(mp, False)     # the tree merged on the mesh
res["merged_vs_apart_max_abs"] = float(np.abs(merged - apart).max())
res["scale"] = float(np.abs(apart).max())
# the Engine's own merge of an unsharded tree, placed by shard_params
eng = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=64, mesh=mesh)
res["engine_merged"] = P.x_proj_is_merged(eng.params)
res["engine_vs_merged_max_abs"] = float(np.abs(eng.teacher_forced_logits(tokens, 70) - merged).max())
print(json.dumps(res))
'''


@pytest.mark.slow  # ~50 s: a subprocess over 2 devices
def test_merged_tree_shards_and_gives_the_same_logits():
    """On a 2-device CPU mesh (tensor parallel, f32): the merged weight is replicated (as
    the sharding table says), and the sharded step (prefill chunk + decode steps) gives the
    same bits as the unmerged tree on the mesh (the mesh against one device:
    tests/test_sharding.py)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(SEED)], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert res["merged_sharding_ok"] and res["merged_replicated"] and res["weights_proj_split"]
    assert res["engine_merged"]
    assert res["merged_vs_apart_max_abs"] == 0.0
    assert res["engine_vs_merged_max_abs"] == 0.0 and res["scale"] > 0.1


def test_row_views_through_the_matmul_kernel(tiny):
    """The weight-streaming kernel (Mosaic GPU interpreter on CPU) with a view of a merged
    FP8 weight: the merged weight's product, sliced, gives each part's product, bit for
    bit. (That the two views' kernel calls are one after XLA's CSE shows in the GPU
    program compiled without a GPU: `python -m benchmarks.kernel_count --layers 4`, 42 matmul
    kernels instead of 50.)"""
    from dsv4_jax.quant import linear
    cfg, params, merged = tiny
    nm = Numerics(True, "bfloat16", matmul="interpret")
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((1, 3, cfg.hidden_size)),
                    jnp.bfloat16)
    for m, parts in P.ROW_MERGES.items():
        if m == "ffn.experts.w13":
            continue  # stacked experts: test_expert_row_views_through_the_grouped_kernel
        views = L.row_merge_views({m: merged["layers.0." + m],
                                   "attn.kv_norm.weight": params["layers.0.attn.kv_norm.weight"]})
        for n in parts:
            want = jax.jit(lambda x, w: linear(x, w, nm))(x, params["layers.0." + n])
            got = jax.jit(lambda x, w: linear(x, w, nm))(x, views[n])
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32), err_msg=n)


def test_expert_row_views_through_the_grouped_kernel():
    """The routed experts' w1 + w3 stored as one FP4 weight [E, 2I, D] (params.ROW_MERGES
    "ffn.experts.w13"): the grouped weight-streaming kernel (Mosaic GPU interpreter on CPU)
    on each view gives that part's product, bit for bit, for any expert ids (one out of
    range: zero rows). (That the two views' calls are one kernel after XLA's CSE shows in
    the GPU program compiled without a GPU: `python -m benchmarks.kernel_count --layers 4`.)"""
    from dsv4_jax.quant import Fp4Weight, encode_fp4_np, grouped_linear
    rng = np.random.default_rng(SEED)
    E, I, D, G = 3, 128, 512, 4     # the FP4 kernel's tiling: K % 512, rows % 128
    nm = Numerics(True, "bfloat16", matmul="interpret")
    w1, w3 = (rng.standard_normal((E, I, D)).astype(np.float32) for _ in range(2))
    parts = [Fp4Weight(*map(jnp.asarray, encode_fp4_np(w))) for w in (w1, w3)]
    merged = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-2), *parts)
    views = L.row_merge_views({"ffn.experts.w13": merged})
    x = jnp.asarray(rng.standard_normal((G, 8, D)), jnp.bfloat16)
    ids = jnp.asarray(np.append(rng.integers(0, E, G - 1), E), jnp.int32)
    f = jax.jit(lambda x, e, w: grouped_linear(x, e, w, nm))
    for n, want_w in zip(("ffn.experts.w1", "ffn.experts.w3"), parts):
        assert views[n].shape == (E, I, D)
        got, want = f(x, ids, views[n]), f(x, ids, want_w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=n)
        assert np.all(np.asarray(got)[-1] == 0) and np.any(np.asarray(got)[0] != 0)


def test_routed_experts_merged_in_the_flash_decode_form():
    """Flash's decode form stores each layer's routed w1 + w3 as one FP4 [256, 4096, 4096]
    weight, sharded on the experts axis like the parts; NVFP4 experts stay apart."""
    import dataclasses
    cfg = config.flash()
    d = P.describe(cfg, x_proj_merged=True)
    s = d["layers.0.ffn.experts.w13"]
    assert (s.shape, s.fmt, s.axes) == ((256, 4096, 4096), "fp4", ("experts", "mlp13", "embed"))
    assert "layers.0.ffn.experts.w1" not in d and "layers.0.ffn.experts.w2" in d
    d4 = P.describe(dataclasses.replace(cfg, expert_dtype="nvfp4"), x_proj_merged=True)
    assert "layers.0.ffn.experts.w13" not in d4 and "layers.0.ffn.experts.w1" in d4
