"""pallas_kernels.formats vs an independent numpy/ml_dtypes restatement of docs/KV_CACHE.md."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import formats as kf

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def _rand(rng, shape, dtype=np.float32):
    """Random rows with magnitudes spread over ~1e-8 .. 1e4, some exact ties, some tiny rows."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 4, shape[:-1] + (1,))
    x[..., :3] = np.where(rng.random(shape[:-1] + (3,)) < 0.5, 448.0, -0.75) * x[..., 3:4]
    return x.astype(dtype)


def _np_pow2_scale(amax, maxv):
    return 2.0 ** np.ceil(np.log2(amax.astype(np.float64) / maxv))


def _np_quantize_kv(x):
    x = np.asarray(x, np.float32)
    nb = x[..., :448].reshape(*x.shape[:-1], 7, 64)
    amax = np.maximum(np.abs(nb).max(-1, keepdims=True), np.float32(1e-4))
    s = _np_pow2_scale(amax, 448.0)
    q = np.clip(nb / s, -448, 448).astype(E4M3)
    e = np.log2(s[..., 0]).astype(np.int64) + 127
    scale = np.concatenate([e, np.full(e.shape[:-1] + (1,), 127)], -1).astype(np.uint8)
    return q.reshape(*x.shape[:-1], 448), scale, x[..., 448:].astype(ml_dtypes.bfloat16)


def _np_fp4(x, block=32):
    xb = x.reshape(*x.shape[:-1], -1, block).astype(np.float32)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(6 * 2.0**-126))
    s = _np_pow2_scale(amax, 6.0)
    codes = (xb / s).astype(E2M1).view(np.uint8) & 0xF
    e = (np.log2(s[..., 0]).astype(np.int64) + 127).astype(np.uint8)
    return codes.reshape(x.shape), e, (codes.view(E2M1).astype(np.float64) * s).reshape(x.shape)


def _np_pack(codes):
    n = codes.shape[-1] // 2
    return (codes[..., :n] | (codes[..., n:] << 4)).astype(np.uint8)


@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_kv_matches_ml_dtypes(seed):
    rng = np.random.default_rng(seed)
    x = _rand(rng, (64, 512)).astype(ml_dtypes.bfloat16)
    nope, scale, rope = jax.jit(kf.quantize_kv)(jnp.asarray(x))
    r_nope, r_scale, r_rope = _np_quantize_kv(x.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(nope).view(np.uint8), r_nope.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), r_scale)
    np.testing.assert_array_equal(np.asarray(rope).view(np.uint16), r_rope.view(np.uint16))
    # decode: value = e4m3 * 2^(e - 127), exact in bf16
    dec = np.asarray(jax.jit(kf.dequantize_kv)(nope, scale, rope)).astype(np.float64)
    ref = r_nope.astype(np.float64).reshape(64, 7, 64) * 2.0 ** (r_scale[:, :7, None].astype(np.float64) - 127)
    np.testing.assert_array_equal(dec[:, :448], ref.reshape(64, 448))
    np.testing.assert_array_equal(dec[:, 448:], x[:, 448:].astype(np.float64))
    # error bound: half an e4m3 ulp of the top binade [256, 448] is 16, times s
    err = np.abs(dec[:, :448] - x[:, :448].astype(np.float64)).reshape(64, 7, 64)
    s = 2.0 ** (r_scale[:, :7, None].astype(np.float64) - 127)
    assert np.all(err <= 16 * s) and err.max() > 0


def test_kv_amax_floor_and_pow2_edges():
    # all-tiny block -> floor 1e-4 -> s = 2^ceil(log2(1e-4/448)) = 2^-22
    x = np.full((4, 512), 1e-7, np.float32)
    x[1, :64] = 448.0  # amax exactly 448 * 2^0 -> s = 1 (no rounding up)
    x[2, :64] = 448.0 * 2.0**-3
    x[3, :64] = np.float32(ml_dtypes.bfloat16(448.0 * 1.01))  # just above -> s = 2
    nope, scale, _ = kf.quantize_kv(jnp.asarray(x, jnp.bfloat16))
    scale = np.asarray(scale).astype(int) - 127
    assert scale[0, 0] == -22 and np.all(scale[:, 7] == 0)
    assert scale[1, 0] == 0 and scale[2, 0] == -3 and scale[3, 0] == 1
    np.testing.assert_array_equal(scale[:, 1:7], -22)


