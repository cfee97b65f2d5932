"""The decode step with the Pallas kernels (Mosaic GPU interpreter on CPU) against the
pure-JAX step on the same cache: identical cache writes, attention to bf16 rounding."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, decode as D, layers as L, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.quant import Numerics

from cached_decode_setup import two_prefilled_requests


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


# Both attention backends; the indexer key formats' scoring kernels run in the CSA layers
# with the Triton attention (cheaper to interpret). The Mosaic case runs every layer kind.
@pytest.mark.parametrize("backend,index_format,every_kind", [
    pytest.param("mosaic", "fp4", True, marks=pytest.mark.slow),   # ~135 s: every layer kind
    ("triton", "fp4", False),
    pytest.param("triton", "nvfp4", False, marks=pytest.mark.slow),   # ~55 s each; the
    pytest.param("triton", "fp8", False, marks=pytest.mark.slow)])    # formats' own tests stay
def test_kernel_decode_layers_match_pure_jax(backend, index_format, every_kind):
    cfg = config.tiny()
    params = P.init_params(cfg, 701)
    nm = Numerics(True, "bfloat16")
    eng, cs, x, args = two_prefilled_requests(cfg, params, nm, index_format=index_format,
                                              attention_backend=backend)
    programs = {}

    def attend(i, kernels):
        """One layer's attention_cached as one jitted program, waited for. (Run op by op,
        the interpreted kernels' callbacks, which run jax ops themselves, could deadlock
        against the ops dispatched after them: seen once in 3 local suite runs.) The layer's
        parameters are an argument, so a layer kind compiles once."""
        key = (kernels, cfg.layer_ratio(i))
        if key not in programs:
            csk = dataclasses.replace(cs, kernels=kernels)
            programs[key] = jax.jit(lambda ap, lc, x, *a, r=key[1]: D.attention_cached(
                ap, lc, x, *a, cfg, csk, nm, r))
        ap = L.block_params(params, f"layers.{i}.attn.")
        return jax.block_until_ready(programs[key](ap, eng.cache[i], x, *args))

    firsts = [cfg.compress_ratios.index(r) for r in sorted(set(cfg.compress_ratios[:-1]))]
    for i in firsts:   # one layer of each kind (another layer of a kind runs the same program)
        if not every_kind and cfg.layer_ratio(i) != 4:
            continue   # the indexer kernels run in the CSA layers only
        res = [attend(i, k) for k in ("off", "interpret")]
        (a, ca), (b, cb) = res
        for (pa, va), (pb, vb) in zip(jax.tree_util.tree_flatten_with_path(ca)[0],
                                      jax.tree_util.tree_flatten_with_path(cb)[0]):
            assert pa == pb
            assert np.array_equal(_bits(va), _bits(vb)), f"layer {i}: cache {pa} differs"
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.linalg.norm(a - b) / np.linalg.norm(a)
        # attention core agrees to ~0.3% (bf16 P); wo_b's FP8 input rounding amplifies it
        assert err < 0.05, (i, err)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_read_only_kernels_lowered_once_per_shape(backend):
    """The indexer top-k and sparse attention kernels sit behind one jit each, so a model's
    layers share one lowered (and one compiled) copy per shape: the CUDA lowering of the
    5-layer tiny step (SWA, 2 CSA, 2 HCA) defines attention once per layer kind and calls
    it from every layer. Without it the 43-layer Flash step compiled ~5x slower."""
    import re
    from jax._src.mesh import AbstractDevice, AbstractMesh
    # the Triton lowerings (attention's default backend, and the top-k kernel with either
    # backend) ask for the GPU's model: an abstract H100
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    ctx = jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev))
    cfg = config.tiny()
    nm = Numerics(True, "bfloat16")
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=4, max_blocks=2, kernels="on",
                                attention_backend=backend)
    S = jax.ShapeDtypeStruct
    args = (S((2, 1), jnp.int32), S((2,), jnp.int32), S((2,), jnp.int32), S((2,), jnp.int32),
            S((2, 2), jnp.int32))
    from dsv4_jax.cache import cache_structs
    with ctx:
        low = jax.jit(functools.partial(D.step, cfg=cfg, cs=cs, nm=nm)).trace(
            P.abstract_params(cfg), cache_structs(cfg, cs), *args).lower(
            lowering_platforms=("cuda",))
    txt = low.as_text()
    defs = re.findall(r"func\.func (?:private|public) @(\w+)", txt)
    count = lambda name: sum(d == name or d.startswith(name + "_") for d in defs)
    assert count("_sparse_attention_jit") == 3, defs  # one per layer kind (SWA, CSA, HCA)
    assert count("_indexer_topk_jit") == 1, defs  # CSA only
    # ... and they are called from every layer that uses them
    assert len(re.findall(r"call @_sparse_attention_jit(?:_\d+)?\b", txt)) == cfg.num_hidden_layers
    assert len(re.findall(r"call @_indexer_topk_jit(?:_\d+)?\b", txt)) == sum(
        cfg.layer_ratio(i) == 4 for i in range(cfg.num_hidden_layers))


def test_kernel_cache_spec_formats():
    """The kernels need the FP8 KV cache and quantised indexer keys (any of the three)."""
    for fmt in ("fp4", "nvfp4", "fp8"):
        assert CacheSpec(kernels="interpret", index_format=fmt).index_format == fmt
    for bad in (dict(kv_format="raw"), dict(index_format="raw")):
        with pytest.raises(ValueError, match="kv_format='fp8' and index_format one of"):
            CacheSpec(kernels="on", **bad)
    assert CacheSpec().attention_backend == "mosaic"   # the shipped kernel
    with pytest.raises(ValueError, match="attention_backend"):
        CacheSpec(attention_backend="cuda")
