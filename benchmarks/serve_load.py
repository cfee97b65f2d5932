"""Load test of `dsv4 serve`: a bounded number of streaming completions from a fixed number
of concurrent clients (closed loop) -> requests/s, output tokens/s and the percentiles of
time to first token, the gaps between streamed events (itl_s) and the time per output token
(tpot_s), as the clients see them over HTTP.

    # against a running server
    python -m benchmarks.serve_load --url http://127.0.0.1:8000 --requests 64 --concurrency 16
    # or an in-process server, built from the model flags `dsv4 serve` takes (default: the
    # embedded model; --preset tiny, --checkpoint DIR, --devices N, --kernels ...), with the
    # fixed-batch Engine.generate on the same prompts for comparison
    PYTHONPATH=. python -m benchmarks.serve_load --requests 32 --concurrency 8 --compare-fixed

    # prefix caching: prompts sharing 160 tokens, with and without the cache
    PYTHONPATH=. python -m benchmarks.serve_load --shared-prefix 160 --prefix-cache-entries 0
    PYTHONPATH=. python -m benchmarks.serve_load --shared-prefix 160 --prefix-cache-entries 16

The clients of an in-process server run in a process of their own (--clients-in-process:
on threads beside the server, sharing its interpreter lock); --sample-stacks reports where
the server's threads spend their time. Bounded in count (--requests) and time (--time-limit: clients stop starting requests).
Prompts are random token ids (seeded), after --shared-prefix common ones; every request
generates exactly --max-tokens tokens (ignore_eos), so the runs are comparable. The prefix
cache's hit rate is read from the server's /metrics.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time

import numpy as np


def percentiles(xs, ps=(50, 90, 99)):
    if not xs:
        return {f"p{p}": float("nan") for p in ps}
    return {f"p{p}": float(np.percentile(xs, p)) for p in ps}


def one_request(http, url, model, prompt, max_tokens):
    """One streaming completion -> (ttft s, [inter-event gaps s], tokens, s per output
    token after the first)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, gaps, tokens, t_first = None, None, [], 0, None
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if not ev["choices"]:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft, t_first = now - t0, now
            else:
                gaps.append(now - last)
            last = now
    tpot = (last - t_first) / (tokens - 1) if tokens > 1 and t_first is not None else None
    return ttft, gaps, tokens, tpot


def run_load(url, model, prompts, max_tokens, concurrency, time_limit):
    import httpx
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    res, errors = [], []
    t_end = time.perf_counter() + time_limit

    def client():
        with httpx.Client(timeout=max(time_limit, 60)) as http:
            while time.perf_counter() < t_end:
                with lock:
                    if not todo:
                        return
                    _, p = todo.pop(0)
                try:
                    r = one_request(http, url, model, p, max_tokens)
                except Exception as e:   # reported, not fatal: a load test counts failures
                    errors.append(repr(e))
                    continue
                with lock:
                    res.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in res]
    gaps = [g for r in res for g in r[1]]
    toks = sum(r[2] for r in res)
    return {"requests": len(res), "errors": len(errors), "wall_s": wall,
            "requests_per_s": len(res) / wall, "output_tokens_per_s": toks / wall,
            "ttft_s": percentiles(ttfts), "itl_s": percentiles(gaps),
            "tpot_s": percentiles([r[3] for r in res if r[3] is not None]),
            "first_error": errors[0] if errors else None}


def run_load_elsewhere(*args):
    """run_load in a process of its own (spawned: numpy and httpx, no jax), so that the
    clients' parsing does not share the server's interpreter lock, as real clients do not."""
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(run_load, *args).result()