def test_pow2_exponent_same_for_division_and_reciprocal_multiply():
    # XLA turns amax / 448 into amax * f32(1/448); the ceil-log2 exponent must not care.
    for maxv in (448.0, 6.0):
        base = np.float32(maxv) * (2.0 ** np.arange(-120, 100, 7)).astype(np.float32)
        amax = np.concatenate([base, np.nextafter(base, 0), np.nextafter(base, np.inf),
                               np.random.default_rng(0).random(5000).astype(np.float32) * 1e3])
        amax = amax[np.isfinite(amax) & (amax / maxv >= 2.0**-126)].astype(np.float32)
        div = np.asarray(kf.pow2_ceil_exponent(jnp.asarray(amax / np.float32(maxv))))
        mul = np.asarray(kf.pow2_ceil_exponent(jnp.asarray(amax * np.float32(1 / maxv))))
        ref = np.ceil(np.log2(amax.astype(np.float64) / maxv)).astype(int) + 127
        np.testing.assert_array_equal(div, ref)
        np.testing.assert_array_equal(mul, ref)


def test_e4m3_round_to_nearest_even():
    # midpoints between adjacent e4m3 values must go to the even code
    grid = np.arange(0, 0x7F, dtype=np.uint8).view(E4M3).astype(np.float64)  # 0..448
    mids = (grid[:-1] + grid[1:]) / 2
    v = np.concatenate([mids, -mids, grid]).astype(np.float32)
    got = np.asarray(kf.e4m3_encode(jnp.asarray(v))).view(np.uint8)
    want = v.astype(E4M3).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[: len(mids)] % 2 == 0)  # ties landed on even mantissas


def test_e2m1_encode_matches_ml_dtypes_everywhere():
    rng = np.random.default_rng(3)
    table = kf.E2M1_TABLE[:8].astype(np.float64)
    mids = (table[:-1] + table[1:]) / 2
    v = np.concatenate([table, mids, -mids, -table, rng.uniform(-6, 6, 4000),
                        np.nextafter(mids, 0), np.nextafter(mids, 10)]).astype(np.float32)
    got = np.asarray(kf.e2m1_encode(jnp.asarray(v)))
    want = v.astype(E2M1).view(np.uint8) & 0xF
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(kf.e2m1_decode(jnp.asarray(got))),
                                  want.view(E2M1).astype(np.float32))


@pytest.mark.parametrize("seed", [0, 1])
def test_index_key_fp4(seed):
    rng = np.random.default_rng(seed)
    k = _rand(rng, (3, 40, 128))
    k[0, 0] = 1e-40  # below the 6*2^-126 floor (subnormal input)
    k[0, 1] = 0.0
    f = jax.jit(lambda k: kf.quantize_index_key(k, "fp4"))(jnp.asarray(k))
    codes, e, dec_ref = _np_fp4(k)
    np.testing.assert_array_equal(np.asarray(f["idx_codes"]), _np_pack(codes))
    np.testing.assert_array_equal(np.asarray(f["idx_scale"]), e)
    assert np.all(np.asarray(f["idx_scale"])[0, :2] == 1)  # floor: s = 2^-126
    # split-half: byte j = elem j (lo) | elem j+64 (hi)
    b = np.asarray(f["idx_codes"])[1, 5]
    np.testing.assert_array_equal(b & 0xF, codes[1, 5, :64])
    np.testing.assert_array_equal(b >> 4, codes[1, 5, 64:])
    dec = np.asarray(kf.dequantize_index_key(f, "fp4"))
    np.testing.assert_array_equal(dec, dec_ref.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(kf.fp4_block_sim(jnp.asarray(k))), dec)


