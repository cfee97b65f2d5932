"""Quantised matmuls in XLA (the path the weight-streaming kernels replace) and the
expert tile schedule of the decode MoE: checked against numpy restatements in float64 and
against the dense per-expert loop, on fresh random data."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, layers as L, params as P, quant as Q
from dsv4_jax.layers import experts as LE
from dsv4_jax.quant import Numerics

F32 = Numerics(act_quant=False, dtype="float32")
BF16_SIM = Numerics(act_quant=True, dtype="bfloat16")
SEED = 44


def _weight(fmt, E, N, K, rng):
    W = (rng.standard_normal((E, N, K)) * rng.uniform(0.01, 3, (E, N, 1))).astype(np.float32)
    if fmt == "fp8":
        return Q.Fp8Weight(*map(jnp.asarray, Q.encode_fp8_np(W)))
    if fmt == "fp4":
        return Q.Fp4Weight(*map(jnp.asarray, Q.encode_fp4_np(W)))
    return Q.NvFp4Weight(*map(jnp.asarray, Q.encode_nvfp4_np(W)))


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "nvfp4"])
@pytest.mark.parametrize("nm", [F32, BF16_SIM], ids=["f32", "bf16-sim"])
def test_grouped_linear_matches_numpy(fmt, nm):
    rng = np.random.default_rng(SEED)
    E, G, M, N, K = 3, 5, 4, 256, 256
    w = _weight(fmt, E, N, K, rng)
    Wd = np.asarray(Q.dequant(w, jnp.float32), np.float64)  # exact dequantisation
    experts = np.array([2, -1, 0, 2, 7], np.int32)  # repeated, empty (-1, >= E)
    x = rng.standard_normal((G, M, K)).astype(np.float32)
    if nm.act_quant:
        x = np.asarray(Q.fp8_block_sim(jnp.asarray(x), 128))
    got = np.asarray(Q.grouped_linear(jnp.asarray(x, nm.jdtype), jnp.asarray(experts), w, nm))
    xr = np.asarray(jnp.asarray(x, nm.jdtype).astype(jnp.float32), np.float64)
    for g, e in enumerate(experts):
        if 0 <= e < E:
            ref = xr[g] @ Wd[e].T
            np.testing.assert_allclose(got[g], ref, rtol=0, atol=2e-6 * np.abs(ref).max())
        else:
            assert (got[g] == 0).all(), "an empty group must give zero rows"


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "nvfp4"])
def test_linear_bf16_operands_are_exact(fmt):
    """With the FP8 activation simulation on, bf16 operands lose nothing: the bf16 path
    equals float64 math on the simulated activations and dequantised weights."""
    rng = np.random.default_rng(SEED)
    w = jax.tree.map(lambda a: a[0], _weight(fmt, 1, 384, 512, rng))
    x = jnp.asarray(rng.standard_normal((3, 7, 512)) * 5, jnp.float32)
    got = np.asarray(Q.linear(x, w, Numerics(True, "float32"), out_dtype=jnp.float32))
    xs = np.asarray(Q.fp8_block_sim(x, 128), np.float64)
    ref = xs @ np.asarray(Q.dequant(w, jnp.float32), np.float64).T
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    assert Numerics(True, "float32").bf16_operands and not F32.bf16_operands


def test_numerics_rejects_bad_values():
    with pytest.raises(ValueError, match="matmul"):
        Numerics(matmul="cuda")
    with pytest.raises(ValueError, match="dtype"):
        Numerics(dtype="float16")


@pytest.mark.parametrize("tile", [1, 8])
def test_expert_schedule_places_every_pair_once(tile):
    rng = np.random.default_rng(SEED)
    E, N, k = 16, 37, 4
    idx = rng.integers(-2, E + 2, (N, k))  # includes invalid ids
    idx[:10] = rng.integers(0, 2, (10, k))  # heavy repeats: experts 0/1 get many tiles
    slot_expert, slot, row, tok = map(np.asarray, L.expert_schedule(jnp.asarray(idx), E, tile))
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    np.testing.assert_array_equal(tok, np.arange(N * k) // k)
    assert row.max() < tile
    np.testing.assert_array_equal(slot_expert[slot[valid]], flat[valid])  # right expert
    assert (slot_expert[slot[~valid]] == -1).all()  # invalid pairs: no expert read
    cells = set(zip(slot[valid].tolist(), row[valid].tolist()))
    assert len(cells) == valid.sum(), "two pairs share a tile row"
    used = np.unique(slot_expert[slot_expert >= 0], return_counts=True)
    for e, n_tiles in zip(*used):  # each expert's pairs fill ceil(count / tile) tiles
        assert n_tiles == -(-(flat == e).sum() // tile)


@pytest.mark.parametrize("tile", [1, 8, "pairs"])
def test_scheduled_moe_equals_dense_loop(tiny_model, tile):
    """Expert tiles of 1 or 8 rows, and one group per (token, expert) pair."""
    cfg, params = tiny_model
    fp = P.block_params(params, "layers.3.ffn.")
    rng = np.random.default_rng(SEED)
    E, k, N = cfg.n_routed_experts, cfg.num_experts_per_tok, 11
    x = jnp.asarray(rng.standard_normal((N, cfg.hidden_size)), jnp.float32)
    idx = rng.integers(0, E, (N, k))
    idx[:5, 0] = -1  # another device's experts (expert parallelism): combine nothing
    w = jnp.asarray(rng.uniform(0.1, 1, (N, k)), jnp.float32)
    if tile == "pairs":
        got = LE._moe_pairs(fp, x, jnp.asarray(idx), w, cfg, F32)
    else:
        got = LE._moe_scheduled(fp, x, jnp.asarray(idx), w, cfg, F32, tile)
    comb = np.zeros((N, E), np.float32)
    for n in range(N):
        for j in range(k):
            if idx[n, j] >= 0:
                comb[n, idx[n, j]] += float(w[n, j])
    sub = lambda name, e: jax.tree.map(lambda a: a[e], fp[name])
    ref = sum(L.expert_ffn(sub("experts.w1", e), sub("experts.w2", e), sub("experts.w3", e),
                           x, jnp.asarray(comb[:, e]), cfg, F32) for e in range(E))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                               atol=1e-5 * float(jnp.abs(ref).max()))


def test_head_logits_split_equals_float64():
    """The bf16 head reads W once as stored; the 3-way bf16 split of y loses nothing."""
    from dsv4_jax.quant import f32_dot_bf16 as head_logits
    rng = np.random.default_rng(SEED)
    W = jnp.asarray(rng.standard_normal((1000, 256)) * 0.05, jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((2, 3, 256)) * rng.uniform(0.1, 10), jnp.float32)
    ref = np.asarray(y, np.float64) @ np.asarray(W.astype(jnp.float32), np.float64).T
    got = np.asarray(head_logits(y, W))
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-6 * np.abs(ref).max())
    one_part = np.asarray(jnp.einsum("...d,vd->...v", y.astype(jnp.bfloat16), W,
                                     preferred_element_type=jnp.float32))
    assert np.abs(one_part - ref).max() > 10 * np.abs(got - ref).max()  # the split matters


def test_flash_decode_step_lowers_for_cuda_with_matmul_kernels():
    """Full-width Flash layers (SWA + CSA + HCA) with the weight-streaming kernels lower for
    CUDA on this CPU machine; layers of equal shapes share one lowered kernel each."""
    import functools
    import re
    from dsv4_jax.cache import CacheSpec, cache_structs
    from dsv4_jax.decode import step
    cfg = config.get_preset("flash")
    cfg = cfg.replace(num_hidden_layers=4, compress_ratios=(0, 0, 4, 128, 0), num_hash_layers=0)
    nm = Numerics(True, "bfloat16", matmul="pallas")
    B, mb = 2, 33
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    f = jax.jit(functools.partial(step, cfg=cfg, cs=cs, nm=nm), donate_argnums=(1,))
    txt = f.trace(P.abstract_params(cfg, include_mtp=False), cache_structs(cfg, cs), i32(B, 1),
                  i32(B), i32(B), i32(B), i32(B, mb)).lower(
                      lowering_platforms=("cuda",)).as_text()
    kernels = re.findall(r"stablehlo.custom_call @mosaic_gpu", txt)
    # distinct (format, shape) kernels: wq_a, wq_b, wkv, wo_a, wo_b, shared w1/w3 (one),
    # shared w2, indexer wq_b, experts w1/w3 (one), experts w2 -> at most ~10, not 4 x that
    assert 6 <= len(kernels) <= 12, len(kernels)


@pytest.mark.slow  # ~40 s: interpreted kernels in the layers
def test_model_layers_through_the_kernel():
    """The model's kernel call sites (dense linears with rows padded to 8, wo_a as 2 groups,
    routed FP4 experts in expert tiles with empty tiles) on the Mosaic-GPU interpreter equal
    the XLA path. bf16 activations: outputs rounded to bf16 between ops, hence 1e-2."""
    cfg = config.tiny().replace(hidden_size=512, moe_intermediate_size=512, num_hidden_layers=1,
                                compress_ratios=(0, 0), num_hash_layers=0)
    params = P.init_params(cfg, SEED)
    rng = np.random.default_rng(SEED)
    xla, ker = (Numerics(False, "bfloat16", matmul=m) for m in ("xla", "interpret"))
    ap = P.block_params(params, "layers.0.attn.")
    fp = P.block_params(params, "layers.0.ffn.")
    x = jnp.asarray(rng.standard_normal((1, 3, cfg.hidden_size)), jnp.bfloat16)

    def close(f, tol):
        # the interpreted kernel runs jax ops inside its callbacks: as one jitted program,
        # waited for, so no other op is dispatched while it runs (ops in flight at the same
        # time can deadlock the CPU client; seen in test_kernel_decode when run op by op)
        a = np.asarray(jax.block_until_ready(jax.jit(lambda: f(ker))()), np.float32)
        b = np.asarray(f(xla), np.float32)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), np.linalg.norm(a - b) / np.linalg.norm(b)

    close(lambda nm: Q.linear(x, ap["wq_a"], nm, out_dtype=jnp.float32), 2e-6)
    H, K = cfg.num_attention_heads, cfg.head_dim
    o = jnp.asarray(rng.standard_normal((1, 3, H, K)), jnp.float32)
    pos = jnp.arange(3)[None]
    freqs = jnp.asarray(L.rope_freqs(cfg, 0))
    close(lambda nm: L.attn_output(ap, o, pos, freqs, cfg, nm), 1e-2)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    idx = jnp.asarray(rng.integers(0, E, (3, k)))
    w = jnp.asarray(rng.uniform(0.1, 1, (3, k)), jnp.float32)
    assert Q._kernel_ok(fp["experts.w1"], ker)  # FP4, K = 512: the kernel takes it
    close(lambda nm: LE._moe_scheduled(fp, x[0], idx, w, cfg, nm, 8), 1e-2)
    close(lambda nm: LE._moe_pairs(fp, x[0], idx.at[1, 2].set(-1), w, cfg, nm), 1e-2)


def test_many_rows_stay_in_xla():
    """Prefill-sized row counts (> KERNEL_MAX_ROWS) take the XLA path even when the kernel
    is asked for (the kernel takes at most 256 rows; the interpreter would raise)."""
    rng = np.random.default_rng(SEED)
    w = jax.tree.map(lambda a: a[0], _weight("fp8", 1, 256, 256, rng))
    x = jnp.asarray(rng.standard_normal((3, 100, 256)), jnp.bfloat16)  # 300 rows
    a = Q.linear(x, w, Numerics(False, "bfloat16", matmul="interpret"), out_dtype=jnp.float32)
    b = Q.linear(x, w, Numerics(False, "bfloat16", matmul="xla"), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ex = jnp.zeros((1,), jnp.int32)
    wE = jax.tree.map(lambda a: a[None], w)
    a = Q.grouped_linear(x.reshape(1, 300, 256), ex, wE, Numerics(False, "bfloat16", matmul="interpret"))
    b = Q.grouped_linear(x.reshape(1, 300, 256), ex, wE, Numerics(False, "bfloat16", matmul="xla"))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
