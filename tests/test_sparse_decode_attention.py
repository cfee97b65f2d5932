"""Sparse decode attention: the shipped Mosaic kernels in the GPU interpreter (with the
interpreter's stand-ins named in each test) and the Triton kernel interpreted, against the
pure-JAX path; the pure-JAX path against a numpy restatement; the CUDA lowering
(compile-only, sm_90a) of the shipped builds; GPU tests (marked gpu) for bit identity and
real shapes."""
import functools
import math

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import pallas_kernels.sparse_decode_attention as A
from pallas_kernels import formats as kvformat
from pallas_kernels.sparse_decode_attention import double_k, inputs, seesaw
from pallas_kernels.sparse_decode_attention import reference as R
from pallas_kernels.sparse_decode_attention.merge import MAX_SPLITS, merge_splits_kernel

T = A.AttentionTuning


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


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(args, backend="mosaic", interpret=True, **kw):
    """The op under jit -> f32 numpy; kw: the op's keywords (tuning=...)."""
    f = functools.partial(A.sparse_decode_attention, backend=backend, interpret=interpret, **kw)
    return np.asarray(jax.jit(f)(*args)).astype(np.float32)


def reference(args, ids=None):
    args = args if ids is None else (*args[:4], ids, *args[5:])
    return np.asarray(R.sparse_decode_attention_reference(*args)).astype(np.float32)


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
    out = A.merge_splits(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse, jnp.float32),
                         jnp.asarray(sink, jnp.float32))
    # reference: one softmax over every key (splits concatenated) plus the sink
    s_all = np.moveaxis(s, 0, 2).reshape(B, HP, NS * n)
    v_all = np.moveaxis(v, 0, 2).reshape(B, HP, NS * n, D)
    m = np.maximum(s_all.max(-1), sink[None])
    p = np.exp(s_all - m[..., None])
    den = p.sum(-1) + np.exp(sink[None] - m)
    want = np.einsum("bhk,bhkd->bhd", p, v_all) / den[..., None]
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def test_double_k_interpreted_with_ref_row_copies_and_smem_mma_operands():
    """double_k as it ships (producer bookkeeping, key bounds, dequant, softmax, epilogue,
    splits' merge) with the interpreter's stand-ins: the rows copied by ref loads/stores
    instead of cp.async, the register / in-place wgmma operands staged through SMEM.
    Against the reference: random ids at 1 split; -1 holes, a whole block of -1, the pool's
    last row and 2 splits; in-kernel HCA ids (idx_BK=None) with an empty request and
    mostly empty window slots (t = 20)."""
    args = make_inputs(1)
    out = run(args, tuning=T(splits=1, seesaw=False))
    assert np.isfinite(out).all() and rel_err(out, reference(args)) < 5e-3
    np.testing.assert_allclose(out, reference(args), atol=3e-2, rtol=3e-2)
    args = edge_inputs()
    out = run(args, tuning=T(splits=2, seesaw=False))
    assert np.isfinite(out).all() and rel_err(out, reference(args)) < 5e-3
    q, win, cmp, bt, _, t, sink = make_inputs(2, NB=8, EPB=1, MAXB=4, n_idx=4, t=(20, 600),
                                              n_valid=(0, 4))
    out = run((q, win, cmp, bt, None, t, sink), hca_entries=4, tuning=T(splits=2))
    assert rel_err(out, reference((q, win, cmp, bt, None, t, sink), R.hca_indices(t, 4))) < 5e-3


def test_dispatch_seesaw_rule_and_interpreted_fallback(monkeypatch):
    """The seesaw for Pro's two head tiles or B <= 8, double_k otherwise (use_seesaw, and the
    op takes it); AttentionTuning.seesaw overrides it; interpreted calls take double_k (the
    GPU interpreter deadlocks on the seesaw). The kernels are stubbed: only the choice is
    traced."""
    for B, H, want in ((8, 64, True), (1, 64, True), (16, 64, False), (64, 64, False),
                       (16, 128, True), (32, 128, True)):
        assert A.use_seesaw(B, H) == want, (B, H)
    calls = []

    def stub(name):
        def attention(q, *args, NS, **kw):
            calls.append((name, bool(kw["interpret"])))
            B, HP, D = q.shape
            return jnp.zeros((NS, B, HP, D), jnp.bfloat16), jnp.zeros((NS, B, HP), jnp.float32)
        return attention
    monkeypatch.setattr(seesaw, "attention", stub("seesaw"))
    monkeypatch.setattr(double_k, "attention", stub("double_k"))
    for B, H, tuning, interp, want in ((8, 64, None, False, "seesaw"),
                                       (16, 64, None, False, "double_k"),
                                       (16, 128, None, False, "seesaw"),
                                       (16, 64, T(seesaw=True), False, "seesaw"),
                                       (8, 64, T(seesaw=False), False, "double_k"),
                                       (8, 64, None, True, "double_k")):
        a, _ = _abstract_args(B, H)
        jax.eval_shape(functools.partial(A.sparse_decode_attention, ids_prefix=True,
                                         interpret=interp, tuning=tuning), *a)
        assert calls.pop() == (want, interp), (B, H, tuning, interp)


