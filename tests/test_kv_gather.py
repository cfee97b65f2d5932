"""kv_gather kernels: GPU interpreter vs the XLA reference (bit-exact bf16), CUDA lowering at
real shapes, input checks."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv4_jax import kvformat as kf
from pallas_kernels.kv_gather import kernel, reference

sd = jax.ShapeDtypeStruct
on_gpu = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not on_gpu, reason="needs a GPU")


@pytest.fixture
def interp():
    yield None if on_gpu else plgpu.InterpretGPUParams()
    if not on_gpu:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        interpret_pallas_call.reset_gpu_interpret_mode_state()


def _entries(key, lead):
    """Random quantised entries: quantize_kv of rows with magnitudes over 8 decades."""
    k1, k2 = jax.random.split(key)
    mag = 10.0 ** jax.random.uniform(k2, (*lead, 1), minval=-4, maxval=4)
    return kf.quantize_kv(jax.random.normal(k1, (*lead, 512)) * mag)


def _pool(key, NB, EPB):
    n, s, r = _entries(key, (NB, EPB))
    return {"cmp_nope": n, "cmp_scale": s, "cmp_rope": r}


def _same(out, ref):
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(ref).view(np.uint16))


def _seed():
    return jax.random.key(np.random.randint(1 << 30))


def test_gather_topk_interpret(interp):
    ks = jax.random.split(_seed(), 4)
    NB, EPB, MAXB, B, K = 9, 4, 3, 2, 8
    pool = _pool(ks[0], NB, EPB)
    bt = jax.random.permutation(ks[1], NB)[: B * MAXB].reshape(B, MAXB).astype(jnp.int32)
    bt = bt.at[1, 2].set(-1)
    idx = jax.random.randint(ks[2], (B, K), -1, MAXB * EPB).astype(jnp.int32)
    idx = idx.at[1, :3].set(jnp.array([8, 9, -1]))  # an unused block and padding -> zeros
    idx = idx.at[0, 5].set(int(jnp.argmax(bt[0] == bt.max())) * EPB + EPB - 1)  # pool's last entry
    out = jax.jit(functools.partial(kernel.gather_topk, interpret=interp))(pool, bt, idx)
    ref = reference.gather_topk(pool, bt, idx)
    _same(out, ref)
    assert not np.any(np.asarray(out[1, :3], np.float32))
    i0 = int(idx[0, 5])
    blk, e = int(bt[0, i0 // EPB]), i0 % EPB
    want = kf.dequantize_kv(pool["cmp_nope"][blk, e], pool["cmp_scale"][blk, e], pool["cmp_rope"][blk, e])
    _same(out[0, 5], want)


def test_gather_all_interpret(interp):
    ks = jax.random.split(_seed(), 3)
    NB, EPB, MAXB, B, M = 12, 1, 16, 2, 16  # HCA: 1 entry per block
    pool = _pool(ks[0], NB, EPB)
    bt = jnp.concatenate([jax.random.permutation(ks[1], NB).reshape(B, 6),
                          -jnp.ones((B, MAXB - 6), jnp.int32)], 1).astype(jnp.int32)
    n = jnp.array([5, 9], jnp.int32)  # request 1 runs past its blocks -> zeros
    out = jax.jit(functools.partial(kernel.gather_all, max_entries=M, interpret=interp))(pool, bt, n)
    _same(out, reference.gather_all(pool, bt, n, M))
    assert not np.any(np.asarray(out[0, 5:], np.float32)) and np.all(np.any(np.asarray(out[0, :5], np.float32), -1))


def test_gather_window_interpret(interp):
    ks = jax.random.split(_seed(), 2)
    R = 1
    n, s, r = _entries(ks[0], (R, 128))
    pos = jax.random.randint(ks[1], (R, 128), -1, 3)  # about a third empty
    win = {"win_nope": n, "win_scale": s, "win_rope": r, "win_pos": pos}
    out = jax.jit(functools.partial(kernel.gather_window, interpret=interp))(win)
    ref = reference.gather_window(win)
    _same(out, ref)
    full = kf.dequantize_kv(n, s, r)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.where(np.asarray(pos)[..., None] >= 0, np.asarray(full, np.float32), 0))


def test_cuda_lowering_real_shapes():
    NB, EPB, MAXB, B = 4096, 32, 64, 64
    pool = {"cmp_nope": sd((NB, EPB, 448), jnp.float8_e4m3fn), "cmp_scale": sd((NB, EPB, 8), jnp.uint8),
            "cmp_rope": sd((NB, EPB, 64), jnp.bfloat16)}
    win = {"win_nope": sd((B, 128, 448), jnp.float8_e4m3fn), "win_scale": sd((B, 128, 8), jnp.uint8),
           "win_rope": sd((B, 128, 64), jnp.bfloat16), "win_pos": sd((B, 128), jnp.int32)}
    hca = {k: sd((NB, 1, v.shape[-1]), v.dtype) for k, v in pool.items()}
    low = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    i32 = lambda *s: sd(s, jnp.int32)
    assert "mosaic_gpu" in low(kernel.gather_topk, pool, i32(B, MAXB), i32(B, 512))
    assert "mosaic_gpu" in low(kernel.gather_window, win)
    assert "mosaic_gpu" in low(functools.partial(kernel.gather_all, max_entries=1024),
                               hca, i32(B, 1024), i32(B))


def test_bad_inputs():
    pool = {"cmp_nope": jnp.zeros((4, 4, 448), jnp.float8_e4m3fn), "cmp_scale": jnp.zeros((4, 4, 8), jnp.uint8),
            "cmp_rope": jnp.zeros((4, 4, 64), jnp.float32)}
    with pytest.raises(ValueError, match="rope"):
        kernel.gather_topk(pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 8), jnp.int32))
    pool["cmp_rope"] = pool["cmp_rope"].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernel.gather_topk(pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 12), jnp.int32))
    with pytest.raises(ValueError, match="capacity"):
        kernel.gather_all(pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32), 16)


@gpu
def test_gpu_matches_reference():
    ks = jax.random.split(_seed(), 6)
    NB, EPB, MAXB, B, K = 1024, 32, 32, 16, 512
    pool = _pool(ks[0], NB, EPB)
    bt = jax.random.permutation(ks[1], NB)[: B * MAXB].reshape(B, MAXB).astype(jnp.int32)
    idx = jax.random.randint(ks[2], (B, K), -1, MAXB * EPB).astype(jnp.int32)
    _same(jax.jit(kernel.gather_topk)(pool, bt, idx), reference.gather_topk(pool, bt, idx))
    n = jax.random.randint(ks[3], (B,), 0, MAXB * EPB)
    _same(jax.jit(kernel.gather_all, static_argnums=3)(pool, bt, n, 1024),
          reference.gather_all(pool, bt, n, 1024))
    ne, s, r = _entries(ks[4], (B, 128))
    win = {"win_nope": ne, "win_scale": s, "win_rope": r,
           "win_pos": jax.random.randint(ks[5], (B, 128), -1, 1000)}
    _same(jax.jit(kernel.gather_window)(win), reference.gather_window(win))


def test_dispatch_switch():
    import pallas_kernels.kv_gather as kvg
    ks = jax.random.split(_seed(), 2)
    n, s, r = _entries(ks[0], (2, 128))
    win = {"win_nope": n, "win_scale": s, "win_rope": r,
           "win_pos": jax.random.randint(ks[1], (2, 128), -1, 3)}
    _same(kvg.gather_window(win, impl="xla"), reference.gather_window(win))
    with pytest.raises(ValueError, match="impl"):
        kvg.gather_window(win, impl="triton")
