"""Decode lightning indexer: Mosaic-GPU kernel (GPU interpreter on CPU) vs the pure-JAX path,
the pure-JAX path vs an independent numpy restatement, and the CUDA lowering at Flash shapes."""
import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats as kvformat
from pallas_kernels.indexer_decode import kernel as K
from pallas_kernels.indexer_decode import reference as R

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def make_inputs(seed, B=2, NB=10, MAXB=4, t=None):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    ks = jax.random.split(key, 3)
    q = kvformat.fp4_block_sim(jax.random.normal(ks[0], (B, 64, 128)))
    w = jax.random.normal(ks[1], (B, 64)) * 0.1
    # Keys with a spread of magnitudes per 32-dim block (exercises different exponents).
    k = jax.random.normal(ks[2], (NB, 32, 128)) * jnp.asarray(
        2.0 ** rng.integers(-6, 6, (NB, 32, 4)), jnp.float32).repeat(32, axis=-1)
    keys = kvformat.quantize_index_key(k, "fp4")
    bt = rng.permutation(NB)[: B * MAXB].reshape(B, MAXB).astype(np.int32)
    if t is None:
        t = rng.integers(0, 4 * 32 * MAXB, B)
    return q, w, keys, jnp.asarray(bt), jnp.asarray(np.asarray(t, np.int32))


def run_kernel(q, w, keys, bt, t, **kw):
    f = functools.partial(K.indexer_scores, interpret=plgpu.InterpretGPUParams(), **kw)
    return np.asarray(jax.jit(f)(q, w, keys["idx_codes"], keys["idx_scale"], bt, t))


def check_scores(out, ref):
    fin = np.isfinite(ref)
    assert out.shape == ref.shape
    assert (np.isfinite(out) == fin).all(), "eligibility mask differs"
    assert (out[~fin] == -np.inf).all()
    scale = np.abs(ref[fin]).max()
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-5, atol=1e-5 * scale)


def test_reference_fp8_format_matches_numpy():
    # The pure-JAX path also serves the `fp8` key format (dequantised with kvformat).
    q, w, _, bt, t = make_inputs(6, B=2, NB=6, MAXB=3)
    k = jax.random.normal(jax.random.key(7), (6, 32, 128))
    keys = kvformat.quantize_index_key(k, "fp8")
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt="fp8"))
    kf = np.asarray(keys["idx_keys"].astype(jnp.float32)) * np.asarray(keys["idx_scale"])
    qn, wn = np.asarray(q, np.float64), np.asarray(w, np.float64)
    for b in range(2):
        kb = kf[np.asarray(bt[b])].reshape(-1, 128).astype(np.float64)
        s = (wn[b][:, None] * np.maximum(qn[b] @ kb.T, 0)).sum(0)
        n = (int(t[b]) + 1) // 4
        np.testing.assert_allclose(ref[b, :n], s[:n], rtol=1e-5, atol=1e-6 * np.abs(s).max())


def test_reference_matches_numpy():
    q, w, keys, bt, t = make_inputs(0, B=2, NB=6, MAXB=3)
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt, t))
    codes = np.asarray(keys["idx_codes"])
    e = np.asarray(keys["idx_scale"]).astype(np.int32)
    vals = np.concatenate([E2M1[codes & 15], E2M1[codes >> 4]], axis=-1)     # split-half
    kf = vals * np.repeat(2.0 ** (e - 127), 32, axis=-1)                      # [NB, 32, 128]
    qn, wn, btn, tn = (np.asarray(x, np.float64) for x in (q, w, bt, t))
    for b in range(2):
        kb = kf[btn[b].astype(int)].reshape(-1, 128).astype(np.float64)
        s = (wn[b][:, None] * np.maximum(qn[b] @ kb.T, 0)).sum(0)
        n = (int(tn[b]) + 1) // 4
        np.testing.assert_allclose(ref[b, :n], s[:n], rtol=1e-5, atol=1e-6 * np.abs(s).max())
        assert (ref[b, n:] == -np.inf).all()


@pytest.mark.parametrize("dequant", ["bits", "e4m3", "fp8mma"])
def test_kernel_matches_reference(dequant):
    # t = 50: 12 eligible (partial first chunk); t = 511: all 128 eligible.
    q, w, keys, bt, t = make_inputs(1, t=[50, 511])
    out = run_kernel(q, w, keys, bt, t, dequant=dequant)
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))


def test_q_fp8_groups_is_exact():
    """FP4-simulated q (any magnitude, zero groups) = its e4m3 groups * scales / 2^6."""
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 64, 128)).astype(np.float32)
    x *= 2.0 ** rng.integers(-30, 30, (3, 64, 4)).repeat(32, axis=-1)
    x[0, 5, 32:64] = 0.0
    q = kvformat.fp4_block_sim(jnp.asarray(x))
    q8, qs = K.q_fp8_groups(q)
    assert q8.dtype == jnp.float8_e4m3fn and q8.shape == (3, 4, 64, 32) and qs.shape == (3, 4, 64)
    back = (np.asarray(q8, np.float32) * np.asarray(qs)[..., None] / 64.0)
    back = back.transpose(0, 2, 1, 3).reshape(3, 64, 128)
    assert np.array_equal(back, np.asarray(q, np.float32))


def test_kernel_fp8mma_multi_chunk_cta_and_unused_blocks():
    q, w, keys, bt, _ = make_inputs(7, B=2, NB=12, MAXB=5)
    bt = bt.at[1, 2:].set(-1)
    t = jnp.asarray([4 * 32 * 5 - 1, 4 * 32 * 2 - 5], jnp.int32)
    out = run_kernel(q, w, keys, bt, t, chunks_per_cta=2, dequant="fp8mma")
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))
    with pytest.raises(ValueError, match="dequant"):
        run_kernel(q, w, keys, bt, t, dequant="fp6")


