"""Continuous batching (serve.scheduler) and per-request sampling as data
(serve.sampling), on the tiny model (one layer of each kind) without HTTP.

One engine and one warmed-up scheduler per module: CPU compilation is most of the time.
Greedy requests are checked against Engine.generate on the same prompts (the fixed-batch
path: its own stream program, no scheduler)."""
import dataclasses

import numpy as np
import pytest

from dsv4_jax import config, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics
from dsv4_jax.serve import metrics as MX
from dsv4_jax.serve.sampling import (TOP_LOGPROBS, SamplingParams, filter_logits, sample_rows)
from dsv4_jax.serve.scheduler import Request, RequestError, Scheduler, SchedulerConfig
from dsv4_jax.tokenizer import ByteTokenizer

R, CHUNK = 4, 16


@pytest.fixture(scope="module")
def sched():
    """The tiny preset cut to one layer of each kind (SWA with hash routing, CSA, HCA):
    scheduling does not depend on the depth, compilation does."""
    cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                num_hash_layers=1)
    params = P.init_params(cfg, 501)
    MX.watch_lowerings()
    cs = CacheSpec.for_numerics(Numerics(), max_requests=R, num_blocks=6, max_blocks=2)
    eng = Engine(cfg, params, cache_spec=cs, prefill_chunk=CHUNK, progress=False)
    sch = Scheduler(eng, ByteTokenizer(cfg.vocab_size), seed=0)
    sch.warm_up()
    return sch


def collect(sch, prompt, sp):
    """Submit -> the list the request's Outputs are appended to."""
    outs = []
    sch.submit(Request(prompt, sp, outs.append))
    return outs


def tokens(outs):
    return [t for o in outs for t in o.token_ids]


def prompts_of(rng, lengths):
    return [[int(t) for t in rng.integers(16, 272, n)] for n in lengths]


# ---- the sampler ------------------------------------------------------------------------
def reference_allowed(logits, temp, k, p, min_p):
    """numpy: the tokens row `logits` may draw under temperature -> top-k -> top-p -> min-p."""
    lg = logits.astype(np.float64) / (temp if temp > 0 else 1.0)
    allowed = np.ones(lg.shape, bool)
    if 0 < k < len(lg):
        allowed &= lg >= np.sort(lg)[::-1][k - 1]
    if p < 1:
        pr = np.where(allowed, np.exp(lg - lg[allowed].max()), 0)
        pr /= pr.sum()
        order = np.argsort(-pr, kind="stable")
        before = np.cumsum(pr[order]) - pr[order]
        keep = order[before < p]
        allowed &= pr >= pr[keep].min()
    if min_p > 0:
        pr = np.where(allowed, np.exp(lg - lg[allowed].max()), 0)
        allowed &= pr >= min_p * pr.max()
    return allowed


def test_filters_and_draws_match_a_numpy_reference():
    rng = np.random.default_rng(500)
    B, V = 8, 1024
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    rows = {"temperature": np.array([0, 1, .7, 1.3, .5, 1, 2, 1], np.float32),
            "top_k": np.array([0, 5, 0, 0, 40, 1, 0, 20], np.int32),
            "top_p": np.array([1, 1, .8, 1, .9, 1, .3, .95], np.float32),
            "min_p": np.array([0, 0, 0, .2, 0, 0, 0, .05], np.float32),
            "seed": rng.integers(0, 2**32, B, dtype=np.uint32)}
    lg = np.asarray(filter_logits(logits, rows["temperature"], rows["top_k"], rows["top_p"],
                                  rows["min_p"]))
    for b in range(B):
        want = reference_allowed(logits[b], *(rows[f][b] for f in
                                              ("temperature", "top_k", "top_p", "min_p")))
        np.testing.assert_array_equal(np.isfinite(lg[b]), want, err_msg=f"row {b}")
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for step in range(5):
        tok, tlp, top_ids, top_lp = map(np.asarray, sample_rows(
            logits, rows, np.full(B, step, np.int32), n_top=TOP_LOGPROBS))
        assert tok[0] == logits[0].argmax() and tok[5] == logits[5].argmax()   # greedy, k=1
        assert all(np.isfinite(lg[b, tok[b]]) for b in range(B))
        np.testing.assert_allclose(tlp, logp[np.arange(B), tok], atol=1e-4)
        np.testing.assert_array_equal(top_ids, np.argsort(-logits, -1)[:, :TOP_LOGPROBS])
        np.testing.assert_allclose(top_lp, np.take_along_axis(logp, top_ids, -1), atol=1e-4)


