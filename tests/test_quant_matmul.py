"""Grouped quantised matmul: the Mosaic-GPU kernel (GPU interpreter on CPU) vs the XLA
reference, the reference vs an independent numpy dequantisation, input validation, and
the CUDA lowering at DeepSeek-V4-Flash shapes."""
import functools

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4_jax.quant import Fp4Weight, Fp8Weight
from pallas_kernels.quant_matmul import grouped_matmul
from pallas_kernels.quant_matmul import kernel as K


def rand_fp8(rng, E, N, Kd):
    """Random e4m3 values (every finite code) and e8m0 block scales around 2^0."""
    b = rng.integers(0, 256, (E, N, Kd), dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 1, b)                  # no NaN codes
    sc = rng.integers(120, 134, (E, -(-N // 128), -(-Kd // 128)), dtype=np.uint8)
    return Fp8Weight(jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)),
                     jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu)))


def rand_fp4(rng, E, N, Kd):
    packed = rng.integers(-128, 128, (E, N, Kd // 2), dtype=np.int8)
    sc = rng.integers(118, 136, (E, N, Kd // 32), dtype=np.uint8)
    return Fp4Weight(jnp.asarray(packed), jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu)))


def dequant_np(w):
    """Independent numpy dequantisation -> f64 [E, N, K]."""
    if isinstance(w, Fp8Weight):
        v = np.asarray(w.w).astype(np.float64)
        s = 2.0 ** (np.asarray(w.scale).view(np.uint8).astype(np.float64) - 127)
        s = np.repeat(np.repeat(s, 128, axis=1)[:, :v.shape[1]], 128, axis=2)[..., :v.shape[2]]
        return v * s
    p = np.asarray(w.packed).view(np.uint8)
    codes = np.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    # e2m1 code -> value through ml_dtypes' own float4 type
    v = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = 2.0 ** (np.asarray(w.scale).view(np.uint8).astype(np.float64) - 127)
    return v * np.repeat(s, 32, axis=-1)


def ref_np(x, ex, w):
    W = dequant_np(w)
    E = W.shape[0]
    xn = np.asarray(x, np.float64)
    y = np.zeros((x.shape[0], x.shape[1], W.shape[1]))
    for g, e in enumerate(np.asarray(ex)):
        if 0 <= e < E:
            y[g] = xn[g] @ W[e].T
    return y


def rand_x(rng, G, M, Kd):
    return jnp.asarray(rng.standard_normal((G, M, Kd)), jnp.bfloat16)


def check(y, ref, ex, E):
    y = np.asarray(y)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.isfinite(y).all()
    for g, e in enumerate(np.asarray(ex)):
        if not 0 <= e < E:
            assert (y[g] == 0).all(), f"empty group {g} not zero"
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, rel


def interpret(x, ex, w, **kw):
    f = functools.partial(grouped_matmul, impl="interpret", **kw)
    return jax.jit(f)(x, ex, w)


def test_reference_matches_numpy():
    rng = np.random.default_rng(0)
    for w, Kd in ((rand_fp8(rng, 3, 200, 320), 320), (rand_fp4(rng, 3, 72, 96), 96)):
        ex = jnp.asarray([2, -1, 0, 2, 3], jnp.int32)
        x = rand_x(rng, 5, 8, Kd)
        ref = ref_np(x, ex, w)
        check(grouped_matmul(x, ex, w, impl="xla"), ref, ex, 3)


@pytest.mark.parametrize("kw", [dict(), dict(splits=1, stages=2), dict(splits=2, stages=1)])
def test_interpret_fp8(kw):
    # repeated, out-of-order and empty (-1 and E) groups; stages < steps exercises refills
    rng = np.random.default_rng(1)
    E, N, Kd = 3, 256, 512
    w = rand_fp8(rng, E, N, Kd)
    ex = jnp.asarray([2, -1, 0, 2, 3], jnp.int32)
    x = rand_x(rng, 5, 8, Kd)
    check(interpret(x, ex, w, **kw), ref_np(x, ex, w), ex, E)


@pytest.mark.parametrize("kw", [dict(), dict(splits=2, stages=1), dict(tn=128, tkp=128, stages=3)])
def test_interpret_fp4(kw):
    rng = np.random.default_rng(2)
    E, N, Kd = 2, 128, 1024
    w = rand_fp4(rng, E, N, Kd)
    ex = jnp.asarray([1, 5, 0, 1], jnp.int32)
    x = rand_x(rng, 4, 16, Kd)
    check(interpret(x, ex, w, **kw), ref_np(x, ex, w), ex, E)


def test_interpret_races_and_wide_m():
    # M > 128 switches to 64-row weight tiles (the f32 accumulator must fit in registers)
    rng = np.random.default_rng(3)
    w = rand_fp8(rng, 1, 128, 256)
    ex = jnp.asarray([0], jnp.int32)
    x = rand_x(rng, 1, 136, 256)
    f = functools.partial(K.grouped_matmul_pallas,
                          interpret=plgpu.InterpretGPUParams(detect_races=True))
    check(jax.jit(f)(x, ex, w), ref_np(x, ex, w), ex, 1)


def test_bad_inputs_raise():
    rng = np.random.default_rng(4)
    w = rand_fp8(rng, 2, 256, 256)
    x = rand_x(rng, 2, 8, 256)
    ex = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_matmul(rand_x(rng, 1, 8, 256), ex[:1], rand_fp8(rng, 1, 192, 256))
    with pytest.raises(ValueError, match="bfloat16"):
        grouped_matmul(x.astype(jnp.float32), ex, w)
    with pytest.raises(ValueError, match="multiple of 8"):
        grouped_matmul(x[:, :4], ex, w)
    with pytest.raises(ValueError, match="expert_G"):
        grouped_matmul(x, ex[:1], w)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_matmul(x[..., :128], ex, w)
    with pytest.raises(ValueError, match="scale"):
        grouped_matmul(x, ex, Fp8Weight(w.w, w.scale[:, :1]))
    with pytest.raises(ValueError, match="K % 512"):
        grouped_matmul(x, ex, rand_fp4(rng, 2, 128, 256))
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(x, ex, w, impl="cuda")
    with pytest.raises(TypeError, match="Fp8Weight"):
        grouped_matmul(x, ex, jnp.zeros((2, 256, 256), jnp.bfloat16))
    # the XLA path takes any N (no tiling constraint)
    w3 = rand_fp8(rng, 1, 192, 256)
    x1 = rand_x(rng, 1, 8, 256)
    check(grouped_matmul(x1, ex[:1], w3, impl="xla"), ref_np(x1, ex[:1], w3), ex[:1], 1)


FLASH = [  # (fmt, E, G, N, K)
    ("fp8", 1, 1, 1024, 4096), ("fp8", 1, 1, 32768, 1024), ("fp8", 1, 1, 512, 4096),
    ("fp8", 1, 1, 4096, 8192), ("fp8", 1, 1, 2048, 4096), ("fp8", 1, 1, 4096, 2048),
    ("fp8", 1, 1, 8192, 1024), ("fp8", 8, 8, 1024, 4096),
    ("fp4", 256, 6, 2048, 4096), ("fp4", 256, 64, 4096, 2048),
]


@pytest.mark.parametrize("fmt,E,G,N,Kd", FLASH)
def test_cuda_lowering_flash_shapes(fmt, E, G, N, Kd):
    S = jax.ShapeDtypeStruct
    if fmt == "fp8":
        w = Fp8Weight(S((E, N, Kd), jnp.float8_e4m3fn),
                      S((E, N // 128, Kd // 128), jnp.float8_e8m0fnu))
    else:
        w = Fp4Weight(S((E, N, Kd // 2), jnp.int8), S((E, N, Kd // 32), jnp.float8_e8m0fnu))
    for M in (8, 64, 256):
        lowered = jax.jit(grouped_matmul).trace(
            S((G, M, Kd), jnp.bfloat16), S((G,), jnp.int32), w).lower(
            lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("M", [8, 64])
def test_cuda_lowering_register_a(M):
    """Both variants (reg_a: dequantised rows fed to the wgmma from registers, the default;
    and the SMEM round trip) lower at Flash shapes. The Mosaic-GPU interpreter cannot run a
    register lhs, so its numbers are checked on the GPU only (test below)."""
    S = jax.ShapeDtypeStruct
    for fmt, E, G, N, Kd in [("fp8", 1, 1, 32768, 1024), ("fp8", 1, 1, 4096, 8192),
                             ("fp8", 8, 8, 1024, 4096), ("fp4", 256, 6, 2048, 4096),
                             ("fp4", 256, 64, 4096, 2048)]:
        if fmt == "fp8":
            w = Fp8Weight(S((E, N, Kd), jnp.float8_e4m3fn),
                          S((E, N // 128, Kd // 128), jnp.float8_e8m0fnu))
        else:
            w = Fp4Weight(S((E, N, Kd // 2), jnp.int8), S((E, N, Kd // 32), jnp.float8_e8m0fnu))
        for reg_a in (True, False):
            f = lambda x, e, w: K.grouped_matmul_pallas(x, e, w, reg_a=reg_a)
            lowered = jax.jit(f).trace(S((G, M, Kd), jnp.bfloat16), S((G,), jnp.int32),
                                       w).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "fp8-smem", "fp4-smem"])
def test_gpu_matches_reference(fmt):
    rng = np.random.default_rng(5)
    E, N, Kd = 4, 1024, 2048
    w = (rand_fp4 if fmt.startswith("fp4") else rand_fp8)(rng, E, N, Kd)
    ex = jnp.asarray([3, -1, 0, 3, 1, 7], jnp.int32)
    x = rand_x(rng, 6, 16, Kd)
    kw = dict(reg_a=False) if fmt.endswith("smem") else {}
    f = jax.jit(lambda x, ex, w: K.grouped_matmul_pallas(x, ex, w, **kw))
    check(f(x, ex, w), ref_np(x, ex, w), ex, E)