def test_kernel_dequants_agree_on_every_code():
    """Raw random bytes (every e2m1 code pair, signs, zeros) under exponents across the
    range: the two dequant paths give bit-identical scores, and match the reference."""
    rng = np.random.default_rng()
    q, w, keys, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=2, NB=8, MAXB=4)
    codes = jnp.asarray(rng.integers(0, 256, (8, 32, 64)), jnp.uint8)
    scale = jnp.asarray(rng.integers(100, 160, (8, 32, 4)), jnp.uint8)
    keys = {"idx_codes": codes, "idx_scale": scale}
    t = jnp.asarray([511, 300], jnp.int32)
    a = run_kernel(q, w, keys, bt, t, dequant="bits")
    b = run_kernel(q, w, keys, bt, t, dequant="e4m3")
    assert np.array_equal(a, b)
    check_scores(b, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))


def test_kernel_multi_chunk_cta_and_unused_blocks():
    # 2 chunks per CTA, odd MAXB (table padded), unused (-1) blocks past the context.
    q, w, keys, bt, _ = make_inputs(2, B=2, NB=12, MAXB=5)
    bt = bt.at[0, 3:].set(-1)
    t = jnp.asarray([4 * 32 * 3 - 3, 4 * 32 * 5 - 1], jnp.int32)
    out = run_kernel(q, w, keys, bt, t, chunks_per_cta=2)
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))


def test_kernel_raw_table_and_positions():
    """The kernel reads the block table and positions as the cache holds them (no XLA
    prep): a table with more rows than requests (the extra row is garbage, never read),
    -1 blocks inside the eligible range's chunk, t = -1 (nothing eligible) and t past
    the table (all eligible), 3 chunks per CTA over an odd MAXB (the last CTA's columns
    past the table clamp to its last one)."""
    B, NB, MAXB = 4, 32, 7
    q, w, keys, bt, _ = make_inputs(int(np.random.default_rng().integers(1 << 20)), B=B,
                                    NB=NB, MAXB=MAXB)
    bt = bt.at[1, 4:].set(-1)
    bt = jnp.concatenate([bt, jnp.full((1, MAXB), 10 ** 6, jnp.int32)])   # row B: garbage
    t = jnp.asarray([4 * 32 * MAXB + 999, 4 * 32 * 4 - 1, -1, 4 * 32 * 2 + 3], jnp.int32)
    out = run_kernel(q, w, keys, bt, t, chunks_per_cta=3)
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt[:B], t))
    check_scores(out, ref)
    assert np.isfinite(out[0]).all() and not np.isfinite(out[2]).any()
    # untrimmed (as topk_select reads it): nothing past the table is eligible, even for a
    # t past it (the last CTA runs past the table's end)
    full = run_kernel(q, w, keys, bt, t, chunks_per_cta=3, trim=False)
    assert full.shape[1] > MAXB * 32 and (full[:, MAXB * 32:] == -np.inf).all()
    np.testing.assert_array_equal(full[:, :MAXB * 32], out)


def test_kernel_fp8_format_matches_reference():
    q, w, _, bt, t = make_inputs(8, t=[70, 511])
    keys = kvformat.quantize_index_key(jax.random.normal(jax.random.key(9), (10, 32, 128)), "fp8")
    f = functools.partial(K.score_keys, fmt="fp8", interpret=plgpu.InterpretGPUParams())
    out = np.asarray(jax.jit(f)(q, w, keys, bt, t))
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt="fp8")))


def _nvfp4_keys(rng, NB):
    """nvfp4 pool from keys whose 16-dim blocks span 2^-6..2^5 (different e4m3 scales)."""
    k = rng.standard_normal((NB, 32, 128)) * 2.0 ** rng.integers(-6, 6, (NB, 32, 8)).repeat(16, -1)
    return kvformat.quantize_index_key(jnp.asarray(k, jnp.float32), "nvfp4")


def run_keys(q, w, keys, bt, t, fmt, **kw):
    f = functools.partial(K.score_keys, fmt=fmt, interpret=plgpu.InterpretGPUParams(), **kw)
    return np.asarray(jax.jit(f)(q, w, keys, bt, t))


PIPELINES = [("fp4", "bits", 3, True, False), ("fp4", "e4m3", 4, True, False),
             ("nvfp4", "e4m3", 3, True, False), ("fp8", "bits", 3, False, False),
             ("fp8", "bits", 2, True, False), ("fp4", "e4m3", 2, False, True),
             ("fp4", "bits", 3, False, True), ("nvfp4", "lut", 2, False, True),
             ("fp8", "bits", 3, False, True), ("nvfp4", "e4m3", 2, False, True),
             ("fp4", "lut", 3, True, False), ("nvfp4", "lutbf", 2, False, True)]


def _keys(rng, fmt, NB):
    if fmt == "nvfp4":
        return _nvfp4_keys(rng, NB)
    k = rng.standard_normal((NB, 32, 128)) * 2.0 ** rng.integers(-6, 6, (NB, 32, 4)).repeat(32, -1)
    return kvformat.quantize_index_key(jnp.asarray(k, jnp.float32), fmt)


# The GPU interpreter (jax 0.11.2) takes no register A operand in wgmma ("Expected shape
# (6,) but got (64, 64)"): the kreg variants run on the GPU (test_gpu_pipeline_variants) and
# in the CUDA lowering test; their dequant code is the SMEM variants' (keys()). Nor does
# it run inline Mosaic GPU code: "lut" / "lutbf" / "place" would silently run as "e4m3" here, so
# they are GPU-only too (their tables: test_lut_program_every_code_pair).
@pytest.mark.parametrize("fmt,dequant,stages,overlap,kreg",
                         [p for p in PIPELINES
                          if not p[4] and p[1] not in ("lut", "lutbf", "place")])
def test_kernel_pipeline_variants(fmt, dequant, stages, overlap, kreg):
    """Deeper TMA rings (stages) and the overlapped second-half dequant: 5 chunks per CTA
    (more than the ring holds, so slots are reused), a partial last chunk, unused blocks."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=2, NB=24, MAXB=11)
    keys = _keys(rng, fmt, 24)
    bt = bt.at[0, 7:].set(-1)
    t = jnp.asarray([4 * 32 * 7 - 5, 4 * 32 * 11 - 1], jnp.int32)
    out = run_keys(q, w, keys, bt, t, fmt, dequant=dequant, chunks_per_cta=5, stages=stages,
                   overlap=overlap, kreg=kreg)
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt)))


@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_kernel_weights_in_loop(fmt):
    """w_in_loop (head weights re-read every chunk) in the interpreter: the same scores as
    the weights held a whole CTA, and the reference's; 3 chunks a CTA, a partial chunk."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=2, NB=24, MAXB=11)
    keys = _keys(rng, fmt, 24)
    t = jnp.asarray([4 * 32 * 7 - 5, 4 * 32 * 11 - 1], jnp.int32)
    out = run_keys(q, w, keys, bt, t, fmt, chunks_per_cta=3, w_in_loop=True)
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt)))
    np.testing.assert_array_equal(out, run_keys(q, w, keys, bt, t, fmt, chunks_per_cta=3))


