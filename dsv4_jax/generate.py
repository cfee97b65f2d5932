"""Generation: samplers, chunked prefill, a streaming iterator and a fully-jitted decode
loop (`lax.while_loop`), plus teacher-forced logits for debugging. The Engine holds the
model as an NNX module (nnx_model.DeepSeekV4) and runs its compiled step programs.

    eng = Engine(cfg, params)
    out = eng.generate([[0, 17, 42], [0, 5]], max_new_tokens=16, sampler=TopP(0.9))
    for step in eng.stream(prompts): ...   # [(request_index, token), ...] per step
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .cache import CacheSpec, CapacityExceeded, PoolExhausted, blocks_needed
from .config import Config
from .quant import Numerics
from .programs import generate_loop
from .runner import ModelRunner
from .serve.sampling import SamplingParams, SamplingRows, sample_rows
from .serve.scheduler import Request, Scheduler, SchedulerConfig
from . import speculative as SP
from . import pipeline as PL


# ---------------------------------------------------------------------------------------
# Samplers: small frozen dataclasses with get_next_tokens(logits [B, V], key) -> [B] int32
# ---------------------------------------------------------------------------------------
def _check_temperature(t):
    if _concrete(t) and not t > 0:
        raise ValueError(f"temperature must be > 0, got {t}")


def _concrete(v) -> bool:
    """A value given by a caller (checked), not a traced leaf of the compiled loop's
    sampler argument (the samplers are pytrees: their settings are data of the program)."""
    return isinstance(v, (int, float, np.number))


@dataclasses.dataclass(frozen=True)
class Greedy:
    def get_next_tokens(self, logits, key):
        return jnp.argmax(logits, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Temperature:
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)

    def get_next_tokens(self, logits, key):
        return jax.random.categorical(key, logits / self.temperature, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopK:
    k: int = 50
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)
        if _concrete(self.k) and self.k < 1:
            raise ValueError(f"top-k needs k >= 1, got {self.k}")

    def get_next_tokens(self, logits, key):
        lg = logits / self.temperature
        kth = jax.lax.top_k(lg, min(self.k, lg.shape[-1]))[0][..., -1:]
        lg = jnp.where(lg >= kth, lg, -jnp.inf)
        return jax.random.categorical(key, lg, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP:
    p: float = 0.9
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)
        if _concrete(self.p) and not 0 < self.p <= 1:
            raise ValueError(f"top-p needs 0 < p <= 1, got {self.p}")

    def get_next_tokens(self, logits, key):
        lg = logits / self.temperature
        probs = jax.nn.softmax(lg, -1)
        sp = jnp.sort(probs, -1)[..., ::-1]
        cum = jnp.cumsum(sp, -1)
        # the smallest prefix with mass >= p: keep tokens whose preceding mass is < p
        n_keep = jnp.sum((cum - sp) < self.p, -1, keepdims=True)
        thresh = jnp.take_along_axis(sp, n_keep - 1, -1)
        lg = jnp.where(probs >= thresh, lg, -jnp.inf)
        return jax.random.categorical(key, lg, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class MinP:
    p: float = 0.05
    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)
        if _concrete(self.p) and not 0 <= self.p <= 1:
            raise ValueError(f"min-p needs 0 <= p <= 1, got {self.p}")

    def get_next_tokens(self, logits, key):
        lg = logits / self.temperature
        probs = jax.nn.softmax(lg, -1)
        lg = jnp.where(probs >= self.p * probs.max(-1, keepdims=True), lg, -jnp.inf)
        return jax.random.categorical(key, lg, -1).astype(jnp.int32)


Sampler = Greedy | Temperature | TopK | TopP | MinP

# pytrees: temperature and p are arguments of the compiled generate loop (a new value runs
# the same program); top-k's k shapes the program (lax.top_k), so it stays static
for _cls, _data, _meta in ((Greedy, (), ()), (Temperature, ("temperature",), ()),
                           (TopK, ("temperature",), ("k",)), (TopP, ("p", "temperature"), ()),
                           (MinP, ("p", "temperature"), ())):
    jax.tree_util.register_dataclass(_cls, data_fields=list(_data), meta_fields=list(_meta))


def sampling_params(sampler, *, max_tokens: int, stop_ids: Sequence[int] = ()) -> SamplingParams:
    """A sampler of this module as one request's per-row settings (serve.sampling: its
    filters keep the tokens this sampler keeps; Greedy: temperature 0, the argmax)."""
    kind = type(sampler)
    if kind not in (Greedy, Temperature, TopK, TopP, MinP):
        raise ValueError(f"sampler must be one of Greedy, Temperature, TopK, TopP, MinP; "
                         f"got {sampler!r}")
    return SamplingParams(temperature=float(getattr(sampler, "temperature", 0.0)),
                          top_k=int(sampler.k) if kind is TopK else 0,
                          top_p=float(sampler.p) if kind is TopP else 1.0,
                          min_p=float(sampler.p) if kind is MinP else 0.0,
                          max_tokens=max_tokens, stop_token_ids=tuple(int(t) for t in stop_ids))


# ---------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    """Wall-clock of the last generation. `compile_s` is kept out of `decode_s`, so
    tokens_per_s is the steady decode rate (new_tokens counts tokens decoded in decode_s).
    The stream: first_token_s = prefill_s until its first token, compile_s then until
    the first decode step's tokens are read (that step compiles on first use), decode_s
    the rest."""
    prefill_s: float = 0.0  # includes prefill compilation on first use
    first_token_s: float = 0.0
    compile_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    decode_steps: int = 0   # the steps run in decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def _check_max_new(n):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {n!r}")


class Engine:
    """Owns the cache, the block manager and the compiled programs for one model."""

    def __init__(self, cfg: Config, params, *, numerics: Numerics = Numerics(),
                 cache_spec: CacheSpec | None = None, prefill_chunk: int = 128,
                 progress: bool = True, mesh=None, pipeline: "PL.Pipeline | None" = None,
                 merge_x_proj: bool = True):
        """mesh: a jax Mesh (dsv4_jax.distributed.make_mesh) to run sharded: parameters and
        cache are placed by the sharding rules and every step runs expert / tensor / data
        parallel; generation then streams step by step (the fused loop is single-device).
        pipeline: a pipeline.Pipeline to run the layers split across devices instead (the
        small-batch layout: each weight read on one device); also streamed step by step.
        merge_x_proj: step with the CSA blocks' five x-projections stored as one weight
        (params.merge_x_proj; same results, no per-step weight concat). The engine merges
        into a new tree, so `params` keeps its five weights alive while the caller holds
        it; pass a tree merged with consume=True (as the CLI does) to hold them once."""
        self.runner = ModelRunner(cfg, params, numerics=numerics, cache_spec=cache_spec,
                                  chunk=prefill_chunk, mesh=mesh, pipeline=pipeline,
                                  merge_x_proj=merge_x_proj)
        self.cfg, self.nm, self.cs = cfg, numerics, self.runner.cs
        self.chunk = prefill_chunk
        self.mesh, self.pipeline = mesh, pipeline
        self.progress = progress
        self.acceptance = None  # speculative decoding: mean tokens per step (speculative.py)
        self._loops = {}  # compiled while_loop programs by (sampler, width, stop count)
        self.timing = Timing()

    # the runner's parameters, cache and block table, as the drivers below use them
    model = property(lambda self: self.runner.model)
    graphdef = property(lambda self: self.runner.graphdef)
    state = property(lambda self: self.runner.state)
    bm = property(lambda self: self.runner.bm)
    cache = property(lambda self: self.runner.cache,
                     lambda self, c: setattr(self.runner, "cache", c))
    mtp_cache = property(lambda self: self.runner.mtp_cache,
                         lambda self, c: setattr(self.runner, "mtp_cache", c))

    @property
    def params(self) -> dict:
        """The flat parameter tree the module (or the pipeline's stages) holds (the same
        arrays)."""
        return self.runner.params

    # ---- building blocks -------------------------------------------------------------
    def check_tokens(self, toks):
        self.runner.check_tokens(toks)

    def prefill(self, slot: int, prompt: Sequence[int]):
        """Feed a prompt into an admitted slot in fixed-size chunks -> last logits [V]."""
        prompt = np.asarray(prompt, np.int32)
        self.check_tokens(prompt)
        start = int(self.bm.length[slot])
        logits = None
        starts = range(0, len(prompt), self.chunk)
        if len(starts) > 8 and self.progress:  # long prompts: show prefill progress
            starts = tqdm(starts, desc=f"prefill slot {slot}", unit="chunk", leave=False)
        for s in starts:
            part = prompt[s:s + self.chunk]
            self.bm.ensure(slot, start + s + len(part))
            buf = np.zeros((1, self.chunk), np.int32)
            buf[0, :len(part)] = part
            logits = self.runner.run_step(buf, [slot], [start + s], [len(part)])[0]
            self.bm.advance(slot, len(part))
        return logits

    def decode(self, tokens_by_slot: dict[int, int]):
        """One decode step -> logits [R, V] (rows of other slots are garbage). Feeds
        `tokens_by_slot` (host ints by slot). Allocates the blocks the step fills first
        (all or nothing); does not wait for the GPU."""
        R = self.cs.max_requests
        slots = list(tokens_by_slot)
        self.bm.ensure_many({s: int(self.bm.length[s]) + 1 for s in slots})
        nvalid = np.zeros(R, np.int32)
        nvalid[slots] = 1
        toks = np.zeros((R, 1), np.int32)
        for s, t in tokens_by_slot.items():
            toks[s, 0] = t
        self.check_tokens(toks)
        logits = self.runner.run_step(toks, np.arange(R), self.bm.length.astype(np.int32), nvalid)
        for s in slots:
            self.bm.advance(s, 1)
        return logits

    def check_fits(self, prompts, extra: int, *, queued: bool = False) -> None:
        """Clear errors before any work: token ids, empty prompts, a prompt + `extra` new
        tokens past a request's capacity or past the cache pool. queued: the prompts may
        wait for free slots (each must fit the pool alone); otherwise they run at once
        (as many as the request slots, their blocks all free together)."""
        for p in prompts:
            self.check_tokens(p)
        if not queued and len(prompts) > self.cs.max_requests:
            raise ValueError(f"{len(prompts)} prompts but the cache has "
                             f"{self.cs.max_requests} request slots (CacheSpec.max_requests)")
        for p in prompts:
            if len(p) == 0:
                raise ValueError("empty prompt")
            if len(p) + extra > self.cs.capacity:
                raise CapacityExceeded(
                    f"prompt of {len(p)} tokens + {extra} new tokens exceeds the cache "
                    f"capacity of {self.cs.capacity} tokens per request")
        need = [blocks_needed(self.cfg, len(p) + extra) for p in prompts]
        pool = self.cs.num_blocks // getattr(self.bm, "groups", 1)
        # queued: the largest request alone; at once: all of them in the free blocks
        want, have = (max(need, default=0), pool) if queued else (sum(need), len(self.bm.free))
        if want > have:
            raise PoolExhausted(f"prompt + {extra} new tokens need {want} cache blocks "
                                f"({'the largest request' if queued else 'all requests'}), "
                                f"and the pool has {have} (CacheSpec.num_blocks); lower "
                                f"max_new_tokens or grow the pool")

    def admit_all(self, prompts, extra: int):
        """Request slots for `prompts` (check_fits first), each with its prompt's blocks."""
        self.check_fits(prompts, extra)
        return [self.bm.admit(len(p)) for p in prompts]

    def release_all(self):
        for s in np.flatnonzero(self.bm.active):
            self.bm.release(int(s))

    # ---- streaming: the serving scheduler over the runner ----------------------------
    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
               sampler=Greedy(), seed: int = 0, stop_ids: Sequence[int] = (),
               speculative_tokens: int | str = 0) -> Iterator[list[tuple[int, int]]]:
        """Yields, per step, [(request_index, token), ...] of the tokens that step gave
        (the first token of a request whose prefill ended, then one per decode step; with
        speculation 1 .. k+1). Stop tokens (EOS + stop_ids) end a request and are
        yielded. Request i samples with `sampler`'s settings and seed + i
        (sampling_params), the draws of Engine.generate and of a served request.

        The driver of `dsv4 serve`'s Scheduler (serve/scheduler.py) over this engine's
        ModelRunner: more prompts than request slots wait for a free one; prompt chunks
        interleave with the decode steps of the requests already running; blocks are
        allocated as requests grow (the youngest is recomputed when the pool runs out).
        Each step samples in its program and keeps its state on the device, and step n+1
        is enqueued before step n's tokens are read: a request that stops at step n runs
        one step more, whose token is dropped.

        speculative_tokens k > 0: the MTP block drafts k tokens a step and one program
        verifies them (speculative.py); "dspark": the DSpark drafter's block
        (dspark_runner.py). Sets `acceptance` (mean tokens a decode step, per request and
        overall) and `timing`. Closing the iterator early ends every request."""
        _check_max_new(max_new_tokens)
        self.check_fits(prompts, max_new_tokens, queued=True)
        sp = sampling_params(sampler, max_tokens=max_new_tokens, stop_ids=stop_ids)
        params = [dataclasses.replace(sp, seed=seed + i) for i in range(len(prompts))]
        # every admitted prompt's chunks in the first steps: the batch decodes together
        sched = Scheduler(self, None, SchedulerConfig(
            prefill_chunks_per_step=self.cs.max_requests, max_waiting=max(len(prompts), 1),
            speculative_tokens=speculative_tokens))
        got: list[tuple[int, int]] = []

        def sink(i):
            return lambda o: got.extend((i, t) for t in o.token_ids)
        t0 = time.perf_counter()
        tm = self.timing = Timing()
        t_dec = None   # when the first decode step's token was read
        try:   # (a refused submit leaves nothing queued behind either)
            reqs = [sched.submit(Request(p, params[i], sink(i), rid=f"prompt-{i}"))
                    for i, p in enumerate(prompts)]
            while sched.has_work():
                sched.step()
                if not got:
                    continue
                now = time.perf_counter()
                if not tm.first_token_s:
                    tm.first_token_s = tm.prefill_s = now - t0
                if t_dec is not None:
                    tm.new_tokens += len(got)
                    tm.decode_steps += 1
                elif any(r.decode_steps for r in reqs):   # it carried the compilation
                    t_dec = now
                    tm.compile_s = now - t0 - tm.prefill_s
                out, got[:] = list(got), []
                yield out
            if t_dec is not None:
                tm.decode_s = time.perf_counter() - t_dec
            if speculative_tokens:
                self.acceptance = SP.acceptance_report(
                    [r.decode_steps for r in reqs], [len(r.out_ids) - 1 for r in reqs])
        finally:
            sched.abort_all()   # a consumer that stopped early, or a failed step

    @property
    def last_stream_state(self):
        """The runner's device decode state after the last step (for inspection)."""
        return self.runner.dstate

    # ---- fully jitted loop -------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
                 sampler=Greedy(), seed: int = 0, stop_ids: Sequence[int] = (),
                 jit_loop: bool = True, speculative_tokens: int | str = 0) -> list[list[int]]:
        """Generated tokens per prompt (including the stop token that ended it, if any).
        Request i samples with `sampler`'s settings and seed + i, as in `stream`, whose
        tokens these are. On one device without speculation (jit_loop) the decode steps
        run as one fused while-loop program (faster than the stream at equal batch);
        more prompts than request slots then run in waves (`timing` sums them).
        Otherwise (a mesh, a pipeline, speculative_tokens k > 0 or "dspark",
        jit_loop=False) it collects `stream`."""
        R = self.cs.max_requests
        _check_max_new(max_new_tokens)
        if (speculative_tokens or not jit_loop or self.mesh is not None
                or self.pipeline is not None):
            res = [[] for _ in prompts]
            for stepv in self.stream(prompts, max_new_tokens=max_new_tokens, sampler=sampler,
                                     seed=seed, stop_ids=stop_ids,
                                     speculative_tokens=speculative_tokens):
                for i, t in stepv:
                    res[i].append(t)
            return res
        if len(prompts) > R:   # waves; timing over all of them
            self.check_fits(prompts, max_new_tokens, queued=True)
            out, waves = [], []
            for i in range(0, len(prompts), R):
                out += self.generate(prompts[i:i + R], max_new_tokens=max_new_tokens,
                                     sampler=sampler, seed=seed + i, stop_ids=stop_ids)
                waves.append(self.timing)
            self.timing = Timing(prefill_s=sum(t.prefill_s for t in waves),
                                 first_token_s=waves[0].first_token_s,
                                 compile_s=sum(t.compile_s for t in waves),
                                 decode_s=sum(t.decode_s for t in waves),
                                 new_tokens=sum(t.new_tokens for t in waves),
                                 decode_steps=sum(t.decode_steps for t in waves))
            return out
        sp = sampling_params(sampler, max_tokens=max_new_tokens, stop_ids=stop_ids)
        slots = self.admit_all(prompts, max_new_tokens)
        try:
            t0 = time.perf_counter()
            rows = SamplingRows.empty(R)
            for i, s in enumerate(slots):
                rows.set(s, sp, seed + i)
            last = [self.prefill(s, p) for s, p in zip(slots, prompts)]
            for s in slots:  # every block the whole generation will fill, before the loop
                self.bm.ensure(s, int(self.bm.length[s]) + max_new_tokens)
            first = sample_rows(jnp.stack(last), rows.take(slots),
                                jnp.zeros(len(slots), jnp.int32), n_top=1)[0]
            first.block_until_ready()
            t1 = time.perf_counter()
            tok0 = jnp.zeros(R, jnp.int32).at[jnp.asarray(slots)].set(first)
            active = jnp.zeros(R, bool).at[jnp.asarray(slots)].set(True)
            # the output width and the stop list's length (both bucketed) key the program;
            # lengths, stop ids and the rows' sampling settings are arguments
            cap, stops = loop_bucket(max_new_tokens), loop_stops({self.cfg.eos_token_id,
                                                                   *stop_ids})
            largs = (self.state, self.cache, tok0, active, jnp.asarray(self.bm.length, jnp.int32),
                     jnp.asarray(self.bm.table), rows.take(np.arange(R)),
                     jnp.int32(max_new_tokens), stops)
            lkey = (cap, stops.shape[0])
            if lkey not in self._loops:
                self._loops[lkey] = generate_loop(self.runner.layout, self.graphdef, self.cs,
                                                  self.nm, cap).lower(*largs).compile()
            t2 = time.perf_counter()
            out, n_gen, self.cache = self._loops[lkey](*largs)
            out, n_gen = np.asarray(out), np.asarray(n_gen)
            t3 = time.perf_counter()
            self.timing = Timing(prefill_s=t1 - t0, first_token_s=t1 - t0, compile_s=t2 - t1,
                                 decode_s=t3 - t2, new_tokens=int(n_gen[slots].sum()) - len(slots),
                                 decode_steps=int(n_gen[slots].max()) - 1)
            return [out[s, :n_gen[s]].tolist() for s in slots]
        finally:
            for s in slots:
                self.bm.release(s)

    # ---- teacher forcing ---------------------------------------------------------------
    def teacher_forced_logits(self, tokens, prefill_len: int) -> np.ndarray:
        """tokens int [B, T]: prefill the first P tokens of each row, then feed the rest
        one per decode step -> logits f32 [B, T-P+1, V] (row 0: after the prefill, row i:
        after feeding token P-1+i)."""
        tokens = np.asarray(tokens)
        self.check_tokens(tokens)   # before the int32 cast, which would wrap large ids
        tokens = tokens.astype(np.int32)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
        B, T = tokens.shape
        if not 1 <= prefill_len <= T:
            raise ValueError(f"prefill_len must be in [1, {T}], got {prefill_len}")
        slots = self.admit_all(list(tokens), 0)
        try:
            out = [np.stack([np.asarray(self.prefill(s, row[:prefill_len]))
                             for s, row in zip(slots, tokens)])]
            for t in range(prefill_len, T):
                lg = self.decode({s: int(row[t]) for s, row in zip(slots, tokens)})
                out.append(np.asarray(lg)[slots])
            return np.stack(out, 1)
        finally:
            for s in slots:
                self.bm.release(s)


def loop_bucket(n: int, least: int = 16) -> int:
    """The power of two >= n (at least `least`): the fused loop's output width for n new
    tokens and its stop-list length, so that other lengths reuse the compiled loop."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def loop_stops(stop_ids) -> jax.Array:
    """The fused loop's stop ids: int32 [S], S a bucketed length (loop_bucket, at least 4),
    padded with -1 (no token)."""
    stops = sorted(stop_ids)
    return jnp.asarray(stops + [-1] * (loop_bucket(len(stops), 4) - len(stops)), jnp.int32)
