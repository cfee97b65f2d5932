"""Grouped quantised matmul: the shipped Mosaic-GPU kernel on the GPU interpreter (its
inline-PTX FP4 decode swapped for the jnp form and its register-A wgmma for SMEM staging:
the test names say so) vs the XLA reference, the reference vs an independent numpy
dequantisation, the FP4 PTX programs on a numpy model of their instructions, input
validation, and the CUDA lowering (compile-only sm_90a) at DeepSeek-V4-Flash shapes."""
import functools

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.formats import Fp4Weight, Fp8Weight
from pallas_kernels.quant_matmul import Tuning, grouped_matmul
from pallas_kernels.quant_matmul import decode as D
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


@pytest.mark.parametrize("tuning", [Tuning(splits=1, stages=2), Tuning(splits=2, stages=1)])
def test_fp8_interpreted_with_smem_operand(tuning):
    """Repeated, out-of-order and empty (-1 and E) groups; stages < steps refills slots."""
    rng = np.random.default_rng(1)
    E, N, Kd = 3, 256, 512
    w = rand_fp8(rng, E, N, Kd)
    ex = jnp.asarray([2, -1, 0, 2, 3], jnp.int32)
    x = rand_x(rng, 5, 8, Kd)
    check(interpret(x, ex, w, tuning=tuning), ref_np(x, ex, w), ex, E)


@pytest.mark.parametrize("exact_fp4,tuning", [(False, None),
                                              (True, Tuning(splits=2, stages=1, tn=128))])
def test_fp4_interpreted_with_jnp_decode(exact_fp4, tuning):
    """The default "place" program (weights * 2^-64, the accumulator * 2^64) at the
    default tiles (64 rows at M = 16), and the exact program with 128-row tiles and a
    refilled one-slot ring; empty groups."""
    rng = np.random.default_rng(2)
    E, N, Kd = 2, 128, 1024
    w = rand_fp4(rng, E, N, Kd)
    ex = jnp.asarray([1, 5, 0, 1], jnp.int32)
    x = rand_x(rng, 4, 16, Kd)
    check(interpret(x, ex, w, exact_fp4=exact_fp4, tuning=tuning), ref_np(x, ex, w), ex, E)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_interpreted_identity_groups_and_real_rows(fmt):
    """expert_G=None (group g uses expert g, no id operand) and rows=r (only the first r
    rows of each group come back, sliced before the split sum)."""
    rng = np.random.default_rng(3)
    E, N, Kd = 3, 128, 1024
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    x = rand_x(rng, 2, 8, Kd)
    ex = jnp.arange(2, dtype=jnp.int32)
    y = np.asarray(interpret(x, None, w, tuning=Tuning(splits=2)))
    check(y, ref_np(x, ex, w), ex, E)
    for rows in (1, 3, 8):
        np.testing.assert_array_equal(
            grouped_matmul(x, None, w, impl="xla", rows=rows),
            grouped_matmul(x, ex, w, impl="xla")[:, :rows])
    y3 = interpret(x, None, w, rows=3, tuning=Tuning(splits=2))
    assert y3.shape == (2, 3, N)
    np.testing.assert_array_equal(np.asarray(y3), y[:, :3])
    with pytest.raises(ValueError, match="rows must be"):
        interpret(x, None, w, rows=9)
    with pytest.raises(ValueError, match="G <= E"):
        interpret(rand_x(rng, 4, 8, Kd), None, w)


def test_interpreted_races_and_wide_m():
    """M > 128 switches to 64-row weight tiles (the f32 accumulator must fit in
    registers); the interpreter's race detector finds none."""
    rng = np.random.default_rng(4)
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
    with pytest.raises(ValueError, match="tn must be"):
        grouped_matmul(x, ex, w, tuning=Tuning(tn=32))
    with pytest.raises(ValueError, match="splits=3"):
        grouped_matmul(x, ex, w, tuning=Tuning(splits=3))
    with pytest.raises(TypeError, match="Fp8Weight"):
        grouped_matmul(x, ex, jnp.zeros((2, 256, 256), jnp.bfloat16))
    # the XLA path takes any N (no tiling constraint)
    w3 = rand_fp8(rng, 1, 192, 256)
    x1 = rand_x(rng, 1, 8, 256)
    check(grouped_matmul(x1, ex[:1], w3, impl="xla"), ref_np(x1, ex[:1], w3), ex[:1], 1)