def _run_ptx(program, x, tables=(), n_out=2):
    """Run _lut_program's PTX (and / shr / shl / or / prmt, default and sign-replicate modes) on an
    independent emulator, for every u32 input in the uint32 array x (operand $n_out; the
    table words given as registers follow it) -> ($0 .. $(n_out - 1))."""
    import re
    regs = {f"${n_out}": x.astype(np.uint64)}
    regs.update({f"${n_out + 1 + k}": np.uint64(v) for k, v in enumerate(tables)})
    val = lambda o: regs[o] if o in regs else np.uint64(int(o, 0))
    for line in program.splitlines():
        m = re.match(r"(\w+)\.\w+ (\S+), (\S+), (\S+)(?:, (\S+))?;", line.strip())
        if not m:
            continue
        op, d, a, b, c = m.groups()
        if op == "and":
            regs[d] = val(a) & val(b)
        elif op == "or":
            regs[d] = val(a) | val(b)
        elif op == "shr":
            regs[d] = val(a) >> val(b)
        elif op == "shl":
            regs[d] = (val(a) << val(b)) & np.uint64(0xFFFFFFFF)
        elif op == "prmt":      # byte i of d: byte (c's nibble i & 7) of {b:a}; bit 3 unused here
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


@pytest.mark.parametrize("to", ["e4m3", "bf16"])
def test_lut_program_every_code_pair(to):
    """The prmt tables of the "lut" / "lutbf" dequants (the kernel's own PTX text, run on
    an emulated prmt) on all 65536 pairs of code bytes: the low / high nibbles' e2m1
    values, as e4m3 or bf16 bit patterns, against ml_dtypes (signs, zeros included)."""
    import ml_dtypes
    x = np.arange(1 << 16, dtype=np.uint32)
    tables = K._BF16_TABLE_REGS if to == "bf16" else ()   # the register-operand words
    lo, hi = _run_ptx(K._lut_program(to), x, tables)
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    for out, shift in ((lo, 0), (hi, 4)):
        want = [e2m1[(x >> (shift + 8 * k)) & 15] for k in range(2)]   # bytes b0, b1
        if to == "e4m3":
            got = [((out >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)
                   .view(ml_dtypes.float8_e4m3fn) for k in range(2)]
            want = [w.astype(ml_dtypes.float8_e4m3fn) for w in want]
        else:
            got = [((out >> np.uint64(16 * k)) & np.uint64(0xFFFF)).astype(np.uint16)
                   .view(ml_dtypes.bfloat16) for k in range(2)]
            want = [w.astype(ml_dtypes.bfloat16) for w in want]
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint8 if to == "e4m3" else np.uint16),
                                  w.view(np.uint8 if to == "e4m3" else np.uint16))


def test_place_program_every_code_pair():
    """The "place" dequant's PTX (_PLACE_PROGRAM, on the emulator) on all 65536 pairs of
    code bytes: each nibble's bf16 is its e2m1 value * 2^-126 exactly (zero, -0, the 0.5
    code as a bf16 subnormal), low nibbles in $0, high in $1, byte 0's in the low lane."""
    import ml_dtypes
    x = np.arange(1 << 16, dtype=np.uint32)
    lo, hi = _run_ptx(K._PLACE_PROGRAM, x)
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    for out, shift in ((lo, 0), (hi, 4)):
        for k in range(2):
            code = (x >> (shift + 8 * k)) & 15
            got = ((out >> np.uint64(16 * k)) & np.uint64(0xFFFF)).astype(np.uint16)
            val = got.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126
            np.testing.assert_array_equal(val, e2m1[code])
            np.testing.assert_array_equal(np.signbit(val), code >= 8)


