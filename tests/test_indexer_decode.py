"""Decode lightning indexer: the shipped Mosaic-GPU scoring kernel on the GPU interpreter
(its inline-PTX dequant and register-A wgmma swapped for their jnp / SMEM forms: the test
names say so) vs the pure-JAX path, the pure-JAX path vs numpy, the PTX programs on an
emulator, and the CUDA lowering (compile-only sm_90a) that pins what ships."""
import functools
import re

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels import formats as kvformat
from pallas_kernels.indexer_decode import dequant as DQ
from pallas_kernels.indexer_decode import reference as R
from pallas_kernels.indexer_decode import scores as SC
from pallas_kernels.indexer_decode import Tuning, score_keys, topk_keys

E2M1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
S = jax.ShapeDtypeStruct


def make_qw(seed, B):
    ks = jax.random.split(jax.random.key(seed), 2)
    q = kvformat.fp4_block_sim(jax.random.normal(ks[0], (B, 64, 128)))
    return q, jax.random.normal(ks[1], (B, 64)) * 0.1


def spread_keys(rng, fmt, NB):
    """A pool of quantised keys whose scale blocks span 2^-6..2^5."""
    k = rng.standard_normal((NB, 32, 128)) * 2.0 ** rng.integers(-6, 6, (NB, 32, 8)).repeat(16, -1)
    return kvformat.quantize_index_key(jnp.asarray(k, jnp.float32), fmt)


def raw_keys(rng, fmt, NB):
    """Raw random bytes: every e2m1 code pair, signs, zeros; fp4 scale bytes 100..159,
    nvfp4 every non-NaN e4m3 scale byte (subnormals, zero, 448, negative)."""
    codes = jnp.asarray(rng.integers(0, 256, (NB, 32, 64)), jnp.uint8)
    if fmt == "fp4":
        return {"idx_codes": codes,
                "idx_scale": jnp.asarray(rng.integers(100, 160, (NB, 32, 4)), jnp.uint8)}
    sc = rng.integers(0, 256, (2, NB, 32, 4)).astype(np.uint8)
    sc.reshape(-1)[:256] = np.arange(256)                # every byte at least once
    sc[(sc & 0x7F) == 0x7F] = 0x38                        # no NaN (never stored)
    sc = jax.lax.bitcast_convert_type(jnp.asarray(sc), jnp.float8_e4m3fn)
    return {"idx_codes": codes, "idx_scale_lo": sc[0], "idx_scale_hi": sc[1]}