def test_merge_choice_and_refusals(monkeypatch):
    """The splits' merge: the merge kernel from MERGE_KERNEL_MIN_BATCH requests (one more
    Mosaic call, no exponential in XLA), XLA's below and past MAX_SPLITS; AttentionTuning
    overrides it and the kernel refuses too many splits. Lowered for CUDA with the
    attention kernels stubbed (only the merge is lowered)."""
    def stub(q, *args, NS, **kw):
        B, HP, D = q.shape
        return (jnp.zeros((NS, B, HP, D), jnp.bfloat16) + q[None].astype(jnp.bfloat16),
                jnp.zeros((NS, B, HP), jnp.float32) + q[None, ..., 0].astype(jnp.float32))
    monkeypatch.setattr(seesaw, "attention", stub)
    monkeypatch.setattr(double_k, "attention", stub)

    def text(B, **tuning):
        a, _ = _abstract_args(B, 64)
        f = functools.partial(A.sparse_decode_attention, ids_prefix=True, tuning=T(**tuning))
        return jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    n = A.MERGE_KERNEL_MIN_BATCH
    kern = text(n, splits=2)
    assert "mosaic_gpu" in kern and "exponential" not in kern
    for B, tuning in ((n - 1, dict(splits=2)), (n, dict(splits=2, merge_kernel=False)),
                      (n, dict(splits=MAX_SPLITS + 1))):
        t = text(B, **tuning)
        assert "mosaic_gpu" not in t and "exponential" in t, (B, tuning)
    assert "mosaic_gpu" in text(n - 1, splits=2, merge_kernel=True)
    with pytest.raises(ValueError, match=f"{MAX_SPLITS + 1} splits exceed"):
        text(n, splits=MAX_SPLITS + 1, merge_kernel=True)
    o = jnp.zeros((2, 1, 64, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="lse"):
        merge_splits_kernel(o, jnp.zeros((2, 1, 32)), jnp.zeros(64))
    with pytest.raises(ValueError, match="multiple of 64"):
        merge_splits_kernel(o[:, :, :48], jnp.zeros((2, 1, 48)), jnp.zeros(48))


@pytest.mark.parametrize("NS,HP", [(2, 128), (5, 64)])
def test_merge_kernel_interpreted_matches_softmax_and_xla_merge(NS, HP):
    """The Mosaic-GPU merge (interpreted): the float64 softmax over every split's keys with
    the sink, and XLA's merge_splits (the same formula in the same order: equal but for a
    rare last-bit difference of exp's implementation, one bf16 step after rounding), for
    Flash / Pro head counts and a split with no keys."""
    o, lse, sink, want = _merge_case(np.random.default_rng(NS), NS, 2, HP)
    out = np.asarray(merge_splits_kernel(o, lse, sink, interpret=True), np.float32)
    np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2)
    xla = np.asarray(A.merge_splits(o, lse, sink), np.float32)
    np.testing.assert_allclose(out, xla, rtol=2 ** -7, atol=1e-6)   # <= one bf16 step
    assert np.mean(out != xla) < 1e-3    # and rarely even that (exp, fused or not)


def test_ids_used_counts_to_the_last_valid_id():
    idx = jnp.asarray([[5, -1, 7, -1, -1], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 9]], jnp.int32)
    padded, used = inputs.ids_used(idx)
    assert padded.shape == (3, 64) and bool(jnp.all(padded[:, 5:] == -1))
    np.testing.assert_array_equal(np.asarray(used), [3, 0, 5])


def test_default_splits_counts_waves():
    # Flash B=64, 10 key blocks on 132 SMs: 2 splits (one wave of 5 blocks), not 3 (2 waves)
    assert inputs.default_splits(64, 64, 10) == 2
    assert inputs.default_splits(1, 64, 10) == 10       # one request: every block its own CTA
    assert inputs.default_splits(1, 64, 0) == 1


