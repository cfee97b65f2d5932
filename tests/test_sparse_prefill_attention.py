"""Sparse prefill attention: the shipped Mosaic-GPU kernel on the GPU interpreter vs the
blocked pure-JAX reference (CSA top-k ids and HCA prefixes, stale ring slots, padding
rows of the chunk), the reference vs the model's dense chunk attention (layers.attend over
the [T, W + T + n] mask it builds), and the CUDA lowering at Flash shapes."""
import functools
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from dsv4_jax.layers.attention import attend
from dsv4_jax.quant import Numerics
from pallas_kernels.sparse_prefill_attention import sparse_prefill_attention, window_table

W = 128


def make_case(seed, T=3, H=2, NE=70, L=16, pos0=130, nvalid=2, ratio=4, hca=False):
    rng = np.random.default_rng(seed)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, ring, kv, ents = bf(T, H, 512), bf(W, 512), bf(T, 512), bf(NE, 512)
    p = pos0 - W + np.arange(W)
    rp = np.full(W, -1)
    rp[p % W] = p
    rp[rng.random(W) < 0.1] = -1                   # stale / empty ring slots
    tpos = pos0 + np.arange(T)
    nvis = np.minimum((tpos + 1) // ratio, NE)
    if hca:
        ids, ncmp = None, nvis
    else:
        ncmp = np.minimum(L, nvis)
        ids = np.stack([rng.permutation(NE)[:L] for _ in range(T)])
        ids = jnp.asarray(np.where(np.arange(L)[None] < ncmp[:, None], ids, -1), jnp.int32)
    win, wb = window_table(ring, jnp.asarray(rp, jnp.int32), kv, pos0, nvalid)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    args = (q, win, wb, ents, ids, jnp.asarray(ncmp, jnp.int32),
            jnp.arange(T, dtype=jnp.int32) + 1, jnp.zeros(T, jnp.int32), sink)
    dense = dict(ring=ring, rp=rp, kv=kv, ents=ents, tpos=tpos, nvalid=nvalid, ids=ids,
                 nvis=nvis)
    return args, dense


def dense_attention(args, d):
    """The model's chunk path (decode.attention_cached's XLA form): keys = ring | chunk |
    every entry, a dense [T, W + T + n] mask, layers.attend."""
    q, sink = args[0], args[-1]
    T = q.shape[0]
    ring_pos = np.where(d["rp"] < d["tpos"][0], d["rp"], -1)
    new_pos = np.where(np.arange(T) < d["nvalid"], d["tpos"], -1)
    kpos = np.concatenate([ring_pos, new_pos])
    pt = d["tpos"][:, None]
    mask = (kpos[None] >= 0) & (kpos[None] <= pt) & (kpos[None] > pt - W)
    NE = d["ents"].shape[0]
    if d["ids"] is None:
        vis = np.arange(NE)[None] < d["nvis"][:, None]
    else:
        ids = np.asarray(d["ids"])
        vis = np.zeros((T, NE), bool)
        for t in range(T):
            vis[t, ids[t][ids[t] >= 0]] = True
    keys = jnp.concatenate([d["ring"], d["kv"], d["ents"]])[None, None]
    m = jnp.asarray(np.concatenate([mask, vis], 1))[None]
    return attend(q[None], keys, m, sink, Numerics())[0]


@pytest.mark.parametrize("hca", [False, True])
def test_reference_matches_dense_chunk_attention(hca):
    args, d = make_case(0, T=6, H=3, hca=hca)
    ref = np.asarray(sparse_prefill_attention(*args, impl="xla"))
    want = np.asarray(dense_attention(args, d))
    np.testing.assert_allclose(ref, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("hca", [False, True])
def test_interpreted_kernel_matches_reference(hca):
    """The kernel's online softmax rounds p to bf16 against the running max (the reference
    against the final one): equal to that rounding, far tighter than a wrong key would
    give (the check's bound is a tenth of the effect of dropping one key)."""
    args, d = make_case(1, hca=hca)
    ref = np.asarray(sparse_prefill_attention(*args, impl="xla"))
    got = np.asarray(jax.jit(functools.partial(sparse_prefill_attention, impl="interpret"))(
        *args))
    assert got.shape == ref.shape and np.isfinite(got).all()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 4e-3, err
    # the same attention without one of its compressed keys moves the output far more
    nc = args[5]
    fewer = np.asarray(sparse_prefill_attention(*args[:5], jnp.maximum(nc - 1, 0), *args[6:],
                                                impl="xla"))
    assert np.abs(fewer - ref).max() / np.abs(ref).max() > 10 * err


@pytest.mark.parametrize("hca", [False, True])
def test_cuda_lowering_flash_shapes(hca):
    S = jax.ShapeDtypeStruct
    T, H, NE, L = 2048, 64, 8192, 512
    ids = None if hca else S((T, L), jnp.int32)
    f = lambda q, w, b, e, i, n, wo, co, s: sparse_prefill_attention(q, w, b, e, i, n, wo, co, s)
    text = jax.jit(f).trace(
        S((T, H, 512), jnp.bfloat16), S((T + W, 512), jnp.bfloat16), S((T + W,), jnp.float32),
        S((NE, 512), jnp.bfloat16), ids, S((T,), jnp.int32), S((T,), jnp.int32),
        S((T,), jnp.int32), S((H,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_bad_inputs_raise():
    args, _ = make_case(2)
    with pytest.raises(ValueError, match="impl"):
        sparse_prefill_attention(*args, impl="cuda")
    with pytest.raises(ValueError, match="rounds p"):
        sparse_prefill_attention(*args, impl="interpret", bf16_p=False)
    with pytest.raises(ValueError, match="head dim"):
        sparse_prefill_attention(args[0][..., :256], *args[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("hca", [False, True])
def test_gpu_kernel_matches_reference(hca):
    args, _ = make_case(3, T=64, H=64, NE=600, L=512, pos0=2000, nvalid=60, hca=hca)
    ref = np.asarray(sparse_prefill_attention(*args, impl="xla"))
    got = np.asarray(jax.jit(sparse_prefill_attention)(*args))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 4e-3


# ---------------------------------------------------------------- compiled for an H100
def _misaligned_tma_starts(ptx):
    """-> the TMAs (cp.async.bulk.tensor) of the PTX whose innermost start coordinate is not
    shown 16-byte aligned: its definition (the last one above the copy, through register
    moves) must be a constant multiple of 8 elements or a shift left by >= 3 (16 bytes for
    elements of 2 bytes or more)."""
    lines = ptx.splitlines()
    defs = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\w[\w.]*)\s+(%r\d+),\s*(.*);", line)
        if m:
            defs.setdefault(m.group(2), []).append((i, m.group(1), m.group(3).strip()))

    def aligned(reg, at):
        before = [d for d in defs.get(reg, []) if d[0] < at]
        if not before:
            return False
        i, op, operands = before[-1]
        if op.startswith("mov") and re.fullmatch(r"%r\d+", operands):
            return aligned(operands, i)
        if op.startswith("mov") and re.fullmatch(r"-?\d+", operands):
            return int(operands) % 8 == 0
        return op.startswith("shl") and int(operands.split(",")[-1]) >= 3

    bad, n = [], 0
    for i, line in enumerate(lines):
        m = re.search(r"cp\.async\.bulk\.tensor\.\dd[^\[]*\[(?:%r\d+\], \[)?%rd\d+, "
                      r"\{\s*(%r\d+)", line)
        if m:
            n += 1
            if not aligned(m.group(1), i):
                bad.append(line.strip())
    return n, bad


@pytest.mark.parametrize("hca", [False, True])
def test_tma_starts_are_16_byte_aligned_on_h100(hca, capfd, monkeypatch):
    """A TMA's innermost start coordinate must be a multiple of 16 bytes; otherwise Hopper
    stops the kernel with CUDA_ERROR_ILLEGAL_INSTRUCTION (the interpreter does not check
    it). The bias copies once started at woff[r] + 64 b floats (woff[r] = r + 1): compiled
    for a described H100 (compile-only), every TMA's innermost coordinate must be shown
    aligned in the PTX (_misaligned_tma_starts). Needs the CUDA PJRT plugin importable
    and JAX_PLATFORMS=cpu, e.g. PYTHONPATH=/opt/jax-cuda; skips without it."""
    try:
        from benchmarks.kernel_count import gpu_devices
        dev = gpu_devices("h100_sxm")[0]
    except (SystemExit, Exception) as e:  # noqa: BLE001
        pytest.skip(f"no compile-only H100 here (needs the CUDA PJRT plugin importable and "
                    f"JAX_PLATFORMS=cpu, e.g. PYTHONPATH=/opt/jax-cuda): {e}")
    sh = jax.sharding.SingleDeviceSharding(dev)
    S = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sh)
    T, H, NE, L = 2048, 64, 4096, 512
    args = (S((T, H, 512), jnp.bfloat16), S((T + W, 512), jnp.bfloat16),
            S((T + W,), jnp.float32), S((NE, 512), jnp.bfloat16),
            None if hca else S((T, L), jnp.int32), S((T,), jnp.int32), S((T,), jnp.int32),
            S((T,), jnp.int32), S((H,), jnp.float32))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.delenv("MOSAIC_GPU_DUMP_TO", raising=False)
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    capfd.readouterr()
    try:
        with jax.default_device(dev):
            jax.jit(sparse_prefill_attention).lower(*args).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    ptx = capfd.readouterr().out
    assert ".target sm_90a" in ptx
    n, bad = _misaligned_tma_starts(ptx)
    assert n >= 100, n                # q, sink, (ids,) 2 x 64 key rows, bias; the stores
    assert not bad, bad