def test_sampling_settings_are_data_not_programs():
    rng = np.random.default_rng(501)
    logits = rng.standard_normal((R, 1024)).astype(np.float32)
    before = None
    for t in range(6):
        rows = {"temperature": rng.uniform(0, 2, R).astype(np.float32),
                "top_k": rng.integers(0, 50, R).astype(np.int32),
                "top_p": rng.uniform(.1, 1, R).astype(np.float32),
                "min_p": rng.uniform(0, .3, R).astype(np.float32),
                "seed": rng.integers(0, 2**32, R, dtype=np.uint32)}
        sample_rows(logits, rows, np.full(R, t, np.int32), n_top=TOP_LOGPROBS)
        before = before or sample_rows._cache_size()
    assert sample_rows._cache_size() == before


def test_bad_sampling_values_are_refused():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
               {"min_p": 2}, {"max_tokens": 0}, {"top_logprobs": TOP_LOGPROBS + 1},
               {"temperature": float("nan")}, {"temperature": "1"}, {"stop": ("",)}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


# ---- the scheduler ----------------------------------------------------------------------
def test_continuous_batching_greedy_equals_engine(sched):
    """More requests than slots, arriving while others run, prompts over several prefill
    chunks, greedy next to sampled rows: every greedy request gives Engine's tokens, and
    no step compiles a program."""
    eng = sched.eng
    rng = np.random.default_rng(502)
    prompts = prompts_of(rng, (5, 37, 20, 9, 50, 3, 18))
    n_new = 10
    calls = []
    run = sched._execute
    sched._execute = lambda b: (calls.append((sched.steps, bool(b.prefill), bool(b.run))),
                                run(b))[1]
    lowered = MX.lowerings()
    try:
        outs = {}
        for i, p in enumerate(prompts[:3]):
            outs[i] = collect(sched, p, SamplingParams(temperature=0, max_tokens=n_new))
        sampled = [collect(sched, prompts[0], SamplingParams(
            temperature=1.5, top_k=k, top_p=p, min_p=m, seed=s, max_tokens=n_new))
            for k, p, m, s in ((0, .9, 0, 1), (30, 1, .1, 2))]
        for _ in range(4):   # the rest arrive while the first ones run
            sched.step()
        for i, p in enumerate(prompts[3:], 3):
            outs[i] = collect(sched, p, SamplingParams(temperature=0, max_tokens=n_new))
        sched.run_until_done()
    finally:
        sched._execute = run
    assert MX.lowerings() == lowered
    want = eng.generate(prompts, max_new_tokens=n_new, jit_loop=False)
    for i in range(len(prompts)):
        assert tokens(outs[i]) == want[i], f"request {i}"
        assert outs[i][-1].finish_reason in ("stop", "length")
    assert all(len(tokens(o)) == n_new for o in sampled)
    # prefill chunks of new requests ran in the same scheduler steps as decode steps
    assert any(pre and dec for _, pre, dec in calls)
    assert not sched.running and sched.bm.active.sum() == 0
    assert len(sched.bm.free) == sched.cs.num_blocks


def test_seeded_draws_do_not_depend_on_the_batch(sched):
    rng = np.random.default_rng(503)
    p, others = prompts_of(rng, (12,)), prompts_of(rng, (30, 7, 21))
    sp = SamplingParams(temperature=1.0, top_p=.95, seed=1234, max_tokens=8, ignore_eos=True)
    alone = collect(sched, p[0], sp)
    sched.run_until_done()
    for o in others:
        collect(sched, o, dataclasses.replace(sp, seed=7))
    crowded = collect(sched, p[0], sp)
    other_seed = collect(sched, p[0], dataclasses.replace(sp, seed=99))
    sched.run_until_done()
    assert tokens(alone) == tokens(crowded)
    assert tokens(alone) != tokens(other_seed)


