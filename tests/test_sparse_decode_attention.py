"""Sparse decode attention: Mosaic-GPU kernel (GPU interpreter on CPU) vs the pure-JAX path,
the pure-JAX path vs an independent numpy restatement, and the CUDA lowering at Flash/Pro
shapes."""
import functools
import math

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats as kvformat
from pallas_kernels.sparse_decode_attention import kernel as K
from pallas_kernels.sparse_decode_attention import reference as R


def make_inputs(seed, B=2, H=16, NB=6, EPB=32, MAXB=3, n_idx=40, t=(70, 300), n_valid=(25, 40)):
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, H, 512), jnp.bfloat16)
    win = kvformat.quantize_kv(jax.random.normal(ks[1], (B, 128, 512)) * 2)
    t = jnp.asarray(t[:B], jnp.int32)
    slots = jnp.arange(128)[None]
    pos = t[:, None] - ((t[:, None] - slots) % 128)          # latest position per slot
    pos = jnp.where(pos >= 0, pos, -1).astype(jnp.int32)
    cmp = kvformat.quantize_kv(jax.random.normal(ks[2], (NB, EPB, 512)) * 2)
    bt = jnp.asarray(rng.permutation(NB)[: B * MAXB].reshape(B, MAXB).astype(np.int32))
    idx = np.full((B, n_idx), -1, np.int32)
    for b in range(B):
        idx[b, : n_valid[b]] = rng.permutation(MAXB * EPB)[: n_valid[b]]
    sink = jax.random.normal(ks[3], (H,))
    return q, (*win, pos), cmp, bt, jnp.asarray(idx), t, sink


