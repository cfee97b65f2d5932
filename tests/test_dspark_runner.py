"""DSpark speculation as a runner mode (dsv4_jax/dspark_runner.py), CPU: the tiny preset cut
to three layers (SWA, CSA, HCA) with a 16-token window and a random DSpark drafter
(dspark.with_dspark: 3 stages reading layers 0..2, blocks of 5), weights from seeded
keys. The references are the non-speculative engine, the whole-sequence forward
(dspark.capture_hidden) for the rings, and the target distribution for the accept rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dsv4_jax import config, dspark as DS, dspark_runner as DR, params as P
from dsv4_jax import speculative as SP
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics
from dsv4_jax.dspark_runner import DSpark
from dsv4_jax.serve.sampling import SamplingParams
from dsv4_jax.serve.scheduler import Request, Scheduler, SchedulerConfig
from dsv4_jax.tokenizer import ByteTokenizer

F32 = Numerics(act_quant=False, dtype="float32")
W = 16   # window: the verify's 6 rows wrap the ring within a few steps


def _cfg():
    base = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                 num_hash_layers=1, sliding_window=W)
    return DS.with_dspark(base, markov_rank=32)


@pytest.fixture(scope="module")
def tiny():
    cfg = _cfg()
    return cfg, P.init_params(cfg, 5101)


def _engine(cfg, params, R=3):
    cs = CacheSpec.for_numerics(F32, max_requests=R, num_blocks=4 * R, max_blocks=3)
    return Engine(cfg, params, numerics=F32, cache_spec=cs, prefill_chunk=32, progress=False)


@pytest.fixture(scope="module")
def eng(tiny):
    return _engine(*tiny)


@pytest.mark.slow  # ~130 s (the scheduler and oracle-draft equalities stay)
def test_greedy_dspark_equals_plain_and_rings_match_the_whole_sequence(tiny, eng):
    """Greedy DSpark (the random drafter: its drafts are mostly rejected, every step rolls
    rows back) gives exactly plain greedy's tokens for three requests at different
    positions (one crosses the HCA block end 127, all cross CSA block ends and wrap the
    window). The drafter's rings then hold (request 0, wrapped many times), for every
    position of the sequence they keep, the rows dspark.commit makes from the
    whole-sequence forward (capture_hidden)."""
    cfg, params = tiny
    rng = np.random.default_rng(5102)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (120, 7, 40)]
    want = eng.generate(prompts, max_new_tokens=14)
    got = eng.generate(prompts, max_new_tokens=14, speculative_tokens="dspark")
    assert got == want
    acc = eng.acceptance
    assert len(acc["per_request"]) == 3 and 1 <= acc["overall"] <= cfg.dspark_block_size + 1
    assert eng.runner.dspark_programs()[1]._cache_size() == 1
    st = eng.runner.dstate
    kv, rpos = np.asarray(st["dsp_kv"]), np.asarray(st["dsp_pos"])
    checked = 0
    for s, (p, g) in list(enumerate(zip(prompts, got)))[:1]:   # slots in admission order
        # committed: every token fed (all but the last, which a step after the request
        # ended commits as its anchor when one ran); such a step's accepted drafts (at
        # most G) lie past the sequence
        seq = np.asarray(p + g, np.int32)
        top = min(int(rpos[s].max()), len(seq) - 1)
        assert top >= len(seq) - 2
        _, hid = DS.capture_hidden(params, jnp.asarray(seq)[None], cfg, F32)
        pos = jnp.arange(len(seq))[None]
        ref = DS.commit(params, DS.init_state(cfg, 1, jnp.float32), hid, pos,
                        jnp.ones_like(pos, bool), cfg, F32)
        rk, rp = np.asarray(ref["kv"])[:, 0], np.asarray(ref["pos"])[0]
        for w in range(W):
            if rp[w] <= top and rpos[s, w] < len(seq):
                assert rp[w] == rpos[s, w]
                scale = np.abs(rk[:, w]).max()
                np.testing.assert_allclose(kv[:, s, w], rk[:, w], rtol=1e-4, atol=1e-4 * scale)
                checked += 1
    assert W - cfg.dspark_block_size - 1 <= checked <= W


def test_oracle_drafts_are_accepted_and_output_stays_exact(tiny, monkeypatch):
    """A drafter that proposes the plain greedy continuation with a wrong token at a fixed
    random fifth of the positions: acceptance lengths 1 .. G+1 occur, the rejected rows
    are rolled back, and the output is still plain greedy's, token for token."""
    cfg, params = tiny
    e = _engine(cfg, params)
    rng = np.random.default_rng(5103)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (30, 9, 61)]
    n_new = 24
    want = e.generate(prompts, max_new_tokens=n_new)
    table = np.zeros((e.cs.max_requests, e.cs.capacity + 8), np.int32)
    for s, (p, w) in enumerate(zip(prompts, want)):   # slots in admission order
        table[s, :len(p) + len(w)] = p + w
    G, V = cfg.dspark_block_size, cfg.vocab_size
    wrong = jnp.asarray(rng.random(table.shape[1]) < 0.2)

    def oracle(params, state, anchor, anchor_pos, cfg, nm, draw=None, key=None):
        at = anchor_pos[:, None] + 1 + jnp.arange(G)[None]                  # [R, G]
        tok = jnp.take_along_axis(jnp.asarray(table), at, 1)
        tok = jnp.where(wrong[at], (tok + 1) % V, tok).astype(jnp.int32)
        return {"tokens": tok, "logits": None, "q": jax.nn.one_hot(tok, V),
                "confidence": jnp.zeros(tok.shape)}
    monkeypatch.setattr(DS, "draft", oracle)
    got, counts = [[] for _ in prompts], []
    for part in e.stream(prompts, max_new_tokens=n_new, speculative_tokens="dspark"):
        counts += list(np.bincount([i for i, _ in part], minlength=len(prompts)))
        for i, t in part:
            got[i].append(t)
    assert got == want
    assert e.acceptance["overall"] > 2
    assert {1, 3, G + 1} <= set(counts[len(prompts):]), counts


