"""Speculative decoding with the MTP block (dsv4_jax/speculative.py), CPU, the tiny preset
cut to three layers (SWA, CSA, HCA; hash and routed MoE; the MTP block) with a 16-token
window, random weights drawn from seeded keys. The reference is always the non-speculative engine (or the whole-sequence
forward for the MTP block)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dsv4_jax import config, decode as D, model as M, params as P, speculative as SP
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine, Greedy, MinP, Temperature, TopK, TopP
from dsv4_jax.quant import Numerics
from dsv4_jax.serve.sampling import TOP_LOGPROBS, RowSampler

F32 = Numerics(act_quant=False, dtype="float32")
W = 16   # window: the verify rows wrap the ring within a few steps


@pytest.fixture(scope="module")
def tiny():
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1, sliding_window=W)
    return cfg, P.init_params(cfg, 3801)


def _engine(cfg, params, R=4, nm=F32, **kw):
    cs = CacheSpec.for_numerics(nm, max_requests=R, num_blocks=4 * R, max_blocks=3, **kw)
    return Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=32, progress=False)


def _leaves(tree):
    return [(jax.tree_util.keystr(p), np.asarray(a))
            for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_verify_rollback_equals_stepping_only_the_kept_rows(tiny):
    """Verify k+1 = 4 rows of every request, then roll back to its first `keep` rows: the
    cache is bit for bit the cache of a step fed only those rows (same program shape), for
    requests whose rows cross a CSA block end, the HCA block end (token 127) and the
    ring's wrap-around; the kept rows' residuals are the same too."""
    cfg, params = tiny
    eng = _engine(cfg, params)
    rng = np.random.default_rng(3802)
    lens = [126, 125, 3 + int(rng.integers(0, 4)), 37 + int(rng.integers(0, 4))]
    for n in lens:
        eng.prefill(eng.bm.admit(n), rng.integers(0, cfg.vocab_size, n))
    T = 4
    eng.bm.ensure_many({s: n + T for s, n in enumerate(lens)})
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, T)), jnp.int32)
    pos = jnp.asarray(lens, jnp.int32)
    keep = jnp.asarray([1, 3, 2, 4], jnp.int32)   # includes all-rejected and all-accepted
    table = jnp.asarray(eng.bm.table)
    cache0 = jax.tree.map(jnp.copy, eng.cache)

    @jax.jit
    def spec(cache):
        X, c, undo = SP.verify_layers(params, cache, tokens, pos, jnp.full(4, T, jnp.int32),
                                      table, cfg, eng.cs, F32)
        return X, undo(c, keep)

    @jax.jit
    def plain(cache):
        X = M.embed(params, tokens, cfg, F32)
        return D.step_layers(params, cache, X, tokens, jnp.arange(4), pos, keep, table,
                             range(cfg.num_hidden_layers), cfg, eng.cs, F32)

    Xa, ca = spec(cache0)
    Xb, cb = plain(cache0)
    changed = 0
    for (pa, a), (pb, b), (_, o) in zip(_leaves(ca), _leaves(cb), _leaves(cache0)):
        assert pa == pb
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"cache {pa} differs"
        changed += not np.array_equal(a.view(np.uint8), o.view(np.uint8))
    assert changed >= 6   # the kept rows did write (ring, positions, pools, state)
    for b in range(4):
        k = int(keep[b])
        np.testing.assert_array_equal(np.asarray(Xa)[b, :k], np.asarray(Xb)[b, :k])


@pytest.mark.parametrize("sampler", [Temperature(0.7), TopK(5, 1.3), TopP(0.8), MinP(0.1)])
def test_sampler_logits_draw_what_the_sampler_draws(sampler):
    """speculative.sampler_logits is each sampler's distribution: categorical over it with
    a key gives the sampler's own token for that key."""
    key = jax.random.key(3803)
    logits = jax.random.normal(jax.random.fold_in(key, 0), (64, 50)) * 3
    for i in range(4):
        kk = jax.random.fold_in(key, i + 1)
        want = sampler.get_next_tokens(logits, kk)
        got = jax.random.categorical(kk, SP.sampler_logits(sampler, logits), -1)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _emitted(rule, p_logits, q, key, N):
    """N independent speculative steps with fixed target rows p (V small) and draft
    distributions q [k, V]: -> (out [N, k+1], n [N])."""

    def one(kk):
        kd, ka = jax.random.split(kk)
        d = jax.random.categorical(kd, jnp.log(q), -1).astype(jnp.int32)    # [k]
        out, n = rule(Temperature(1.0), p_logits[None], d[None], q[None], ka)
        return out[0], n[0]
    return jax.vmap(one)(jax.random.split(key, N))


