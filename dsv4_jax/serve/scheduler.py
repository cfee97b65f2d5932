"""Continuous batching: the host policy of serving, over the engine's ModelRunner
(dsv4_jax.runner). Pure Python; no device work of its own.

Each `step()`:
1. takes new requests from the inbox and drops cancelled ones (their slot and blocks are
   freed at once);
2. admits waiting requests, first come first served, into free cache slots, with the
   blocks of their prompt (blocks for generated tokens are allocated as they grow);
3. grows the blocks of the decoding requests by what this step writes; when the pool runs
   out, the youngest request is preempted (recompute: its blocks are freed and it waits
   again with its prompt + the tokens generated so far, which a later prefill restores);
4. emits one StepBatch to the runner: `prefill_chunks_per_step` prefill chunks (the
   oldest request first; a final chunk samples the first token and starts the row
   decoding), and the decode step of every decoding request, sampled per row on the
   device;
5. then reads the *previous* step's tokens (the step just enqueued runs meanwhile),
   detokenises them, checks stop ids, stop strings and max_tokens, and streams them.
A request that stops is thus decoded one step past its stop; that token is dropped.

With `decode_steps` N > 1 the decode step is N plain steps in one program, read once
(vLLM's multi-step scheduling): the host's work per token drops N-fold, each request's N
tokens stream as one event, and a request stopping inside the N runs on to the end of
them (its extra tokens dropped). A request's tokens of one step reach its sink as one
Output in every mode.

With `speculative_tokens` k, the decode step drafts k tokens per request with the MTP
block and verifies them (speculative.py), emitting 1 .. k+1 tokens a step; with
"dspark", the DSpark drafter's block of G = dspark_block_size (dspark_runner.py), 1 .. G+1.

Requests talk to the outside through `sink(Output)`, called on the scheduler's thread.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import threading
import time
from typing import Callable

import numpy as np

from ..cache import BLOCK_TOKENS, PoolExhausted, blocks_needed
from ..runner import DSpark, PrefillChunk, RowStart, Speculation, StepBatch
from .prefix import PrefixCache
from .sampling import SamplingParams, SamplingRows
from .text import IncrementalText

log = logging.getLogger("dsv4.serve")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    prefill_chunks_per_step: int = 1   # prefill chunks run between two decode steps
    max_waiting: int = 1024            # queued requests beyond which submit refuses
    prefix_cache_entries: int = 0      # cached prompt prefixes (serve.prefix); 0: off
    speculative_tokens: int | str = 0  # MTP drafts verified per decode step, or "dspark"
                                       # (the DSpark drafter's block); 0: off
    decode_steps: int = 1              # plain decode steps one program runs between two
                                       # reads of their tokens (runner.set_mode(steps=))

    def __post_init__(self):
        if self.prefill_chunks_per_step < 1 or self.max_waiting < 1:
            raise ValueError(f"SchedulerConfig: prefill_chunks_per_step and max_waiting "
                             f"must be >= 1, got {self}")
        if not isinstance(self.decode_steps, int) or self.decode_steps < 1:
            raise ValueError(f"SchedulerConfig.decode_steps must be an integer >= 1, got "
                             f"{self.decode_steps!r}")
        if self.decode_steps > 1 and self.speculative_tokens:
            raise ValueError("SchedulerConfig: decode_steps > 1 and speculative_tokens do "
                             "not combine (a speculative step already emits several tokens)")
        if self.prefix_cache_entries < 0:
            raise ValueError(f"SchedulerConfig.prefix_cache_entries must be >= 0, got "
                             f"{self.prefix_cache_entries}")
        if self.speculative_tokens:
            if self.speculative_tokens != "dspark":
                Speculation(self.speculative_tokens)   # its own range check
            if self.prefix_cache_entries:
                raise ValueError("speculative decoding and the prefix cache do not combine "
                                 "(the prefix snapshots do not hold the drafter's cache)")


class RequestError(ValueError):
    """A request the scheduler refuses (its message names the problem); `code` is the
    OpenAI error code."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class Overloaded(RuntimeError):
    """The waiting queue is full."""


@dataclasses.dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]   # (id, logprob) of the likeliest tokens, best first


@dataclasses.dataclass
class Output:
    """What one scheduler step produced for a request (sent to its sink)."""
    text: str = ""                      # new text (never a fragment of a stop string)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0              # prompt tokens served by the prefix cache
    decode_steps: int = 0               # decode steps that emitted the completion so far
    error: str | None = None


_ids = itertools.count()