def test_scheduler_greedy_dspark_equals_engine(tiny, eng):
    """The serving scheduler in the DSpark mode: greedy requests (arriving while others
    run, more than the slots) give Engine's greedy tokens; a sampled request runs and
    repeats with its seed."""
    cfg, _ = tiny
    sch = Scheduler(eng, ByteTokenizer(cfg.vocab_size),
                    SchedulerConfig(speculative_tokens="dspark"), seed=0)
    assert sch.T == cfg.dspark_block_size + 1
    rng = np.random.default_rng(5104)
    prompts = [[int(t) for t in rng.integers(16, 272, n)] for n in (5, 37, 20, 9)]
    outs = {}
    for i, p in enumerate(prompts[:3]):
        outs[i] = []
        sch.submit(Request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           outs[i].append))
    sampled = [[], []]
    for o in sampled:
        sch.submit(Request(prompts[0], SamplingParams(temperature=1.0, top_k=30, seed=7,
                                                      max_tokens=10, ignore_eos=True), o.append))
    for _ in range(3):
        sch.step()
    outs[3] = []
    sch.submit(Request(prompts[3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       outs[3].append))
    sch.run_until_done()
    want = eng.generate(prompts, max_new_tokens=10, stop_ids=(), jit_loop=False)
    toks = lambda o: [t for x in o for t in x.token_ids]
    for i in range(len(prompts)):
        # (Engine stops at EOS; the requests ignore it)
        assert toks(outs[i])[:len(want[i])] == want[i] and len(toks(outs[i])) == 10, i
    assert toks(sampled[0]) == toks(sampled[1]) and len(toks(sampled[0])) == 10
    assert not sch.running and sch.bm.active.sum() == 0


def _chi2_pvalue(samples, p):
    counts = np.bincount(samples, minlength=len(p))
    return stats.chisquare(counts, counts.sum() * p / p.sum()).pvalue


@pytest.mark.slow  # ~65 s (the MTP accept rule's chi-square test stays)
def test_markov_drafts_and_accept_rule_keep_the_target_distribution():
    """The DSpark path's draws and accept rule (dspark_runner.draft_and_accept: the Markov
    head's sequential per-row draws, accept_rows with their q) on fixed target rows p,
    V = 6, G = 5, N = 20k rows: emitted token j (after j accepted drafts) is distributed
    as p_j (chi-square, p-value floor 1e-4). The same draws accepted against q without the
    Markov bias fail it: the check sees a wrong q."""
    cfg = _cfg()
    V, G, r, N = 6, cfg.dspark_block_size, 4, 20_000
    key = jax.random.key(5105)
    mk = DS._markov_key(cfg)
    params = {mk + "markov_w1.weight": jax.random.normal(jax.random.fold_in(key, 0), (V, r)),
              mk + "markov_w2.weight": jax.random.normal(jax.random.fold_in(key, 1), (V, r))}
    base = jax.random.normal(jax.random.fold_in(key, 2), (G, V))
    p_logits = jax.random.normal(jax.random.fold_in(key, 3), (G + 1, V)) * 1.5
    rows = {"temperature": jnp.full(N, 1.0), "top_k": jnp.zeros(N, jnp.int32),
            "top_p": jnp.ones(N), "min_p": jnp.zeros(N),
            "seed": jnp.zeros(N, jnp.uint32)}
    keys = jax.random.split(jax.random.fold_in(key, 4), N)
    anchor = jnp.full(N, 2, jnp.int32)
    tgt = jnp.broadcast_to(p_logits, (N, G + 1, V))
    f = jax.jit(lambda k: DR.draft_and_accept(params, jnp.broadcast_to(base, (N, G, V)),
                                              anchor, tgt, rows, k, cfg))
    drafts, q, out, n = map(np.asarray, f(keys))
    p = np.asarray(jax.nn.softmax(p_logits, -1), np.float64)
    assert n.min() >= 1 and n.max() <= G + 1 and (n >= 3).mean() > 0.05
    for j in range(3):
        assert _chi2_pvalue(out[n > j, j], p[j]) > 1e-4, j
    # the wrong q: the drafts' distribution without the Markov bias
    wrong = jax.nn.softmax(jnp.broadcast_to(base, (N, G, V)), -1)
    sub = lambda j: jax.vmap(lambda kk: jax.random.fold_in(kk, j))(keys)
    bad, m = map(np.asarray, jax.jit(SP.accept_rows)(rows, tgt, jnp.asarray(drafts), wrong,
                                                     sub(2), sub(3)))
    assert min(_chi2_pvalue(bad[m > j, j], p[j]) for j in range(2)) < 1e-6


@pytest.mark.slow  # ~45 s
def test_split_attention_equals_one_pass(tiny, eng):
    """verify_layers with each layer's attention in parts of 4 + 2 rows (what the kernels
    take) gives the residuals and the cache of the one 6-row pass, for requests whose rows
    cross a CSA block end, the HCA block end and the ring's wrap."""
    cfg, params = tiny
    rng = np.random.default_rng(5106)
    R = eng.cs.max_requests
    lens = [125, 14, 37][:R]
    T = cfg.dspark_block_size + 1
    for n in lens:
        eng.prefill(eng.bm.admit(n), rng.integers(0, cfg.vocab_size, n))
    try:
        eng.bm.ensure_many({s: n + T for s, n in enumerate(lens)})
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (R, T)), jnp.int32)
        args = (tokens, jnp.asarray(lens, jnp.int32), jnp.full(R, T, jnp.int32),
                jnp.asarray(eng.bm.table))
        run = jax.jit(lambda c, rows: SP.verify_layers(params, c, *args, cfg, eng.cs, F32,
                                                       attn_rows=rows)[:2],
                      static_argnums=1)
        Xa, ca = run(eng.cache, 0)
        Xb, cb = run(eng.cache, 4)
        np.testing.assert_allclose(np.asarray(Xb), np.asarray(Xa), rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):
            np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                       rtol=1e-5, atol=1e-5)
    finally:
        eng.release_all()