def _chi2_pvalue(samples, p):
    counts = np.bincount(samples, minlength=len(p))
    p = p / p.sum()
    return stats.chisquare(counts, counts.sum() * p).pvalue


def test_rejection_sampling_keeps_the_target_distribution():
    """Tiny vocabulary (V = 6), k = 2 drafts from distributions q far from the targets p:
    the first emitted token is distributed as p_0, and the second (after an accepted first
    draft) as p_1 (chi-square, N = 200k, seeded; p-value floor 1e-4). A wrong rule (bonus
    drawn from p instead of the residual max(p - q, 0)) fails the same check, so the check
    has the power to see a broken acceptance."""
    key = jax.random.key(3804)
    V, k, N = 6, 2, 200_000
    p_logits = jax.random.normal(jax.random.fold_in(key, 0), (k + 1, V)) * 1.5
    q = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 1), (k, V)) * 1.5, -1)
    p = np.asarray(jax.nn.softmax(p_logits, -1), np.float64)
    out, n = map(np.asarray, _emitted(SP.accept, p_logits, q, jax.random.fold_in(key, 2), N))
    assert 1 <= n.min() and n.max() <= k + 1 and (n > 1).mean() > 0.2
    assert _chi2_pvalue(out[:, 0], p[0]) > 1e-4
    assert _chi2_pvalue(out[n >= 2, 1], p[1]) > 1e-4

    def wrong(sampler, logits, drafts, q_, kk):   # bonus from p, not from the residual
        o, m = SP.accept(sampler, logits, drafts, q_, kk)
        b = jax.random.categorical(jax.random.fold_in(kk, 9), logits[:, 0], -1)
        return jnp.where(jnp.arange(k + 1)[None] == m[:, None] - 1,
                         jnp.where(m[:, None] == 1, b[:, None], o), o), m
    bad, _ = map(np.asarray, _emitted(wrong, p_logits, q, jax.random.fold_in(key, 2), N))
    assert _chi2_pvalue(bad[:, 0], p[0]) < 1e-6


def test_greedy_accept_counts_the_matching_drafts():
    rng = np.random.default_rng(3805)
    logits = jnp.asarray(rng.standard_normal((5, 4, 30)), jnp.float32)
    tgt = np.asarray(jnp.argmax(logits, -1))
    match = [0, 3, 1, 2, 3]                      # leading drafts equal to the argmax
    drafts = np.array([(tgt[b, :3] + (np.arange(3) >= m)) % 30 for b, m in enumerate(match)])
    out, n = SP.accept(Greedy(), logits, jnp.asarray(drafts, jnp.int32), None, None)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(match) + 1)
    np.testing.assert_array_equal(np.asarray(out), tgt)


@pytest.fixture(scope="module")
def eng(tiny):
    """One engine (3 request slots) for the tests below: its programs compile once."""
    cfg, params = tiny
    return _engine(cfg, params, R=3)


def test_greedy_speculative_generation_equals_plain(tiny, eng):
    """Greedy with k = 2 chained drafts gives exactly the tokens of greedy without, for a
    batch of three requests at different positions: one crosses the HCA block end (127),
    every one crosses CSA block ends and wraps the 16-token window many times. Run twice
    (other prompt lengths, positions and acceptance): the step compiles once; the
    acceptance report has one entry per request."""
    cfg, params = tiny
    rng = np.random.default_rng(3807)
    for rep, lens in enumerate([(120, 7, 30), (5, 61, 118)]):
        prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in lens]
        want = eng.generate(prompts, max_new_tokens=18)
        got = eng.generate(prompts, max_new_tokens=18, speculative_tokens=2)
        assert got == want
        acc = eng.acceptance
        assert len(acc["per_request"]) == 3 and 1 <= acc["overall"] <= 3
        assert all(3 * s >= len(g) - 1 for s, g in zip(acc["steps"], got)), acc
        prefill, step = eng.runner.spec_programs(RowSampler(TOP_LOGPROBS), 2)
        assert step._cache_size() == 1 and prefill._cache_size() == 1
    # streamed: the same tokens, 1 .. k+1 per request and step
    streamed = [[] for _ in prompts]
    for part in eng.stream(prompts, max_new_tokens=18, speculative_tokens=2):
        assert all(c <= 3 for c in np.bincount([i for i, _ in part]))
        for i, t in part:
            streamed[i].append(t)
    assert streamed == want