class Request:
    """One generation. prompt: token ids; sink(Output) receives its progress."""

    def __init__(self, prompt, params: SamplingParams, sink: Callable[[Output], None],
                 rid: str | None = None):
        self.prompt = [int(t) for t in prompt]
        self.params, self.sink = params, sink
        self.id = rid or f"req-{next(_ids)}"
        self.seed = params.seed
        self.slot: int | None = None
        self.feed = self.prompt    # what its prefill feeds (+ generated tokens when preempted)
        self.n_prefilled = 0
        self.decoding = False      # its row is in the runner's decode state
        self.ready = None          # its prefill's sampled token (device) until it decodes
        self.first_unread = False  # that token is not read back yet
        self.inflight_steps = 0    # its decode steps enqueued and not read yet
        self.replay = None         # preempted: the generated tokens to feed again
        self.replay_next = None    # index of the next one, once the prompt is prefilled
        self.decode_steps = 0      # decode steps read back
        self.preemptions = 0
        self.cached_tokens = 0
        self.out_ids: list[int] = []
        self.cancelled = False   # set by any thread; the scheduler retires it next step
        self.done = False
        self.t_arrival = time.perf_counter()
        self.t_first = self.t_last = None
        self.stop_ids: frozenset[int] = frozenset()
        self.text: IncrementalText | None = None

    def cancel(self):
        self.cancelled = True


@dataclasses.dataclass
class _Inflight:
    """A step enqueued and not yet read: its result and whom each output belongs to."""
    result: object                              # runner.StepResult
    finals: list[tuple[Request, int]]           # (request, prefill chunk index)
    rows: list[tuple[int, Request, bool]]       # (slot, request, its token counts)


