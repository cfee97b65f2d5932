"""Engine.stream / Engine.generate with the DSpark drafter (dspark_runner.py): the host
loop over the runner's DSpark mode."""
from __future__ import annotations

import time

from . import speculative as SP
from .runner import DSpark, PrefillChunk, RowStart, StepBatch
from .serve.sampling import seed_word


def sampling_row(sampler, seed: int) -> tuple:
    """A generate.py sampler as a per-row sampling setting (SamplingRows.row): the same
    distribution (serve.sampling's filters; Greedy: temperature 0)."""
    name = type(sampler).__name__
    t = float(getattr(sampler, "temperature", 0.0))
    k = int(sampler.k) if name == "TopK" else 0
    p = float(sampler.p) if name == "TopP" else 1.0
    m = float(sampler.p) if name == "MinP" else 0.0
    if name not in ("Greedy", "Temperature", "TopK", "TopP", "MinP"):
        raise ValueError(f"DSpark speculation does not know the sampler {sampler!r}")
    return (t, k, p, m, seed_word(seed))


def stream(eng, prompts, *, max_new_tokens: int, sampler, seed: int, stop_ids):
    """Engine.stream with the DSpark drafter, through the runner's DSpark mode
    (runner.execute): yields, per step, [(request_index, token), ...] with 1 .. G+1 tokens
    per running request; sets eng.acceptance (speculative.acceptance_report) and
    eng.timing. Request i samples with the per-row settings of `sampler` and seed + i.
    Pipelined as Engine.stream: step n+1 is enqueued before step n's tokens are read, so a
    request that ended runs one step more (its tokens dropped), and each request keeps
    blocks for two steps of G + 1 rows."""
    runner = eng.runner
    runner.set_mode(DSpark())   # checks the config and the drafter first
    cfg, cs = eng.cfg, eng.cs
    G = cfg.dspark_block_size
    T = G + 1
    stops = {cfg.eos_token_id, *stop_ids}
    slots = eng.admit_all(prompts, max_new_tokens + G)
    rows = [sampling_row(sampler, seed + i) for i in range(len(prompts))]
    try:
        t0 = time.perf_counter()
        last = []   # each prompt's final prefill result
        for i, (s, p) in enumerate(zip(slots, prompts)):
            p = [int(t) for t in p]
            for c in range(0, len(p), runner.chunk):
                part = tuple(p[c:c + runner.chunk])
                eng.bm.ensure(s, c + len(part))
                res = runner.execute(StepBatch(prefill=(PrefillChunk(s, part, c, rows[i], 0),)))
            last.append(res)
        first = [int(r.fetch()[0][0][0]) for r in last]
        eng.timing = type(eng.timing)(prefill_s=time.perf_counter() - t0)  # generate.Timing
        eng.timing.first_token_s = eng.timing.prefill_s
        yield [(i, first[i]) for i in range(len(prompts))]
        n_out = [1] * len(prompts)
        alive = [i for i in range(len(prompts))
                 if first[i] not in stops and n_out[i] < max_new_tokens]
        starts = [RowStart(slots[i], last[i].first_token(0), len(prompts[i]), rows[i], 1)
                  for i in alive]
        steps, emitted = [0] * len(prompts), [0] * len(prompts)
        done, pending, first_step = set(), None, True
        t1 = time.perf_counter()
        while alive or pending is not None:
            launched = None
            if alive:
                # a slot may reach its length as read + T for each step not yet read
                ahead = T * (2 if pending is not None else 1)
                eng.bm.ensure_many({slots[i]: min(int(eng.bm.length[slots[i]]) + ahead,
                                                  cs.capacity) for i in alive})
                res = runner.execute(StepBatch(start=tuple(starts),
                                               run=tuple(sorted(slots[i] for i in alive))))
                starts = []
                launched = (res, list(alive), first_step)
                if first_step:   # the first step carries compilation: not timed
                    res.fetch()
                    eng.timing.compile_s = time.perf_counter() - t1
                    t1 = time.perf_counter()
                    first_step = False
            if pending is not None:
                res, ran, untimed = pending
                _, (out, n, *_) = res.fetch()   # the step's one read-back
                got = []
                for i in ran:
                    if i in done:
                        continue   # ended: this step ran before the host knew
                    s = slots[i]
                    steps[i] += 1
                    emitted[i] += int(n[s])
                    runner.advance(s, int(n[s]))
                    if SP.emit_row(i, out[s, :n[s]], n_out, max_new_tokens, stops, got):
                        done.add(i)
                if not untimed:
                    eng.timing.new_tokens += len(got)
                alive = [i for i in alive if i not in done]
                yield got
            pending = launched
        eng.timing.decode_s = time.perf_counter() - t1
        eng.acceptance = SP.acceptance_report(steps, emitted)
    finally:
        for s in slots:
            eng.bm.release(s)