def test_base_checkpoint_is_refused(tiny):
    """A base-V4 config (an MTP block, no DSpark fields) and parameters without the drafter
    are refused with clear errors before any work."""
    cfg, params = tiny
    base = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                 num_hash_layers=1, sliding_window=W)
    e = _engine(base, P.init_params(base, 5107), R=1)
    with pytest.raises(ValueError, match="no DSpark drafter"):
        e.generate([[1, 2, 3]], max_new_tokens=2, speculative_tokens="dspark")
    assert not e.bm.active.any()
    with pytest.raises(ValueError, match="no DSpark drafter"):
        SchedulerConfig(speculative_tokens="dspark") and Scheduler(
            e, ByteTokenizer(base.vocab_size), SchedulerConfig(speculative_tokens="dspark"))
    no_drafter = {k: v for k, v in params.items() if not k.startswith("mtp.")}
    e2 = _engine(cfg, no_drafter, R=1)
    with pytest.raises(ValueError, match="have none"):
        e2.runner.set_mode(DSpark())
    with pytest.raises(ValueError, match="sliding_window"):
        DR.check(cfg.replace(sliding_window=cfg.dspark_block_size))


def test_cli_refuses_dspark_on_a_base_model_before_loading(capsys, monkeypatch):
    from dsv4_jax import cli
    monkeypatch.setattr(cli, "_load_params", lambda *a, **k: pytest.fail("weights loaded"))
    try:
        code = cli.main(["generate", "--prompt", "hi", "--speculative-tokens", "dspark"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-tokens dspark" in line and "no DSpark drafter" in line, line