class Scheduler:
    """Continuous batching over an Engine's ModelRunner (its cache, block table and step
    programs). Thread model: submit() / cancel from any thread; step() / run() on one
    engine thread.

    observer: optional hooks (serve.metrics.Metrics): on_token(req, now, first),
    on_finish(req, reason), on_step(scheduler), on_admit(req)."""

    def __init__(self, engine, tokenizer, config: SchedulerConfig = SchedulerConfig(),
                 observer=None, seed: int | None = None):
        self.eng, self.tok, self.config = engine, tokenizer, config
        self.runner = engine.runner
        self.cs, self.bm = self.runner.cs, self.runner.bm
        self.R, self.C = self.cs.max_requests, self.runner.chunk
        k = config.speculative_tokens
        if k == "dspark":
            self.T = engine.cfg.dspark_block_size + 1   # tokens a decode step may write
            self.runner.set_mode(DSpark())
        elif k:
            self.T = k + 1   # tokens a decode step may write per request
            self.runner.set_mode(Speculation(k))
        else:
            self.T = config.decode_steps
            self.runner.set_mode(None, steps=config.decode_steps)
        # tokens a decode step surely emits (unless the request ends): a multi-step one
        # emits all of its steps' up to max_tokens, a speculative one at least one
        self.sure = config.decode_steps
        # no tokenizer (Engine.stream: token ids only): no text, no stop strings
        self.eos_ids = frozenset([tokenizer.eos_id if tokenizer is not None
                                  else engine.cfg.eos_token_id])
        self.observer = observer
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.inbox: collections.deque[Request] = collections.deque()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}   # by slot: prefilling or decoding
        self.pending: _Inflight | None = None   # the step whose tokens are not read yet
        self.steps = self.preemptions = 0
        self.prefix = (PrefixCache(engine, config.prefix_cache_entries)
                       if config.prefix_cache_entries else None)

    # ---- from any thread -------------------------------------------------------------
    def check(self, prompt, params: SamplingParams) -> None:
        """RequestError if the request could never run (before it is queued)."""
        n, cap = len(prompt), self.cs.capacity
        if params.stop and self.tok is None:
            raise RequestError("stop strings need a tokenizer (this scheduler has none); "
                               "give stop_token_ids", param="stop")
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in prompt if not 0 <= t < self.eng.cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, "
                               f"{self.eng.cfg.vocab_size})", param="prompt")
        if n + params.max_tokens > cap:
            raise RequestError(
                f"this model's context is {cap} tokens; the request asks for {n} prompt "
                f"tokens + max_tokens {params.max_tokens} = {n + params.max_tokens}",
                code="context_length_exceeded", param="max_tokens" if n < cap else "prompt")
        need = blocks_needed(self.eng.cfg, n + params.max_tokens)
        if need > self.cs.num_blocks // getattr(self.bm, "groups", 1):
            raise RequestError(f"the request needs {need} cache blocks, more than the pool "
                               f"holds ({self.cs.num_blocks}); lower max_tokens",
                               code="context_length_exceeded", param="max_tokens")

    def submit(self, req: Request) -> Request:
        """Queue a request (RequestError / Overloaded when refused; nothing queued then)."""
        self.check(req.prompt, req.params)
        with self._lock:
            if len(self.inbox) + len(self.waiting) >= self.config.max_waiting:
                raise Overloaded(f"{self.config.max_waiting} requests are waiting; retry later")
            if req.seed is None:
                req.seed = self._rng.getrandbits(32)
            self.inbox.append(req)
        self._wake.set()
        return req

    @property
    def queue_depth(self) -> int:
        return len(self.inbox) + len(self.waiting)

    def blocks_used(self) -> int:
        return self.cs.num_blocks - len(self.bm.free)

    # ---- the engine thread -----------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting or self.running or self.pending)

    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step until `stop` is set; sleeps while there is nothing to do. A step that fails
        (a device error) ends every request it holds with an error, and serving goes on."""
        while not stop.is_set():
            if not self.has_work():
                self._wake.wait(idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:   # keep serving; the requests in flight are lost
                log.exception("scheduler step failed")
                self.pending = None
                for req in list(self.running.values()):
                    self._finish(req, "error", error=f"{type(e).__name__}: {e}")

    def step(self) -> None:
        with self._lock:
            self.waiting.extend(self.inbox)
            self.inbox.clear()
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish(req, "abort")
        for req in [r for r in self.running.values() if r.cancelled]:
            self._finish(req, "abort")
        grown = self._grow()         # may read the step in flight and preempt
        rows = [r for r in grown if r.decoding]
        starts = []
        for req in sorted([r for r in self.running.values() if r.ready is not None],
                          key=lambda r: r.t_arrival):
            # its prefill sampled token index n_base; the decode steps sample the rest
            n_base = len(req.feed) - len(req.prompt)
            if n_base + 1 >= req.params.max_tokens:
                req.ready = None
            elif self._try_ensure(req.slot, len(req.feed) + self.T):
                starts.append(RowStart(req.slot, req.ready, len(req.feed),
                                       SamplingRows.row(req.params, req.seed), n_base + 1,
                                       req.params.max_tokens))
                req.ready, req.decoding = None, True
                rows.append(req)
        replays = self._replay_rows([r for r in grown if not r.decoding], starts)
        self._admit()
        chunks, finals, inserts = [], [], []
        for _ in range(self.config.prefill_chunks_per_step):
            req = self._next_chunk_request()
            if req is None:
                break
            s, start = req.slot, req.n_prefilled
            end = min(start + self.C, len(req.feed))
            if self.prefix is not None and end // BLOCK_TOKENS > start // BLOCK_TOKENS:
                end = max(end // BLOCK_TOKENS * BLOCK_TOKENS, start + 1)  # stop at a boundary
            req.n_prefilled = end
            chunks.append(PrefillChunk(s, tuple(req.feed[start:end]), start,
                                       SamplingRows.row(req.params, req.seed),
                                       len(req.feed) - len(req.prompt)))
            if self.prefix is not None and end % BLOCK_TOKENS == 0:
                inserts.append((req.feed, s, end // BLOCK_TOKENS))
            if end == len(req.feed):
                if req.replay:   # a preempted request: its tokens are replayed instead
                    req.replay_next = 0
                else:            # the last chunk samples the next token
                    finals.append((req, len(chunks) - 1))
                    req.first_unread = True
        for r in rows:
            r.inflight_steps += 1
        ran = [(r.slot, r, True) for r in rows] + replays
        batch = StepBatch(tuple(chunks), tuple(starts), tuple(sorted(s for s, _, _ in ran)))
        now = None
        if batch.prefill or batch.start or batch.run:
            result = self._execute(batch)
            for req, i in finals:   # the row starts decoding from this device token
                req.ready = result.first_token(i)
            for feed, s, k in inserts:
                self.prefix.insert(feed, s, k)
            now = _Inflight(result, finals, ran)
        prev, self.pending = self.pending, now
        if prev is not None:
            self._consume(prev)
        self.steps += 1
        if self.observer is not None:
            self.observer.on_step(self)

    def _execute(self, batch: StepBatch):
        """The runner's step (one place, so a test can watch or fail it)."""
        return self.runner.execute(batch)

    def _grow(self) -> list[Request]:
        """The decoding requests that decode this step, each with the blocks the step
        writes. When the pool runs out: read the step in flight (finished requests give
        their blocks back), evict cached prefixes, then preempt the youngest request,
        until the oldest fit."""
        out = []
        for r in sorted([r for r in self.running.values()
                         if r.decoding or r.replay_next is not None],
                        key=lambda r: r.t_arrival):
            while r.slot is not None and not r.done:
                # tokens it surely has once what is in flight is read: no step past
                # max_tokens
                if r.decoding and (len(r.out_ids) + r.first_unread
                                   + r.inflight_steps * self.sure >= r.params.max_tokens):
                    break
                if self._try_ensure(r.slot, self._reach(r)):
                    out.append(r)
                    break
                if self.pending is not None:
                    self._drain()
                    continue
                if self.prefix is not None and self.prefix.evict():
                    continue   # cached prefixes give their blocks back first
                self._preempt(max((q for q in self.running.values()),
                                  key=lambda q: q.t_arrival))
        return [r for r in out if r.slot is not None and not r.done]

    def _replay_rows(self, reqs, starts) -> list[tuple[int, Request, bool]]:
        """Preempted requests whose prompt is prefilled again (`reqs`, their blocks grown)
        feed their generated tokens one per decode step (forced, as RowStarts), so their
        cache ends exactly as before; the step fed the last one samples the next token as
        usual."""
        out = []
        for r in reqs:
            j = r.replay_next
            starts.append(RowStart(r.slot, int(r.replay[j]), len(r.prompt) + j,
                                   SamplingRows.row(r.params, r.seed), j + 1))
            last = j == len(r.replay) - 1
            if last:
                r.replay, r.replay_next, r.decoding = None, None, True
                r.inflight_steps += 1
            else:
                r.replay_next = j + 1
            out.append((r.slot, r, last))
        return out

    def _reach(self, r: Request) -> int:
        """The tokens r's cache may hold once this step ran (capped at the capacity:
        a speculative step's writes past it are dropped)."""
        if self.T == 1:
            return int(self.bm.length[r.slot]) + 1
        return min(int(self.bm.length[r.slot]) + self.T * (r.inflight_steps + 1),
                   self.cs.capacity)

    def _try_ensure(self, slot: int, n: int) -> bool:
        try:
            self.bm.ensure(slot, min(n, self.cs.capacity))
            return True
        except PoolExhausted:
            return False

    def _drain(self) -> None:
        prev, self.pending = self.pending, None
        if prev is not None:
            self._consume(prev)

    def _preempt(self, req: Request) -> None:
        """Give the request's slot and blocks back; it waits at the queue's head to be
        recomputed: its prompt prefilled again, then its generated tokens replayed
        (speculative mode: prompt + generated tokens prefilled, equal to rounding)."""
        assert self.pending is None   # its tokens in flight were read
        self._release(req)
        req.done = False
        req.slot, req.decoding, req.ready, req.n_prefilled = None, False, None, 0
        req.replay = req.replay_next = None
        if self.T == 1:   # exact: prefill the prompt, then replay the tokens as decode steps
            req.replay = list(req.out_ids) or None
        else:             # the speculative step has no forced rows: prefill them all
            req.feed = req.prompt + req.out_ids
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.R:
            req = self.waiting[0]
            # a spare block beside running requests, so that their next block does not
            # preempt at once what admission just admitted
            spare = 1 if self.running else 0
            need = blocks_needed(self.eng.cfg, len(req.feed) + self.T)
            k, hit = self.prefix.lookup(req.feed) if self.prefix else (0, None)
            if need - k + spare > len(self.bm.free):
                if self.prefix is not None and self.prefix.evict():
                    continue   # cached prefixes give their blocks back first
                return   # first come first served: later requests wait behind it
            slot = self.bm.admit(len(req.feed))
            if hit is not None:
                self.prefix.attach(slot, hit)
            try:
                self.bm.ensure(slot, len(req.feed))
            except PoolExhausted:   # shared blocks counted above; cannot happen
                if self.prefix is not None:
                    self.prefix.detach(slot)
                self.bm.release(slot)
                return
            self.waiting.popleft()
            if hit is not None:
                self.prefix.load(slot, hit)
                req.n_prefilled = req.cached_tokens = k * BLOCK_TOKENS
            req.slot = slot
            p = req.params
            req.stop_ids = frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else self.eos_ids)
            if req.text is None and self.tok is not None:
                req.text = IncrementalText(self.tok.decode, p.stop)
            self.running[slot] = req
            if self.observer is not None and not req.preemptions:
                self.observer.on_admit(req)

    def _next_chunk_request(self) -> Request | None:
        pending = [r for r in self.running.values() if r.n_prefilled < len(r.feed)]
        return min(pending, key=lambda r: r.t_arrival) if pending else None

    def _consume(self, inf: _Inflight) -> None:
        """Read a step's tokens (waits for that step only) and hand them to their
        requests; outputs of requests that ended since are dropped."""
        pre, dec = inf.result.fetch()
        for req, i in inf.finals:
            if req.first_unread:
                req.first_unread = False
                if not req.done:
                    self._accept(req, *(np.asarray(a)[None] for a in pre[i]))
        if dec is None:
            return
        toks, counts, lp, top_ids, top_lp = dec
        for slot, req, output in inf.rows:
            if not output:   # a replayed token's step: its draw is not output
                continue
            req.inflight_steps -= 1
            if req.done or req.slot != slot:
                continue
            n = int(counts[slot])
            if self.T > 1:
                self.runner.advance(slot, n)
            req.decode_steps += 1
            self._accept(req, toks[slot, :n], lp[slot, :n], top_ids[slot, :n],
                         top_lp[slot, :n])

    def _accept(self, req: Request, toks, lps, top_ids, top_lps) -> None:
        """A step's sampled tokens toks [n] (with their logprobs lps [n] and the likeliest
        top_ids / top_lps [n, K]): their text, the stop checks, and one Output to the sink
        (up to the first token that ends the request)."""
        now = time.perf_counter()
        p, text = req.params, req.text
        o = Output(prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens)
        for j, tok in enumerate(toks.tolist()):
            first = req.t_first is None
            if first:
                req.t_first = now
            req.out_ids.append(tok)
            o.token_ids.append(tok)
            if p.logprobs:
                o.logprobs.append(TokenLogprob(
                    tok, float(lps[j]), list(zip(top_ids[j, :p.top_logprobs].tolist(),
                                                 top_lps[j, :p.top_logprobs].tolist()))))
            if self.observer is not None:
                self.observer.on_token(req, now, first)
            if tok in req.stop_ids:   # a stop id's own text is not part of the output
                o.text += text.finish() if text else ""
                o.finish_reason = "stop"
            else:
                piece, hit = text.push([tok]) if text else ("", False)
                o.text += piece
                if hit:
                    o.finish_reason = "stop"
                elif len(req.out_ids) >= p.max_tokens:
                    o.text += text.finish() if text else ""
                    o.finish_reason = "length"
            if o.finish_reason is not None:
                break
        req.t_last = now
        o.completion_tokens, o.decode_steps = len(req.out_ids), req.decode_steps
        if o.finish_reason is not None:
            self._release(req)
            self._report_finish(req, o.finish_reason)
        req.sink(o)

    def _release(self, req: Request) -> None:
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            if self.prefix is not None:
                self.prefix.detach(req.slot)
            self.bm.release(req.slot)
        req.done = True

    def _report_finish(self, req, reason):
        if self.observer is not None:
            self.observer.on_finish(req, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request from outside the token path (cancelled, failed)."""
        self._release(req)
        self._report_finish(req, reason)
        req.sink(Output(finish_reason=reason, prompt_tokens=len(req.prompt),
                        completion_tokens=len(req.out_ids), cached_tokens=req.cached_tokens,
                        decode_steps=req.decode_steps, error=error))

    def abort_all(self) -> None:
        """End every request (finish_reason "abort") and give back its slot and blocks,
        without reading the step in flight (a driver that stops early, or a step that
        failed)."""
        self.pending = None
        with self._lock:
            self.waiting.extend(self.inbox)
            self.inbox.clear()
        for req in list(self.waiting) + list(self.running.values()):
            if not req.done:
                self._finish(req, "abort")
        self.waiting.clear()

    # ---- helpers ---------------------------------------------------------------------
    def run_until_done(self, max_steps: int = 100_000) -> None:
        """Step until every submitted request has finished (tests, warm-up)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"requests still running after {max_steps} steps")

    def warm_up(self) -> None:
        """Compile every program serving uses (prefill chunk and decode step with their
        sampling, the prefix cache's copies) with one short request, so no client waits on
        a compilation."""
        if self.prefix is not None:
            self.prefix.warm_up()
        p = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=0)
        self.submit(Request([self.tok.bos_id], p, lambda o: None, rid="warm-up"))
        self.run_until_done()
