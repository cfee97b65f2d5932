"""`dsv4 serve` end to end: the real HTTP server (uvicorn on a free localhost port) over
the embedded model (dsv4-small-stdlib, its BPE tokenizer), driven by the official `openai`
client and raw HTTP.

One server per module (its programs compile once, in the warm-up). The greedy references
come from Engine.generate on the same engine before the server starts (the fixed-batch
path, no scheduler). Tool calls go through a second server whose "model" replays a
scripted DSV4 completion: the embedded model was never taught DSML."""
import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from dsv4_jax import chat, config, load
from dsv4_jax.embedded import EMBEDDED_NAME, embedded_checkpoint
from dsv4_jax.cache import CacheSpec
from dsv4_jax.cli import main as cli_main
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics
from dsv4_jax.serve.run import BackgroundServer, build, free_port
from dsv4_jax.serve.api import Server
from dsv4_jax.serve.metrics import Metrics
from dsv4_jax.serve.scheduler import Output, SchedulerConfig
from dsv4_jax.serve.text import IncrementalText
from dsv4_jax.tokenizer import ByteTokenizer, load_tokenizer

R, CHUNK, NEW = 4, 16, 8
RNG = np.random.default_rng(600)
# token-id prompts (plain completions) over one or more prefill chunks
ID_PROMPTS = [[int(t) for t in RNG.integers(16, 272, n)] for n in (7, 33, 20)]
LONG = [int(t) for t in RNG.integers(16, 272, 150)]   # a whole block to cache, and more
MODEL = EMBEDDED_NAME
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three primes."}]


@pytest.fixture(scope="module")
def embedded():
    cfg, params = load(embedded_checkpoint())
    return cfg, params, load_tokenizer(str(embedded_checkpoint()), cfg.vocab_size)


@pytest.fixture(scope="module")
def server(embedded):
    """-> (base url, Server, references): the greedy tokens Engine gives for ID_PROMPTS and
    for CHAT (thinking on), computed on the same engine before it serves."""
    cfg, params, tok = embedded
    cs = CacheSpec.for_numerics(Numerics(), max_requests=R, num_blocks=6, max_blocks=2)
    eng = Engine(cfg, params, cache_spec=cs, prefill_chunk=CHUNK, progress=False)
    chat_ids = tok.encode(chat.encode_messages(CHAT, thinking_mode="thinking"))
    refs = eng.generate(ID_PROMPTS + [chat_ids, LONG], max_new_tokens=NEW, jit_loop=False,
                        stop_ids=tok.stop_ids)
    ref = {"ids": refs[:-2], "chat": refs[-2], "long": refs[-1]}
    srv = build(eng, tok, MODEL, SchedulerConfig(prefix_cache_entries=2), seed=0)
    with BackgroundServer(srv) as url:
        yield url, srv, ref


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def aborted(url) -> float:
    """Generations finished by a cancel so far (the label appears with the first)."""
    try:
        return metric(url, 'dsv4_generations_finished_total{reason="abort"}')
    except KeyError:
        return 0.0


def text_of(tok, ids, stops):
    """The text a request outputs for tokens `ids`: a final stop id's text is not part."""
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    return tok.decode(ids)