def run_kernel(args, **kw):
    f = functools.partial(K.sparse_decode_attention, interpret=plgpu.InterpretGPUParams(), **kw)
    return np.asarray(jax.jit(f)(*args)).astype(np.float32)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_reference_matches_numpy():
    args = make_inputs(0)
    q, (wn, wsc, wr, pos), (cn, csc, cr), bt, idx, t, sink = args
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    f8 = lambda x: np.asarray(x.astype(jnp.float32))
    dq = lambda n, s, r: np.concatenate(
        [f8(n) * np.repeat(2.0 ** (np.asarray(s)[..., :7].astype(np.float64) - 127), 64, -1),
         f8(r)], -1)
    kw, kc = dq(wn, wsc, wr), dq(cn, csc, cr)
    EPB = cn.shape[1]
    for b in range(2):
        tb = int(t[b])
        keys = [kw[b, s] for s in range(128) if 0 <= int(pos[b, s]) and tb - 127 <= int(pos[b, s]) <= tb]
        keys += [kc[int(bt[b, i // EPB]), i % EPB] for i in np.asarray(idx[b]) if i >= 0]
        kk = np.stack(keys)
        s = f8(q[b]).astype(np.float64) @ kk.T / math.sqrt(512)
        sk = np.asarray(sink, np.float64)[:, None]
        m = np.maximum(s.max(1, keepdims=True), sk)
        p = np.exp(s - m)
        o = p @ kk / (p.sum(1, keepdims=True) + np.exp(sk - m))
        assert rel_err(ref[b], o) < 5e-3


@pytest.mark.parametrize("gather,splits,ws,qks", [("direct", 1, True, False),
                                                  ("direct", 2, False, False),
                                                  ("staged", 1, False, False),
                                                  ("direct", 2, True, True)])
def test_kernel_matches_reference(gather, splits, ws, qks):
    args = make_inputs(1)
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    out = run_kernel(args, splits=splits, gather=gather, warp_specialized=ws, qk_split=qks)
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < 5e-3
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)


def edge_inputs():
    """The pool's LAST row and the window ring's last row are attended; -1 holes sit
    between valid ids and one request has a whole 64-id block of -1 between valid ones."""
    B, NB, EPB, MAXB = 2, 6, 32, 3
    args = make_inputs(5, B=B, NB=NB, EPB=EPB, MAXB=MAXB, n_idx=150, t=(300, 380), n_valid=(0, 0))
    q, win, cmp, bt, _, t, sink = args
    bt_np = np.asarray(bt)
    last = NB * EPB - 1                                   # pool row of the last entry
    b_last, i_last = np.argwhere(bt_np == last // EPB)[0]
    rng = np.random.default_rng(5)
    idx = np.full((B, 150), -1, np.int32)
    ids = rng.permutation(MAXB * EPB)
    idx[0, :40:2] = ids[:20]                             # holes every other slot
    idx[1, 100:110] = ids[20:30]                          # first block all -1
    idx[b_last, 3 if b_last == 0 else 120] = i_last * EPB + EPB - 1   # the pool's last row
    return (q, win, cmp, bt, jnp.asarray(idx), t, sink)


@pytest.mark.parametrize("ws,qks", [(True, False), (False, False), (True, True)])
def test_kernel_direct_pool_edges_and_holes(ws, qks):
    # Direct gather: each row is copied as a 512-byte box that also covers the next row's
    # first 64 bytes, so the pool's last row is read past the end (zero-filled). qks: the
    # consumers split the keys (-1 keys in one half only, whole halves masked).
    args = edge_inputs()
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    out = run_kernel(args, splits=1, gather="direct", warp_specialized=ws, qk_split=qks)
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("qks", [False, True])
def test_gpu_cpasync_pool_edges_and_holes(qks):
    # cp.async gather (inline PTX: GPU only): the same edge cases, and the merge of splits
    args = edge_inputs()
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    for splits in (1, 2):
        f = functools.partial(K.sparse_decode_attention, splits=splits, gather="cpasync",
                              qk_split=qks)
        out = np.asarray(jax.jit(f)(*args)).astype(np.float32)
        assert np.isfinite(out).all()
        assert rel_err(out, ref) < 5e-3


@pytest.mark.gpu
def test_gpu_cpasync_ids_past_the_table_read_its_last_entry():
    # The producer derives pool rows from the block table itself: an id past the table
    # (invalid input) must not read another request's row or beyond the table; it reads
    # the table's last entry, as XLA's clamping gather did: the same output as that id
    # written as (MAXB - 1) * EPB + id % EPB.
    q, win, cmp, bt, idx, t, sink = edge_inputs()
    EPB, MAXB = cmp[0].shape[1], bt.shape[1]
    idx = np.asarray(idx).copy()
    far = np.array([MAXB * EPB + 5, 7 * MAXB * EPB + 31])
    idx[0, 41:43] = far
    clamped = idx.copy()
    clamped[0, 41:43] = (MAXB - 1) * EPB + far % EPB
    f = jax.jit(functools.partial(K.sparse_decode_attention, splits=1, gather="cpasync"))
    out = np.asarray(f(q, win, cmp, bt, jnp.asarray(idx), t, sink)).astype(np.float32)
    want = np.asarray(f(q, win, cmp, bt, jnp.asarray(clamped), t, sink)).astype(np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, want)


@pytest.mark.gpu
def test_gpu_cpasync_ids_prefix_bounds_blocks_from_t():
    """ids_prefix (the decode step's top-k / HCA lists): the kernel bounds its key blocks
    by min(K, (t+1) // ratio) from t instead of XLA's search for the last valid id. With
    the valid ids in that prefix the output is bit-identical to the search's, for a bound
    below K (not a multiple of 64), one above K, HCA's one entry per block, and splits."""
    cases = [make_inputs(4, B=2, H=64, NB=64, MAXB=32, n_idx=512, t=(700, 4095),
                         n_valid=(175, 512)),           # bounds 175 and 512 (CSA, ratio 4)
             make_inputs(5, B=2, H=64, NB=64, MAXB=32, n_idx=512, t=(2999, 300),
                         n_valid=(512, 40))]            # bounds 512 (750 capped at K) and
    # 75 (past the 40 valid ids: one more block, all -1); then HCA, one entry a block
    q, win, cmp, bt, _, t, sink = make_inputs(6, B=2, H=64, NB=80, EPB=1, MAXB=40, n_idx=40,
                                              t=(1000, 5119), n_valid=(0, 0))
    cases.append((q, win, cmp, bt, R.hca_indices(t, 40), t, sink))   # HCA: 7 and 40 entries
    for args in cases:
        for splits in (1, 2):
            run = lambda prefix: np.asarray(jax.jit(functools.partial(
                K.sparse_decode_attention, splits=splits, gather="cpasync",
                ids_prefix=prefix))(*args)).astype(np.float32)
            out = run(True)
            assert np.isfinite(out).all()
            np.testing.assert_array_equal(out, run(False))


@pytest.mark.gpu
def test_gpu_cpasync_implicit_hca_ids():
    """idx_BK=None, hca_entries=K (the decode step's HCA layers): the producer derives the
    ids from t instead of reading hca_indices' list; the output is bit-identical to the
    list's, for a count below K (not a multiple of 64), t past the table (capped at K),
    t < 127 (no entry) and t = -1, at 1 and 2 splits."""
    q, win, cmp, bt, _, _, sink = make_inputs(7, B=4, H=64, NB=640, EPB=1, MAXB=150, n_idx=150,
                                              t=(1000, 5119, 100, 4000), n_valid=(0,) * 4)
    t = jnp.asarray([1000, 150 * 128 + 700, 100, -1], jnp.int32)  # 7, 150 (capped), 0, 0
    for splits in (1, 2):
        f = lambda idx, K_: np.asarray(jax.jit(functools.partial(
            K.sparse_decode_attention, splits=splits, gather="cpasync", ids_prefix=True,
            hca_entries=K_))(q, win, cmp, bt, idx, t, sink)).astype(np.float32)
        out = f(None, 150)
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out, f(R.hca_indices(t, 150), None))


def _double_k_cases(kind):
    """(args, hca_entries, ids_prefix, splits) for the double_k GPU tests."""
    if kind == "csa":
        return [(edge_inputs(), None, False, (1, 2)),
                (make_inputs(4, B=2, H=64, NB=64, MAXB=32, n_idx=512, t=(700, 4095),
                             n_valid=(175, 512)), None, True, (1, 3)),
                (make_inputs(9, B=2, H=128, NB=64, MAXB=32, n_idx=512, t=(4095, 2000),
                             n_valid=(512, 300)), None, True, (2,))]
    q, win, cmp, bt, _, _, sink = make_inputs(7, B=3, H=64, NB=640, EPB=1, MAXB=150,
                                              n_idx=150, t=(1000, 5119, 100), n_valid=(0,) * 3)
    t = jnp.asarray([1000, 150 * 128 + 700, 100], jnp.int32)      # 7, 150 (capped), 0
    return [((q, win, cmp, bt, None, t, sink), 150, True, (1, 3))]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("at", ["qk", "pv"])
def test_gpu_double_k_matches_cpasync(kind, at, monkeypatch):
    """double_k (two K tiles, the next block's dequant under the scores' or P V's wgmma,
    P V from registers, rope rows copied straight into the K tile) gives the cpasync
    kernel's output bit for bit: the same operands and roundings. csa: pool edges and -1
    holes, a whole block of -1, bounds from t below / above K, Flash and Pro head counts;
    hca: in-kernel ids (0, 7 and 150 entries); 1 to 3 splits (odd and even block counts a
    CTA)."""
    monkeypatch.setenv("DSV4_ATTN_DK_AT", at)
    for args, hca, prefix, all_splits in _double_k_cases(kind):
        ids = R.hca_indices(args[5], hca) if hca else args[4]
        ref = np.asarray(R.sparse_decode_attention_reference(
            *args[:4], ids, *args[5:])).astype(np.float32)
        for splits in all_splits:
            run = lambda dk: np.asarray(jax.jit(functools.partial(
                K.sparse_decode_attention, splits=splits, gather="cpasync", ids_prefix=prefix,
                hca_entries=hca, double_k=dk))(*args)).astype(np.float32)
            out = run(True)
            assert np.isfinite(out).all()
            np.testing.assert_array_equal(out, run(False))
            assert rel_err(out, ref) < 5e-3


def _abstract_cache(B, NB=4096, EPB=32):
    """Shapes of a cache for lowering-only tests -> (window parts, compressed pool parts
    with EPB entries a block, the same pool with one entry a block (HCA))."""
    S = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    win = (S((B, 128, 448), f8), S((B, 128, 8), jnp.uint8), S((B, 128, 64), jnp.bfloat16),
           S((B, 128), jnp.int32))
    cmp = (S((NB, EPB, 448), f8), S((NB, EPB, 8), jnp.uint8), S((NB, EPB, 64), jnp.bfloat16))
    return win, cmp, tuple(S((NB, 1) + a.shape[2:], a.dtype) for a in cmp)


def _abstract_args(B, H, MAXB=512, topk=512):
    """Abstract sparse_decode_attention arguments for lowering-only tests -> (top-k ids
    args, in-kernel HCA ids args)."""
    S = jax.ShapeDtypeStruct
    win, cmp, hcmp = _abstract_cache(B)
    a = (S((B, H, 512), jnp.bfloat16), win, cmp, S((B, MAXB), jnp.int32),
         S((B, topk), jnp.int32), S((B,), jnp.int32), S((H,), jnp.float32))
    return a, a[:2] + (hcmp,) + a[3:4] + (None,) + a[5:]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("deq_at", ["qk", "pv"])
def test_gpu_seesaw_matches_double_k(kind, deq_at, monkeypatch):
    """The seesaw kernel ($DSV4_ATTN_SEESAW=1: q.k once a block, P and the row statistics
    published through SMEM, q's rope columns from registers) gives double_k's output bit
    for bit on double_k's cases (pool edges, -1 holes, a block of -1, t bounds, Flash and
    Pro head counts, in-kernel HCA ids, 1-3 splits: 0 to 11 key blocks a CTA, odd and
    even); chunks 4-6 of the next block dequantised under the scores or under P V."""
    monkeypatch.setenv("DSV4_ATTN_SS_DEQ_AT", deq_at)
    for args, hca, prefix, all_splits in _double_k_cases(kind):
        ids = R.hca_indices(args[5], hca) if hca else args[4]
        ref = np.asarray(R.sparse_decode_attention_reference(
            *args[:4], ids, *args[5:])).astype(np.float32)
        for splits in all_splits:
            def run(seesaw):
                monkeypatch.setenv("DSV4_ATTN_SEESAW", seesaw)
                return np.asarray(jax.jit(functools.partial(
                    K.sparse_decode_attention, splits=splits, gather="cpasync",
                    ids_prefix=prefix, hca_entries=hca, double_k=True))(*args)).astype(np.float32)
            out, dk = run("1"), run("0")
            assert np.isfinite(out).all()
            np.testing.assert_array_equal(out, dk)
            assert rel_err(out, ref) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_seesaw_eager_changes_nothing(kind, monkeypatch):
    """The seesaw's eager announcement of chunks 4-6 ($DSV4_ATTN_SS_B=eager) gives double_k's
    outputs bit for bit."""
    for args, hca, prefix, all_splits in _double_k_cases(kind):
        for splits in all_splits[:2]:
            def run(seesaw, b_mode="lazy"):
                monkeypatch.setenv("DSV4_ATTN_SEESAW", seesaw)
                monkeypatch.setenv("DSV4_ATTN_SS_B", b_mode)
                return np.asarray(jax.jit(functools.partial(
                    K.sparse_decode_attention, splits=splits, gather="cpasync",
                    ids_prefix=prefix, hca_entries=hca, double_k=True))(*args)).astype(np.float32)
            np.testing.assert_array_equal(run("1", "eager"), run("0"))


def test_seesaw_lowering_and_refusal(monkeypatch):
    """The seesaw kernel lowers for Flash / Pro head counts (top-k ids, 1 and 3 splits) and
    in-kernel HCA ids, and is a different program from double_k; bad values of its knobs
    are refused."""
    MAXB = 512

    def lowered(seesaw, a, **kw):
        monkeypatch.setenv("DSV4_ATTN_SEESAW", seesaw)
        f = functools.partial(K.sparse_decode_attention, gather="cpasync", ids_prefix=True,
                              double_k=True, **kw)
        return jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    for H in (64, 128):
        a, ha = _abstract_args(8, H, MAXB)
        for splits in (1, 3):
            assert "mosaic_gpu" in lowered("1", a, splits=splits)
        assert "mosaic_gpu" in lowered("1", ha, splits=2, hca_entries=MAXB)

    def program(seesaw, a):   # the traced program (its lowered text differs run to run)
        if seesaw is None:
            monkeypatch.delenv("DSV4_ATTN_SEESAW", raising=False)
        else:
            monkeypatch.setenv("DSV4_ATTN_SEESAW", seesaw)
        return str(jax.make_jaxpr(functools.partial(
            K.sparse_decode_attention, gather="cpasync", ids_prefix=True, double_k=True))(*a))
    assert program("0", a) == program("0", a) != program("1", a) == program("1", a)
    # auto (the default): the seesaw for Pro's two head tiles or B <= 8, else double_k
    for B, H, want in ((8, 64, "1"), (1, 64, "1"), (16, 64, "0"), (64, 64, "0"),
                       (16, 128, "1"), (32, 128, "1")):
        ab, _ = _abstract_args(B, H, MAXB)
        assert program(None, ab) == program("auto", ab) == program(want, ab) \
            != program("1" if want == "0" else "0", ab), (B, H)
    # the seesaw's producer / dequant placements lower; bad values are refused
    for knob, good, bad in (("DSV4_ATTN_SS_B", "eager", "soon"),
                            ("DSV4_ATTN_SS_DEQ_AT", "qk", "both")):
        monkeypatch.setenv(knob, good)
        assert "mosaic_gpu" in lowered("1", a, splits=2)
        monkeypatch.setenv(knob, bad)
        with pytest.raises(ValueError, match=knob):
            program("1", a)
        monkeypatch.delenv(knob)
    monkeypatch.setenv("DSV4_ATTN_SEESAW", "yes")
    with pytest.raises(ValueError, match="DSV4_ATTN_SEESAW"):
        jax.jit(functools.partial(K.sparse_decode_attention, gather="cpasync",
                                  ids_prefix=True, double_k=True)).trace(*a)


def test_double_k_lowering_and_refusals(monkeypatch):
    """double_k lowers for Flash / Pro head counts, top-k and in-kernel HCA ids, 1 and 3
    splits; it refuses qk_split and the in-kernel merge; it is the default, which gives way
    to qk_split and the in-kernel merge; interpreted calls ignore it; a bad
    $DSV4_ATTN_DK_AT is refused."""
    monkeypatch.setenv("DSV4_ATTN_SEESAW", "0")   # double_k itself, not the auto choice
    MAXB = 512
    for H in (64, 128):
        a, ha = _abstract_args(8, H, MAXB)
        for splits in (1, 3):
            f = functools.partial(K.sparse_decode_attention, splits=splits, gather="cpasync",
                                  ids_prefix=True, double_k=True)
            assert "mosaic_gpu" in jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        f = functools.partial(K.sparse_decode_attention, splits=2, gather="cpasync",
                              ids_prefix=True, hca_entries=MAXB, double_k=True)
        assert "mosaic_gpu" in jax.jit(f).trace(*ha).lower(lowering_platforms=("cuda",)).as_text()
    for kw in (dict(qk_split=True), dict(splits=2, merge="cluster")):
        f = functools.partial(K.sparse_decode_attention, gather="cpasync", ids_prefix=True,
                              double_k=True, **kw)
        with pytest.raises(ValueError, match="double_k"):
            jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))

    def program(dk, **kw):   # the traced program (its lowered text differs run to run)
        f = functools.partial(K.sparse_decode_attention, gather="cpasync", ids_prefix=True,
                              double_k=dk, **kw)
        return str(jax.make_jaxpr(f)(*a))
    # the default is double_k, unless qk_split or the in-kernel merge is asked for
    assert program(None) == program(True) != program(False)
    for kw in (dict(qk_split=True), dict(splits=2, merge="cluster")):
        assert program(None, **kw) == program(False, **kw)
    args = edge_inputs()   # the interpreter runs the direct gather: double_k has no effect
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    out = run_kernel(args, splits=1, gather="cpasync", double_k=True)
    assert rel_err(out, ref) < 5e-3
    f = functools.partial(K.sparse_decode_attention, gather="cpasync", ids_prefix=True)
    monkeypatch.setenv("DSV4_ATTN_DK_AT", "yes")
    with pytest.raises(ValueError, match="DSV4_ATTN_DK_AT"):
        jax.jit(f).trace(*a)


@pytest.mark.gpu
def test_gpu_cluster_merge_matches_xla_merge():
    """merge="cluster" (2 key splits as a cluster of 2 CTAs, merged through distributed
    SMEM) against the XLA merge of the same kernel's partials: within a bf16 ulp (the
    kernel's exp is the approximate one), mostly bit-identical, and as close to the
    reference. A request whose second split has no valid key, Flash (1 head tile) and
    Pro (2) head counts, top-k ids and in-kernel HCA ids."""
    cases = [(make_inputs(8, B=3, H=64, NB=96, MAXB=32, n_idx=512, t=(700, 4095, 300),
                          n_valid=(175, 512, 20)), None),
             (make_inputs(9, B=2, H=128, NB=64, MAXB=32, n_idx=512, t=(4095, 2000),
                          n_valid=(512, 300)), None)]
    q, win, cmp, bt, _, _, sink = make_inputs(10, B=2, H=64, NB=320, EPB=1, MAXB=150,
                                              n_idx=150, t=(5000, 19000), n_valid=(0, 0))
    t = jnp.asarray([5000, 19000], jnp.int32)
    cases.append(((q, win, cmp, bt, None, t, sink), 150))
    for args, hca in cases:
        run = lambda merge: np.asarray(jax.jit(functools.partial(
            K.sparse_decode_attention, splits=2, gather="cpasync", ids_prefix=True,
            hca_entries=hca, merge=merge))(*args))
        a, x = run("cluster"), run("xla")
        assert np.isfinite(a.astype(np.float32)).all()
        ai, xi = (v.view(np.int16).astype(np.int32) for v in (a, x))
        ulps = np.abs(np.where(ai < 0, -32768 - ai, ai) - np.where(xi < 0, -32768 - xi, xi))
        assert ulps.max() <= 1 and (ulps == 0).mean() > 0.9, (ulps.max(), (ulps == 0).mean())
        ids = R.hca_indices(t, 150) if hca else args[4]
        ref = np.asarray(R.sparse_decode_attention_reference(
            *args[:4], ids, *args[5:])).astype(np.float32)
        assert rel_err(a.astype(np.float32), ref) < 5e-3


def test_implicit_hca_ids_interpreted_take_the_list():
    """idx_BK=None outside the GPU's cpasync path (here the interpreter) builds
    hca_indices' list: the same output as passing it; bad uses are refused."""
    args = make_inputs(3, NB=8, EPB=1, MAXB=4, n_idx=4, t=(200, 600), n_valid=(0, 4))
    q, win, cmp, bt, _, t, sink = args
    want = run_kernel((q, win, cmp, bt, R.hca_indices(t, 4), t, sink), splits=1)
    out = run_kernel((q, win, cmp, bt, None, t, sink), splits=1, hca_entries=4)
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="hca_entries"):
        K.sparse_decode_attention(q, win, cmp, bt, None, t, sink)
    with pytest.raises(ValueError, match="hca_entries"):
        K.sparse_decode_attention(q, win, cmp, bt, R.hca_indices(t, 4), t, sink, hca_entries=4)
    # the in-kernel merge needs the GPU's cpasync kernel; bad merge names are refused
    with pytest.raises(ValueError, match="merge='cluster'"):
        run_kernel(args, splits=2, merge="cluster")
    with pytest.raises(ValueError, match="merge must be"):
        K.sparse_decode_attention(*args, merge="smem")


