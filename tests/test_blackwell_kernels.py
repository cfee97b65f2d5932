"""The Blackwell (sm_100a) kernels: each on the Mosaic GPU interpreter (CPU, single CTA
programs; the inline-PTX decodes and cp.async gathers, which the interpreter cannot run,
swapped for their jnp / ref-copy forms: the test names say so) against its pure-JAX
reference on random data, and each compiled for a described B200 (compile-only, no GPU)
with its PTX pinned (.target sm_100a, tcgen05 MMA, no wgmma). The compile tests need the
CUDA PJRT plugin importable and jax on its CPU platform (no GPU to start), e.g.
JAX_PLATFORMS=cpu PYTHONPATH=/opt/jax-cuda pytest tests/test_blackwell_kernels.py;
without them they skip.

The interpreted tests reach the Blackwell kernels through the packages' entry points with
the dispatch's `is_blackwell` answering yes (this machine has no sm_100 to report)."""
import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels.indexer_decode.scores as ix_scores
import pallas_kernels.quant_matmul as qm
import pallas_kernels.sparse_decode_attention as sda
from pallas_kernels.arch import compute_capability
from pallas_kernels.formats import Fp4Weight, Fp8Weight
from pallas_kernels.indexer_decode import reference as ix_ref
from pallas_kernels.indexer_decode import score_keys
from pallas_kernels.quant_matmul import Tuning, grouped_matmul
from pallas_kernels.sparse_decode_attention import reference as sda_ref
from test_indexer_decode import check_scores, edge_table, make_qw, raw_keys, spread_keys
from test_quant_matmul import check, rand_fp4, rand_fp8, rand_x, ref_np
from test_sparse_decode_attention import edge_inputs, make_inputs, rel_err, reference

S = jax.ShapeDtypeStruct


@pytest.fixture
def blackwell(monkeypatch):
    """The three packages' dispatch sees an sm_100 target."""
    for mod in (qm, ix_scores, sda):
        monkeypatch.setattr(mod, "is_blackwell", lambda: True)


def test_no_gpu_means_the_hopper_kernels():
    """Without a GPU (or a described one as the default device) Mosaic GPU lowers for 9.0,
    so the entry points keep the Hopper kernels."""
    assert compute_capability() == (9, 0)


# ---------------------------------------------------------------- interpreted
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quant_matmul_interpreted(fmt, blackwell):
    """FP8 (the exact register dequant) and FP4 (its inline-PTX decode swapped for the jnp
    form): an empty group, a repeated expert, 2 K splits (FP8: 4 steps a split through the
    3-deep ring; FP4: 2 steps, 2 deep); identity groups with rows=1."""
    rng = np.random.default_rng(3)
    E, N, Kd, M = 3, 256, 1024, 16
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    ex = jnp.asarray([2, -1, 0, 2], jnp.int32)
    x = rand_x(rng, 4, M, Kd)
    f = functools.partial(grouped_matmul, impl="interpret", tuning=Tuning(splits=2))
    check(jax.jit(f)(x, ex, w), ref_np(x, ex, w), ex, E)
    x = rand_x(rng, 2, 8, Kd)
    y = jax.jit(lambda x, w: grouped_matmul(x, None, w, impl="interpret", rows=1))(x, w)
    ex = jnp.arange(2, dtype=jnp.int32)
    check(y, ref_np(x, ex, w)[:, :1], ex, E)


@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_indexer_scores_interpreted_with_jnp_dequant(fmt, blackwell):
    """Raw fp4 / nvfp4 bytes (every code pair) and spread fp8 keys, the edge table (a
    request past the table, -1 blocks, nothing eligible, a partial chunk), an odd CTA span
    (1 chunk: the kernel takes 2, so 2 CTAs), untrimmed output -inf past the table."""
    rng = np.random.default_rng(41)
    B, NB, MAXB = 4, 32, 7
    q, w = make_qw(42, B)
    keys = spread_keys(rng, fmt, NB) if fmt == "fp8" else raw_keys(rng, fmt, NB)
    bt, t = edge_table(rng, B, NB, MAXB)
    ref = np.asarray(ix_ref.indexer_scores_reference(q, w, keys, bt[:B], t, fmt=fmt))
    f = jax.jit(functools.partial(score_keys, fmt=fmt, interpret=True, trim=False,
                                  tuning=ix_scores.Tuning(chunks_per_cta=1)))
    full = np.asarray(f(q, w, keys, bt, t))
    assert full.shape == (B, 2 * 2 * 64) and (full[:, MAXB * 32:] == -np.inf).all()
    check_scores(full[:, :MAXB * 32], ref)


def test_sparse_attention_interpreted_with_ref_row_copies(blackwell):
    """The pool's last row, -1 holes and a whole block of -1 at 2 splits (the first with an
    odd block count: a zeroed, masked pair half), the splits' merge; then in-kernel HCA ids
    with an empty request and mostly empty window slots."""
    args = edge_inputs()
    out = np.asarray(jax.jit(functools.partial(
        sda.sparse_decode_attention, interpret=True,
        tuning=sda.AttentionTuning(splits=2)))(*args)).astype(np.float32)
    assert np.isfinite(out).all() and rel_err(out, reference(args)) < 5e-3
    q, win, cmp, bt, _, t, sink = make_inputs(2, B=2, NB=8, EPB=1, MAXB=4, n_idx=4,
                                              t=(20, 600), n_valid=(0, 4))
    out = np.asarray(jax.jit(functools.partial(
        sda.sparse_decode_attention, interpret=True, hca_entries=4))(
        q, win, cmp, bt, None, t, sink)).astype(np.float32)
    want = reference((q, win, cmp, bt, None, t, sink), sda_ref.hca_indices(t, 4))
    assert rel_err(out, want) < 5e-3