def test_place_words_program_every_code_pair():
    """The "words" key order's PTX (_PLACE_WORDS_PROGRAM, on the emulator) on words whose
    bytes 0, 1 take all 65536 pairs and bytes 2, 3 random values, and the other way round:
    $0 / $1 = the low nibbles of bytes (0, 1) / (2, 3), $2 / $3 = their high nibbles, each
    e2m1 value * 2^-126 exactly, the lower byte's in the low lane."""
    import ml_dtypes
    rng = np.random.default_rng()
    pairs = np.arange(1 << 16, dtype=np.uint32)
    other = rng.integers(0, 1 << 16, 1 << 16).astype(np.uint32)
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    for x in (pairs | other << 16, other | pairs << 16):
        outs = _run_ptx(K._PLACE_WORDS_PROGRAM, x, n_out=4)
        for k, out in enumerate(outs):
            shift, byte0 = 4 * (k // 2), 2 * (k % 2)
            for lane in range(2):
                code = (x >> (8 * (byte0 + lane) + shift)) & 15
                got = ((out >> np.uint64(16 * lane)) & np.uint64(0xFFFF)).astype(np.uint16)
                val = got.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126
                np.testing.assert_array_equal(val, e2m1[code])
                np.testing.assert_array_equal(np.signbit(val), code >= 8)


def test_words_key_order_emulated():
    """The "words" key order end to end on an emulator of the kernel's registers: the two
    Mosaic layouts it relies on (checked as spelled in Mosaic), the thread -> column maps
    they imply, _e2m1_place_words' register assembly (word c of a row -> k16 step c, byte
    pair a -> WGMMA column tile 2 c + a) and the emulated PTX. Scores of q permuted by
    words_q against the keys so assembled equal the reference's (float64, random keys
    and q); with q unpermuted they do not."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    import ml_dtypes
    assert str(fa.WGMMA_LAYOUT.tiling) == str(fa.Tiling(((64, 8), (16, 8), (8, 8), (2,))))
    assert str(fa.WGMMA_LAYOUT_8BIT.tiling) == str(fa.Tiling(((64, 16), (16, 16), (8, 16), (4,))))
    assert fa.WGMMA_LAYOUT.lane_dims == fa.WGMMA_LAYOUT_8BIT.lane_dims == (-3, -2)
    assert sorted(K.WORDS_PERM) == list(range(64))
    assert (K.WORDS_PERM // 16 == np.arange(64) // 16).all()   # scale blocks unchanged
    rng = np.random.default_rng()
    codes = rng.integers(0, 256, (64, 64)).astype(np.uint8)      # one chunk: [row, byte]
    # WGMMA_LAYOUT_8BIT: in each 8 x 16 tile lane t of a row holds columns 4 t .. 4 t + 3,
    # so thread t's word c of a row is bytes 16 c + 4 t + (0..3)
    words = np.stack([np.stack([codes[:, 16 * c + 4 * t: 16 * c + 4 * t + 4].copy().view("<u4")[:, 0]
                                for c in range(4)], 1) for t in range(4)], 1)   # [row, t, c]
    outs = _run_ptx(K._PLACE_WORDS_PROGRAM, words.reshape(-1), n_out=4)
    bf = [(((o >> np.uint64(16 * lane)) & np.uint64(0xFFFF)).astype(np.uint16)
           .view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126).reshape(64, 4, 4)
          for o in outs for lane in range(2)]                    # [k * 2 + lane][row, t, c]
    # WGMMA_LAYOUT: column tile ct (8 columns), lane t holds columns 8 ct + 2 t + (0, 1)
    keys = np.zeros((2, 64, 64))                                 # [half, row, k index]
    for k in range(4):
        half, a = divmod(k, 2)
        for lane in range(2):
            for t in range(4):
                for c in range(4):
                    keys[half, :, 8 * (2 * c + a) + 2 * t + lane] = bf[2 * k + lane][:, t, c]
    q = np.asarray(kvformat.fp4_block_sim(jax.random.normal(
        jax.random.key(int(rng.integers(1 << 20))), (64, 128))), np.float64)   # [head, dim]
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    k_nat = np.concatenate([e2m1[codes & 15], e2m1[codes >> 4]], axis=1)      # [row, 128]
    want = k_nat @ q.T
    qp = np.asarray(K.words_q(jnp.asarray(q)))
    got = keys[0] @ qp[:, :64].T + keys[1] @ qp[:, 64:].T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    wrong = keys[0] @ q[:, :64].T + keys[1] @ q[:, 64:].T
    assert not np.allclose(wrong, want)


def _flash_format_args(B=8, NB=8192, MAXB=1024):
    """Abstract arguments of the three key formats' entry points at 128K:
    [(fp4 entry, args), (nvfp4 entry, args), (fp8 entry, args)]."""
    S = jax.ShapeDtypeStruct
    args = (S((B, 64, 128), jnp.bfloat16), S((B, 64), jnp.float32),
            S((NB, 32, 64), jnp.uint8), S((NB, 32, 4), jnp.uint8),
            S((B, MAXB), jnp.int32), S((B,), jnp.int32))
    argsn = args[:3] + (S((NB, 32, 4), jnp.float8_e4m3fn),) * 2 + args[4:]
    args8 = args[:2] + (S((NB, 32, 128), jnp.float8_e4m3fn), S((NB, 32, 1), jnp.float32)) + args[4:]
    return [(K.indexer_scores, args), (K.indexer_scores_nvfp4, argsn),
            (K.indexer_scores_fp8, args8)]


def test_words_key_order_lowering_and_errors():
    """key_order="words" lowers for the GPU for fp4 and nvfp4 keys (and fp8 keys, which
    keep their one order); a bad key order is refused by name, also from the environment."""
    formats = _flash_format_args()
    args = formats[0][1]
    for f, a in formats:
        g = functools.partial(f, key_order="words")
        lowered = jax.jit(g).trace(*a).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()
    with pytest.raises(ValueError, match="key_order"):
        jax.jit(functools.partial(K.indexer_scores, key_order="dims")).trace(*args)


def test_words_key_order_env(monkeypatch):
    monkeypatch.setenv("DSV4_IDX_KEY_ORDER", "bytes")
    with pytest.raises(ValueError, match="DSV4_IDX_KEY_ORDER"):
        K._pipeline(None, None)
    monkeypatch.setenv("DSV4_IDX_KEY_ORDER", "words")
    assert K._pipeline(None, None)["key_order"] == "words"
    assert K._pipeline(None, None, key_order="natural")["key_order"] == "natural"


def test_epilogue_forms_agree(monkeypatch):
    """The heads' reduction as one FFMA chain over the column tiles ("chain", the default)
    and as Mosaic's reduce of the whole tile ("tree"), interpreted: the same scores to f32
    rounding (the sums' order differs), both the reference's; a bad form is named."""
    rng = np.random.default_rng()
    q, w, keys, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=2, NB=8, MAXB=4)
    t = jnp.asarray([511, 300], jnp.int32)
    out = {}
    for form in ("chain", "tree"):
        monkeypatch.setenv("DSV4_IDX_EPILOGUE", form)
        out[form] = run_kernel(q, w, keys, bt, t)
        check_scores(out[form], np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))
    fin = np.isfinite(out["tree"])
    assert np.array_equal(fin, np.isfinite(out["chain"]))
    assert np.abs(out["chain"][fin] - out["tree"][fin]).max() <= 1e-5 * np.abs(out["tree"][fin]).max()
    monkeypatch.setenv("DSV4_IDX_EPILOGUE", "pairwise")
    with pytest.raises(ValueError, match="DSV4_IDX_EPILOGUE"):
        run_kernel(q, w, keys, bt, t)


def test_e4m3_bits_decode_every_byte():
    """The nvfp4 path's scale decode (the stored byte as e4m3, converted) on all 254
    non-NaN e4m3 bytes with other bits set above the byte, against ml_dtypes."""
    import ml_dtypes
    b = np.array([v for v in range(256) if v & 0x7F != 0x7F], np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(K._e4m3_bits_to_f32(jnp.asarray(b.astype(np.uint32) | 0xABCD00)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kernel_nvfp4_matches_reference():
    """nvfp4 keys (split scale fields), a partial first chunk / all eligible, then two chunks
    per CTA with unused (-1) blocks."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), NB=12, MAXB=5)
    keys = _nvfp4_keys(rng, 12)
    t = jnp.asarray([50, 4 * 32 * 5 - 1], jnp.int32)
    out = run_keys(q, w, keys, bt, t, "nvfp4")
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt="nvfp4")))
    bt = bt.at[0, 3:].set(-1)
    t = jnp.asarray([4 * 32 * 3 - 3, 4 * 32 * 5 - 1], jnp.int32)
    out = run_keys(q, w, keys, bt, t, "nvfp4", chunks_per_cta=2)
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt="nvfp4")))
    with pytest.raises(ValueError, match="nvfp4 keys take"):
        run_keys(q, w, keys, bt, t, "nvfp4", dequant="bits")