def test_kernel_hca_indices_and_empty_window_slots():
    # HCA-style: one entry per pool block, all visible entries listed; t = 20 leaves most
    # window slots empty (-1).
    args = make_inputs(2, NB=8, EPB=1, MAXB=4, n_idx=4, t=(20, 600), n_valid=(0, 4))
    q, win, cmp, bt, _, t, sink = args
    idx = R.hca_indices(t, 4)                     # request 0: none, request 1: 4 entries
    args = (q, win, cmp, bt, idx, t, sink)
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    out = run_kernel(args, splits=1)
    assert rel_err(out, ref) < 5e-3


@pytest.mark.parametrize("NS", [2, 3, 5])
def test_merge_splits_matches_softmax_over_all_keys(NS):
    """Splits s hold softmax-normalised outputs o_s over disjoint key sets with log-sum-exp
    lse_s (-inf: a split with no valid key); the merge must equal the softmax over all
    keys with the sink in the denominator, computed here from the raw scores in float64."""
    rng = np.random.default_rng(NS)
    B, HP, D, n = 3, 4, 8, 5                               # n keys per split
    s = rng.normal(size=(NS, B, HP, n)) * 3
    v = rng.normal(size=(NS, B, HP, n, D))
    s[1, 0] = -np.inf                                      # split 1 of request 0: no keys
    sink = rng.normal(size=HP)
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = np.log(np.exp(s).sum(-1))
        o = np.nan_to_num(np.einsum("sbhk,sbhkd->sbhd", np.exp(s - lse[..., None]), v))
    out = K.merge_splits(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse, jnp.float32),
                         jnp.asarray(sink, jnp.float32))
    # reference: one softmax over every key (splits concatenated) plus the sink
    s_all = np.moveaxis(s, 0, 2).reshape(B, HP, NS * n)
    v_all = np.moveaxis(v, 0, 2).reshape(B, HP, NS * n, D)
    m = np.maximum(s_all.max(-1), sink[None])
    p = np.exp(s_all - m[..., None])
    den = p.sum(-1) + np.exp(sink[None] - m)
    want = np.einsum("bhk,bhkd->bhd", p, v_all) / den[..., None]
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def _merge_case(rng, NS, B, HP, n=5):
    """Splits' partials from raw scores: (o bf16, lse f32, sink f32, the float64 softmax over
    every key of every split with the sink in the denominator [B, HP, 512]). Request 0's
    split 1 saw no key (lse -inf, o 0)."""
    D = 512
    s = rng.normal(size=(NS, B, HP, n)) * 3
    v = rng.normal(size=(NS, B, HP, n, D))
    s[1, 0] = -np.inf
    sink = rng.normal(size=HP)
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = np.log(np.exp(s).sum(-1))
        o = np.nan_to_num(np.einsum("sbhk,sbhkd->sbhd", np.exp(s - lse[..., None]), v))
    s_all = np.moveaxis(s, 0, 2).reshape(B, HP, NS * n)
    v_all = np.moveaxis(v, 0, 2).reshape(B, HP, NS * n, D)
    m = np.maximum(s_all.max(-1), sink[None])
    p = np.exp(s_all - m[..., None])
    want = np.einsum("bhk,bhkd->bhd", p, v_all) / (p.sum(-1) + np.exp(sink[None] - m))[..., None]
    return (jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse, jnp.float32),
            jnp.asarray(sink, jnp.float32), want)