def edge_table(rng, B, NB, MAXB):
    """A block table with a garbage row past the requests (never read) and unused (-1)
    blocks inside request 1's range; t: a request past the table (all eligible), one
    with -1 blocks, t = -1 (nothing eligible), a partial first chunk."""
    bt = rng.permutation(NB)[: B * MAXB].reshape(B, MAXB).astype(np.int32)
    bt[1, MAXB // 2:] = -1
    bt = np.concatenate([bt, np.full((1, MAXB), 10 ** 6, np.int32)])
    t = np.array([4 * 32 * MAXB + 999, 4 * 32 * (MAXB // 2) - 5, -1, 50], np.int32)[:B]
    return jnp.asarray(bt), jnp.asarray(t)


def check_scores(out, ref):
    fin = np.isfinite(ref)
    assert out.shape == ref.shape
    assert (np.isfinite(out) == fin).all(), "eligibility mask differs"
    assert (out[~fin] == -np.inf).all()
    scale = np.abs(ref[fin]).max()
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-5, atol=1e-5 * scale)


def interpreted(fmt, tuning=None, trim=True):
    return jax.jit(functools.partial(score_keys, fmt=fmt, interpret=True, tuning=tuning,
                                     trim=trim))


# ---------------------------------------------------------------- the pure-JAX path
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_reference_matches_numpy(fmt):
    rng = np.random.default_rng(0)
    B, NB, MAXB = 2, 6, 3
    q, w = make_qw(1, B)
    keys = spread_keys(rng, fmt, NB)
    bt = jnp.asarray(rng.permutation(NB)[: B * MAXB].reshape(B, MAXB).astype(np.int32))
    t = jnp.asarray([100, 4 * 32 * MAXB - 1], jnp.int32)
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt))
    if fmt == "fp4":
        codes = np.asarray(keys["idx_codes"])
        e = np.asarray(keys["idx_scale"]).astype(np.int32)
        vals = np.concatenate([E2M1[codes & 15], E2M1[codes >> 4]], axis=-1)   # split-half
        kf = vals * np.repeat(2.0 ** (e - 127), 32, axis=-1)                   # [NB, 32, 128]
    else:
        kf = np.asarray(keys["idx_keys"].astype(jnp.float32)) * np.asarray(keys["idx_scale"])
    qn, wn = np.asarray(q, np.float64), np.asarray(w, np.float64)
    for b in range(B):
        kb = kf[np.asarray(bt[b])].reshape(-1, 128).astype(np.float64)
        s = (wn[b][:, None] * np.maximum(qn[b] @ kb.T, 0)).sum(0)
        n = (int(t[b]) + 1) // 4
        np.testing.assert_allclose(ref[b, :n], s[:n], rtol=1e-5, atol=1e-6 * np.abs(s).max())
        assert (ref[b, n:] == -np.inf).all()


# ---------------------------------------------------------------- the kernel, interpreted
def test_fp4_scores_interpreted_with_jnp_dequant():
    """fp4 keys from raw bytes (every code pair) through the shipped kernel, its "place"
    dequant and words order in their jnp forms: 2 chunks a CTA (2 a loop iteration) and 3
    (1 an iteration, the last CTA past an odd table), the edge table; the untrimmed output
    (as topk_select reads it) is -inf past the table."""
    rng = np.random.default_rng(11)
    B, NB, MAXB = 4, 32, 7
    q, w = make_qw(12, B)
    keys = raw_keys(rng, "fp4", NB)
    bt, t = edge_table(rng, B, NB, MAXB)
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt[:B], t))
    full = np.asarray(interpreted("fp4", Tuning(chunks_per_cta=2), trim=False)(q, w, keys, bt, t))
    assert full.shape[1] > MAXB * 32 and (full[:, MAXB * 32:] == -np.inf).all()
    check_scores(full[:, :MAXB * 32], ref)
    assert np.isfinite(full[0, :MAXB * 32]).all() and not np.isfinite(full[2]).any()
    out = np.asarray(interpreted("fp4", Tuning(chunks_per_cta=3))(q, w, keys, bt, t))
    check_scores(out, ref)


def test_nvfp4_scores_interpreted_with_jnp_dequant():
    """nvfp4 keys from raw bytes (every code pair, every non-NaN e4m3 scale), the default
    split, then spread keys at 2 chunks a CTA with the edge table."""
    rng = np.random.default_rng(21)
    B, NB, MAXB = 4, 24, 5
    q, w = make_qw(22, B)
    keys = raw_keys(rng, "nvfp4", NB)
    bt, t = edge_table(rng, B, NB, MAXB)
    f = interpreted("nvfp4", Tuning(chunks_per_cta=2))
    check_scores(np.asarray(f(q, w, keys, bt, t)),
                 np.asarray(R.indexer_scores_reference(q, w, keys, bt[:B], t, fmt="nvfp4")))
    keys = spread_keys(rng, "nvfp4", NB)
    check_scores(np.asarray(f(q, w, keys, bt, t)),
                 np.asarray(R.indexer_scores_reference(q, w, keys, bt[:B], t, fmt="nvfp4")))