def test_kernel_nvfp4_every_code_and_scale():
    """Raw random bytes: every e2m1 code pair and every non-NaN e4m3 scale (subnormals, 448,
    zero, negative), each half's scales in its own field."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=2, NB=8, MAXB=4)
    sc = rng.integers(0, 256, (2, 8, 32, 4)).astype(np.uint8)
    sc[(sc & 0x7F) == 0x7F] = 0x38      # no NaN (never stored: the scale clamps to 448)
    sc = jax.lax.bitcast_convert_type(jnp.asarray(sc), jnp.float8_e4m3fn)
    keys = {"idx_codes": jnp.asarray(rng.integers(0, 256, (8, 32, 64)), jnp.uint8),
            "idx_scale_lo": sc[0], "idx_scale_hi": sc[1]}
    t = jnp.asarray([511, 300], jnp.int32)
    out = run_keys(q, w, keys, bt, t, "nvfp4")
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt="nvfp4")))


def test_topk_keys_all_formats_match_reference():
    """topk_keys (the decode step's call) over each key format, both selections: the same
    set of ids as the reference's top-k on the kernel's own scores, -1 padded."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), NB=10, MAXB=4)
    t = jnp.asarray([90, 511], jnp.int32)
    k = jnp.asarray(rng.standard_normal((10, 32, 128)), jnp.float32)
    for fmt in ("fp4", "nvfp4", "fp8"):
        keys = kvformat.quantize_index_key(k, fmt)
        scores = run_keys(q, w, keys, bt, t, fmt)
        check_scores(scores, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt)))
        want = np.asarray(R.topk_reference(jnp.asarray(scores), 32))
        for select in ("xla", "kernel"):
            f = functools.partial(K.topk_keys, topk=32, fmt=fmt, select=select,
                                  interpret=plgpu.InterpretGPUParams())
            got = np.asarray(jax.jit(f)(q, w, keys, bt, t))
            for b in range(2):
                assert set(got[b]) == set(want[b]), (fmt, select, b)