@pytest.mark.parametrize("NS", [2, 5])
def test_merge_kernel_interpreted_matches_softmax_and_xla_merge(NS):
    """The Mosaic-GPU merge (interpreted): the float64 softmax over every split's keys with
    the sink, and XLA's merge_splits (the same formula in the same order: equal but for a
    rare last-bit difference of exp's implementation, one bf16 step after rounding), for
    Flash / Pro head counts and a split with no keys."""
    from pallas_kernels.sparse_decode_attention.merge import merge_splits_kernel
    rng = np.random.default_rng()
    for HP in (64, 128):
        o, lse, sink, want = _merge_case(rng, NS, 2, HP)
        out = np.asarray(merge_splits_kernel(o, lse, sink, interpret=plgpu.InterpretGPUParams()),
                         np.float32)
        np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2)
        xla = np.asarray(K.merge_splits(o, lse, sink), np.float32)
        np.testing.assert_allclose(out, xla, rtol=2 ** -7, atol=1e-6)   # <= one bf16 step
        assert np.mean(out != xla) < 1e-3    # and rarely even that (exp, fused or not)


def test_merge_kernel_lowers_and_refuses_bad_shapes(monkeypatch):
    """merge="kernel" puts the merge kernel in the op's program (cpasync, 2 and 5 splits; the
    in-kernel cluster merge is not taken for it); it is the default from
    MERGE_KERNEL_MIN_BATCH requests, XLA's merge below; bad shapes and merge names are
    refused."""
    monkeypatch.delenv("DSV4_ATTN_MERGE", raising=False)
    from pallas_kernels.sparse_decode_attention.merge import merge_splits_kernel
    B = 8
    S = jax.ShapeDtypeStruct
    a, _ = _abstract_args(B, 64)
    for splits in (2, 5):
        def program(merge):
            f = functools.partial(K.sparse_decode_attention, splits=splits, gather="cpasync",
                                  ids_prefix=True, merge=merge)
            return jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        xla, kern = program("xla"), program("kernel")
        assert kern.count("mosaic_gpu") > xla.count("mosaic_gpu")
        assert "exponential" in xla and "exponential" not in kern
    assert B >= K.MERGE_KERNEL_MIN_BATCH
    default = jax.jit(functools.partial(K.sparse_decode_attention, splits=2, gather="cpasync",
                                        ids_prefix=True)).trace(*a).lower(
                                            lowering_platforms=("cuda",)).as_text()
    assert "exponential" not in default                    # the kernel merge
    small = jax.tree.map(lambda x: S((K.MERGE_KERNEL_MIN_BATCH - 1,) + x.shape[1:], x.dtype)
                         if x.shape[0] == B else x, a)
    f = functools.partial(K.sparse_decode_attention, splits=2, gather="cpasync", ids_prefix=True)
    assert "exponential" in jax.jit(f).trace(*small).lower(lowering_platforms=("cuda",)).as_text()
    o = jnp.zeros((2, 1, 64, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="lse"):
        merge_splits_kernel(o, jnp.zeros((2, 1, 32)), jnp.zeros(64))
    with pytest.raises(ValueError, match="multiple of 64"):
        merge_splits_kernel(o[:, :, :48], jnp.zeros((2, 1, 48)), jnp.zeros(48))
    with pytest.raises(ValueError, match="merge must be one of"):
        jax.jit(functools.partial(K.sparse_decode_attention, merge="fused")).trace(*a)
    # past MAX_SPLITS (SMEM), the kernel says so and the default merges in XLA
    from pallas_kernels.sparse_decode_attention.merge import MAX_SPLITS
    n = MAX_SPLITS + 1
    with pytest.raises(ValueError, match=f"{n} splits exceed"):
        merge_splits_kernel(jnp.zeros((n, 1, 64, 512), jnp.bfloat16), jnp.zeros((n, 1, 64)),
                            jnp.zeros(64))
    f = functools.partial(K.sparse_decode_attention, splits=n, gather="cpasync", ids_prefix=True)
    assert "exponential" in jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="splits exceed"):
        jax.jit(functools.partial(f, merge="kernel")).trace(*a)