def test_models_health_metrics(server):
    url, srv, _ = server
    assert [m.id for m in client(url).models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    # the pool's size reads right before any client's request
    assert metric(url, "dsv4_cache_blocks_total") == srv.sch.cs.num_blocks == 6
    text = httpx.get(url + "/metrics").text
    for name in ("dsv4_requests_total", "dsv4_queue_depth", "dsv4_generation_tokens_per_second",
                 "dsv4_time_to_first_token_seconds", "dsv4_inter_token_latency_seconds",
                 "dsv4_cache_usage_ratio", "dsv4_compilations"):
        assert name in text


def test_concurrent_mixed_requests(server):
    """Streaming and non-streaming, completions and chat, greedy and sampled with different
    settings, n=2, all at once: greedy ones give Engine's text, a seeded one repeats, and
    nothing compiles after the warm-up."""
    url, srv, ref = server
    c, tok = client(url), srv.tok
    lowered = metric(url, "dsv4_compilations")

    def completion(i, stream):
        kw = dict(model=MODEL, prompt=ID_PROMPTS[i], max_tokens=NEW, temperature=0)
        if not stream:
            r = c.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens
        return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw)
                       if ch.choices), None

    def sampled_chat(seed, stream, **kw):
        args = dict(model=MODEL, messages=CHAT, max_tokens=NEW, seed=seed, **kw)
        if not stream:
            return c.chat.completions.create(**args).choices[0].message.content
        return "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(stream=True, **args) if ch.choices)

    def thinking_chat():
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW,
                                      temperature=0,
                                      extra_body={"chat_template_kwargs": {"thinking": True}})
        return r.choices[0].message

    with ThreadPoolExecutor(8) as pool:
        jobs = {"c0": pool.submit(completion, 0, False), "c1": pool.submit(completion, 1, True),
                "c2": pool.submit(completion, 2, False),
                "s1": pool.submit(sampled_chat, 11, False, temperature=1.2, top_p=0.8),
                "s2": pool.submit(sampled_chat, 11, True, temperature=1.2, top_p=0.8),
                "s3": pool.submit(sampled_chat, 5, True, temperature=0.7,
                                  extra_body={"top_k": 20, "min_p": 0.05}),
                "n2": pool.submit(lambda: c.completions.create(
                    model=MODEL, prompt="abc", max_tokens=4, n=2, temperature=1.0, seed=3)),
                "think": pool.submit(thinking_chat),
                "c0s": pool.submit(completion, 0, True)}
        got = {k: f.result() for k, f in jobs.items()}
    stops = set(tok.stop_ids)
    for i, key in enumerate(("c0", "c1", "c2")):
        assert got[key][0] == text_of(tok, ref["ids"][i], stops), key
    assert got["c0"][1] == len(ref["ids"][0])
    assert got["c0s"][0] == got["c0"][0]
    assert got["s1"] == got["s2"]   # same seed and settings: same draws, streamed or not
    assert len(got["n2"].choices) == 2 and [ch.index for ch in got["n2"].choices] == [0, 1]
    want = chat.parse_completion(text_of(tok, ref["chat"], stops), "thinking")
    msg = got["think"]
    assert msg.reasoning_content == want["reasoning_content"]
    assert msg.content == want["content"]
    assert metric(url, "dsv4_compilations") == lowered == 0   # none since the warm-up
    assert metric(url, "dsv4_cache_slots_used") == 0


def test_bad_input_gets_openai_errors_and_serving_goes_on(server):
    url, srv, _ = server
    c = client(url)
    body = b'{"model": "' + MODEL.encode() + b'", "messages": ['   # cut short
    r = httpx.post(url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "JSON" in err["message"]
    cases = [(dict(prompt="x", temperature="hot"), "temperature", "invalid_type"),
             (dict(prompt="x", top_p=2.0), "top_p", "invalid_value"),
             (dict(prompt="x", temperature=-0.5), "temperature", "invalid_value"),
             (dict(prompt="x", n=0), "n", "invalid_value"),
             (dict(prompt="x", max_tokens="many"), "max_tokens", "invalid_type"),
             (dict(prompt=[5] * srv.capacity, max_tokens=4), "prompt",
              "context_length_exceeded"),
             (dict(prompt="x", max_tokens=10 * srv.capacity), "max_tokens",
              "context_length_exceeded"),
             (dict(prompt=[5, 10 ** 7], max_tokens=2), "prompt", "invalid_value")]
    for kw, param, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, **kw)
        assert e.value.status_code == 400
        assert (e.value.body["param"], e.value.body["code"]) == (param, code), kw
        if kw.get("max_tokens") == "many":
            assert "'max_tokens' must be an integer" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-5", prompt="x")
    assert httpx.get(url + "/v1/nowhere").status_code == 404
    assert srv.sch.queue_depth == 0 and not srv.sch.running
    r = c.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_disconnect_mid_stream_frees_the_slot(server):
    url, srv, _ = server
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 0}
    n_aborted = aborted(url)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]   # two events (each one line + a blank)
        assert got[0].startswith("data: ") and len(srv.sch.running) == 1
    t0 = time.monotonic()
    while srv.sch.running and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    assert not srv.sch.running and srv.sch.blocks_used() == srv.sch.prefix.blocks_held
    assert aborted(url) == n_aborted + 1