@pytest.mark.slow  # ~35 s (the accept rule's distribution test stays)
def test_sampled_speculative_generation_runs(tiny, eng):
    """Sampled: every request gets its tokens (the distribution is checked on the
    acceptance rule above), seeded runs repeat."""
    cfg, _ = tiny
    rng = np.random.default_rng(3808)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (9, 40)]
    a = eng.generate(prompts, max_new_tokens=6, sampler=TopK(20), seed=3,
                     speculative_tokens=2)
    b = eng.generate(prompts, max_new_tokens=6, sampler=TopK(20), seed=3,
                     speculative_tokens=2)
    assert a == b and [len(x) for x in a] == [6, 6]
    assert all(0 <= t < cfg.vocab_size for x in a for t in x)


@pytest.mark.parametrize("k", [-1, 4, 1.5, True])
def test_bad_draft_count_is_refused_before_any_work(tiny, eng, k):
    with pytest.raises(ValueError, match=r"speculative tokens must be an integer in \[1, 3\]"):
        eng.generate([[1, 2, 3]], max_new_tokens=2, speculative_tokens=k)
    assert not eng.bm.active.any()


def test_checkpoint_without_mtp_block_is_refused(tiny):
    cfg, params = tiny
    no_mtp = {k: v for k, v in params.items() if not k.startswith("mtp.")}
    e = _engine(cfg, no_mtp, R=1)
    with pytest.raises(ValueError, match="has none"):
        e.generate([[1, 2, 3]], max_new_tokens=2, speculative_tokens=1)
    assert not e.bm.active.any()


def _cli(argv):
    from dsv4_jax import cli
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("extra, needles", [
    (["--speculative-tokens", "4"], ["--speculative-tokens", "[1, 3]"]),
    (["--speculative-tokens", "-1"], ["--speculative-tokens", "[1, 3]"]),
    (["--speculative-tokens", "1", "--devices", "1", "--layout", "pipeline"],
     ["--speculative-tokens", "pipeline"]),
])
def test_generate_flag_is_checked_before_loading(capsys, monkeypatch, extra, needles):
    from dsv4_jax import cli

    def fail(*a, **k):
        raise AssertionError("weights were loaded before the flags were checked")
    monkeypatch.setattr(cli, "_load_params", fail)
    assert _cli(["generate", "--prompt", "hi", *extra]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(n in line for n in needles), line


def test_generate_refuses_a_checkpoint_without_mtp_before_loading(tmp_path, capsys,
                                                                 monkeypatch):
    import json
    from checkpoints.convert import MANIFEST
    from dsv4_jax import cli
    monkeypatch.setattr(cli, "_load_params", lambda *a, **k: pytest.fail("weights loaded"))
    d = tmp_path / "ckpt"
    d.mkdir()
    hf = config.tiny().to_hf_dict()
    hf.update(num_nextn_predict_layers=0, compress_ratios=hf["compress_ratios"][:-1])
    (d / "config.json").write_text(json.dumps(hf))
    (d / MANIFEST).write_text("{}")
    assert _cli(["generate", "--checkpoint", str(d), "--speculative-tokens", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-tokens" in line and "MTP block" in line, line


@pytest.mark.parametrize("argv, needle", [(["--speculative-tokens", "5"], "[1, 3]"),
                                          (["--accept-rates", "1.5"], "--accept-rates")])
def test_bench_flags_are_checked_first(capsys, monkeypatch, argv, needle):
    from benchmarks import decode_bench
    monkeypatch.setattr(decode_bench, "copy_bandwidth",
                        lambda *a, **k: pytest.fail("the bench started before its flags were checked"))
    assert _cli(["bench", "decode", "--preset", "tiny", *argv]) == 2
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]