class StackSampler:
    """Where the server's threads spend their time: every `interval_s`, the innermost frame
    of each live thread (sys._current_frames), counted by function, and the innermost frame
    in dsv4_jax (what of ours it is in). A sampler of its own costs the interpreter lock
    ~1% at 2 ms; device waits show as the frame that blocks (StepResult.fetch)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.leaf: dict[str, dict[str, int]] = {}
        self.ours: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self):
        self._cpu0, self._t0 = self.thread_cpu(), time.perf_counter()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        cpu1, self.wall_s = self.thread_cpu(), time.perf_counter() - self._t0
        self.cpu_s = {n: round(c - self._cpu0.get(n, 0.0), 3) for n, c in cpu1.items()}

    @staticmethod
    def thread_cpu() -> dict[str, float]:
        """CPU seconds (user + system) of each live thread, by name (Linux /proc): what a
        thread blocked in C (a selector, a device wait) cannot show in its stack."""
        out, tick = {}, os.sysconf("SC_CLK_TCK")
        for t in threading.enumerate():
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
                out[t.name] = out.get(t.name, 0.0) + (int(f[11]) + int(f[12])) / tick
            except (OSError, TypeError, IndexError, ValueError):
                pass
        return out

    def _run(self):
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, "?")
                leaf = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
                ours, f = "(not in dsv4_jax)", frame
                while f is not None:
                    if "dsv4_jax" in f.f_code.co_filename:
                        ours = (f"{f.f_code.co_filename.split('dsv4_jax/', 1)[-1]}:"
                                f"{f.f_code.co_name}")
                        break
                    f = f.f_back
                for d, k in ((self.leaf, leaf), (self.ours, ours)):
                    c = d.setdefault(name, {})
                    c[k] = c.get(k, 0) + 1

    def report(self, top: int = 12) -> dict:
        """{"cpu_s": {thread: CPU seconds}, "wall_s", thread: {"leaf": [(function, share of
        the samples)], "ours": [...]}} for the busiest threads."""
        out = {"wall_s": round(self.wall_s, 3), "cpu_s": self.cpu_s}
        for name in sorted(self.leaf, key=lambda n: -sum(self.leaf[n].values()))[:6]:
            out[name] = {kind: [(k, round(v / max(self.samples, 1), 3)) for k, v in
                                sorted(d[name].items(), key=lambda kv: -kv[1])[:top]]
                         for kind, d in (("leaf", self.leaf), ("ours", self.ours))}
        return out


def prefix_stats(metrics_text: str) -> dict:
    """Hit rate of the prefix cache from a /metrics page: prompt tokens served from it over
    all admitted prompt tokens."""
    vals = {}
    for line in metrics_text.splitlines():
        for name in ("dsv4_prefix_cache_queried_tokens_total", "dsv4_prefix_cache_hit_tokens_total"):
            if line.startswith(name + " "):
                vals[name] = float(line.split()[1])
    q = vals.get("dsv4_prefix_cache_queried_tokens_total", 0)
    h = vals.get("dsv4_prefix_cache_hit_tokens_total", 0)
    return {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else float("nan")}


def main(argv=None):
    from dsv4_jax import cli
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one in this process with "
                    "the model flags below, as `dsv4 serve` takes them)")
    ap.add_argument("--served-model", default=None,
                    help="with --url: the model name (default: the server's)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--time-limit", type=float, default=300.0,
                    help="seconds after which clients start no new request")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt starts with (before its own MIN..MAX)")
    # the in-process server: the model flags of `dsv4 generate` / `dsv4 serve` (--seed also
    # draws the prompts)
    cli._add_model_args(ap)
    ap.set_defaults(max_requests=8, num_blocks=32, max_blocks=2, prefill_chunk=32)
    ap.add_argument("--prefix-cache-entries", type=int, default=16,
                    help="in-process server: cached prefixes (0: off)")
    ap.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                    help="in-process: the server (and the fixed batch) draft K tokens a step "
                         "with the MTP block (needs --prefix-cache-entries 0)")
    ap.add_argument("--decode-steps", type=int, default=1, metavar="N",
                    help="in-process server: plain decode steps a program (dsv4 serve "
                         "--decode-steps)")
    ap.add_argument("--compare-fixed", action="store_true",
                    help="in-process: also time Engine.generate (fixed batches of "
                         "--max-requests, the fused decode loop) on the same prompts")
    ap.add_argument("--clients-in-process", action="store_true",
                    help="in-process server: run the clients on threads of the server's "
                         "process (default: a process of their own)")
    ap.add_argument("--sample-stacks", action="store_true",
                    help="in-process server: sample its threads' stacks during the load and "
                         "report where each spends its time")
    args = ap.parse_args(argv)
    for f in ("requests", "concurrency", "max_tokens"):
        if getattr(args, f) < 1:
            ap.error(f"--{f.replace('_', '-')} must be at least 1")
    lo, hi = args.prompt_len
    if not 1 <= lo <= hi:
        ap.error("--prompt-len needs 1 <= MIN <= MAX")
    rng = np.random.default_rng(args.seed)
    shared = [int(t) for t in rng.integers(16, 272, args.shared_prefix)]
    prompts = [shared + [int(t) for t in rng.integers(16, 272, int(rng.integers(lo, hi + 1)))]
               for _ in range(args.requests)]
    out = {"machine": None, "args": vars(args)}
    if args.url:
        import httpx
        model = args.served_model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        out["load"] = run_load(args.url, model, prompts, args.max_tokens, args.concurrency,
                               args.time_limit)
        out["prefix_cache"] = prefix_stats(httpx.get(args.url + "/metrics").text)
    else:
        import jax
        from dsv4_jax.serve.run import BackgroundServer, build
        from dsv4_jax.serve.scheduler import SchedulerConfig
        eng, tok, name = cli.serving_engine(args)
        out["machine"] = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
        out["model"] = name
        if args.compare_fixed:
            kw = dict(max_new_tokens=args.max_tokens, stop_ids=(),
                      speculative_tokens=args.speculative_tokens)
            eng.generate(prompts[:args.max_requests], **kw)   # compiles the loop
            t0 = time.perf_counter()
            res = eng.generate(prompts, **kw)
            wall = time.perf_counter() - t0
            out["fixed_batch"] = {"requests": len(prompts), "wall_s": wall,
                                  "requests_per_s": len(prompts) / wall,
                                  "output_tokens_per_s": sum(map(len, res)) / wall}
            # the stream step at the server's batch (Engine.stream, one step behind): what
            # the server's inter-token latency compares with
            batch = prompts[:min(args.concurrency, args.max_requests)]
            for _ in range(2):   # the first run compiles
                for _ in eng.stream(batch, **kw):
                    pass
            out["stream_step_ms"] = 1e3 * eng.timing.decode_s / max(eng.timing.decode_steps, 1)
        t0 = time.perf_counter()
        srv = build(eng, tok, name, seed=args.seed,
                    config=SchedulerConfig(prefix_cache_entries=args.prefix_cache_entries,
                                           speculative_tokens=args.speculative_tokens,
                                           decode_steps=args.decode_steps))
        out["warm_up_s"] = time.perf_counter() - t0
        with BackgroundServer(srv) as url:
            load = run_load if args.clients_in_process else run_load_elsewhere
            steps0 = srv.sch.steps
            with StackSampler() if args.sample_stacks else contextlib.nullcontext() as sampler:
                out["load"] = load(url, name, prompts, args.max_tokens, args.concurrency,
                                   args.time_limit)
            if sampler is not None:
                out["stacks"] = dict(sampler.report(), scheduler_steps=srv.sch.steps - steps0)
            import httpx
            out["prefix_cache"] = prefix_stats(httpx.get(url + "/metrics").text)
    json.dump(out, sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main()