def test_bad_inputs_raise():
    q, win, cmp, bt, idx, t, sink = make_inputs(3)
    op = A.sparse_decode_attention
    with pytest.raises(ValueError, match="attn_sink"):
        op(q, win, cmp, bt, idx, t, sink[:3])
    with pytest.raises(ValueError, match="cmp_nope"):
        op(q, win, (cmp[0].astype(jnp.bfloat16), *cmp[1:]), bt, idx, t, sink)
    with pytest.raises(ValueError, match="cmp_rope"):
        op(q, win, (cmp[0], cmp[1], cmp[2][:, :, :32]), bt, idx, t, sink)
    with pytest.raises(ValueError, match="backend"):
        op(q, win, cmp, bt, idx, t, sink, backend="cuda")
    with pytest.raises(ValueError, match="hca_entries"):
        op(q, win, cmp, bt, None, t, sink)
    with pytest.raises(ValueError, match="hca_entries"):
        op(q, win, cmp, bt, idx, t, sink, hca_entries=4)
    with pytest.raises(ValueError, match="splits"):
        T(splits=0)


@pytest.mark.parametrize("H,topk", [(64, 512), (128, 1024)])
def test_cuda_lowering_shipped_builds(H, topk):
    """The shipped builds lower for sm_90a at Flash / Pro head counts: the default kernel
    with 3 splits (merge kernel at B = 8), double_k with 1 split and the bound from t, and
    in-kernel HCA ids (idx_BK=None: one Mosaic call and no id list in XLA)."""
    args, hargs = _abstract_args(8, H, topk=topk)
    for a, kw in ((args, dict(ids_prefix=True, tuning=T(splits=3))),
                  (args, dict(tuning=T(splits=1, seesaw=False))),
                  (hargs, dict(ids_prefix=True, hca_entries=512, tuning=T(splits=1)))):
        f = functools.partial(A.sparse_decode_attention, **kw)
        text = jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        if kw.get("hca_entries"):
            assert text.count("mosaic_gpu_v2") == 1 and "iota" not in text


# ---------------------------------------------------------------- Triton backend
# The portable kernel for GPUs without wgmma.
@pytest.mark.parametrize("splits", [1, 2])
def test_triton_interpreted_matches_reference(splits):
    args = make_inputs(11 + splits)
    out = run(args, backend="triton", tuning=T(splits=splits))
    assert np.isfinite(out).all() and rel_err(out, reference(args)) < 5e-3
    np.testing.assert_allclose(out, reference(args), atol=3e-2, rtol=3e-2)


def test_triton_interpreted_holes_pool_end_and_hca():
    # -1 holes between valid ids, a whole block of -1, the pool's last row; then HCA ids
    # (idx_BK=None: hca_indices' list) with an empty request and mostly empty window slots
    args = edge_inputs()
    assert rel_err(run(args, backend="triton", tuning=T(splits=2)), reference(args)) < 5e-3
    q, win, cmp, bt, _, t, sink = make_inputs(16, NB=8, EPB=1, MAXB=4, n_idx=4, t=(20, 600),
                                              n_valid=(0, 4))
    out = run((q, win, cmp, bt, None, t, sink), backend="triton", hca_entries=4)
    assert rel_err(out, reference((q, win, cmp, bt, None, t, sink), R.hca_indices(t, 4))) < 5e-3


@pytest.mark.parametrize("H,topk", [(64, 512), (128, 1024)])
def test_triton_cuda_lowering_flash_pro_shapes(H, topk):
    from jax._src.mesh import AbstractDevice, AbstractMesh
    args, _ = _abstract_args(8, H, topk=topk)
    dev = AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        f = functools.partial(A.sparse_decode_attention, backend="triton", tuning=T(splits=3))
        assert "triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


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