def test_topk_matches_reference():
    q, w, keys, bt, t = make_inputs(3, t=[37, 500])
    out = run_kernel(q, w, keys, bt, t)
    ref = np.asarray(R.indexer_scores_reference(q, w, keys, bt, t))
    topk = 16
    ik = np.asarray(K.topk_from_scores(jnp.asarray(out), topk))
    ir = np.asarray(R.topk_reference(jnp.asarray(ref), topk))
    for b in range(2):
        n = min(topk, (int(t[b]) + 1) // 4)
        assert (ik[b, n:] == -1).all() and (ir[b, n:] == -1).all()
        # Same selection up to near-ties: kernel's picks score (by the reference) at least
        # the reference's k-th best, within rounding.
        kth = ref[b, ir[b, n - 1]]
        assert (ref[b, ik[b, :n]] >= kth - 1e-5 * np.abs(ref[b][np.isfinite(ref[b])]).max()).all()
        assert len(set(ik[b, :n])) == n


def test_bad_inputs_raise():
    q, w, keys, bt, t = make_inputs(4)
    with pytest.raises(ValueError, match="idx_scale"):
        K.indexer_scores(q, w, keys["idx_codes"], keys["idx_scale"][..., :2], bt, t)
    with pytest.raises(ValueError, match="idx_codes"):
        K.indexer_scores(q, w, keys["idx_codes"][..., :32], keys["idx_scale"], bt, t)
    with pytest.raises(ValueError, match="indexer q"):
        K.indexer_scores(q[:, :32], w, keys["idx_codes"], keys["idx_scale"], bt, t)
    # the nvfp4 and fp8 entry points share the q / weights / block-table / positions checks
    rng = np.random.default_rng(4)
    kn = _nvfp4_keys(rng, keys["idx_codes"].shape[0])
    k8 = kvformat.quantize_index_key(jnp.asarray(rng.standard_normal(
        (keys["idx_codes"].shape[0], 32, 128)), jnp.float32), "fp8")
    nv = lambda *a: K.indexer_scores_nvfp4(a[0], a[1], kn["idx_codes"], kn["idx_scale_lo"],
                                           kn["idx_scale_hi"], a[2], a[3])
    f8 = lambda *a: K.indexer_scores_fp8(a[0], a[1], k8["idx_keys"], k8["idx_scale"], a[2], a[3])
    for f in (nv, f8):
        with pytest.raises(ValueError, match="indexer q"):
            f(q[:, :32], w, bt, t)
        with pytest.raises(ValueError, match="indexer weights"):
            f(q, w[:, :8], bt, t)
        with pytest.raises(ValueError, match="block_table"):
            f(q, w, bt[:1], t)
        with pytest.raises(ValueError, match="positions t"):
            f(q, w, bt, t[:1])
    with pytest.raises(ValueError, match="idx_scale_hi"):
        K.indexer_scores_nvfp4(q, w, kn["idx_codes"], kn["idx_scale_lo"],
                               kn["idx_scale_hi"][..., :2], bt, t)


def test_cuda_lowering_flash_shapes():
    B, NB, MAXB = 8, 8192, 1024      # 128K context
    S = jax.ShapeDtypeStruct
    args = (S((B, 64, 128), jnp.bfloat16), S((B, 64), jnp.float32),
            S((NB, 32, 64), jnp.uint8), S((NB, 32, 4), jnp.uint8),
            S((B, MAXB), jnp.int32), S((B,), jnp.int32))
    f = functools.partial(K.indexer_topk, topk=512)
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    for dq, st, ov, kr in (("e4m3", 2, False, False), ("fp8mma", 2, False, False),
                           ("e4m3", 4, True, False), ("e4m3", 2, False, True),
                           ("lut", 2, False, True), ("lutbf", 2, False, True),
                           ("place", 2, False, True), ("place", 3, False, False)):
        for barriers in ("auto", "manual", "warp"):
            f = functools.partial(K.indexer_scores, dequant=dq, stages=st, overlap=ov, kreg=kr,
                                  barriers=barriers)
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()
    # the fp8 and nvfp4 key formats share this kernel
    args8 = args[:2] + (S((NB, 32, 128), jnp.float8_e4m3fn), S((NB, 32, 1), jnp.float32)) + args[4:]
    lowered = jax.jit(K.indexer_scores_fp8).trace(*args8).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    argsn = args[:3] + (S((NB, 32, 4), jnp.float8_e4m3fn),) * 2 + args[4:]
    for dq in ("lut", "lutbf", "place", "e4m3"):
        f = functools.partial(K.indexer_scores_nvfp4, dequant=dq)
        lowered = jax.jit(f).trace(*argsn).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()
    # the head weights re-read every chunk (w_in_loop), each key format
    for f, a in ((functools.partial(K.indexer_scores, w_in_loop=True), args),
                 (functools.partial(K.indexer_scores, w_in_loop=True, dequant="lutbf"), args),
                 (functools.partial(K.indexer_scores_nvfp4, w_in_loop=True), argsn),
                 (functools.partial(K.indexer_scores_fp8, w_in_loop=True), args8)):
        assert "mosaic_gpu" in jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()


def test_default_chunks_per_cta():
    """The split rule: at B >= 32, 16 chunks a CTA in calls of >= CPC16_MIN_CHUNKS chunks
    (B = 64 at 32K, B = 32 at 64K) and 32 from CPC32_MIN_CHUNKS (fp4 / nvfp4: B = 32 / 64
    at 128K, B = 64 at 64K; fp8: B = 64 at 128K), else enough CTAs to fill the chip twice,
    at most 8."""
    n128k = 131072 // 4 // K.CHUNK                      # 512 chunks a request at 128K
    for fmt in ("fp4", "nvfp4"):
        assert [K.default_chunks_per_cta(B, n128k, fmt=fmt) for B in (1, 8, 32, 64)] == [1, 8, 32, 32]
        assert K.default_chunks_per_cta(64, n128k // 2, fmt=fmt) == 32   # B = 64, 64K
        assert K.default_chunks_per_cta(1024, 16, fmt=fmt) == 16         # 16-chunk tables
    for fmt in ("fp4", "nvfp4", "fp8"):
        assert K.default_chunks_per_cta(64, n128k // 4, fmt=fmt) == 16   # B = 64, 32K
        assert K.default_chunks_per_cta(32, n128k // 2, fmt=fmt) == 16   # B = 32, 64K
        assert K.default_chunks_per_cta(32, n128k // 4, fmt=fmt) == 8    # B = 32, 32K
    assert [K.default_chunks_per_cta(B, n128k, fmt="fp8") for B in (1, 8, 32, 64)] == [1, 8, 16, 32]
    assert K.default_chunks_per_cta(4096, 8) == 8         # a table shorter than 16 chunks
    assert K.default_chunks_per_cta(1, 128) == 1          # B = 1, 32K
    assert K.default_chunks_per_cta(8, 4 * n128k) == 8    # B = 8, a 512K table


def test_default_chunks_per_step():
    """Two chunks a loop iteration where the H100 measured it faster (fp4 / nvfp4 keys at
    every span; fp8 keys below 16 chunks a CTA), one where the pipeline cannot (odd spans,
    Pallas' automatic barriers)."""
    f = K.default_chunks_per_step
    assert [f("fp4", c) for c in (1, 2, 3, 8, 16)] == [1, 2, 1, 2, 2]
    assert [f("nvfp4", c) for c in (1, 8, 16)] == [1, 2, 2]
    assert [f("fp8", c) for c in (2, 8, 16)] == [2, 2, 1]
    assert f("fp4", 8, manual=False) == 1


def test_cuda_lowering_every_chunks_per_cta():
    """Every CTA span the default split can pick (1..8, 16 and 32 chunks; nvfp4 keys at 16
    and 32, fp8 at 16) lowers: 5 and 6 chunks (320 / 384 scores a CTA) failed in the -inf
    fill before its buffer was rounded to 256."""
    B, NB, MAXB = 3, 256, 63
    S = jax.ShapeDtypeStruct
    args = (S((B, 64, 128), jnp.bfloat16), S((B, 64), jnp.float32),
            S((NB, 32, 64), jnp.uint8), S((NB, 32, 4), jnp.uint8),
            S((B, MAXB), jnp.int32), S((B,), jnp.int32))
    for cpc in (*range(1, 9), 16, 32):
        for barriers in ("auto", "manual", "warp"):
            f = functools.partial(K.indexer_scores, chunks_per_cta=cpc, barriers=barriers)
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()
    # the other key formats at 16 chunks a CTA (their default from B >= 32)
    argsn = args[:3] + (S((NB, 32, 4), jnp.float8_e4m3fn),) * 2 + args[4:]
    args8 = args[:2] + (S((NB, 32, 128), jnp.float8_e4m3fn), S((NB, 32, 1), jnp.float32)) + args[4:]
    for f, a, cpc in ((K.indexer_scores_nvfp4, argsn, 16), (K.indexer_scores_nvfp4, argsn, 32),
                      (K.indexer_scores_fp8, args8, 16)):
        f = functools.partial(f, chunks_per_cta=cpc)
        assert "mosaic_gpu" in jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
def test_gpu_lut_dequant_every_code():
    """"lut" (prmt lookup tables in inline Mosaic GPU code: no interpreter) on raw random
    bytes (every e2m1 code pair, signs, zeros) under exponents across the range: the
    same scores, bit for bit, as "bits" and "e4m3"; both with keys from SMEM and from
    registers."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=4, NB=256, MAXB=64)
    keys = {"idx_codes": jnp.asarray(rng.integers(0, 256, (256, 32, 64)), jnp.uint8),
            "idx_scale": jnp.asarray(rng.integers(100, 160, (256, 32, 4)), jnp.uint8)}
    t = jnp.asarray(rng.integers(0, 4 * 32 * 64, 4), jnp.int32)
    # (the natural k order: "words" sums the same products in another order)
    run = lambda dq, kreg: np.asarray(jax.jit(functools.partial(
        K.indexer_scores, dequant=dq, kreg=kreg, key_order="natural"))(
            q, w, keys["idx_codes"], keys["idx_scale"], bt, t))
    a = run("bits", False)
    check_scores(a, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))
    for kreg in (False, True):
        assert np.array_equal(run("lut", kreg), a)
        assert np.array_equal(run("lutbf", kreg), a)
        assert np.array_equal(run("place", kreg), a)
        assert np.array_equal(run("e4m3", kreg), a)


@pytest.mark.gpu
@pytest.mark.parametrize("dequant", ["bits", "e4m3", "fp8mma", "lut", "lutbf", "place"])
def test_gpu_kernel_matches_reference(dequant):
    q, w, keys, bt, t = make_inputs(5, B=4, NB=256, MAXB=64)
    f = functools.partial(K.indexer_scores, dequant=dequant)
    out = np.asarray(jax.jit(f)(q, w, keys["idx_codes"], keys["idx_scale"], bt, t))
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dequant,stages,overlap,kreg", PIPELINES)
def test_gpu_pipeline_variants(fmt, dequant, stages, overlap, kreg):
    rng = np.random.default_rng()
    q, w, _, bt, t = make_inputs(int(rng.integers(1 << 20)), B=4, NB=256, MAXB=64)
    keys = _keys(rng, fmt, 256)
    f = functools.partial(K.score_keys, fmt=fmt, dequant=dequant, stages=stages, overlap=overlap,
                          kreg=kreg)
    out = np.asarray(jax.jit(f)(q, w, keys, bt, t))
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt)))


def _split_edge_case(fmt):
    """Fresh random inputs for the GPU pipeline comparisons: 63-block table (the last CTA's
    block-table prefetch runs past it), a request with unused (-1) blocks, a partial last
    chunk, a request with 3 positions -> (q, w, keys, bt, t, reference scores)."""
    rng = np.random.default_rng()
    q, w, _, bt, _ = make_inputs(int(rng.integers(1 << 20)), B=4, NB=256, MAXB=63)
    keys = _keys(rng, fmt, 256)
    bt = bt.at[1, 40:].set(-1)
    t = jnp.asarray([4 * 32 * 63 - 1, 4 * 32 * 40 - 7, 4 * 32 * 9 + 5, 3], jnp.int32)
    return q, w, keys, bt, t, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dequant,stages", [("fp4", "lutbf", 2), ("fp4", "lutbf", 3),
                                                ("nvfp4", "lutbf", 2), ("fp8", "bits", 3),
                                                ("fp4", "place", 2), ("nvfp4", "place", 2)])
def test_gpu_manual_barriers_match_auto(fmt, dequant, stages):
    """barriers="manual" (one warpgroup barrier a chunk, block-table loads an iteration
    ahead) and "warp" (as manual, the TMA issue in warp 0 only): the same scores, bit for
    bit, as Pallas' automatic barriers, and the reference's. 5 chunks per CTA (ring slots reused; the block-table prefetch runs past
    the CTA's last chunk and past the table), a request with unused blocks, a partial
    last chunk; then the default split."""
    q, w, keys, bt, t, ref = _split_edge_case(fmt)
    for cpc in (5, None):
        run = lambda barriers: np.asarray(jax.jit(functools.partial(
            K.score_keys, fmt=fmt, dequant=dequant, stages=stages, chunks_per_cta=cpc,
            barriers=barriers))(q, w, keys, bt, t))
        out = run("manual")
        check_scores(out, ref)
        assert np.array_equal(out, run("auto"))
        assert np.array_equal(out, run("warp"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dequant", [("fp4", "place"), ("fp4", "lutbf"), ("nvfp4", "place"),
                                         ("fp8", "bits")])
def test_gpu_weights_in_loop_match(fmt, dequant):
    """w_in_loop (the head weights re-read from SMEM every chunk; with "place" the 2^64 then
    goes on each chunk's scores): the same scores, bit for bit, as the weights held in
    registers, and the reference's. 5 chunks a CTA, unused blocks, a partial chunk, then
    the default split. (Written in session 24 after its device time ran out: not yet run.)"""
    q, w, keys, bt, t, ref = _split_edge_case(fmt)
    for cpc in (5, None):
        run = lambda wl: np.asarray(jax.jit(functools.partial(
            K.score_keys, fmt=fmt, dequant=dequant, chunks_per_cta=cpc,
            w_in_loop=wl))(q, w, keys, bt, t))
        out = run(True)
        check_scores(out, ref)
        assert np.array_equal(out, run(False))


@pytest.mark.gpu
def test_gpu_nvfp4_every_code_and_scale():
    """The default nvfp4 kernel (register keys, place, the hardware's e4m3 scale
    conversion) on raw random bytes: every e2m1 code pair, every non-NaN e4m3 scale
    (subnormals, zero, 448, negative), against the reference."""
    rng = np.random.default_rng()
    NB = 64
    q, w, _, bt, t = make_inputs(int(rng.integers(1 << 20)), B=4, NB=NB, MAXB=16)
    sc = rng.integers(0, 256, (2, NB, 32, 4)).astype(np.uint8)
    sc[(sc & 0x7F) == 0x7F] = 0x38
    sc[:, :2] = np.arange(256, dtype=np.uint8).reshape(2, 1, 32, 4)   # every byte once
    sc[(sc & 0x7F) == 0x7F] = 0x01
    sc = jax.lax.bitcast_convert_type(jnp.asarray(sc), jnp.float8_e4m3fn)
    keys = {"idx_codes": jnp.asarray(rng.integers(0, 256, (NB, 32, 64)), jnp.uint8),
            "idx_scale_lo": sc[0], "idx_scale_hi": sc[1]}
    t = jnp.asarray([4 * 32 * 16 - 1] * 4, jnp.int32)
    out = np.asarray(jax.jit(functools.partial(K.score_keys, fmt="nvfp4"))(q, w, keys, bt, t))
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt="nvfp4")))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_gpu_other_key_formats_match_reference(fmt):
    rng = np.random.default_rng()
    q, w, _, bt, t = make_inputs(int(rng.integers(1 << 20)), B=4, NB=256, MAXB=64)
    keys = (_nvfp4_keys(rng, 256) if fmt == "nvfp4" else kvformat.quantize_index_key(
        jnp.asarray(rng.standard_normal((256, 32, 128)), jnp.float32), "fp8"))
    out = np.asarray(jax.jit(functools.partial(K.score_keys, fmt=fmt))(q, w, keys, bt, t))
    check_scores(out, np.asarray(R.indexer_scores_reference(q, w, keys, bt, t, fmt=fmt)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dequant,stages", [("fp4", "place", 2), ("fp4", "place", 3),
                                                ("nvfp4", "place", 2), ("fp8", "bits", 2)])
def test_gpu_two_chunks_a_step_match(fmt, dequant, stages):
    """chunks_per_step=2 (two chunks from one ring slot a loop iteration): the same scores,
    bit for bit, as one chunk a step, and the reference's: CTA spans of 2, 6, 16 and 32
    chunks, a request whose last step has one chunk to score (its second chunk's entries
    are past the eligible count), unused (-1) blocks, the table's end mid-chunk."""
    q, w, keys, bt, t, ref = _split_edge_case(fmt)
    for cpc in (2, 6, 16, 32):
        run = lambda g: np.asarray(jax.jit(functools.partial(
            K.score_keys, fmt=fmt, dequant=dequant, stages=stages, chunks_per_cta=cpc,
            chunks_per_step=g))(q, w, keys, bt, t))
        out = run(2)
        check_scores(out, ref)
        assert np.array_equal(out, run(1))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp4", "nvfp4"])
def test_gpu_words_key_order_matches(fmt):
    """key_order="words" (whole words of code bytes a thread, q permuted to match; built in
    session 32, first passed on the H100 in session 33): scores within rounding of the natural order's
    (the same products summed in another order) and of the reference's, the same top-k;
    CTA spans of 5 and 32 chunks, one and two chunks a step, unused blocks, a partial
    chunk. Raw random code bytes (every code) under scale exponents across the range."""
    q, w, keys, bt, t, ref = _split_edge_case(fmt)
    for cpc, g in ((5, 1), (32, 2), (None, None)):
        run = lambda order: np.asarray(jax.jit(functools.partial(
            K.score_keys, fmt=fmt, chunks_per_cta=cpc, chunks_per_step=g,
            key_order=order))(q, w, keys, bt, t))
        out, nat = run("words"), run("natural")
        check_scores(out, ref)
        check_scores(out, nat)
        fin = np.isfinite(nat)
        assert np.abs(out[fin] - nat[fin]).max() <= 1e-5 * np.abs(nat[fin]).max()
    rng = np.random.default_rng()
    qa, wa, _, bta, _ = make_inputs(int(rng.integers(1 << 20)), B=4, NB=256, MAXB=64)
    keys = ({"idx_codes": jnp.asarray(rng.integers(0, 256, (256, 32, 64)), jnp.uint8),
             "idx_scale": jnp.asarray(rng.integers(100, 160, (256, 32, 4)), jnp.uint8)}
            if fmt == "fp4" else _nvfp4_keys(rng, 256))
    ta = jnp.asarray(rng.integers(4 * 32 * 32, 4 * 32 * 64, 4), jnp.int32)
    words, nat = (np.asarray(jax.jit(functools.partial(K.topk_keys, fmt=fmt, key_order=order),
                                     static_argnums=5)(qa, wa, keys, bta, ta, 512))
                  for order in ("words", "natural"))
    ref_scores = np.asarray(R.indexer_scores_reference(qa, wa, keys, bta, ta, fmt=fmt))
    kth = np.sort(ref_scores, axis=1)[:, -512][:, None]
    # the same set up to ties at the k-th score (the sums are rounded in another order)
    for b in range(4):
        a, n = set(words[b][words[b] >= 0]), set(nat[b][nat[b] >= 0])
        diff = a ^ n
        assert all(abs(ref_scores[b, i] - kth[b, 0]) <= 1e-5 * abs(kth[b, 0]) for i in diff)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp4", "nvfp4", "fp8"])
def test_gpu_epilogue_forms_agree(fmt, monkeypatch):
    """"chain" (session 33) against "tree" (Mosaic's reduce) on the GPU: within f32
    rounding of each other and the reference's; CTA spans of 5 chunks and the default."""
    q, w, keys, bt, t, ref = _split_edge_case(fmt)
    for cpc in (5, None):
        out = {}
        for form in ("chain", "tree"):
            monkeypatch.setenv("DSV4_IDX_EPILOGUE", form)
            out[form] = np.asarray(jax.jit(functools.partial(
                K.score_keys, fmt=fmt, chunks_per_cta=cpc))(q, w, keys, bt, t))
            check_scores(out[form], ref)
        fin = np.isfinite(out["tree"])
        assert np.array_equal(fin, np.isfinite(out["chain"]))
        assert (np.abs(out["chain"][fin] - out["tree"][fin]).max()
                <= 1e-5 * np.abs(out["tree"][fin]).max())


def test_two_chunks_a_step_lowering_and_errors():
    """chunks_per_step=2 lowers for the GPU in every key format; it refuses what it cannot
    do (Pallas' automatic barriers, keys through SMEM, a CTA span that is not a multiple)."""
    formats = _flash_format_args()
    args = formats[0][1]
    for f, a in formats:
        for cpc in (2, 16):
            g = functools.partial(f, chunks_per_step=2, chunks_per_cta=cpc)
            assert "mosaic_gpu" in jax.jit(g).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    for kw, msg in ((dict(barriers="auto"), "barriers"), (dict(kreg=False), "kreg"),
                    (dict(chunks_per_cta=5), "5 chunks a CTA")):
        g = functools.partial(K.indexer_scores, chunks_per_step=2, **kw)
        with pytest.raises(ValueError, match=msg):
            jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",))