def test_disconnect_while_waiting_for_a_whole_answer(server):
    """A non-streaming client that gives up: its request is cancelled too (it would run
    200 steps otherwise)."""
    url, srv, _ = server
    n_aborted = aborted(url)
    body = {"model": MODEL, "prompt": "wait for it", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    t0 = time.monotonic()
    while srv.sch.running and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    assert not srv.sch.running and srv.sch.queue_depth == 0
    assert aborted(url) == n_aborted + 1


def test_prefix_cache_hit_reported_in_usage(server):
    """The same 150-token prompt twice: the second reuses its first block (128 tokens, as
    usage and the metrics say) and gives the same greedy text as Engine."""
    url, srv, ref = server
    c = client(url)
    hit0 = metric(url, "dsv4_prefix_cache_hit_tokens_total")
    got = [c.completions.create(model=MODEL, prompt=LONG, max_tokens=NEW, temperature=0)
           for _ in range(2)]
    want = text_of(srv.tok, ref["long"], set(srv.tok.stop_ids))
    assert [r.choices[0].text for r in got] == [want, want]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in got] == [0, 128]
    assert metric(url, "dsv4_prefix_cache_hit_tokens_total") == hit0 + 128


# ---- tool calls and reasoning, through HTTP, from a scripted completion ------------------
SCRIPT = ("Think about the weather.</think>Let me check." + "\n\n" + chat._render_tool_calls(
    [{"function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris",
                                                                    "days": 3})}}], "script"))


class ScriptedScheduler:
    """The scheduler's surface for the API, replaying SCRIPT token by token."""

    def __init__(self, tok):
        self.tok, self.cs = tok, CacheSpec(max_requests=1, num_blocks=4, max_blocks=2)
        self.config = SchedulerConfig()
        self.queue_depth, self.running = 0, {}

    def check(self, prompt, params):
        pass

    def submit(self, req):
        def play():
            inc = IncrementalText(self.tok.decode)
            ids = self.tok.encode(SCRIPT) + [self.tok.eos_id]
            for k, t in enumerate(ids):
                req.out_ids.append(t)
                fin = "stop" if t == self.tok.eos_id else None
                text = inc.finish() if fin else inc.push([t])[0]
                req.sink(Output(text=text, token_ids=[t], finish_reason=fin,
                                prompt_tokens=len(req.prompt), completion_tokens=k + 1))
            req.done = True
        threading.Thread(target=play, daemon=True).start()
        return req

    def run(self, stop):
        stop.wait()


@pytest.fixture(scope="module")
def scripted():
    tok = ByteTokenizer(1024)
    with BackgroundServer(Server(ScriptedScheduler(tok), tok, "scripted")) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_reasoning_parsed(scripted, stream):
    c = client(scripted)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    kw = dict(model="scripted", messages=[{"role": "user", "content": "weather?"}],
              tools=tools, reasoning_effort="high", max_tokens=64)
    want = chat.parse_completion(SCRIPT, "thinking")
    if not stream:
        ch = c.chat.completions.create(**kw).choices[0]
        msg, finish = ch.message, ch.finish_reason
        content, reasoning, calls = msg.content, msg.reasoning_content, msg.tool_calls
    else:
        content = reasoning = ""
        calls, finish = [], None
        for ev in c.chat.completions.create(stream=True, **kw):
            d = ev.choices[0].delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            calls += d.tool_calls or []
            finish = ev.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content == want["content"] == "Let me check." and chat.DSML not in content
    assert reasoning == want["reasoning_content"]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    assert all(t.id and t.type == "function" for t in calls)