@pytest.mark.gpu
def test_gpu_merge_kernel_matches_xla_merge():
    """On the GPU: the merge kernel against the float64 softmax and XLA's merge (equal up to
    the exp implementations: at most one bf16 step apart), and the whole op with
    merge="kernel" against merge="xla" (1-5 splits, Flash and Pro heads)."""
    from pallas_kernels.sparse_decode_attention.merge import merge_splits_kernel
    rng = np.random.default_rng()
    for NS, HP in ((2, 64), (5, 128), (10, 64)):
        o, lse, sink, want = _merge_case(rng, NS, 3, HP)
        out = np.asarray(jax.jit(merge_splits_kernel)(o, lse, sink), np.float32)
        xla = np.asarray(jax.jit(K.merge_splits)(o, lse, sink), np.float32)
        np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(out, xla, rtol=2 ** -7, atol=1e-6)
        print(f"NS={NS} HP={HP}: {np.mean(out != xla):.2e} of the outputs differ from XLA's")
        assert np.mean(out != xla) < 1e-3
    for args in (edge_inputs(), make_inputs(9, B=2, H=128, NB=64, MAXB=32, n_idx=512,
                                            t=(4095, 2000), n_valid=(512, 300))):
        ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
        for splits in (2, 3, 5):
            run = lambda m: np.asarray(jax.jit(functools.partial(
                K.sparse_decode_attention, splits=splits, gather="cpasync",
                merge=m))(*args)).astype(np.float32)
            out = run("kernel")
            assert np.isfinite(out).all()
            np.testing.assert_allclose(out, run("xla"), rtol=2 ** -7, atol=1e-6)
            assert rel_err(out, ref) < 5e-3