# ---- the FP4 programs' PTX, executed on a numpy model of its instructions ----

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


def _lanes(w):
    """uint32 bf16x2 words -> float64 (lane 0, lane 1)."""
    f = lambda u: u.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    return f(w & 0xFFFF), f(w >> 16)


def _dec_fp4(n):
    return n.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _fp4_want(n, e):
    return (_dec_fp4(n) * 2.0 ** (e.astype(np.float64) - 127)).astype(
        ml_dtypes.bfloat16).astype(np.float64)


def _pairs_and_scales(e_range):
    b0, b1, e = np.meshgrid(np.arange(256), np.arange(0, 256, 37), e_range, indexing="ij")
    return (a.ravel().astype(np.uint32) for a in (b0, b1, e))


def test_fp4_mad_ptx_exact_all_codes_and_scales():
    """The exact program (exact_fp4): every pair of packed bytes' nibbles x every e8m0
    scale byte 0..254 gives exactly bf16(e2m1 * 2^(e-127)) (rounding only where that
    overflows bf16); the SA / SB words are normal bf16x2 splats for every byte."""
    b0, b1, e = _pairs_and_scales(np.arange(255))
    sa, sb = (np.asarray(v).astype(np.uint32) for v in D.swar_scale_words(jnp.asarray(e, jnp.int32)))
    lo, hi = run_ptx(D.FP4_MAD_PTX, ["lo", "hi"], [b0 | (b1 << 8), sa, sb])
    for got, (n0, n1) in ((lo, (b0 & 15, b1 & 15)), (hi, (b0 >> 4, b1 >> 4))):
        g0, g1 = _lanes(got)
        np.testing.assert_array_equal(g0, _fp4_want(n0, e))
        np.testing.assert_array_equal(g1, _fp4_want(n1, e))
    # the e2m1 subnormal (0.5) at the smallest scale
    sa0, sb0 = (np.asarray(v).astype(np.uint32) for v in D.swar_scale_words(jnp.int32(0)))
    assert _lanes(run_ptx(D.FP4_MAD_PTX, ["lo", "hi"], [np.uint32(1), sa0, sb0])[0])[0] == 2.0 ** -128
    for w in (sa, sb):
        assert (w & 0xFFFF == w >> 16).all()
        f = (w >> 7) & 0xFF                     # biased exponent of each half
        assert ((f >= 1) & (f <= 254)).all() and (w & 0x7F == 0).all()


def test_fp4_place_ptx_exact_in_its_scale_range():
    """The default "place" program with its SA word (place_scale_word): every pair of
    packed bytes' nibbles x every e8m0 byte in [59, 192] gives exactly bf16(e2m1 *
    2^(e-127)) * 2^-PLACE_LOG2, which the kernel's accumulator takes back; from 193
    (PLACE_MAX_SCALE_BYTE + 1) on the nonzero codes read as inf."""
    b0, b1, e = _pairs_and_scales(np.arange(59, 193))
    sa = np.asarray(D.place_scale_word(jnp.asarray(e, jnp.int32))).astype(np.uint32)
    lo, hi = run_ptx(D.FP4_PLACE_PTX, ["lo", "hi"], [b0 | (b1 << 8), sa])
    for got, (n0, n1) in ((lo, (b0 & 15, b1 & 15)), (hi, (b0 >> 4, b1 >> 4))):
        g0, g1 = _lanes(got)
        np.testing.assert_array_equal(g0 * 2.0 ** D.PLACE_LOG2, _fp4_want(n0, e))
        np.testing.assert_array_equal(g1 * 2.0 ** D.PLACE_LOG2, _fp4_want(n1, e))
    # the smallest code at the smallest exact scale: a bf16 subnormal, kept
    lo, _ = run_ptx(D.FP4_PLACE_PTX, ["lo", "hi"],
                    [np.uint32(1), np.asarray(D.place_scale_word(jnp.int32(59))).astype(np.uint32)])
    assert _lanes(lo)[0] == 2.0 ** (59 - 128 - D.PLACE_LOG2)
    assert D.PLACE_MAX_SCALE_BYTE == 192
    big = np.asarray(D.place_scale_word(jnp.arange(193, 255, dtype=jnp.int32))).astype(np.uint32)
    lo, _ = run_ptx(D.FP4_PLACE_PTX, ["lo", "hi"], [np.full(big.shape, 0x22, np.uint32), big])
    assert np.isinf(_lanes(lo)[0]).all()