def test_fp8_scores_interpreted():
    """fp8 keys (no PTX: only the register-A wgmma goes through SMEM), 2 chunks a CTA and
    2 an iteration, the edge table."""
    rng = np.random.default_rng(31)
    B, NB, MAXB = 4, 24, 5
    q, w = make_qw(32, B)
    keys = spread_keys(rng, "fp8", NB)
    bt, t = edge_table(rng, B, NB, MAXB)
    out = np.asarray(interpreted("fp8", Tuning(chunks_per_cta=2))(q, w, keys, bt, t))
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt[:B], t, fmt="fp8")))


@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_topk_keys_interpreted_with_jnp_dequant(fmt):
    """topk_keys (the decode step's call: scores + the topk_select kernel, both
    interpreted): the reference's top-k set on the reference scores, up to ties at the
    k-th score (the sums are rounded in another order); -1 past the eligible entries."""
    rng = np.random.default_rng(41)
    B, NB, MAXB, k = 2, 10, 4, 32
    q, w = make_qw(42, B)
    keys = spread_keys(rng, fmt, NB)
    bt = jnp.asarray(rng.permutation(NB)[: B * MAXB].reshape(B, MAXB).astype(np.int32))
    t = jnp.asarray([90, 511], jnp.int32)
    got = np.asarray(jax.jit(functools.partial(topk_keys, topk=k, fmt=fmt, interpret=True))(
        q, w, keys, bt, t))
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt))
    want = np.asarray(R.topk_reference(jnp.asarray(ref), k))
    for b in range(B):
        n = min(k, (int(t[b]) + 1) // 4)
        assert (got[b, n:] == -1).all() and len(set(got[b, :n])) == n
        assert (np.diff(got[b, :n]) > 0).all()                          # ascending ids
        kth = ref[b, want[b, n - 1]]
        tol = 1e-5 * np.abs(ref[b][np.isfinite(ref[b])]).max()
        assert all(abs(ref[b, i] - kth) <= tol for i in set(got[b, :n]) ^ set(want[b, :n]))


def test_bad_inputs_raise():
    rng = np.random.default_rng(4)
    q, w = make_qw(4, 2)
    bt, t = jnp.zeros((2, 4), jnp.int32) + 1, jnp.asarray([5, 9], jnp.int32)
    k4, kn, k8 = (spread_keys(rng, f, 8) for f in ("fp4", "nvfp4", "fp8"))
    with pytest.raises(ValueError, match="idx_scale"):
        SC.indexer_scores(q, w, k4["idx_codes"], k4["idx_scale"][..., :2], bt, t)
    with pytest.raises(ValueError, match="idx_codes"):
        SC.indexer_scores(q, w, k4["idx_codes"][..., :32], k4["idx_scale"], bt, t)
    with pytest.raises(ValueError, match="idx_scale_hi"):
        SC.indexer_scores_nvfp4(q, w, kn["idx_codes"], kn["idx_scale_lo"],
                                kn["idx_scale_hi"][..., :2], bt, t)
    with pytest.raises(ValueError, match="unknown indexer key format"):
        score_keys(q, w, k4, bt, t, fmt="fp6")
    # every format shares the q / weights / block-table / positions checks
    for fmt, keys in (("fp4", k4), ("nvfp4", kn), ("fp8", k8)):
        f = functools.partial(score_keys, keys=keys, fmt=fmt)
        for args, msg in (((q[:, :32], w, bt, t), "indexer q"), ((q, w[:, :8], bt, t),
                          "indexer weights"), ((q, w, bt[:1], t), "block_table"),
                          ((q, w, bt, t[:1]), "positions t")):
            with pytest.raises(ValueError, match=msg):
                f(args[0], args[1], block_table=args[2], t_B=args[3])
    with pytest.raises(ValueError, match="chunks_per_step"):
        interpreted("fp4", Tuning(chunks_per_cta=3, chunks_per_step=2)).trace(
            q, w, k4, bt, t)


# ---------------------------------------------------------------- the split rules
def test_default_chunks_per_cta():
    """At B >= 32, 16 chunks a CTA in calls of >= CPC16_MIN_CHUNKS chunks (B = 64 at 32K,
    B = 32 at 64K) and 32 from CPC32_MIN_CHUNKS (fp4 / nvfp4: B = 32 / 64 at 128K, B = 64
    at 64K; fp8: B = 64 at 128K), else enough CTAs to fill the chip twice, at most 8."""
    f = SC.default_chunks_per_cta
    n128k = 131072 // 4 // DQ.CHUNK                     # 512 chunks a request at 128K
    for fmt in ("fp4", "nvfp4"):
        assert [f(B, n128k, fmt=fmt) for B in (1, 8, 32, 64)] == [1, 8, 32, 32]
        assert f(64, n128k // 2, fmt=fmt) == 32          # B = 64, 64K
        assert f(1024, 16, fmt=fmt) == 16                # 16-chunk tables
    for fmt in ("fp4", "nvfp4", "fp8"):
        assert f(64, n128k // 4, fmt=fmt) == 16          # B = 64, 32K
        assert f(32, n128k // 2, fmt=fmt) == 16          # B = 32, 64K
        assert f(32, n128k // 4, fmt=fmt) == 8           # B = 32, 32K
    assert [f(B, n128k, fmt="fp8") for B in (1, 8, 32, 64)] == [1, 8, 16, 32]
    assert f(4096, 8) == 8                               # a table shorter than 16 chunks
    assert f(1, 128) == 1                                # B = 1, 32K
    assert f(8, 4 * n128k) == 8                          # B = 8, a 512K table


def test_default_chunks_per_step():
    """Two chunks a loop iteration (fp4 / nvfp4 keys at every even span; fp8 keys below 16
    chunks a CTA), one for odd spans."""
    f = SC.default_chunks_per_step
    assert [f("fp4", c) for c in (1, 2, 3, 8, 16)] == [1, 2, 1, 2, 2]
    assert [f("nvfp4", c) for c in (1, 8, 16)] == [1, 2, 2]
    assert [f("fp8", c) for c in (2, 8, 16)] == [2, 2, 1]


# ---------------------------------------------------------------- the PTX programs
def _run_ptx(program, x, n_out=2):
    """Run a dequant program's PTX (and / shl / prmt, default and sign-replicate modes) on
    an independent emulator, for every u32 input in x (operand $n_out) -> ($0 ..)."""
    regs = {f"${n_out}": x.astype(np.uint64)}
    val = lambda o: regs[o] if o in regs else np.uint64(int(o, 0))
    for line in program.splitlines():
        m = re.match(r"(\w+)\.\w+ (\S+), (\S+), (\S+)(?:, (\S+))?;", line.strip())
        if not m:
            continue
        op, d, a, b, c = m.groups()
        if op == "and":
            regs[d] = val(a) & val(b)
        elif op == "shl":
            regs[d] = (val(a) << val(b)) & np.uint64(0xFFFFFFFF)
        elif op == "prmt":      # byte i of d: byte (c's nibble i & 7) of {b:a}
            src = (val(b) << np.uint64(32)) | val(a)
            sel = val(c)
            out = np.zeros_like(x, np.uint64)
            for i in range(4):
                nib = (sel >> np.uint64(4 * i)) & np.uint64(15)
                byte = (src >> (np.uint64(8) * (nib & np.uint64(7)))) & np.uint64(0xFF)
                # sign-replicate mode (selector bit 3): the byte's msb, 8 times
                rep = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                byte = np.where(nib & np.uint64(8), rep, byte)
                out |= byte << np.uint64(8 * i)
            regs[d] = out
        else:
            raise AssertionError(f"op {op} not emulated: {line}")
    return tuple(regs[f"${k}"] for k in range(n_out))


def _bf16_lane(out, lane):
    return (((out >> np.uint64(16 * lane)) & np.uint64(0xFFFF)).astype(np.uint16)
            .view(ml_dtypes.bfloat16).astype(np.float64))


def test_place_program_every_code_pair():
    """PLACE_PROGRAM on all 65536 pairs of code bytes: each nibble's bf16 is its e2m1 value
    * 2^-126 exactly (zero, -0, the 0.5 code as a bf16 subnormal), low nibbles in $0, high
    in $1, byte 0's in the low lane; and the interpreter's jnp form (dequant.e2m1_place)
    gives the values themselves."""
    x = np.arange(1 << 16, dtype=np.uint32)
    lo, hi = _run_ptx(DQ.PLACE_PROGRAM, x)
    jnp_lo, jnp_hi = DQ.e2m1_place(jnp.asarray(x.view(np.uint8).reshape(-1, 4)[:, :2]),
                                   interpret=True)
    for out, shift, jn in ((lo, 0, jnp_lo), (hi, 4, jnp_hi)):
        for k in range(2):
            code = (x >> (shift + 8 * k)) & 15
            val = _bf16_lane(out, k) * 2.0 ** 126
            np.testing.assert_array_equal(val, E2M1[code])
            np.testing.assert_array_equal(np.signbit(val), code >= 8)
            j = np.asarray(jn[:, k], np.float64)
            np.testing.assert_array_equal(j, E2M1[code])
            np.testing.assert_array_equal(np.signbit(j), code >= 8)


def test_place_words_program_every_code_pair():
    """PLACE_WORDS_PROGRAM on words whose bytes 0, 1 take all 65536 pairs and bytes 2, 3
    random values, and the other way round: $0 / $1 = the low nibbles of bytes (0, 1) /
    (2, 3), $2 / $3 = their high nibbles, each e2m1 value * 2^-126 exactly."""
    rng = np.random.default_rng(5)
    pairs = np.arange(1 << 16, dtype=np.uint32)
    other = rng.integers(0, 1 << 16, 1 << 16).astype(np.uint32)
    for x in (pairs | other << 16, other | pairs << 16):
        outs = _run_ptx(DQ.PLACE_WORDS_PROGRAM, x, n_out=4)
        for k, out in enumerate(outs):
            shift, byte0 = 4 * (k // 2), 2 * (k % 2)
            for lane in range(2):
                code = (x >> (8 * (byte0 + lane) + shift)) & 15
                val = _bf16_lane(out, lane) * 2.0 ** 126
                np.testing.assert_array_equal(val, E2M1[code])
                np.testing.assert_array_equal(np.signbit(val), code >= 8)


def test_words_key_order_emulated():
    """The "words" key order end to end on an emulator of the kernel's registers: the two
    Mosaic layouts it relies on (as spelled in Mosaic), e2m1_place_words' register assembly
    (word c of a row -> k16 step c, byte pair a -> WGMMA column tile 2 c + a) and the
    emulated PTX. Scores of q permuted by words_q against the keys so assembled equal the
    reference's; with q unpermuted they do not. The interpreter's jnp form assembles the
    same keys."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    assert str(fa.WGMMA_LAYOUT.tiling) == str(fa.Tiling(((64, 8), (16, 8), (8, 8), (2,))))
    assert str(fa.WGMMA_LAYOUT_8BIT.tiling) == str(fa.Tiling(((64, 16), (16, 16), (8, 16), (4,))))
    assert fa.WGMMA_LAYOUT.lane_dims == fa.WGMMA_LAYOUT_8BIT.lane_dims == (-3, -2)
    assert sorted(DQ.WORDS_PERM) == list(range(64))
    assert (DQ.WORDS_PERM // 16 == np.arange(64) // 16).all()   # scale blocks unchanged
    rng = np.random.default_rng(6)
    codes = rng.integers(0, 256, (64, 64)).astype(np.uint8)      # one chunk: [row, byte]
    # WGMMA_LAYOUT_8BIT: lane t of a row holds bytes 16 c + 4 t + (0..3)
    words = np.stack([np.stack([codes[:, 16 * c + 4 * t: 16 * c + 4 * t + 4].copy().view("<u4")[:, 0]
                                for c in range(4)], 1) for t in range(4)], 1)   # [row, t, c]
    outs = _run_ptx(DQ.PLACE_WORDS_PROGRAM, words.reshape(-1), n_out=4)
    bf = [(_bf16_lane(o, lane) * 2.0 ** 126).reshape(64, 4, 4) for o in outs for lane in range(2)]
    # WGMMA_LAYOUT: column tile ct (8 columns), lane t holds columns 8 ct + 2 t + (0, 1)
    keys = np.zeros((2, 64, 64))                                 # [half, row, k index]
    for k in range(4):
        half, a = divmod(k, 2)
        for lane in range(2):
            for t in range(4):
                for c in range(4):
                    keys[half, :, 8 * (2 * c + a) + 2 * t + lane] = bf[2 * k + lane][:, t, c]
    jn = DQ.e2m1_place_words(jnp.asarray(codes), interpret=True)
    for half in range(2):
        np.testing.assert_array_equal(np.asarray(jn[half], np.float64), keys[half])
    q = np.asarray(kvformat.fp4_block_sim(jax.random.normal(jax.random.key(7), (64, 128))),
                   np.float64)                                   # [head, dim]
    k_nat = np.concatenate([E2M1[codes & 15], E2M1[codes >> 4]], axis=1)      # [row, 128]
    want = k_nat @ q.T
    qp = np.asarray(DQ.words_q(jnp.asarray(q)))
    got = keys[0] @ qp[:, :64].T + keys[1] @ qp[:, 64:].T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    assert not np.allclose(keys[0] @ q[:, :64].T + keys[1] @ q[:, 64:].T, want)


def test_place_scale_interpreted_equals_bf16_product():
    """The interpreter's place_scale (e2m1 values * factor * 2^-126 in f32) equals the
    GPU's bf16 product of the placed values and the factor (computed here in float64,
    exact) for every code and the factors the kernel builds (fp4: 2^(E - 65), E 66..192;
    nvfp4: every non-NaN e4m3 scale * 2^62)."""
    code = np.arange(16)
    e4 = np.arange(256, dtype=np.uint8)
    e4 = e4[(e4 & 0x7F) != 0x7F].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    factors = np.concatenate([2.0 ** (np.arange(66, 193) - 65.0), e4 * 2.0 ** 62])
    v, f = np.meshgrid(E2M1[code], factors)
    got = DQ.place_scale(jnp.asarray(v, jnp.bfloat16), jnp.asarray(f, jnp.bfloat16),
                         interpret=True)
    want = ((v * 2.0 ** -126) * f.astype(ml_dtypes.bfloat16).astype(np.float64)).astype(
        ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_e4m3_bits_decode_every_byte():
    """The nvfp4 path's scale decode (the stored byte as e4m3, converted) on all 254
    non-NaN e4m3 bytes with other bits set above the byte, against ml_dtypes."""
    b = np.array([v for v in range(256) if v & 0x7F != 0x7F], np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(DQ.e4m3_bits_to_f32(jnp.asarray(b.astype(np.uint32) | 0xABCD00)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------- CUDA lowering (sm_90a)
def _abstract(fmt, B, NB, MAXB):
    fields = kvformat.index_key_fields(fmt)
    keys = {nm: S((NB, 32, *suffix), dt) for nm, (suffix, dt) in fields.items()}
    return (S((B, 64, 128), jnp.bfloat16), S((B, 64), jnp.float32), keys,
            S((B, MAXB), jnp.int32), S((B,), jnp.int32))


def _lower_text(f, args):
    from jax._src.mesh import AbstractDevice, AbstractMesh
    dev = AbstractDevice("NVIDIA H200", 132, "gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_cuda_lowering_shipped_program(fmt):
    """topk_keys at Flash's 128K shapes (B = 8) lowers for the GPU with what ships: the
    "place" words program (fp4 / nvfp4), the warpgroup barrier (Pallas' automatic ones
    off), the top-k selection kernel; and the scoring kernel alone at 16 and 32 chunks a
    CTA (the B >= 32 defaults)."""
    args = _abstract(fmt, 8, 8192, 1024)
    txt = _lower_text(functools.partial(topk_keys, topk=512, fmt=fmt), args)
    assert "mosaic_gpu" in txt and "triton" in txt
    assert "bar.sync $0, 128;" in txt
    place_line = "prmt.b32 a, t, 0, 0xB3A2;"
    assert (place_line in txt) == (fmt != "fp8")
    for cpc in (16, 32):
        f = functools.partial(score_keys, fmt=fmt, tuning=Tuning(chunks_per_cta=cpc))
        assert "mosaic_gpu" in _lower_text(f, _abstract(fmt, 3, 256, 63))


def test_cuda_lowering_every_chunks_per_cta():
    """Every CTA span the default split picks below 16 (1..8 chunks; 5 and 6 failed in the
    -inf fill before its buffer was rounded to 256 floats), one and two chunks a loop
    iteration, lowers."""
    args = _abstract("fp4", 3, 256, 63)
    for cpc, g in ((1, None), (2, 1), (3, None), (4, None), (5, None), (6, None), (7, None),
                   (8, None)):
        f = functools.partial(score_keys, tuning=Tuning(chunks_per_cta=cpc, chunks_per_step=g))
        assert "mosaic_gpu" in _lower_text(f, args)


# ---------------------------------------------------------------- GPU (H100 / H200)
def _gpu_case(fmt, raw=False):
    rng = np.random.default_rng(51)
    B, NB, MAXB = 4, 256, 63
    q, w = make_qw(52, B)
    keys = raw_keys(rng, fmt, NB) if raw else spread_keys(rng, fmt, NB)
    bt, t = edge_table(rng, B, NB, MAXB)
    return q, w, keys, bt, t, np.asarray(R.indexer_scores_reference(q, w, keys, bt[:B], t, fmt=fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,raw", [("fp4", False), ("fp4", True), ("nvfp4", False),
                                     ("nvfp4", True), ("fp8", False)])
def test_gpu_scores_match_reference(fmt, raw):
    """The shipped kernel on the GPU: spread keys and raw bytes (every code, fp4 scale bytes
    100..159, every e4m3 scale), the edge table, CTA spans of 5 (one chunk an iteration),
    16 and 32 (two) and the default; two chunks an iteration bit-identical to one."""
    q, w, keys, bt, t, ref = _gpu_case(fmt, raw)
    for cpc in (5, 16, 32, None):
        run = lambda g: np.asarray(jax.jit(functools.partial(
            score_keys, fmt=fmt, tuning=Tuning(chunks_per_cta=cpc, chunks_per_step=g)))(
                q, w, keys, bt, t))
        out = run(None)
        check_scores(out, ref)
        if cpc in (16, 32):
            assert np.array_equal(out, run(1 if SC.default_chunks_per_step(fmt, cpc) == 2 else 2))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_gpu_topk_keys_match_reference(fmt):
    q, w, keys, bt, t, ref = _gpu_case(fmt)
    got = np.asarray(jax.jit(functools.partial(topk_keys, topk=512, fmt=fmt))(q, w, keys, bt, t))
    want = np.asarray(R.topk_reference(jnp.asarray(ref), 512))
    kth = np.sort(np.where(np.isfinite(ref), ref, -np.inf), axis=1)[:, -512]
    for b in range(4):
        diff = set(got[b][got[b] >= 0]) ^ set(want[b][want[b] >= 0])
        assert all(abs(ref[b, i] - kth[b]) <= 1e-5 * abs(kth[b]) for i in diff)