def test_ids_used_counts_to_the_last_valid_id():
    idx = jnp.asarray([[5, -1, 7, -1, -1], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 9]], jnp.int32)
    padded, used = K._ids_used(idx)
    assert padded.shape == (3, K.BLK) and bool(jnp.all(padded[:, 5:] == -1))
    np.testing.assert_array_equal(np.asarray(used), [3, 0, 5])


def test_bad_inputs_raise():
    q, win, cmp, bt, idx, t, sink = make_inputs(3)
    with pytest.raises(ValueError, match="attn_sink"):
        K.sparse_decode_attention(q, win, cmp, bt, idx, t, sink[:3])
    with pytest.raises(ValueError, match="cmp_nope"):
        K.sparse_decode_attention(q, win, (cmp[0].astype(jnp.bfloat16), *cmp[1:]), bt, idx, t, sink)
    with pytest.raises(ValueError, match="gather"):
        K.sparse_decode_attention(q, win, cmp, bt, idx, t, sink, gather="xla")
    with pytest.raises(ValueError, match="warp_specialized"):
        K.sparse_decode_attention(q, win, cmp, bt, idx, t, sink, gather="cpasync",
                                  warp_specialized=False)
    with pytest.raises(ValueError, match="qk_split"):
        K.sparse_decode_attention(q, win, cmp, bt, idx, t, sink, warp_specialized=False,
                                  qk_split=True)
    with pytest.raises(ValueError, match="cmp_rope"):
        K.sparse_decode_attention(q, win, (cmp[0], cmp[1], cmp[2][:, :, :32]), bt, idx, t, sink)