@pytest.mark.parametrize("form,e_range", [("place", np.arange(66, 193)),
                                          ("mad", np.arange(2, 255))])
def test_fp4_jnp_decode_equals_ptx(form, e_range):
    """The interpreter's decode (fp4_decode_jnp) gives the PTX program's bf16 values, bit
    for bit, for every byte and every scale byte where its f32 scale is normal."""
    b0, b1, e = _pairs_and_scales(e_range)
    words = [np.asarray(v).astype(np.uint32) for v in D.scale_words(jnp.asarray(e, jnp.int32), form)
             if v is not None]
    lo, hi = run_ptx(D.FP4_PROGRAMS[form], ["lo", "hi"], [b0 | (b1 << 8), *words])
    b = jnp.asarray(np.stack([b0, b1], 1).astype(np.uint8))
    jlo, jhi = D.fp4_decode_jnp(b, jnp.asarray(e, jnp.int32), form=form)
    for got, j in ((lo, jlo), (hi, jhi)):
        g = np.stack(_lanes(got), 1)
        np.testing.assert_array_equal(np.asarray(j, np.float64), g)
        np.testing.assert_array_equal(np.signbit(np.asarray(j, np.float64)), np.signbit(g))
    assert D.fp4_swar_form() == "place" and D.fp4_swar_form(exact_fp4=True) == "mad"


# ---- CUDA lowering (compile-only sm_90a) ----

FLASH = [  # (fmt, E, G, N, K)
    ("fp8", 1, 1, 1024, 4096), ("fp8", 1, 1, 32768, 1024), ("fp8", 1, 1, 4096, 8192),
    ("fp8", 8, 8, 1024, 4096), ("fp4", 256, 6, 2048, 4096), ("fp4", 256, 64, 4096, 2048),
]


