"""Prometheus metrics of a server: requests, queue depth, tokens/s, time to first token,
inter-token latency, cache use, and compilations (which must stop after warm-up).

Implements the scheduler's observer hooks (on_token, on_finish, on_step); the HTTP layer
counts requests by endpoint and status. Each Metrics has its own registry, so several
servers in one process (tests) do not collide."""
from __future__ import annotations

import collections
import threading
import time

import jax
import prometheus_client as prom

# latency buckets (s): sub-ms GPU steps up to CPU compilations
_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# jax records this event once per program lowered (a jit cache miss), whether XLA then
# compiles it or loads it from the persistent cache
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_lowerings = 0
_listener_lock = threading.Lock()
_listening = False


def lowerings() -> int:
    """Programs lowered in this process since watch_lowerings was first called."""
    return _lowerings


def watch_lowerings() -> None:
    """Start counting lowered programs (once per process: jax has no unregister)."""
    global _listening

    def on_event(event, duration, **kw):
        global _lowerings
        if event == LOWERING_EVENT:
            _lowerings += 1

    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(on_event)
            _listening = True


class Metrics:
    def __init__(self, model: str, tokens_window_s: float = 10.0):
        watch_lowerings()
        self.registry = r = prom.CollectorRegistry()
        self.window = tokens_window_s
        self._recent = collections.deque()   # token times of the last window
        self._lock = threading.Lock()   # engine thread appends, HTTP thread renders
        self.requests = prom.Counter("dsv4_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.finished = prom.Counter("dsv4_generations_finished",
                                     "generations by finish reason", ["reason"], registry=r)
        self.waiting = prom.Gauge("dsv4_queue_depth", "requests waiting for a cache slot",
                                  registry=r)
        self.running = prom.Gauge("dsv4_requests_running",
                                  "requests holding a cache slot (prefilling or decoding)",
                                  registry=r)
        self.prompt_tokens = prom.Counter("dsv4_prompt_tokens", "prompt tokens prefilled",
                                          registry=r)
        self.gen_tokens = prom.Counter("dsv4_generation_tokens", "tokens generated", registry=r)
        self.tps = prom.Gauge("dsv4_generation_tokens_per_second",
                              f"tokens generated per second over the last {self.window:g} s",
                              registry=r)
        self.ttft = prom.Histogram("dsv4_time_to_first_token_seconds",
                                   "arrival to first token", buckets=_LAT, registry=r)
        self.itl = prom.Histogram("dsv4_inter_token_latency_seconds",
                                  "time between a request's consecutive tokens", buckets=_LAT,
                                  registry=r)
        self.e2e = prom.Histogram("dsv4_request_latency_seconds", "arrival to last token",
                                  buckets=_LAT, registry=r)
        self.blocks_used = prom.Gauge("dsv4_cache_blocks_used", "cache pool blocks in use",
                                      registry=r)
        self.blocks_total = prom.Gauge("dsv4_cache_blocks_total", "cache pool blocks",
                                       registry=r)
        self.cache_usage = prom.Gauge("dsv4_cache_usage_ratio", "share of pool blocks in use",
                                      registry=r)
        self.slots_used = prom.Gauge("dsv4_cache_slots_used", "request slots in use",
                                     registry=r)
        self.prefix_queried = prom.Counter(
            "dsv4_prefix_cache_queried_tokens", "prompt tokens of admitted requests", registry=r)
        self.prefix_hit = prom.Counter(
            "dsv4_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache (not "
            "prefilled)", registry=r)
        self.prefix_entries = prom.Gauge("dsv4_prefix_cache_entries", "cached prefixes",
                                         registry=r)
        self.prefix_blocks = prom.Gauge("dsv4_prefix_cache_blocks",
                                        "pool blocks the cached prefixes hold", registry=r)
        start = lowerings()
        prom.Gauge("dsv4_compilations", "jax programs lowered since the server became ready "
                   "(0 unless a request compiled one)", registry=r).set_function(
                       lambda: lowerings() - start)
        prom.Info("dsv4_model", "the served model", registry=r).info({"name": model})

    # ---- scheduler hooks (engine thread) ------------------------------------------------
    def on_token(self, req, now: float, first: bool) -> None:
        self.gen_tokens.inc()
        if first:
            self.ttft.observe(now - req.t_arrival)
            self.prompt_tokens.inc(len(req.prompt))
        else:
            self.itl.observe(now - req.t_last)
        with self._lock:
            self._recent.append(now)

    def on_admit(self, req) -> None:
        self.prefix_queried.inc(len(req.prompt))
        self.prefix_hit.inc(req.cached_tokens)

    def on_finish(self, req, reason: str) -> None:
        self.finished.labels(reason).inc()
        if req.t_last is not None:
            self.e2e.observe(req.t_last - req.t_arrival)

    def _update_rate(self) -> None:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0] < now - self.window:
                self._recent.popleft()
            self.tps.set(len(self._recent) / self.window)

    def on_step(self, sch) -> None:
        self._update_rate()
        self.waiting.set(sch.queue_depth)
        self.running.set(len(sch.running))
        used = sch.blocks_used()
        self.blocks_used.set(used)
        self.blocks_total.set(sch.cs.num_blocks)
        self.cache_usage.set(used / sch.cs.num_blocks)
        self.slots_used.set(len(sch.running))
        if sch.prefix is not None:
            self.prefix_entries.set(len(sch.prefix.entries))
            self.prefix_blocks.set(sch.prefix.blocks_held)

    def render(self) -> bytes:
        self._update_rate()   # also while idle, when no step updates it
        return prom.generate_latest(self.registry)