@pytest.mark.parametrize("H,topk", [(64, 512), (128, 1024)])
def test_cuda_lowering_flash_pro_shapes(H, topk):
    MAXB = 512
    args, hargs = _abstract_args(8, H, MAXB, topk=topk)
    for splits, gather, ws, qks in ((1, "direct", True, False), (3, "direct", True, False),
                                    (3, "direct", False, False), (3, "staged", False, False),
                                    (1, "cpasync", True, False), (3, "cpasync", True, False),
                                    (3, "cpasync", True, True)):
        f = functools.partial(K.sparse_decode_attention, splits=splits, gather=gather,
                              warp_specialized=ws, qk_split=qks)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()
    for splits in (1, 3):   # the bound from t (ids_prefix): no reduce over the ids in XLA
        f = functools.partial(K.sparse_decode_attention, splits=splits, gather="cpasync",
                              ids_prefix=True)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()
    # 2 key splits merged in-kernel by a cluster of 2 CTAs: no merge in XLA
    f = functools.partial(K.sparse_decode_attention, splits=2, gather="cpasync",
                          ids_prefix=True, merge="cluster")
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "exponential" not in text
    # HCA ids derived in-kernel (idx_BK=None): one custom call and nothing else in XLA
    for splits in (1, 3):
        f = functools.partial(K.sparse_decode_attention, splits=splits, gather="cpasync",
                              ids_prefix=True, hca_entries=MAXB)
        text = jax.jit(f).trace(*hargs).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "iota" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("gather,ws,qks", [("direct", True, False), ("direct", False, False),
                                           ("staged", False, False), ("cpasync", True, False),
                                           ("cpasync", True, True)])