def _weight(fmt, E, N, Kd):
    S = jax.ShapeDtypeStruct
    if fmt == "fp8":
        return Fp8Weight(S((E, N, Kd), jnp.float8_e4m3fn),
                         S((E, N // 128, Kd // 128), jnp.float8_e8m0fnu))
    return Fp4Weight(S((E, N, Kd // 2), jnp.int8), S((E, N, Kd // 32), jnp.float8_e8m0fnu))


def _lower_text(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fmt,E,G,N,Kd", FLASH)
def test_cuda_lowering_flash_shapes(fmt, E, G, N, Kd):
    """The shipped programs lower at Flash shapes (M = 8, 64, and 256 with 64-row tiles);
    FP4 with the "place" program and the lane shuffle of the scale words."""
    S = jax.ShapeDtypeStruct
    w = _weight(fmt, E, N, Kd)
    for M in (8, 64, 256):
        text = _lower_text(grouped_matmul, S((G, M, Kd), jnp.bfloat16), S((G,), jnp.int32), w)
        assert "mosaic_gpu" in text
        if fmt == "fp4":
            assert "mul.rn.bf16x2 $0, a, $3" in text and "shfl.sync.idx.b32" in text


def test_cuda_lowering_exact_fp4_and_identity_groups():
    """exact_fp4 lowers the "mad" program (its sign lift); expert_G=None lowers with no id
    operand."""
    S = jax.ShapeDtypeStruct
    x, ex = S((6, 8, 4096), jnp.bfloat16), S((6,), jnp.int32)
    text = _lower_text(functools.partial(grouped_matmul, exact_fp4=True), x, ex,
                       _weight("fp4", 256, 2048, 4096))
    assert "mad.lo.u32 n, s, 4032, n" in text and "mul.rn.bf16x2 $0, a, $3" not in text
    w = _weight("fp8", 8, 1024, 4096)
    text = _lower_text(lambda x, w: grouped_matmul(x, None, w, rows=1),
                       S((8, 8, 4096), jnp.bfloat16), w)
    assert "mosaic_gpu" in text


# ---- GPU (H100 / H200) ----

@pytest.mark.gpu
@pytest.mark.parametrize("fmt,M", [("fp8", 16), ("fp4", 8), ("fp4", 16), ("fp4", 64)])
def test_gpu_matches_reference(fmt, M):
    """The shipped kernel (FP4 default tiles at M = 8 / 64: 128 rows, 16: 64 rows)."""
    rng = np.random.default_rng(5)
    E, N, Kd = 8, 1024, 2048
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    ex = jnp.asarray([5, 0, -1, 7, 5, 2], jnp.int32)
    x = rand_x(rng, 6, M, Kd)
    check(jax.jit(grouped_matmul)(x, ex, w), ref_np(x, ex, w), ex, E)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_gpu_identity_groups_and_real_rows(fmt):
    rng = np.random.default_rng(8)
    E, N, Kd = 8, 1024, 4096
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, E, N, Kd)
    x = rand_x(rng, 8, 8, Kd)
    ex = jnp.arange(8, dtype=jnp.int32)
    y = jax.jit(lambda x, w: grouped_matmul(x, None, w, rows=1))(x, w)
    check(y, ref_np(x, ex, w)[:, :1], ex, E)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,exact_fp4", [("fp8", False), ("fp4", False), ("fp4", True)])
def test_gpu_single_weights_across_the_scale_range(fmt, exact_fp4):
    """Random experts against the reference, then single weights read out through an
    identity-like x (one 1.0 a row) at scale bytes 10 .. 227 (FP8, and FP4 with
    exact_fp4) or 66 .. 192 (FP4 "place": the weights * 2^-64 and their products with
    x = 1 stay normal): each exactly the numpy dequantisation."""
    rng = np.random.default_rng(6)
    mm = jax.jit(functools.partial(grouped_matmul, exact_fp4=exact_fp4))
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, 8, 1024, 2048)
    ex = jnp.asarray([5, 0, -1, 7, 5, 2], jnp.int32)
    x = rand_x(rng, 6, 8, 2048)
    check(mm(x, ex, w), ref_np(x, ex, w), ex, 8)
    lo, hi = (66, 193) if fmt == "fp4" and not exact_fp4 else (10, 228)
    w = (rand_fp4 if fmt == "fp4" else rand_fp8)(rng, 1, 256, 512)
    sc = rng.integers(lo, hi, w.scale.shape, dtype=np.uint8)
    w = type(w)(*(jax.tree.leaves(w)[:-1] + [jnp.asarray(sc.view(ml_dtypes.float8_e8m0fnu))]))
    cols = rng.choice(512, 16, replace=False)
    xi = np.zeros((1, 16, 512), np.float32)
    xi[0, np.arange(16), cols] = 1.0
    y = np.asarray(mm(jnp.asarray(xi, jnp.bfloat16), jnp.asarray([0], jnp.int32), w))
    np.testing.assert_array_equal(y[0], dequant_np(w)[0][:, cols].T.astype(np.float32))