def test_stop_ids_stop_strings_and_logprobs(sched):
    rng = np.random.default_rng(504)
    p = prompts_of(rng, (25,))[0]
    ref = sched.eng.generate([p], max_new_tokens=8, jit_loop=False)[0]
    assert len(ref) == 8
    tok = sched.tok
    by_id = collect(sched, p, SamplingParams(temperature=0, max_tokens=8,
                                             stop_token_ids=(ref[3],)))
    stop = tok.decode([ref[5]])
    by_text = collect(sched, p, SamplingParams(temperature=0, max_tokens=8, stop=(stop,),
                                               logprobs=True, top_logprobs=3))
    sched.run_until_done()
    assert tokens(by_id) == ref[:ref.index(ref[3]) + 1]
    assert by_id[-1].finish_reason == "stop"
    # the stop id's text is not output
    assert "".join(o.text for o in by_id) == tok.decode(ref[:ref.index(ref[3])])
    text = "".join(o.text for o in by_text)
    assert by_text[-1].finish_reason == "stop"
    assert text == tok.decode(ref)[:tok.decode(ref).find(stop)] and stop not in text
    lps = [x for o in by_text for x in o.logprobs]
    assert [x.token for x in lps] == tokens(by_text)
    for x in lps:   # greedy: the token is the likeliest, listed first
        assert len(x.top) == 3 and x.top[0] == (x.token, pytest.approx(x.logprob))
        assert x.top[0][1] >= x.top[1][1] >= x.top[2][1]


def test_blocks_grow_with_requests_and_preemption_recomputes(sched):
    """Requests whose prompt + max_tokens need 3x the pool's 6 blocks (2 blocks each):
    blocks are allocated as requests grow, the youngest is preempted when the pool runs
    out (and prefilled again with its generated tokens), and every greedy output equals
    the request run alone; no step compiles a program."""
    from dsv4_jax.cache import blocks_needed
    rng = np.random.default_rng(505)
    n_new = 48                       # each request reaches 2 blocks (>= 132 tokens)
    # the reference: Engine.generate, three prompts at a time (their 2 blocks each fill
    # the pool; the engine's batch is R rows whatever it holds, so a row's tokens do not
    # depend on the others); prompts whose greedy run does not meet EOS first
    cand = prompts_of(rng, rng.integers(90, 116, 12))
    alone = [w for i in range(0, len(cand), 3)
             for w in sched.eng.generate(cand[i:i + 3], max_new_tokens=n_new)]
    ps, want = [], []
    for p, w in zip(cand, alone):
        if len(w) == n_new and len(ps) < 9:
            ps.append(p)
            want.append(w)
    assert all(blocks_needed(sched.eng.cfg, len(p)) == 1 < blocks_needed(sched.eng.cfg, len(p) + n_new)
               for p in ps)
    assert sum(blocks_needed(sched.eng.cfg, len(p) + n_new) for p in ps) >= 3 * sched.cs.num_blocks
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    lowered = MX.lowerings()
    pre0 = sched.preemptions
    outs = [collect(sched, p, sp) for p in ps]
    sched.step()
    # admission holds only the prompts' blocks: more requests run than full reservations fit
    assert len(sched.running) == R > sched.cs.num_blocks // 2
    sched.run_until_done()
    assert MX.lowerings() == lowered
    assert sched.preemptions > pre0
    for i, o in enumerate(outs):
        assert tokens(o) == want[i], f"request {i}"
        assert o[-1].finish_reason == "length"
    assert sched.blocks_used() == 0 and sched.bm.active.sum() == 0


