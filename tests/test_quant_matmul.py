"""Grouped quantised matmul: the Mosaic-GPU kernel (GPU interpreter on CPU) vs the XLA
reference, the reference vs an independent numpy dequantisation, input validation, and
the CUDA lowering at DeepSeek-V4-Flash shapes."""
import functools
import re

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


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_interpret_identity_groups_and_real_rows(fmt):
    """expert_G=None (group g uses expert g, no id operand) and rows=r (only the first r
    rows of each group come back, sliced before the split sum)."""
    rng = np.random.default_rng()
    E, N, Kd = 3, 128, 1024
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    x = rand_x(rng, 2, 8, Kd)
    ex = jnp.arange(2, dtype=jnp.int32)
    for rows in (1, 3, 8):
        y = interpret(x, None, w, rows=rows, splits=2)
        assert y.shape == (2, rows, N)
        check(y, ref_np(x, ex, w)[:, :rows], ex, E)
        np.testing.assert_array_equal(
            grouped_matmul(x, None, w, impl="xla", rows=rows),
            grouped_matmul(x, ex, w, impl="xla")[:, :rows])
    with pytest.raises(ValueError, match="rows must be"):
        interpret(x, None, w, rows=9)
    with pytest.raises(ValueError, match="G <= E"):
        interpret(rand_x(rng, 4, 8, Kd), None, w)


def test_cuda_lowering_identity_groups():
    S = jax.ShapeDtypeStruct
    w = Fp8Weight(S((8, 1024, 4096), jnp.float8_e4m3fn), S((8, 8, 32), jnp.float8_e8m0fnu))
    f = lambda x, w: grouped_matmul(x, None, w, rows=1)
    lowered = jax.jit(f).trace(S((8, 8, 4096), jnp.bfloat16), w).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


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


# ---- the "swar" decode's inline PTX, executed on a numpy model of its instructions ----