def test_cli_serve_refuses_bad_flags_before_loading(capsys):
    assert cli_main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli_main(["serve", "--max-waiting", "0"]) == 2
    assert cli_main(["serve", "--prefix-cache-entries", "-1"]) == 2
    assert cli_main(["serve", "--devices", "1", "--prefix-cache-entries", "4"]) == 2
    assert "single-device" in capsys.readouterr().err


# ---- what a new user hit (issue 54): a scripted server, no model ------------------------
LIMIT = 100_000   # request body bytes


class SlowTokenizer(ByteTokenizer):
    """Tokenizes a prompt longer than 10k characters only once the test lets it go (as
    megabytes of text take seconds)."""

    def __init__(self):
        super().__init__(1024)
        self.busy, self.go = threading.Event(), threading.Event()

    def encode(self, text):
        if len(text) > 10_000:
            self.busy.set()
            self.go.wait(10)
        return super().encode(text)


@pytest.fixture(scope="module")
def slow():
    tok = SlowTokenizer()
    srv = Server(ScriptedScheduler(tok), tok, "scripted", Metrics("scripted"),
                 max_body_bytes=LIMIT)
    with BackgroundServer(srv) as url:
        yield url, tok


def test_health_answers_while_a_long_prompt_is_tokenized(slow):
    url, tok = slow
    tok.go.clear()
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, url + "/v1/completions", timeout=60,
                          json={"model": "scripted", "prompt": "x" * (LIMIT // 2),
                                "max_tokens": 4})
        try:
            assert tok.busy.wait(10), "the long prompt never reached the tokenizer"
            t0 = time.monotonic()
            health = httpx.get(url + "/health", timeout=5)
            took = time.monotonic() - t0
        finally:
            tok.go.set()
        assert health.status_code == 200 and took < 2.0, took
        assert big.result().status_code == 200