def test_multi_step_decode_equals_single_steps(sched):
    """decode_steps=3: three decode steps a program, read once: each read hands a request
    its (up to 3) tokens as one Output; greedy requests give Engine's tokens, a seeded
    sampled one the single-step scheduler's, a stop id inside a group ends the request
    there, max_tokens (not a multiple of 3) is met exactly, and a pool too small for every
    request preempts and recomputes with the same tokens."""
    from dsv4_jax.cache import blocks_needed
    eng = sched.eng
    rng = np.random.default_rng(506)
    prompts = prompts_of(rng, (5, 37, 20, 9, 50))
    n_new = 10
    sp_s = SamplingParams(temperature=1.0, top_p=.9, seed=77, max_tokens=n_new, ignore_eos=True)
    single = collect(sched, prompts[0], sp_s)
    sched.run_until_done()
    want = eng.generate(prompts, max_new_tokens=n_new, jit_loop=False)
    ref = want[1]
    assert len(ref) == n_new
    # the preemption case: prompts of one block growing into a second, 4 at a time in a
    # pool of 6 blocks (the reference: 3 at a time, which fit)
    long = prompts_of(rng, rng.integers(90, 116, 9))
    n_long = 48
    want_long = [w for i in range(0, 9, 3)
                 for w in eng.generate(long[i:i + 3], max_new_tokens=n_long, stop_ids=())]
    assert sum(blocks_needed(eng.cfg, len(p) + n_long) for p in long[:R]) > sched.cs.num_blocks
    multi = Scheduler(eng, sched.tok, SchedulerConfig(decode_steps=3, prefill_chunks_per_step=4),
                      seed=0)
    try:
        outs = [collect(multi, p, SamplingParams(temperature=0, max_tokens=n_new))
                for p in prompts]
        sampled = collect(multi, prompts[0], sp_s)
        by_id = collect(multi, prompts[1], SamplingParams(temperature=0, max_tokens=n_new,
                                                          stop_token_ids=(ref[5],)))
        odd = collect(multi, prompts[1], SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))
        multi.run_until_done()
        for i, o in enumerate(outs):
            assert tokens(o) == want[i], f"request {i}"
        assert tokens(sampled) == tokens(single)
        assert tokens(by_id) == ref[:ref.index(ref[5]) + 1]
        assert by_id[-1].finish_reason == "stop"
        assert tokens(odd) == ref[:8] and odd[-1].finish_reason == "length"
        # the prefill's token, then groups of up to 3 (a request's tokens of one read)
        assert [len(o.token_ids) for o in odd] == [1, 3, 3, 1]
        assert [o.completion_tokens for o in odd] == [1, 4, 7, 8]
        pre0 = multi.preemptions
        sp = SamplingParams(temperature=0, max_tokens=n_long, ignore_eos=True)
        louts = [collect(multi, p, sp) for p in long]
        multi.run_until_done()
        assert multi.preemptions > pre0
        for i, o in enumerate(louts):
            assert tokens(o) == want_long[i], f"long request {i}"
        assert multi.blocks_used() == 0 and multi.bm.active.sum() == 0
    finally:
        sched.runner.set_mode(None)


def test_multi_step_config_is_checked():
    with pytest.raises(ValueError, match="decode_steps"):
        SchedulerConfig(decode_steps=0)
    with pytest.raises(ValueError, match="do not combine"):
        SchedulerConfig(decode_steps=2, speculative_tokens=1)


def test_refused_before_queueing(sched):
    cap = sched.cs.capacity
    for prompt, sp, what in (([], SamplingParams(), "empty"),
                             ([5] * cap, SamplingParams(max_tokens=1), "context"),
                             ([5] * 10, SamplingParams(max_tokens=cap), "context"),
                             ([5, 99999], SamplingParams(), "vocabulary")):
        with pytest.raises(RequestError, match=what):
            sched.submit(Request(prompt, sp, lambda o: None))
    assert sched.queue_depth == 0


