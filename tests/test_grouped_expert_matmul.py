"""Grouped expert matmul for many rows (prefill): the shipped Mosaic-GPU kernel on the GPU
interpreter (its FP4 PTX decode swapped for the jnp form) vs an independent float64 numpy
product, the XLA references (row tiles, lax.ragged_dot over group sizes) vs the same, the
row-tile layout from group sizes, input validation, and the CUDA lowering at
DeepSeek-V4-Flash shapes (compile-only sm_90a)."""
import functools

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.formats import Fp4Weight, Fp8Weight
from pallas_kernels.grouped_expert_matmul import (Tuning, grouped_expert_matmul,
                                                  ragged_expert_matmul, tile_layout,
                                                  from_tiles, to_tiles)


def rand_fp8(rng, E, N, K):
    """Random e4m3 values (every finite code) and e8m0 block scales around 2^0."""
    b = rng.integers(0, 256, (E, N, K), dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 1, b)                  # no NaN codes
    sc = rng.integers(120, 134, (E, -(-N // 128), -(-K // 128)), dtype=np.uint8)
    return Fp8Weight(jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)),
                     jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu)))


def rand_fp4(rng, E, N, K):
    packed = rng.integers(-128, 128, (E, N, K // 2), dtype=np.int8)
    sc = rng.integers(118, 136, (E, N, K // 32), dtype=np.uint8)
    return Fp4Weight(jnp.asarray(packed), jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu)))


def dequant_np(w):
    """Independent numpy dequantisation -> float64 [E, N, K] (e2m1 through ml_dtypes)."""
    if isinstance(w, Fp8Weight):
        v = np.asarray(w.w).astype(np.float64)
        s = 2.0 ** (np.asarray(w.scale).view(np.uint8).astype(np.float64) - 127)
        s = np.repeat(np.repeat(s, 128, axis=1)[:, :v.shape[1]], 128, axis=2)[..., :v.shape[2]]
        return v * s
    p = np.asarray(w.packed).view(np.uint8)
    codes = np.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    v = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = 2.0 ** (np.asarray(w.scale).view(np.uint8).astype(np.float64) - 127)
    return v * np.repeat(s, 32, axis=-1)


def rand_x(rng, R, K):
    return jnp.asarray(rng.standard_normal((R, K)), jnp.bfloat16)


def tiled_np(x, tile_expert, w, tm):
    """float64 y[r] = x[r] @ W[tile_expert[r // tm]].T (empty tiles 0)."""
    W = dequant_np(w)
    xn = np.asarray(x, np.float64)
    y = np.zeros((xn.shape[0], W.shape[1]))
    for s, e in enumerate(np.asarray(tile_expert)):
        if 0 <= e < W.shape[0]:
            y[s * tm:(s + 1) * tm] = xn[s * tm:(s + 1) * tm] @ W[e].T
    return y


def ragged_np(x, sizes, w):
    W = dequant_np(w)
    xn = np.asarray(x, np.float64)
    y = np.zeros((xn.shape[0], W.shape[1]))
    r = 0
    for e, n in enumerate(np.asarray(sizes)):
        y[r:r + n] = xn[r:r + n] @ W[e].T
        r += n
    return y


def check(y, ref):
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.float32 and np.isfinite(y).all()
    assert (y[(ref == 0).all(1)] == 0).all(), "rows of no expert must be exactly 0"
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, rel


def interpret(x, ex, w, **kw):
    return jax.jit(functools.partial(grouped_expert_matmul, impl="interpret", **kw))(x, ex, w)


def test_references_match_numpy():
    rng = np.random.default_rng(0)
    for w, K in ((rand_fp8(rng, 3, 200, 320), 320), (rand_fp4(rng, 3, 72, 96), 96)):
        ex = jnp.asarray([2, -1, 0, 2, 3], jnp.int32)
        x = rand_x(rng, 5 * 8, K)
        check(grouped_expert_matmul(x, ex, w, impl="xla", tuning=Tuning(tm=8)),
              tiled_np(x, ex, w, 8))
        sizes = jnp.asarray([7, 0, 25], jnp.int32)          # 32 rows, one expert unused
        check(ragged_expert_matmul(x[:32], sizes, w, impl="xla"), ragged_np(x[:32], sizes, w))


def test_tile_layout_round_trip():
    """Sorted rows -> tiles of one expert each (padding rows 0) -> back, exactly; rows past
    the group sizes' sum belong to no tile."""
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([5, 0, 9, 1, 0, 3], jnp.int32)     # 18 of P = 20 rows
    P, tm = 20, 4
    lay = tile_layout(sizes, P, tm)
    x = rand_x(rng, P, 8)
    xt = np.asarray(to_tiles(x, lay))
    ex = np.asarray(lay.tile_expert_S)
    assert len(ex) == -(-P // tm) + 6
    want = [0, 0, 2, 2, 2, 3, 5] + [-1] * (len(ex) - 7)
    np.testing.assert_array_equal(ex, want)
    # every real row sits in a tile of its own expert; padding rows are zero
    gid = np.repeat(np.arange(6), np.asarray(sizes))
    dst = np.asarray(lay.dst_P)
    np.testing.assert_array_equal(ex[dst[:18] // tm], gid)
    assert (dst[18:] == len(ex) * tm).all()
    pad = np.setdiff1d(np.arange(len(ex) * tm), dst[:18])
    assert (xt[pad] == 0).all()
    back = np.asarray(from_tiles(jnp.asarray(xt), lay))
    np.testing.assert_array_equal(back[:18], np.asarray(x)[:18])
    assert (back[18:] == 0).all()


@pytest.mark.parametrize("tuning", [Tuning(tm=64, tn=128, stages=2), Tuning(tm=64, tn=64, stages=3)])
def test_fp8_interpreted(tuning):
    """Repeated, out-of-order and empty (-1 and E) tiles; 6 K steps through a 2- or 3-deep
    ring (slots refill), 64- and 128-row weight tiles."""
    rng = np.random.default_rng(2)
    E, N, K = 3, 256, 768
    w = rand_fp8(rng, E, N, K)
    ex = jnp.asarray([2, -1, 0, 2, 3], jnp.int32)
    x = rand_x(rng, 5 * tuning.tm, K)
    check(interpret(x, ex, w, tuning=tuning), tiled_np(x, ex, w, tuning.tm))


@pytest.mark.parametrize("exact_fp4,tuning", [(False, Tuning(tm=64, tn=128, stages=2)),
                                              (True, Tuning(tm=64, tn=64, stages=3))])
def test_fp4_interpreted_with_jnp_decode(exact_fp4, tuning):
    """The default "place" decode (weights * 2^-64, the accumulator * 2^64) and the exact
    one; 8 K steps (4 pairs: both scale-column halves), empty tiles."""
    rng = np.random.default_rng(3)
    E, N, K = 2, 128, 1024
    w = rand_fp4(rng, E, N, K)
    ex = jnp.asarray([1, 5, 0], jnp.int32)
    x = rand_x(rng, 3 * tuning.tm, K)
    check(interpret(x, ex, w, exact_fp4=exact_fp4, tuning=tuning),
          tiled_np(x, ex, w, tuning.tm))


def test_ragged_interpreted_matches_ragged_dot():
    """Sorted rows with group sizes (an expert with none, one with more than a tile)
    through the tiles and the kernel = lax.ragged_dot's path = numpy."""
    rng = np.random.default_rng(4)
    E, N, K = 4, 128, 512
    w = rand_fp8(rng, E, N, K)
    sizes = jnp.asarray([70, 0, 3, 23], jnp.int32)
    x = rand_x(rng, 96, K)
    f = jax.jit(functools.partial(ragged_expert_matmul, impl="interpret",
                                  tuning=Tuning(tm=64, stages=2)))
    ref = ragged_np(x, sizes, w)
    check(f(x, sizes, w), ref)
    check(ragged_expert_matmul(x, sizes, w, impl="xla"), ref)


def test_bad_inputs_raise():
    rng = np.random.default_rng(5)
    w = rand_fp8(rng, 2, 256, 512)
    x = rand_x(rng, 128, 512)
    ex = jnp.asarray([0, 1], jnp.int32)
    t = Tuning(tm=64)
    with pytest.raises(ValueError, match="expected S \\* tm"):
        grouped_expert_matmul(x[:100], ex, w, tuning=t)
    with pytest.raises(ValueError, match="bfloat16"):
        grouped_expert_matmul(x.astype(jnp.float32), ex, w, tuning=t)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_expert_matmul(x[:, :256], ex, w, tuning=t)
    with pytest.raises(ValueError, match="K % 256"):
        grouped_expert_matmul(x[:, :384], ex, rand_fp8(rng, 2, 256, 384), tuning=t)
    with pytest.raises(ValueError, match="K % 512"):
        grouped_expert_matmul(rand_x(rng, 128, 768), ex, rand_fp4(rng, 2, 128, 768), tuning=t)
    with pytest.raises(ValueError, match="multiple of tn"):
        grouped_expert_matmul(x, ex, rand_fp8(rng, 2, 192, 512), tuning=t)
    with pytest.raises(ValueError, match="tm and tn"):
        grouped_expert_matmul(rand_x(rng, 64, 512), ex, w, tuning=Tuning(tm=32))
    with pytest.raises(ValueError, match="impl"):
        grouped_expert_matmul(x, ex, w, impl="cuda", tuning=t)
    with pytest.raises(TypeError, match="Fp8Weight"):
        grouped_expert_matmul(x, ex, jnp.zeros((2, 256, 512), jnp.bfloat16), tuning=t)


# ---- CUDA lowering (compile-only sm_90a) ----

FLASH = [  # (fmt, E, N, K): routed w13 merged (FP4), w2 (FP4), a Base model's FP8 experts
    ("fp4", 256, 4096, 4096), ("fp4", 256, 4096, 2048), ("fp8", 256, 4096, 4096),
    ("fp8", 256, 4096, 2048),
]


def _weight(fmt, E, N, K, sharding=None):
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    if fmt == "fp8":
        return Fp8Weight(S((E, N, K), jnp.float8_e4m3fn),
                         S((E, N // 128, K // 128), jnp.float8_e8m0fnu))
    return Fp4Weight(S((E, N, K // 2), jnp.int8), S((E, N, K // 32), jnp.float8_e8m0fnu))


@pytest.mark.parametrize("fmt,E,N,K", FLASH)
def test_cuda_lowering_flash_shapes(fmt, E, N, K):
    """The shipped programs lower at Flash shapes, 64- and 128-row tiles; FP4 with the
    "place" PTX and the lane shuffle of the scale words."""
    S = jax.ShapeDtypeStruct
    for tm in (64, 128):
        f = functools.partial(grouped_expert_matmul, tuning=Tuning(tm=tm))
        text = jax.jit(f).trace(S((300 * tm, K), jnp.bfloat16), S((300,), jnp.int32),
                                _weight(fmt, E, N, K)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        if fmt == "fp4":
            assert "mul.rn.bf16x2 $0, a, $3" in text and "shfl.sync.idx.b32" in text


def test_cuda_compile_with_described_h100():
    """Through XLA's compile for a described H100 (benchmarks/kernel_count.gpu_devices)
    where the CUDA plugin is importable (JAX_PLATFORMS=cpu, PYTHONPATH=/opt/jax-cuda)."""
    try:
        from benchmarks.kernel_count import gpu_devices
        dev = gpu_devices()[0]
    except (SystemExit, Exception) as e:  # noqa: BLE001
        pytest.skip(f"no compile-only CUDA topology here: {e}")
    sh = jax.sharding.SingleDeviceSharding(dev)
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sh)
    for fmt in ("fp4", "fp8"):
        c = jax.jit(grouped_expert_matmul).lower(
            S((64 * 128, 4096), jnp.bfloat16), S((64,), jnp.int32),
            _weight(fmt, 256, 4096, 4096, sh)).compile()
        assert "mosaic_gpu" in c.as_text()


# ---- GPU (H100 / H200) ----

@pytest.mark.gpu
@pytest.mark.parametrize("fmt,tm", [("fp8", 128), ("fp8", 64), ("fp4", 128), ("fp4", 64)])
def test_gpu_matches_reference(fmt, tm):
    rng = np.random.default_rng(6)
    E, N, K = 8, 1024, 2048
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, K)
    ex = jnp.asarray([5, 0, -1, 7, 5, 2], jnp.int32)
    x = rand_x(rng, 6 * tm, K)
    f = jax.jit(functools.partial(grouped_expert_matmul, tuning=Tuning(tm=tm)))
    check(f(x, ex, w), tiled_np(x, ex, w, tm))


# ---- the model's prefill MoE path ----

def test_moe_prefill_path_matches_dense_loop():
    """routed_experts for many tokens with nm.matmul="interpret" (pairs sorted into row
    tiles through the kernel) = the XLA path (a loop over all experts with a combine
    mask), to f32 summation order; w1 and w3 as row views of one merged w13 (the decode
    form); a dropped pair (expert id E) contributes nothing."""
    from dsv4_jax import config as C
    from dsv4_jax.layers import experts as X
    from dsv4_jax.quant import Numerics, WeightRows
    rng = np.random.default_rng(7)
    E, D, I, k, N = 4, 256, 256, 2, 130          # 260 pairs: past the decode kernels' 256
    cfg = C.test().replace(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E,
                           num_experts_per_tok=k)
    w13 = rand_fp8(rng, E, 2 * I, D)
    p = {"experts.w1": WeightRows(w13, 0, I), "experts.w3": WeightRows(w13, I, 2 * I),
         "experts.w2": rand_fp8(rng, E, D, I)}
    x = jnp.asarray(rng.standard_normal((1, N, D)) * 0.5, jnp.bfloat16)
    # distinct experts a token (as top-k routes; a repeated one is weighted once by the loop)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])[None]
    idx = jnp.asarray(idx, jnp.int32).at[0, 5, 1].set(E)
    w = jnp.asarray(rng.random((1, N, k)), jnp.float32)
    assert X.grouped_kernel_ok(p["experts.w1"]) and X.grouped_kernel_ok(p["experts.w2"])
    f = lambda nm: jax.jit(lambda p, x, i, w: X.routed_experts(p, x, i, w, cfg, nm))(p, x, idx, w)
    got = np.asarray(f(Numerics(matmul="interpret")))
    want = np.asarray(f(Numerics()))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err