def test_index_key_nvfp4():
    rng = np.random.default_rng(5)
    k = _rand(rng, (50, 128))
    k[0] = 0.0
    k[1, :16] = 1e-6  # amax/6 underflows e4m3 -> s = 0 -> zero codes
    f = kf.quantize_index_key(jnp.asarray(k), "nvfp4")
    kb = k.reshape(50, 8, 16)
    s = np.clip(np.abs(kb).max(-1) * np.float32(1 / 6), -448, 448).astype(np.float32).astype(E4M3)
    sf = s.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.clip(kb / sf, -6, 6)
    codes = np.where(sf > 0, v.astype(E2M1).view(np.uint8) & 0xF, 0).reshape(50, 128)
    assert set(f) == {"idx_codes", "idx_scale_lo", "idx_scale_hi"}  # one scale field per half
    np.testing.assert_array_equal(np.asarray(f["idx_scale_lo"]).view(np.uint8), s[:, :4].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(f["idx_scale_hi"]).view(np.uint8), s[:, 4:].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(f["idx_codes"]), _np_pack(codes.astype(np.uint8)))
    dec = np.asarray(kf.dequantize_index_key(f, "nvfp4"))
    ref = (codes.astype(np.uint8).view(E2M1).astype(np.float32).reshape(50, 8, 16) * sf).reshape(50, 128)
    np.testing.assert_array_equal(dec, ref)
    assert np.all(dec[0] == 0) and np.all(dec[1, :16] == 0)


def test_index_key_fp8():
    rng = np.random.default_rng(6)
    k = _rand(rng, (50, 128))
    k[0] = 0.0
    f = kf.quantize_index_key(jnp.asarray(k), "fp8")
    scale = np.abs(k).max(-1, keepdims=True) * np.float32(1 / 448)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.clip(k / scale, -448, 448), 0).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(f["idx_scale"]), scale)
    np.testing.assert_array_equal(np.asarray(f["idx_keys"]).view(np.uint8), q.view(np.uint8))
    dec = np.asarray(kf.dequantize_index_key(f, "fp8"))
    np.testing.assert_array_equal(dec, q.astype(np.float32) * scale)
    rel = np.linalg.norm(dec[1:] - k[1:]) / np.linalg.norm(k[1:])
    assert rel < 0.05


def test_fp8_block_sim_is_dequantize_of_quantize():
    rng = np.random.default_rng(7)
    x = jnp.asarray(_rand(rng, (8, 1024)), jnp.bfloat16)
    y = kf.fp8_block_sim(x, 128)
    q, e = kf.fp8_block_quantize(x, 128)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(kf.fp8_block_dequantize(q, e, 128)))
    # with block 64 on the nope dims it is the KV simulation
    kv = jnp.asarray(_rand(rng, (8, 512)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(kf.kv_sim(kv)[:, :448], np.float32),
                                  np.asarray(kf.fp8_block_sim(kv[:, :448], 64), np.float32))


def test_model_quant_sim_matches_kvformat():
    quant = pytest.importorskip("dsv4_jax.quant")
    rng = np.random.default_rng(8)
    x = jnp.asarray(_rand(rng, (16, 512)), jnp.bfloat16)
    k = jnp.asarray(_rand(rng, (16, 128)), jnp.float32)
    fp8 = getattr(quant, "fp8_block_sim", None) or getattr(quant, "fp8_simulate", None)
    fp4 = getattr(quant, "fp4_block_sim", None) or getattr(quant, "fp4_simulate", None)
    if fp8 is None or fp4 is None:
        pytest.skip("dsv4_jax.quant exposes no fp8/fp4 simulation under a known name yet")
    np.testing.assert_array_equal(np.asarray(fp8(x[:, :448], 64), np.float32),
                                  np.asarray(kf.fp8_block_sim(x[:, :448], 64), np.float32))
    np.testing.assert_array_equal(np.asarray(fp8(x, 128), np.float32),
                                  np.asarray(kf.fp8_block_sim(x, 128), np.float32))
    np.testing.assert_array_equal(np.asarray(fp4(k, 32), np.float32),
                                  np.asarray(kf.fp4_block_sim(k, 32), np.float32))
    big = jnp.asarray(_rand(rng, (256, 128)), jnp.float32)  # many e2m1 ties and magnitudes
    np.testing.assert_array_equal(np.asarray(fp4(big, 32)), np.asarray(kf.fp4_block_sim(big, 32)))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="512"):
        kf.quantize_kv(jnp.ones((2, 500)))
    with pytest.raises(ValueError, match="format"):
        kf.quantize_index_key(jnp.ones((2, 128)), "int4")