def test_gpu_kernel_matches_reference(gather, ws, qks):
    args = make_inputs(4, B=2, H=64, NB=64, MAXB=32, n_idx=512, t=(4000, 4095), n_valid=(300, 512))
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    f = functools.partial(K.sparse_decode_attention, gather=gather, warp_specialized=ws,
                          qk_split=qks)
    out = np.asarray(jax.jit(f)(*args)).astype(np.float32)
    assert rel_err(out, ref) < 5e-3


# ---------------------------------------------------------------- Triton backend
def run_triton(args, **kw):
    f = functools.partial(K.sparse_decode_attention, backend="triton", interpret=True, **kw)
    return np.asarray(jax.jit(f)(*args)).astype(np.float32)


@pytest.mark.parametrize("splits,head_tile,opts", [
    (1, 64, {}), (2, 16, {}), (3, 32, {}), (2, 64, dict(col_split=2)),
    (1, 64, dict(q_in_loop=True)), (2, 64, dict(joined=True)), (1, 16, dict(joined=True))])
def test_triton_matches_reference(splits, head_tile, opts):
    args = make_inputs(11 + splits)
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    out = run_triton(args, splits=splits, head_tile=head_tile, **opts)
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < 5e-3
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)


def test_triton_holes_pool_end_and_hca():
    # -1 holes between valid ids, a whole block of -1, the pool's last row; then an HCA-style
    # list with an empty request (only window slots, most of them empty at t = 20)
    B, NB, EPB, MAXB = 2, 6, 32, 3
    q, win, cmp, bt, _, t, sink = make_inputs(15, B=B, NB=NB, EPB=EPB, MAXB=MAXB, n_idx=150,
                                              t=(300, 380), n_valid=(0, 0))
    bt_np = np.asarray(bt)
    b_last, i_last = np.argwhere(bt_np == (NB * EPB - 1) // EPB)[0]
    rng = np.random.default_rng()
    idx = np.full((B, 150), -1, np.int32)
    ids = rng.permutation(MAXB * EPB)
    idx[0, :40:2] = ids[:20]
    idx[1, 100:110] = ids[20:30]
    idx[b_last, 3 if b_last == 0 else 120] = i_last * EPB + EPB - 1
    args = (q, win, cmp, bt, jnp.asarray(idx), t, sink)
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    assert rel_err(run_triton(args, splits=2), ref) < 5e-3
    args = make_inputs(16, NB=8, EPB=1, MAXB=4, n_idx=4, t=(20, 600), n_valid=(0, 4))
    q, win, cmp, bt, _, t, sink = args
    args = (q, win, cmp, bt, R.hca_indices(t, 4), t, sink)
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    assert rel_err(run_triton(args), ref) < 5e-3


def test_triton_bad_arguments_raise():
    args = make_inputs(3)
    with pytest.raises(ValueError, match="backend"):
        K.sparse_decode_attention(*args, backend="cuda")
    with pytest.raises(ValueError, match="gather must be 'direct'"):
        K.sparse_decode_attention(*args, backend="triton", gather="staged")
    with pytest.raises(ValueError, match="head tile"):
        run_triton(args, head_tile=48)
    with pytest.raises(ValueError, match="col_split"):
        run_triton(args, col_split=3)
    with pytest.raises(ValueError, match="joined"):
        run_triton(args, joined=True, col_split=2)


@pytest.mark.parametrize("H,topk", [(64, 512), (128, 1024)])
def test_triton_cuda_lowering_flash_pro_shapes(H, topk):
    from jax._src.mesh import AbstractDevice, AbstractMesh
    args, _ = _abstract_args(8, H, topk=topk)
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        for splits, joined in ((1, False), (3, False), (3, True)):
            f = functools.partial(K.sparse_decode_attention, splits=splits, backend="triton",
                                  joined=joined)
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            assert "triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("H,splits,joined", [(64, None, False), (128, 3, False), (64, None, True),
                                             (128, 3, True)])
def test_gpu_triton_matches_reference(H, splits, joined):
    args = make_inputs(17, B=2, H=H, NB=64, MAXB=32, n_idx=512, t=(4000, 4095), n_valid=(300, 512))
    ref = np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)
    f = functools.partial(K.sparse_decode_attention, backend="triton", splits=splits,
                          joined=joined)
    out = np.asarray(jax.jit(f)(*args)).astype(np.float32)
    assert rel_err(out, ref) < 5e-3