def test_cancel_frees_the_slot_at_once(sched):
    rng = np.random.default_rng(506)
    outs = collect(sched, prompts_of(rng, (40,))[0],
                   SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    req = None
    for _ in range(5):
        sched.step()
    (req,) = sched.running.values()
    assert sched.blocks_used() > 0 and not req.done
    req.cancel()
    sched.step()
    assert outs[-1].finish_reason == "abort" and req.done
    assert not sched.running and sched.blocks_used() == 0


def test_prefix_cache_reuses_whole_blocks(sched):
    """Prompts sharing 150 tokens: the second and later reuse the first 128 (one block and
    the slot state at its end), prefill only the rest, and give Engine's greedy tokens;
    cached prefixes give their blocks back when admission needs them."""
    from dsv4_jax.serve.scheduler import SchedulerConfig
    eng = sched.eng
    rng = np.random.default_rng(507)
    shared = prompts_of(rng, (150,))[0]
    a, b = (shared + t for t in prompts_of(rng, (20, 30)))
    want_a, want_b = eng.generate([a, b], max_new_tokens=8, jit_loop=False)
    ps = Scheduler(eng, sched.tok, SchedulerConfig(prefix_cache_entries=2), seed=0)
    ps.prefix.warm_up()
    lowered = MX.lowerings()
    chunks = []
    run = ps._execute
    ps._execute = lambda b: (chunks.extend(b.prefill), run(b))[1]
    try:
        got = []
        for p in (a, b, a):
            n0 = len(chunks)
            out = collect(ps, p, SamplingParams(temperature=0, max_tokens=8))
            ps.run_until_done()
            got.append((tokens(out), out[-1].cached_tokens, len(chunks) - n0))
    finally:
        ps._execute = run
    assert MX.lowerings() == lowered
    assert got[0] == (want_a, 0, -(-len(a) // CHUNK))
    assert got[1] == (want_b, 128, -(-(len(b) - 128) // CHUNK))
    assert got[2] == (want_a, 128, -(-(len(a) - 128) // CHUNK))
    assert ps.prefix.blocks_held == 1 and ps.blocks_used() == 1 and not ps.running
    # three requests growing to 2 blocks each need the whole pool: the cached prefix
    # yields its block (no request is preempted for it)
    pre0 = ps.preemptions
    outs = [collect(ps, p, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True))
            for p in prompts_of(rng, (100, 95, 110))]
    ps.step()
    assert len(ps.running) == 3
    ps.run_until_done()
    assert ps.prefix.blocks_held == 0 and ps.preemptions == pre0
    assert all(len(tokens(o)) == 90 for o in outs)
    while ps.prefix.evict():
        pass
    assert ps.blocks_used() == 0 and not ps.prefix.ref


def test_a_failing_step_ends_its_requests_and_serving_goes_on(sched):
    import threading
    from dsv4_jax.serve.scheduler import Overloaded, SchedulerConfig
    rng = np.random.default_rng(508)
    p = prompts_of(rng, (20,))[0]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    run = sched._execute

    def fail_once(*a):
        sched._execute = run
        raise RuntimeError("device lost")
    sched._execute = fail_once
    broken, ok = collect(sched, p, sp), []
    stop = threading.Event()
    t = threading.Thread(target=sched.run, args=(stop,))
    t.start()
    try:
        for _ in range(600):
            if broken and broken[-1].finish_reason and not sched.has_work():
                break
            threading.Event().wait(0.05)
        assert broken[-1].finish_reason == "error" and "device lost" in broken[-1].error
        assert sched.blocks_used() == 0
        ok = collect(sched, p, sp)   # the engine thread still serves
        for _ in range(600):
            if ok and ok[-1].finish_reason:
                break
            threading.Event().wait(0.05)
    finally:
        stop.set()
        t.join()
    assert ok[-1].finish_reason == "length" and len(tokens(ok)) == 4
    # a full waiting queue refuses at submit
    small = Scheduler(sched.eng, sched.tok, SchedulerConfig(max_waiting=1))
    small.submit(Request(p, sp, lambda o: None))
    with pytest.raises(Overloaded):
        small.submit(Request(p, sp, lambda o: None))


@pytest.mark.slow  # ~40 s
def test_generate_timing_covers_every_wave(sched):
    """Engine.generate over more prompts than slots runs waves; its timing counts every
    wave's decoded tokens (each prompt's first token comes from its prefill)."""
    eng = sched.eng
    ps = prompts_of(np.random.default_rng(509), (5, 9, 3, 7, 11, 4))
    outs = eng.generate(ps, max_new_tokens=5)
    last_wave = eng.generate(ps[R:], max_new_tokens=5)
    assert last_wave == outs[R:]
    eng.generate(ps, max_new_tokens=5)
    assert eng.timing.new_tokens == sum(map(len, outs)) - len(ps) > sum(map(len, last_wave))