def _bf16x2_mul(a, b):
    """PTX mul.rn.bf16x2 on uint32 words: per 16-bit lane, exact product rounded to
    nearest even bf16, subnormals kept (computed in float64 through ml_dtypes)."""
    out = np.zeros_like(a)
    for sh in (0, 16):
        fa = ((a >> sh) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        fb = ((b >> sh) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        r = (fa * fb).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        out |= r << sh
    return out


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i:4i+3] of {b, a}
    (bit 3 of the selector nibble replicates that byte's sign bit)."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(np.uint32)
        out |= byte << (8 * i)
    return out


def run_ptx(ptx, outs, ins):
    """Executes the subset of PTX the swar decode uses on uint32 numpy arrays: `ins` are
    $len(outs).. operands, returns the `outs` output operands ($0..)."""
    regs = {f"${len(outs) + i}": np.asarray(v, np.uint32) for i, v in enumerate(ins)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        M32 = np.uint64(0xFFFFFFFF)
        if op == "prmt.b32":
            r = _prmt(np.broadcast_to(v[0], v[2].shape if np.ndim(v[0]) == 0 else np.shape(v[0])).astype(np.uint32),
                      np.uint32(v[1]), int(v[2]))
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "shl.b32":
            r = ((v[0].astype(np.uint64) << np.uint64(int(v[1]))) & M32).astype(np.uint32)
        elif op == "mad.lo.u32":
            r = ((v[0].astype(np.uint64) * np.uint64(int(v[1])) + v[2]) & M32).astype(np.uint32)
        elif op == "mul.rn.bf16x2":
            r = _bf16x2_mul(v[0], v[1])
        else:
            raise NotImplementedError(op)
        regs[d] = np.asarray(r, np.uint32)
    return [regs[f"${i}"] for i in range(len(outs))]


def _bf16_words(fmt, e):
    sa, sb = K.swar_scale_words(fmt, jnp.asarray(e, jnp.int32))
    return np.asarray(sa).astype(np.uint32), np.asarray(sb).astype(np.uint32)


def _lanes(w):
    """uint32 bf16x2 words -> float64 (lane 0, lane 1)."""
    f = lambda u: u.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    return f(w & 0xFFFF), f(w >> 16)


@pytest.mark.parametrize("ptx", ["FP4_SWAR_PTX", "FP4_SWAR_PTX_PRMT"])
def test_fp4_swar_ptx_exact_all_codes_and_scales(ptx):
    """Every pair of packed bytes' nibbles x every e8m0 scale byte 0..254: the PTX gives
    exactly bf16(e2m1 * 2^(e-127)) (rounding only where that overflows bf16); both
    programs (the mad form and the prmt sign-replicate form)."""
    ptx = getattr(K, ptx)
    b0, b1, e = np.meshgrid(np.arange(256), np.arange(0, 256, 37), np.arange(255), indexing="ij")
    b0, b1, e = (a.ravel().astype(np.uint32) for a in (b0, b1, e))
    sa, sb = _bf16_words("fp4", e)
    lo, hi = run_ptx(ptx, ["lo", "hi"], [b0 | (b1 << 8), sa, sb])
    dec = lambda n: n.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = 2.0 ** (e.astype(np.float64) - 127)
    want = lambda n: (dec(n) * scale).astype(ml_dtypes.bfloat16).astype(np.float64)
    for got, (n0, n1) in ((lo, (b0 & 15, b1 & 15)), (hi, (b0 >> 4, b1 >> 4))):
        g0, g1 = _lanes(got)
        np.testing.assert_array_equal(g0, want(n0))
        np.testing.assert_array_equal(g1, want(n1))
    # the interesting corner: the e2m1 subnormal (0.5) at the smallest scales
    assert _lanes(run_ptx(ptx, ["lo", "hi"], [np.uint32(1), *_bf16_words("fp4", 0)])[0])[0] == 2.0 ** -128


def test_fp4_place_ptx_exact_in_its_scale_range():
    """The one-multiply "place" program with its SA word (place_scale_word): every pair of
    packed bytes' nibbles x every e8m0 byte in [59, 192] gives exactly bf16(e2m1 *
    2^(e-127)) * 2^-PLACE_LOG2, which the kernel's accumulator takes back by 2^PLACE_LOG2;
    from 193 on the nonzero codes read as inf (documented, no trained weight's scale)."""
    b0, b1, e = np.meshgrid(np.arange(256), np.arange(0, 256, 37), np.arange(59, 193),
                            indexing="ij")
    b0, b1, e = (a.ravel().astype(np.uint32) for a in (b0, b1, e))
    sa = np.asarray(K.place_scale_word(jnp.asarray(e, jnp.int32))).astype(np.uint32)
    lo, hi = run_ptx(K.FP4_SWAR_PTX_PLACE, ["lo", "hi"], [b0 | (b1 << 8), sa])
    dec = lambda n: n.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = 2.0 ** (e.astype(np.float64) - 127)
    want = lambda n: (dec(n) * scale).astype(ml_dtypes.bfloat16).astype(np.float64)
    for got, (n0, n1) in ((lo, (b0 & 15, b1 & 15)), (hi, (b0 >> 4, b1 >> 4))):
        g0, g1 = _lanes(got)
        np.testing.assert_array_equal(g0 * 2.0 ** K.PLACE_LOG2, want(n0))
        np.testing.assert_array_equal(g1 * 2.0 ** K.PLACE_LOG2, want(n1))
    # the smallest code at the smallest exact scale: a bf16 subnormal, kept
    lo, _ = run_ptx(K.FP4_SWAR_PTX_PLACE, ["lo", "hi"],
                    [np.uint32(1), np.asarray(K.place_scale_word(jnp.int32(59))).astype(np.uint32)])
    assert _lanes(lo)[0] == 2.0 ** (59 - 128 - K.PLACE_LOG2)
    big = np.asarray(K.place_scale_word(jnp.arange(193, 255, dtype=jnp.int32))).astype(np.uint32)
    lo, _ = run_ptx(K.FP4_SWAR_PTX_PLACE, ["lo", "hi"], [np.full(big.shape, 0x22, np.uint32), big])
    assert np.isinf(_lanes(lo)[0]).all()


def test_fp8_swar_ptx_exact_all_codes_and_scales():
    b0, b1, e = np.meshgrid(np.arange(256), np.arange(0, 256, 29), np.arange(255), indexing="ij")
    b0, b1, e = (a.ravel().astype(np.uint32) for a in (b0, b1, e))
    ok = ((b0 & 0x7F) != 0x7F) & ((b1 & 0x7F) != 0x7F)              # no NaN codes
    b0, b1, e = b0[ok], b1[ok], e[ok]
    sa, sb = _bf16_words("fp8", e)
    [out] = run_ptx(K.FP8_SWAR_PTX, ["out"], [b0 | (b1 << 8), sa, sb])
    dec = lambda b: b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = 2.0 ** (e.astype(np.float64) - 127)
    want = lambda b: (dec(b) * scale).astype(ml_dtypes.bfloat16).astype(np.float64)
    g0, g1 = _lanes(out)
    np.testing.assert_array_equal(g0, want(b0))
    np.testing.assert_array_equal(g1, want(b1))


def test_swar_scale_words_are_normal_bf16():
    for fmt in ("fp4", "fp8"):
        for w in _bf16_words(fmt, np.arange(255)):
            assert (w & 0xFFFF == w >> 16).all()
            f = (w >> 7) & 0xFF                     # biased exponent of each half
            assert ((f >= 1) & (f <= 254)).all() and (w & 0x7F == 0).all()


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
        for reg_a, decode in ((True, "cvt"), (False, "cvt"), (True, "swar"), (False, "swar"),
                              (True, "swar-shfl")):
            f = lambda x, e, w: K.grouped_matmul_pallas(x, e, w, reg_a=reg_a, decode=decode)
            lowered = jax.jit(f).trace(S((G, M, Kd), jnp.bfloat16), S((G,), jnp.int32),
                                       w).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("form", [None, "mad", "prmt", "place"])
def test_cuda_lowering_fp4_programs(form, monkeypatch):
    """Each FP4 decode program lowers through both swar paths (the "place" form without SB
    words and with the accumulator's 2^64), "place" when $DSV4_QMM_FP4_PTX is unset; a bad
    name is an error that names the variable."""
    S = jax.ShapeDtypeStruct
    w = Fp4Weight(S((256, 2048, 2048), jnp.int8), S((256, 2048, 128), jnp.float8_e8m0fnu))
    if form is None:
        monkeypatch.delenv("DSV4_QMM_FP4_PTX", raising=False)
    else:
        monkeypatch.setenv("DSV4_QMM_FP4_PTX", form)
    expect = form or "place"
    assert K.fp4_swar_form() == expect
    # each program's own marker: mad's sign lift, the others' mask and last multiply (by
    # SB, $4, in prmt; by SA, $3, in place)
    marks = {"mad": ["mad.lo.u32 n, s, 4032, n"],
             "prmt": ["81C081C0", "mul.rn.bf16x2 $0, a, $4"],
             "place": ["81C081C0", "mul.rn.bf16x2 $0, a, $3"]}[expect]
    for decode in ("swar", "swar-shfl"):
        f = lambda x, e, w: K.grouped_matmul_pallas(x, e, w, decode=decode)
        text = jax.jit(f).trace(S((6, 8, 4096), jnp.bfloat16), S((6,), jnp.int32),
                                w).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and all(m in text for m in marks)
    monkeypatch.setenv("DSV4_QMM_FP4_PTX", "fast")
    with pytest.raises(ValueError, match="DSV4_QMM_FP4_PTX"):
        jax.jit(lambda x, e, w: K.grouped_matmul_pallas(x, e, w, decode="swar")).trace(
            S((6, 8, 4096), jnp.bfloat16), S((6,), jnp.int32), w).lower(
            lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["cvt", "swar", "swar-shfl"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "fp8-smem", "fp4-smem"])
def test_gpu_matches_reference(fmt, decode):
    rng = np.random.default_rng(5)
    E, N, Kd = 4, 1024, 2048
    w = (rand_fp4 if fmt.startswith("fp4") else rand_fp8)(rng, E, N, Kd)
    ex = jnp.asarray([3, -1, 0, 3, 1, 7], jnp.int32)
    x = rand_x(rng, 6, 16, Kd)
    kw = dict(reg_a=False) if fmt.endswith("smem") else {}
    f = jax.jit(lambda x, ex, w: K.grouped_matmul_pallas(x, ex, w, decode=decode, **kw))
    check(f(x, ex, w), ref_np(x, ex, w), ex, E)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_gpu_identity_groups_and_real_rows(fmt):
    rng = np.random.default_rng()
    E, N, Kd = 8, 1024, 4096
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    x = rand_x(rng, 8, 8, Kd)
    ex = jnp.arange(8, dtype=jnp.int32)
    y = jax.jit(lambda x, w: K.grouped_matmul_pallas(x, None, w, rows=1))(x, w)
    check(y, ref_np(x, ex, w)[:, :1], ex, E)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [8, 64])
@pytest.mark.parametrize("decode", [None, "swar"])
def test_gpu_fp4_default_tiles(M, decode):
    """The FP4 default tiles at M = 8 and 64 (128-row tiles, 128 B steps)."""
    rng = np.random.default_rng(7)
    E, N, Kd = 8, 1024, 2048
    w = rand_fp4(rng, E, N, Kd)
    ex = jnp.asarray([5, 0, -1, 7, 5, 2], jnp.int32)
    x = rand_x(rng, 6, M, Kd)
    f = jax.jit(lambda x, ex, w: K.grouped_matmul_pallas(x, ex, w, decode=decode))
    check(f(x, ex, w), ref_np(x, ex, w), ex, E)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_gpu_swar_full_scale_range(fmt, monkeypatch):
    """Scales 2^-117 .. 2^100 (far outside real checkpoints; the smallest scales are left
    out only so that no product is an f32 subnormal in the tensor cores; the numpy model
    of the PTX covers e = 0..254): every weight exactly as the numpy dequantisation,
    read out through an identity-like x (one 1.0 per row picks single weights)."""
    monkeypatch.setenv("DSV4_QMM_FP4_PTX", "mad")   # the default "place": 66..192 below
    rng = np.random.default_rng(6)
    E, N, Kd = 1, 256, 512
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    sc = rng.integers(10, 228, w.scale.shape, dtype=np.uint8)
    w = type(w)(*(jax.tree.leaves(w)[:-1] + [jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu))]))
    cols = rng.choice(Kd, 16, replace=False)
    x = np.zeros((1, 16, Kd), np.float32)
    x[0, np.arange(16), cols] = 1.0
    x = jnp.asarray(x, jnp.bfloat16)
    ex = jnp.asarray([0], jnp.int32)
    y = np.asarray(jax.jit(lambda x, ex, w: K.grouped_matmul_pallas(x, ex, w, decode="swar"))(x, ex, w))
    W = dequant_np(w)[0]                                        # f64 [N, K], exact
    np.testing.assert_array_equal(y[0], W[:, cols].T.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["mad", "prmt", "place"])