# ---------------------------------------------------------------- compiled for a B200
def _b200():
    try:
        from benchmarks.kernel_count import gpu_devices
        return gpu_devices("b200")[0]
    except (SystemExit, Exception) as e:  # noqa: BLE001
        pytest.skip(f"no compile-only B200 here (needs the CUDA PJRT plugin importable and "
                    f"JAX_PLATFORMS=cpu, e.g. PYTHONPATH=/opt/jax-cuda): {e}")


def _ptx(f, args, capfd, monkeypatch):
    """Compile f(*args) (args: ShapeDtypeStructs) for the described B200 with Mosaic GPU
    targeting it (the default device) -> the PTX of its Mosaic kernels (the plugin prints
    it with MOSAIC_GPU_DUMP_PTX set; the compilation cache is off so that it compiles)."""
    dev = _b200()
    sh = jax.sharding.SingleDeviceSharding(dev)
    args = jax.tree.map(lambda a: S(a.shape, a.dtype, sharding=sh), args)
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    capfd.readouterr()
    try:
        with jax.default_device(dev):
            assert compute_capability() == (10, 0)
            jax.jit(f).lower(*args).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    ptx = capfd.readouterr().out
    assert ".target sm_100a" in ptx and "wgmma" not in ptx
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and "tcgen05.alloc" in ptx
    return ptx


@pytest.mark.parametrize("fmt,E,G,N,Kd,M", [
    ("fp8", 1, 1, 1024, 4096, 8), ("fp8", 8, 8, 1024, 4096, 256),
    ("fp4", 256, 6, 2048, 4096, 8), ("fp4", 256, 64, 4096, 2048, 64)])
def test_quant_matmul_compiles_for_sm100a(fmt, E, G, N, Kd, M, capfd, monkeypatch):
    """Flash shapes through grouped_matmul (impl="pallas"): the dispatch takes the
    Blackwell kernel; FP4 with the "place" decode's PTX."""
    w = (Fp8Weight(S((E, N, Kd), jnp.float8_e4m3fn),
                   S((E, N // 128, Kd // 128), jnp.float8_e8m0fnu)) if fmt == "fp8" else
         Fp4Weight(S((E, N, Kd // 2), jnp.int8), S((E, N, Kd // 32), jnp.float8_e8m0fnu)))
    ptx = _ptx(grouped_matmul, (S((G, M, Kd), jnp.bfloat16), S((G,), jnp.int32), w),
               capfd, monkeypatch)
    if fmt == "fp4":
        assert "mul.rn.bf16x2" in ptx


@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_indexer_scores_compile_for_sm100a(fmt, capfd, monkeypatch):
    """Each key format at B = 64, a 40-block table (Flash 4K context), through score_keys."""
    B, NB, MAXB = 64, 64 * 40, 40
    keys = {"fp4": {"idx_codes": S((NB, 32, 64), jnp.uint8),
                    "idx_scale": S((NB, 32, 4), jnp.uint8)},
            "nvfp4": {"idx_codes": S((NB, 32, 64), jnp.uint8),
                      "idx_scale_lo": S((NB, 32, 4), jnp.float8_e4m3fn),
                      "idx_scale_hi": S((NB, 32, 4), jnp.float8_e4m3fn)},
            "fp8": {"idx_keys": S((NB, 32, 128), jnp.float8_e4m3fn),
                    "idx_scale": S((NB, 32, 1), jnp.float32)}}[fmt]
    args = (S((B, 64, 128), jnp.bfloat16), S((B, 64), jnp.float32), keys,
            S((B, MAXB), jnp.int32), S((B,), jnp.int32))
    _ptx(functools.partial(score_keys, fmt=fmt), args, capfd, monkeypatch)


@pytest.mark.parametrize("B,epb,hca", [(1, 32, False), (64, 32, False), (64, 1, True)])
def test_sparse_attention_compiles_for_sm100a(B, epb, hca, capfd, monkeypatch):
    """Flash's 64 heads: CSA top-512 ids at B = 1 and 64 (ids_prefix), HCA in-kernel ids;
    the cp.async row gather is kept."""
    H, NB, MAXB, K = 64, B * 34, 34, 512
    win = (S((B, 128, 448), jnp.float8_e4m3fn), S((B, 128, 8), jnp.uint8),
           S((B, 128, 64), jnp.bfloat16), S((B, 128), jnp.int32))
    cmp = (S((NB, epb, 448), jnp.float8_e4m3fn), S((NB, epb, 8), jnp.uint8),
           S((NB, epb, 64), jnp.bfloat16))
    q, bt, t, sink = (S((B, H, 512), jnp.bfloat16), S((B, MAXB), jnp.int32),
                      S((B,), jnp.int32), S((H,), jnp.float32))
    if hca:
        f = lambda q, win, cmp, bt, t, sink: sda.sparse_decode_attention(
            q, win, cmp, bt, None, t, sink, hca_entries=32)
        args = (q, win, cmp, bt, t, sink)
    else:
        f = functools.partial(sda.sparse_decode_attention, ids_prefix=True)
        args = (q, win, cmp, bt, S((B, K), jnp.int32), t, sink)
    ptx = _ptx(f, args, capfd, monkeypatch)
    assert "cp.async.cg.shared.global" in ptx
