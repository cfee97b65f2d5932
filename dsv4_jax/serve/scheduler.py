"""Continuous batching around the engine's compiled step programs (pure Python on the
host; the programs: a prefill chunk [1, C] and the decode step [R, 1], each with the
per-row sampler of serve.sampling inside, serve.programs).

Each `step()`:
1. takes new requests from the inbox and drops cancelled ones (their slot and blocks are
   freed at once);
2. admits waiting requests, first come first served, into free cache slots, reserving the
   blocks of the prompt + max_tokens: a request that does not fit now waits in the queue
   (a request that can never fit was refused at submit);
3. runs `prefill_chunks_per_step` prefill chunks of admitted requests (the oldest first);
   a request whose prompt is complete samples its first token from the chunk's logits;
4. runs one decode step of every request that has a token to feed, samples each row with
   its own settings, and retires requests that hit a stop id, a stop string or
   max_tokens.
So new requests' prefill interleaves with running requests' decode, chunk by chunk.

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
from .prefix import PrefixCache
from .programs import run_step
from .sampling import SamplingParams, SamplingRows
from .text import IncrementalText

log = logging.getLogger("dsv4.serve")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    prefill_chunks_per_step: int = 1   # prefill chunks run between two decode steps
    max_waiting: int = 1024            # queued requests beyond which submit refuses
    prefix_cache_entries: int = 0      # cached prompt prefixes (serve.prefix); 0: off

    def __post_init__(self):
        if self.prefill_chunks_per_step < 1 or self.max_waiting < 1:
            raise ValueError(f"SchedulerConfig: prefill_chunks_per_step and max_waiting "
                             f"must be >= 1, got {self}")
        if self.prefix_cache_entries < 0:
            raise ValueError(f"SchedulerConfig.prefix_cache_entries must be >= 0, got "
                             f"{self.prefix_cache_entries}")


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
        self.n_prefilled = 0
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


class Scheduler:
    """Continuous batching over an Engine (generate.Engine): its cache, block manager and
    step programs. Thread model: submit() / cancel from any thread; step() / run() on one
    engine thread.

    observer: optional hooks (serve.metrics.Metrics): on_token(req, now, first),
    on_finish(req, reason), on_step(scheduler), on_admit(req)."""

    def __init__(self, engine, tokenizer, config: SchedulerConfig = SchedulerConfig(),
                 observer=None, seed: int | None = None):
        self.eng, self.tok, self.config = engine, tokenizer, config
        self.cs, self.bm = engine.cs, engine.bm
        self.R, self.C = engine.cs.max_requests, engine.chunk
        self.eos_ids = frozenset([tokenizer.eos_id])
        self.rows = SamplingRows.empty(self.R)
        self.observer = observer
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.inbox: collections.deque[Request] = collections.deque()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}   # by slot: prefilling or decoding
        self.steps = 0
        self.prefix = (PrefixCache(engine, config.prefix_cache_entries)
                       if config.prefix_cache_entries else None)

    # ---- from any thread -------------------------------------------------------------
    def check(self, prompt, params: SamplingParams) -> None:
        """RequestError if the request could never run (before it is queued)."""
        n, cap = len(prompt), self.cs.capacity
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
        return bool(self.inbox or self.waiting or self.running)

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
        self._admit()
        for _ in range(self.config.prefill_chunks_per_step):
            if not self._prefill_chunk():
                break
        self._decode()
        self.steps += 1
        if self.observer is not None:
            self.observer.on_step(self)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.R:
            req = self.waiting[0]
            slot = self.bm.admit(len(req.prompt))
            k, hit = self.prefix.lookup(req.prompt) if self.prefix else (0, None)
            if hit is not None:
                self.prefix.attach(slot, hit)
            try:   # every block the request can fill, now: it never waits mid-generation
                self.bm.ensure(slot, len(req.prompt) + req.params.max_tokens)
            except PoolExhausted:
                if self.prefix is not None:
                    self.prefix.detach(slot)
                self.bm.release(slot)
                if self.prefix is not None and self.prefix.evict():
                    continue   # cached prefixes give their blocks back first
                return   # first come first served: later requests wait behind it
            self.waiting.popleft()
            if hit is not None:
                self.prefix.load(slot, hit)
                req.n_prefilled = req.cached_tokens = k * BLOCK_TOKENS
            req.slot = slot
            p = req.params
            self.rows.set(slot, p, req.seed)
            req.stop_ids = frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else self.eos_ids)
            req.text = IncrementalText(self.tok.decode, p.stop)
            self.running[slot] = req
            if self.observer is not None:
                self.observer.on_admit(req)

    def _prefill_chunk(self) -> bool:
        pending = [r for r in self.running.values() if r.n_prefilled < len(r.prompt)]
        if not pending:
            return False
        req = min(pending, key=lambda r: r.t_arrival)
        s, start = req.slot, req.n_prefilled
        end = min(start + self.C, len(req.prompt))
        if self.prefix is not None and end // BLOCK_TOKENS > start // BLOCK_TOKENS:
            end = max(end // BLOCK_TOKENS * BLOCK_TOKENS, start + 1)  # stop at a boundary
        part = req.prompt[start:end]
        buf = np.zeros((1, self.C), np.int32)
        buf[0, :len(part)] = part
        out = self._run_step(buf, [s], [start], [len(part)], self.rows.take([s]),
                             np.zeros(1, np.int32))
        self.bm.advance(s, len(part))
        req.n_prefilled += len(part)
        if self.prefix is not None and req.n_prefilled % BLOCK_TOKENS == 0:
            self.prefix.insert(req.prompt, s, req.n_prefilled // BLOCK_TOKENS)
        if req.n_prefilled == len(req.prompt):   # the first token, from the last chunk
            self._accept(req, *(np.asarray(a)[0] for a in out))
        return True

    def _decode(self) -> None:
        rows = [r for r in self.running.values()
                if r.n_prefilled == len(r.prompt) and r.out_ids]
        if not rows:
            return
        R = self.R
        toks = np.zeros((R, 1), np.int32)
        nvalid = np.zeros(R, np.int32)
        steps = np.zeros(R, np.int32)
        for r in rows:
            toks[r.slot, 0], nvalid[r.slot], steps[r.slot] = r.out_ids[-1], 1, len(r.out_ids)
        # the blocks were reserved at admission: this allocates nothing
        self.bm.ensure_many({r.slot: int(self.bm.length[r.slot]) + 1 for r in rows})
        out = self._run_step(toks, np.arange(R), self.bm.length.astype(np.int32), nvalid,
                             self.rows.take(np.arange(R)), steps)
        tok, lp, top_ids, top_lp = (np.asarray(a) for a in out)
        for r in rows:
            self.bm.advance(r.slot, 1)
            self._accept(r, tok[r.slot], lp[r.slot], top_ids[r.slot], top_lp[r.slot])

    def _run_step(self, tokens, slots, pos, nvalid, rows, steps):
        """The step program with sampling (serve.programs.run_step): tokens [B, T] at pos
        [B] in slots [B], the first nvalid [B] real; each row sampled with `rows` at token
        index `steps` [B] -> (tokens [B], logprobs [B], top ids / logprobs [B, K])."""
        return run_step(self.eng, tokens, slots, pos, nvalid, rows, steps)

    def _accept(self, req: Request, tok, lp, top_ids, top_lp) -> None:
        """A sampled token: its text, stop checks and the Output to the sink."""
        now = time.perf_counter()
        tok = int(tok)
        first = req.t_first is None
        if first:
            req.t_first = now
        req.out_ids.append(tok)
        p = req.params
        o = Output(token_ids=[tok], prompt_tokens=len(req.prompt),
                   completion_tokens=len(req.out_ids), cached_tokens=req.cached_tokens)
        if p.logprobs:
            o.logprobs = [TokenLogprob(tok, float(lp), [(int(i), float(v)) for i, v in
                                                        zip(top_ids[:p.top_logprobs],
                                                            top_lp[:p.top_logprobs])])]
        if self.observer is not None:
            self.observer.on_token(req, now, first)
        req.t_last = now
        if tok in req.stop_ids:   # a stop id's own text is not part of the output
            o.text, o.finish_reason = req.text.finish(), "stop"
        else:
            o.text, hit = req.text.push([tok])
            if hit:
                o.finish_reason = "stop"
            elif len(req.out_ids) >= p.max_tokens:
                o.text += req.text.finish()
                o.finish_reason = "length"
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
                        error=error))

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