def test_an_oversized_body_gets_413_and_serving_goes_on(slow):
    url, _ = slow
    body = json.dumps({"model": "scripted", "prompt": "y" * LIMIT}).encode()
    for content in (body, (body[i:i + 8192] for i in range(0, len(body), 8192))):
        # with a Content-Length, then chunked (counted as it arrives)
        r = httpx.post(url + "/v1/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert client(url).completions.create(model="scripted", prompt="ok", max_tokens=2)


def test_unsupported_generation_fields_are_refused(slow):
    """response_format asks for constrained (JSON) decoding, which this server does not
    do: 400, never a silent plain-text answer; likewise logit_bias and vLLM's guided_*."""
    url, _ = slow
    c = client(url)
    msgs = [{"role": "user", "content": "json please"}]
    for kw in (dict(response_format={"type": "json_object"}),
               dict(response_format={"type": "json_schema", "json_schema": {
                   "name": "x", "schema": {"type": "object"}}}),
               dict(logit_bias={"5": 10}),
               dict(extra_body={"guided_json": {"type": "object"}})):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="scripted", messages=msgs, max_tokens=4, **kw)
        param = next(iter(kw.get("extra_body", kw)))
        assert (e.value.body["param"], e.value.body["code"]) == (param,
                                                                 "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="scripted", prompt="x", best_of=3)
    assert e.value.body["param"] == "best_of"
    r = c.chat.completions.create(model="scripted", messages=msgs, max_tokens=4,
                                  response_format={"type": "text"})
    assert r.choices[0].finish_reason


def endpoint_counts(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("dsv4_requests_total{"):
            ep = line.split('endpoint="')[1].split('"')[0]
            out[ep] = out.get(ep, 0) + float(line.rsplit(" ", 1)[1])
    return out


def test_model_retrieve(slow):
    """GET /v1/models/{id} (the openai client's models.retrieve), counted under its
    route's template."""
    url, _ = slow
    c = client(url)
    assert c.models.retrieve("scripted").id == "scripted"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-5")
    assert e.value.body["code"] == "model_not_found"
    got = endpoint_counts(url)
    assert got["/v1/models/{model_id:path}"] >= 2 and "/v1/models/gpt-5" not in got, got


def test_endpoint_labels_are_bounded(slow):
    """Every unknown path counts as one "other" endpoint, not a label series each."""
    url, _ = slow
    assert httpx.get(f"{url}/v1/models").status_code == 200
    for i in range(5):
        assert httpx.get(f"{url}/v1/nowhere-{i}").status_code == 404
    got = endpoint_counts(url)
    assert not [e for e in got if "nowhere" in e], got
    assert got["other"] >= 5 and got["/v1/models"] >= 1


def test_cli_serve_on_a_busy_port_exits_2_before_loading(capsys, monkeypatch):
    from dsv4_jax import cli
    monkeypatch.setattr(cli, "serving_engine",
                        lambda args: pytest.fail("the model loaded before the port was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_main(["serve", "--port", str(port)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("dsv4 serve: error: ") and f"--port {port}" in line \
        and "in use" in line
    assert cli_main(["serve", "--host", "10.255.255.1", "--port", str(port)]) == 2
    assert "not an address of this machine" in capsys.readouterr().err


def test_cli_serve_says_ready_once_it_listens(capsys, monkeypatch):
    """`ready` is printed when the port answers (uvicorn's start slowed down here by a
    second, so a line printed before it would find the port closed)."""
    import uvicorn
    from dsv4_jax import cli
    from dsv4_jax.serve import run as serve_run
    tok = ByteTokenizer(1024)

    class Eng:
        cfg = config.tiny()
    monkeypatch.setattr(cli, "serving_engine", lambda args: (Eng(), tok, "scripted"))
    monkeypatch.setattr(serve_run, "build", lambda *a, **k: Server(ScriptedScheduler(tok),
                                                                   tok, "scripted"))
    started = uvicorn.Server.startup

    async def slow_startup(self, sockets=None):
        await asyncio.sleep(1.0)
        await started(self, sockets=sockets)
    monkeypatch.setattr(uvicorn.Server, "startup", slow_startup)
    servers = []
    make = getattr(serve_run, "http_server", None)
    monkeypatch.setattr(serve_run, "http_server",
                        lambda *a, **k: servers.append(make(*a, **k)) or servers[-1],
                        raising=False)
    port, rc = free_port(), []
    th = threading.Thread(target=lambda: rc.append(cli_main(
        ["serve", "--port", str(port), "--log-level", "warning"])), daemon=True)
    th.start()
    err, t0 = "", time.monotonic()
    try:
        while "ready" not in err and th.is_alive() and time.monotonic() - t0 < 30:
            time.sleep(0.01)
            err += capsys.readouterr().err
        assert f"http://127.0.0.1:{port}/v1" in err, err
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        for s in servers:
            s.should_exit = True
        th.join(30)
    assert rc == [0]


def test_cli_serve_start_failure_exits_1(capsys, monkeypatch):
    """A server that fails to start exits 1 with one line (uvicorn's own status would be
    3, which the CLI does not document)."""
    from dsv4_jax import cli
    from dsv4_jax.serve import run as serve_run
    tok = ByteTokenizer(1024)

    class Eng:
        cfg = config.tiny()

    class Broken(Server):
        def start(self):
            raise RuntimeError("the engine thread did not start")
    monkeypatch.setattr(cli, "serving_engine", lambda args: (Eng(), tok, "scripted"))
    monkeypatch.setattr(serve_run, "build", lambda *a, **k: Broken(ScriptedScheduler(tok),
                                                                   tok, "scripted"))
    assert cli_main(["serve", "--port", str(free_port()), "--log-level", "critical"]) == 1
    err = capsys.readouterr().err
    assert "dsv4 serve: failed" in err and "ready" not in err, err


@pytest.mark.slow  # ~65 s (the scheduler's speculative tests stay)
def test_speculative_server_gives_the_plain_text_and_reports_acceptance(embedded, server):
    """`dsv4 serve --speculative-tokens 2` on its own engine: greedy completions (streamed
    and not) give the plain server's text; usage reports the decode steps and the accepted
    drafts; nothing compiles after the warm-up."""
    from dsv4_jax.serve import metrics as MX
    cfg, params, tok = embedded
    _, _, ref = server
    cs = CacheSpec.for_numerics(Numerics(), max_requests=R, num_blocks=6, max_blocks=2)
    eng = Engine(cfg, params, cache_spec=cs, prefill_chunk=CHUNK, progress=False)
    n_new = 24
    want = eng.generate(ID_PROMPTS, max_new_tokens=n_new, jit_loop=False, stop_ids=tok.stop_ids)
    srv = build(eng, tok, MODEL, SchedulerConfig(speculative_tokens=2), seed=0)
    lowered = MX.lowerings()
    with BackgroundServer(srv) as url:
        c = client(url)
        with ThreadPoolExecutor(len(ID_PROMPTS)) as pool:
            got = list(pool.map(lambda p: c.completions.create(
                model=MODEL, prompt=p, max_tokens=n_new, temperature=0), ID_PROMPTS))
        streamed = c.completions.create(model=MODEL, prompt=ID_PROMPTS[1], max_tokens=n_new,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True})
        parts = list(streamed)
    assert MX.lowerings() == lowered
    stops = set(tok.stop_ids)
    for r, w in zip(got, want):
        assert r.choices[0].text == text_of(tok, w, stops)
        spec = r.usage.model_extra["speculative"]
        assert spec["draft_tokens_per_step"] == 2 and spec["decode_steps"] >= 1
        # 1 .. 3 tokens a step; the embedded model's MTP block drafts well
        assert 1 <= spec["tokens_per_step"] <= 3
        assert spec["accepted_draft_tokens"] == r.usage.completion_tokens - 1 - spec["decode_steps"]
    assert "".join(p.choices[0].text for p in parts if p.choices) == text_of(tok, want[1], stops)
    assert parts[-1].usage.model_extra["speculative"]["decode_steps"] >= 1


def test_outbox_wakes_the_loop_once_per_burst():
    """Outputs put from the engine thread while the loop is busy join one scheduled flush
    (one loop wake-up a step, not one a token), arrive in order, and a closed loop drops
    them without an error."""
    from dsv4_jax.serve.api import Outbox

    class Loop:
        def __init__(self, closed=False):
            self.calls, self.closed = [], closed

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls.append((fn, args))

    class Q(list):
        put_nowait = list.append

    box, loop, q1, q2 = Outbox(), Loop(), Q(), Q()
    items = [(i % 3, f"out{i}") for i in range(40)]
    t = threading.Thread(target=lambda: [box.put(loop, q1 if i % 2 else q2, it)
                                         for i, it in enumerate(items)])
    t.start()
    t.join()
    assert len(loop.calls) == 1
    fn, args = loop.calls.pop()
    fn(*args)
    assert q1 == items[1::2] and q2 == items[0::2]
    box.put(loop, q1, "next")   # the flush ran: the next output schedules another
    assert len(loop.calls) == 1
    dead = Loop(closed=True)
    box.put(dead, q1, "lost")
    box.put(dead, q1, "lost")   # nothing left behind blocks later puts
    assert not dead.calls and q1[-1] == items[-1]