def test_gpu_fp4_programs(form, monkeypatch):
    """Each FP4 decode program ($DSV4_QMM_FP4_PTX, read at trace time): random experts
    against the reference, then single weights read out through an identity-like x at
    scales 2^-61 .. 2^65 ("place", the default: e8m0 bytes 66 .. 192, where the weights *
    2^-64 and their products with x = 1 are normal; "mad" / "prmt": 10 .. 227, as
    test_gpu_swar_full_scale_range), each exactly the numpy dequantisation."""
    monkeypatch.setenv("DSV4_QMM_FP4_PTX", form)
    rng = np.random.default_rng()
    E, N, Kd = 8, 1024, 2048
    w = rand_fp4(rng, E, N, Kd)
    ex = jnp.asarray([5, 0, -1, 7, 5, 2], jnp.int32)
    x = rand_x(rng, 6, 8, Kd)
    f = jax.jit(lambda x, ex, w: K.grouped_matmul_pallas(x, ex, w))
    check(f(x, ex, w), ref_np(x, ex, w), ex, E)
    lo, hi = (66, 193) if form == "place" else (10, 228)
    w = rand_fp4(rng, 1, 256, 512)
    sc = rng.integers(lo, hi, w.scale.shape, dtype=np.uint8)
    w = Fp4Weight(w.packed, jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu)))
    cols = rng.choice(512, 16, replace=False)
    xi = np.zeros((1, 16, 512), np.float32)
    xi[0, np.arange(16), cols] = 1.0
    y = np.asarray(jax.jit(lambda x, ex, w: K.grouped_matmul_pallas(x, ex, w))(
        jnp.asarray(xi, jnp.bfloat16), jnp.asarray([0], jnp.int32), w))
    np.testing.assert_array_equal(y[0], dequant_np(w)[0][:, cols].T.astype(np.float32))