# ---------------------------------------------------------------- GPU (H100 / H200)
def gpu_run(args, **kw):
    return run(args, interpret=False, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("ss", [False, True])
def test_gpu_kernels_match_reference(ss):
    """Both shipped kernels at a real shape (Flash heads, top-512, 4K context), the default
    splits, against the reference."""
    args = make_inputs(4, B=2, H=64, NB=64, MAXB=32, n_idx=512, t=(4000, 4095),
                       n_valid=(300, 512))
    assert rel_err(gpu_run(args, tuning=T(seesaw=ss)), reference(args)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("ss", [False, True])
def test_gpu_pool_edges_and_holes(ss):
    # the pool's last row, -1 holes, a block of -1; 1 and 2 splits (the merge)
    args = edge_inputs()
    for splits in (1, 2):
        out = gpu_run(args, tuning=T(splits=splits, seesaw=ss))
        assert np.isfinite(out).all() and rel_err(out, reference(args)) < 5e-3


@pytest.mark.gpu
def test_gpu_ids_past_the_table_read_its_last_entry():
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
    out = gpu_run((q, win, cmp, bt, jnp.asarray(idx), t, sink), tuning=T(splits=1))
    want = gpu_run((q, win, cmp, bt, jnp.asarray(clamped), t, sink), tuning=T(splits=1))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, want)


@pytest.mark.gpu
def test_gpu_ids_prefix_bounds_blocks_from_t():
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
            out = gpu_run(args, ids_prefix=True, tuning=T(splits=splits))
            assert np.isfinite(out).all()
            np.testing.assert_array_equal(out, gpu_run(args, tuning=T(splits=splits)))


@pytest.mark.gpu
def test_gpu_implicit_hca_ids():
    """idx_BK=None, hca_entries=K (the decode step's HCA layers): the producer derives the
    ids from t instead of reading hca_indices' list; the output is bit-identical to the
    list's, for a count below K (not a multiple of 64), t past the table (capped at K),
    t < 127 (no entry) and t = -1, at 1 and 2 splits."""
    q, win, cmp, bt, _, _, sink = make_inputs(7, B=4, H=64, NB=640, EPB=1, MAXB=150, n_idx=150,
                                              t=(1000, 5119, 100, 4000), n_valid=(0,) * 4)
    t = jnp.asarray([1000, 150 * 128 + 700, 100, -1], jnp.int32)  # 7, 150 (capped), 0, 0
    for splits in (1, 2):
        out = gpu_run((q, win, cmp, bt, None, t, sink), hca_entries=150, tuning=T(splits=splits))
        assert np.isfinite(out).all()
        want = gpu_run((q, win, cmp, bt, R.hca_indices(t, 150), t, sink), ids_prefix=True,
                       tuning=T(splits=splits))
        np.testing.assert_array_equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_seesaw_matches_double_k(kind):
    """The seesaw kernel (q.k once a block, P and the row statistics published through
    SMEM, q's rope columns from registers) gives double_k's output bit for bit: pool edges,
    -1 holes, a block of -1, t bounds, Flash and Pro head counts, in-kernel HCA ids, 1-3
    splits (0 to 11 key blocks a CTA, odd and even); both against the reference."""
    for args, hca, prefix, all_splits in _double_k_cases(kind):
        ref = reference(args, R.hca_indices(args[5], hca) if hca else None)
        for splits in all_splits:
            out, dk = (gpu_run(args, ids_prefix=prefix, hca_entries=hca,
                               tuning=T(splits=splits, seesaw=ss)) for ss in (True, False))
            assert np.isfinite(out).all()
            np.testing.assert_array_equal(out, dk)
            assert rel_err(out, ref) < 5e-3


@pytest.mark.gpu
def test_gpu_merge_kernel_matches_xla_merge():
    """On the GPU: the merge kernel against the float64 softmax and XLA's merge (equal up to
    the exp implementations: at most one bf16 step apart), and the whole op with the merge
    kernel against XLA's merge (2-5 splits, Flash and Pro heads)."""
    rng = np.random.default_rng(30)
    for NS, HP in ((2, 64), (5, 128), (10, 64)):
        o, lse, sink, want = _merge_case(rng, NS, 3, HP)
        out = np.asarray(jax.jit(merge_splits_kernel)(o, lse, sink), np.float32)
        xla = np.asarray(jax.jit(A.merge_splits)(o, lse, sink), np.float32)
        np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(out, xla, rtol=2 ** -7, atol=1e-6)
        assert np.mean(out != xla) < 1e-3
    for args in (edge_inputs(), make_inputs(9, B=2, H=128, NB=64, MAXB=32, n_idx=512,
                                            t=(4095, 2000), n_valid=(512, 300))):
        for splits in (2, 3, 5):
            out, xla = (gpu_run(args, tuning=T(splits=splits, merge_kernel=m))
                        for m in (True, False))
            assert np.isfinite(out).all()
            np.testing.assert_allclose(out, xla, rtol=2 ** -7, atol=1e-6)
            assert rel_err(out, reference(args)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("H,splits", [(64, None), (128, 3)])
def test_gpu_triton_matches_reference(H, splits):
    args = make_inputs(17, B=2, H=H, NB=64, MAXB=32, n_idx=512, t=(4000, 4095), n_valid=(300, 512))
    out = gpu_run(args, backend="triton", tuning=T(splits=splits))
    assert rel_err(out, reference(args)) < 5e-3
