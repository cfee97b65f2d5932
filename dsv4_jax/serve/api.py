"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions (both
streaming as server-sent events ending in `data: [DONE]`, and not), /v1/models,
/v1/models/{id}, /health, /metrics.

The scheduler runs on its own engine thread (started and stopped with the app); a handler
submits its requests and reads their outputs from an asyncio queue that the engine thread
fills. Bad input is answered 4xx with an OpenAI error body
{"error": {"message", "type", "param", "code"}} before anything is queued. The event loop
only moves bytes: a body is capped (413 above Server.max_body_bytes) and prompts are
tokenized on worker threads, so one large request never stalls the others or /health.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .. import chat
from .sampling import SamplingParams
from .scheduler import Output, Overloaded, Request, RequestError, Scheduler
from .text import ChatOutputParser

log = logging.getLogger("dsv4.serve")

MAX_N = 16   # choices per request
MAX_BODY_BYTES = 16 << 20   # request bodies above get 413 (`dsv4 serve --max-request-size`)


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_

    def response(self) -> JSONResponse:
        return error_response(str(self), self.status, self.param, self.code, self.type)


def error_response(message, status=400, param=None, code=None, type_="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status)


# ---------------------------------------------------------------------------------------
# Field checks: each names the field and what would be valid
# ---------------------------------------------------------------------------------------
def _get(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind` ("number", "integer", "boolean", "string",
    "object", "array"); absent or null -> default."""
    v = body.get(name)
    if v is None:
        return default
    ok = {"number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool),
          "integer": lambda: isinstance(v, int) and not isinstance(v, bool),
          "boolean": lambda: isinstance(v, bool),
          "string": lambda: isinstance(v, str),
          "object": lambda: isinstance(v, dict),
          "array": lambda: isinstance(v, list)}[kind]()
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ApiError(f"'{name}' must be {article} {kind}, got {json.dumps(v)[:80]}",
                       param=name, code="invalid_type")
    return v


# Fields that change what is generated and that this server does not implement: refused,
# never silently ignored ({field: the values that mean "off"}). Fields that change nothing
# generated (user, metadata, store, ...) are ignored.
_UNSUPPORTED = {
    "logit_bias": ({},),
    "best_of": (1,),
    "functions": ([],), "function_call": ("none", "auto"),   # the legacy form of tools
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "prediction": (), "audio": (),
    "modalities": (["text"],),
}


def _refuse_unsupported(body: dict):
    for name, off in _UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v not in off:
            raise ApiError(f"'{name}' is not supported", param=name,
                           code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise ApiError(f"'response_format' {json.dumps(kind or fmt)[:40]} is not supported: "
                       "no constrained (JSON) decoding here; only {\"type\": \"text\"}",
                       param="response_format", code="unsupported_parameter")


def _stop_strings(body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("'stop' must be a non-empty string or a list of them", param="stop",
                       code="invalid_type")
    return tuple(stop)


def _sampling(body: dict, max_tokens_default: int, *, logprobs: bool, top_logprobs: int,
              extra_stop_ids=()) -> SamplingParams:
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, "number", 0) != 0:
            raise ApiError(f"'{name}' is not supported (only 0)", param=name,
                           code="unsupported_parameter")
    ids = _get(body, "stop_token_ids", "array", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError("'stop_token_ids' must be a list of integers", param="stop_token_ids",
                       code="invalid_type")
    kw = dict(temperature=_get(body, "temperature", "number", 1.0),
              top_p=_get(body, "top_p", "number", 1.0),
              top_k=_get(body, "top_k", "integer", 0),
              min_p=_get(body, "min_p", "number", 0.0),
              seed=_get(body, "seed", "integer"),
              max_tokens=max_tokens_default, stop=_stop_strings(body),
              stop_token_ids=tuple(ids) + tuple(extra_stop_ids),
              ignore_eos=_get(body, "ignore_eos", "boolean", False),
              logprobs=logprobs, top_logprobs=top_logprobs)
    try:
        return SamplingParams(**kw)
    except ValueError as e:   # the message starts with the field's name
        raise ApiError(str(e), param=str(e).split()[0], code="invalid_value") from None


def _n(body) -> int:
    n = _get(body, "n", "integer", 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(f"'n' must be in [1, {MAX_N}], got {n}", param="n", code="invalid_value")
    return n


def _max_tokens(body, names, default, capacity, prompt_len):
    for name in names:
        v = _get(body, name, "integer")
        if v is not None:
            if v < 1:
                raise ApiError(f"'{name}' must be >= 1, got {v}", param=name,
                               code="invalid_value")
            return v
    return default if default is not None else max(capacity - prompt_len, 1)


def _text_content(content, where: str):
    """OpenAI content: a string or a list of {"type": "text", "text"} parts -> str."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
                    p.get("text"), str):
                raise ApiError(f"{where}: only text content parts are supported",
                               param="messages", code="invalid_value")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(f"{where}: content must be a string or a list of text parts",
                   param="messages", code="invalid_type")


def _thinking(body) -> tuple[bool, str | None]:
    """-> (thinking on, the encoding's reasoning_effort). reasoning_effort "none" turns
    thinking off, "low" / "medium" / "high" on, "max" on with the maximum-effort preamble;
    chat_template_kwargs {"thinking" | "enable_thinking": bool} sets it explicitly."""
    efforts = ("none", "low", "medium", "high", "max")
    kwargs = _get(body, "chat_template_kwargs", "object", {})
    effort = _get(body, "reasoning_effort", "string")
    effort = kwargs.get("reasoning_effort", effort)
    if effort is not None and effort not in efforts:
        raise ApiError(f"'reasoning_effort' must be one of {efforts}, got {effort!r}",
                       param="reasoning_effort", code="invalid_value")
    thinking = effort is not None and effort != "none"
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise ApiError(f"'chat_template_kwargs.{key}' must be a boolean",
                               param="chat_template_kwargs", code="invalid_type")
            thinking = kwargs[key]
    return thinking, ("max" if thinking and effort == "max" else None)


def _chat_prompt(body) -> tuple[str, bool]:
    msgs = _get(body, "messages", "array")
    if not msgs:
        raise ApiError("'messages' must be a non-empty list", param="messages",
                       code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object", param="messages",
                           code="invalid_type")
        m = dict(m)
        m["content"] = _text_content(m.get("content"), f"messages[{i}]")
        out.append(m)
    tools = _get(body, "tools", "array")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError("'tool_choice' supports 'auto' and 'none'", param="tool_choice",
                       code="unsupported_parameter")
    if tools and choice != "none":   # DSV4 lists tools in the system prompt
        if out[0].get("role") == "system":
            out[0] = dict(out[0], tools=tools)
        else:
            out.insert(0, {"role": "system", "content": "", "tools": tools})
    thinking, effort = _thinking(body)
    try:
        text = chat.encode_messages(out, thinking_mode="thinking" if thinking else "chat",
                                    reasoning_effort=effort)
    except (ValueError, TypeError, KeyError) as e:
        raise ApiError(f"messages: {e}", param="messages", code="invalid_value") from None
    return text, thinking


# ---------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------
class Outbox:
    """Outputs from the engine thread to the handlers' asyncio queues. A scheduler step
    hands out one Output per running request; posting each with call_soon_threadsafe
    would wake the event loop (a write to its self-pipe) once per token. Here the first
    output of a burst schedules one flush, and the rest join it until the loop runs it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: dict[asyncio.AbstractEventLoop, list] = {}

    def put(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
        with self._lock:
            items = self._items.get(loop)
            if items is not None:   # a flush is scheduled and has not run yet
                items.append((q, item))
                return
            self._items[loop] = [(q, item)]
        try:
            loop.call_soon_threadsafe(self._flush, loop)
        except RuntimeError:   # the loop is closed: nobody reads
            with self._lock:
                self._items.pop(loop, None)

    def _flush(self, loop) -> None:
        with self._lock:
            items = self._items.pop(loop, ())
        for q, item in items:
            q.put_nowait(item)


class Server:
    """What the handlers share: the scheduler (and its engine thread), the tokenizer, the
    served model's name and the metrics."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, metrics=None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.sch, self.tok, self.model = scheduler, tokenizer, model_name
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.capacity = scheduler.cs.capacity
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._outbox = Outbox()

    def start(self):
        self._stop.clear()
        self.thread = threading.Thread(target=self.sch.run, args=(self._stop,),
                                       name="dsv4-engine", daemon=True)
        self.thread.start()

    def stop(self):
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tok.encode(text)
        return ids if text.startswith(chat.BOS) else [self.tok.bos_id] + ids

    async def encode_prompt_async(self, text: str) -> list[int]:
        """encode_prompt on a worker thread: megabytes of text take seconds to tokenize
        (the tokenizers library releases the GIL meanwhile)."""
        return await asyncio.to_thread(self.encode_prompt, text)

    def token_text(self, t: int) -> str:
        return self.tok.decode([t])

    async def submit(self, prompt, params_list):
        """Queue one request per SamplingParams -> (requests, asyncio queue of (choice
        index, Output)). Refusals raise ApiError before anything is queued."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(i):
            def put(o: Output):
                self._outbox.put(loop, q, (i, o))
            return put

        try:
            for p in params_list:
                self.sch.check(prompt, p)
            reqs = [Request(prompt, p, sink(i)) for i, p in enumerate(params_list)]
            for r in reqs:
                self.sch.submit(r)
        except RequestError as e:
            raise ApiError(str(e), param=e.param, code=e.code or "invalid_value") from None
        except Overloaded as e:
            for r in reqs:
                r.cancel()
            raise ApiError(str(e), status=503, code="overloaded", type_="server_error") from None
        return reqs, q


def _seeded(sp: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: seeds seed, seed + 1, ... (a random seed each when none is given)."""
    return [dataclasses.replace(sp, seed=None if sp.seed is None else sp.seed + i)
            for i in range(n)]


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(f"the request body is {size} bytes, more than this server takes "
                    f"({limit} bytes: dsv4 serve --max-request-size)", status=413,
                    code="request_too_large")


async def _json_body(http: HTTPRequest, limit: int) -> dict:
    """The body as a JSON object, read up to `limit` bytes (413 beyond: refused from its
    Content-Length before it is read, or when the bytes read pass the limit)."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)
    parts, size = [], 0
    async for part in http.stream():
        size += len(part)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        parts.append(part)
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    return body


def _check_model(srv: Server, body):
    model = _get(body, "model", "string")
    if model is not None and model != srv.model:
        raise ApiError(f"the model '{model}' does not exist; this server serves "
                       f"'{srv.model}'", status=404, param="model", code="model_not_found")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(srv, reqs, prompt_tokens, completion_tokens, cached_tokens=0):
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    k = srv.sch.config.speculative_tokens
    if k:   # each decode step emits 1 + its accepted drafts (the first token: the prefill)
        steps = sum(r.decode_steps for r in reqs)
        emitted = sum(max(len(r.out_ids) - 1, 0) for r in reqs)
        u["speculative"] = {"draft_tokens_per_step": k, "decode_steps": steps,
                            "accepted_draft_tokens": max(emitted - steps, 0),
                            "tokens_per_step": emitted / steps if steps else None}
    return u


async def _outputs(q: asyncio.Queue, reqs, http: HTTPRequest, poll_s: float = 0.5):
    """Yield (choice index, Output) until every request finished. A client that goes away
    (checked every poll_s, whether outputs arrive or not) cancels its requests: their
    slots are freed at the scheduler's next step."""
    left = len(reqs)
    checked = time.monotonic()
    try:
        while left:
            try:   # what is queued already needs no timer task (wait_for makes one)
                i, o = q.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    i, o = await asyncio.wait_for(q.get(), poll_s)
                except asyncio.TimeoutError:
                    o = None
            if time.monotonic() - checked >= poll_s:
                if await http.is_disconnected():
                    return
                checked = time.monotonic()
            if o is None:
                continue
            if o.finish_reason is not None:
                left -= 1
            yield i, o
    finally:
        for r in reqs:
            if not r.done:
                r.cancel()


def _chat_logprobs(srv, o: Output):
    def entry(t, lp):
        s = srv.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return [dict(entry(x.token, x.logprob), top_logprobs=[entry(t, lp) for t, lp in x.top])
            for x in o.logprobs]


def _tool_calls(calls, start: int, with_index: bool):
    out = []
    for k, c in enumerate(calls):
        d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": dict(c["function"])}
        out.append(dict(d, index=start + k) if with_index else d)
    return out


def _error_finish(o: Output):
    if o.finish_reason == "error":
        raise ApiError(f"generation failed: {o.error}", status=500, type_="server_error")


class CountRequests:
    """ASGI middleware counting requests by endpoint and status. The endpoint is the
    matched route's path template ("/v1/models/{model_id}"), and "other" for a path no
    route matches, so clients cannot grow the label set. (Starlette's BaseHTTPMiddleware
    would hide a client's disconnect from the handlers.)"""

    def __init__(self, app, metrics, router):
        self.app, self.metrics, self.router = app, metrics, router

    def endpoint(self, scope) -> str:
        for route in self.router.routes:
            if route.matches(scope)[0] != Match.NONE:   # PARTIAL: a wrong method (405)
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, send_)
        finally:
            self.metrics.requests.labels(self.endpoint(scope), str(status["code"])).inc()


def create_app(srv: Server, start_engine: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            srv.start()
        try:
            yield
        finally:
            if start_engine:
                srv.stop()

    app = FastAPI(title="dsv4-jax", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code,
                              code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("request failed")
        return error_response(f"internal error: {type(e).__name__}: {e}", 500,
                              type_="server_error")

    if srv.metrics is not None:
        app.add_middleware(CountRequests, metrics=srv.metrics, router=app.router)

    @app.get("/health")
    async def health():
        alive = srv.thread is None or srv.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"},
                            status_code=200 if alive else 503)

    def model_card():
        return {"id": srv.model, "object": "model", "created": 0, "owned_by": "dsv4-jax",
                "max_model_len": srv.capacity}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != srv.model:
            raise ApiError(f"the model '{model_id}' does not exist; this server serves "
                           f"'{srv.model}'", status=404, param="model",
                           code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        if srv.metrics is None:
            raise ApiError("metrics are off", status=404)
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- chat ----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await _json_body(http, srv.max_body_bytes)
        _check_model(srv, body)
        _refuse_unsupported(body)
        text, thinking = _chat_prompt(body)
        prompt = await srv.encode_prompt_async(text)
        stream = _get(body, "stream", "boolean", False)
        want_lp = _get(body, "logprobs", "boolean", False)
        top = _get(body, "top_logprobs", "integer", 0)
        if top and not want_lp:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                           code="invalid_value")
        mt = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None, srv.capacity,
                         len(prompt))
        sp = _sampling(body, mt, logprobs=want_lp, top_logprobs=top,
                       extra_stop_ids=srv.tok.stop_ids)
        n = _n(body)
        opts = _get(body, "stream_options", "object", {})
        reqs, q = await srv.submit(prompt, _seeded(sp, n))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        parsers = [ChatOutputParser(thinking) for _ in range(n)]
        if stream:
            return StreamingResponse(
                _chat_stream(srv, reqs, q, http, parsers, rid, created, want_lp,
                             bool(opts.get("include_usage"))),
                media_type="text/event-stream")
        acc = [{"content": "", "reasoning": "", "calls": [], "lp": [], "finish": None,
                "usage": (0, 0, 0)} for _ in range(n)]
        async for i, o in _outputs(q, reqs, http):
            _error_finish(o)
            a = acc[i]
            events = parsers[i].feed(o.text)
            if o.finish_reason is not None:
                events += parsers[i].finish()
                a["finish"], a["usage"] = o.finish_reason, (o.prompt_tokens,
                                                            o.completion_tokens,
                                                            o.cached_tokens)
            for kind, v in events:
                if kind == "tool_calls":
                    a["calls"] += v
                else:
                    a["content" if kind == "content" else "reasoning"] += v
            if want_lp:
                a["lp"] += _chat_logprobs(srv, o)
        choices = []
        for i, a in enumerate(acc):
            msg = {"role": "assistant", "content": a["content"]}
            if thinking:
                msg["reasoning_content"] = a["reasoning"]
            if a["calls"]:
                msg["tool_calls"] = _tool_calls(a["calls"], 0, with_index=False)
            choices.append({"index": i, "message": msg,
                            "logprobs": {"content": a["lp"]} if want_lp else None,
                            "finish_reason": "tool_calls" if a["calls"] and a["finish"] == "stop"
                            else a["finish"]})
        pt = len(prompt)
        return {"id": rid, "object": "chat.completion", "created": created, "model": srv.model,
                "choices": choices,
                "usage": _usage(srv, reqs, pt, sum(a["usage"][1] for a in acc),
                                acc[0]["usage"][2])}

    # ---- completions ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await _json_body(http, srv.max_body_bytes)
        _check_model(srv, body)
        _refuse_unsupported(body)
        if _get(body, "echo", "boolean", False):
            raise ApiError("'echo' is not supported", param="echo", code="unsupported_parameter")
        if body.get("suffix") is not None:
            raise ApiError("'suffix' is not supported", param="suffix",
                           code="unsupported_parameter")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError("'prompt' is empty", param="prompt", code="invalid_value")
            ids = await srv.encode_prompt_async(prompt)
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            ids = prompt
        else:
            raise ApiError("'prompt' must be a string or a list of token ids (one prompt per "
                           "request)", param="prompt", code="invalid_type")
        stream = _get(body, "stream", "boolean", False)
        lp = _get(body, "logprobs", "integer")
        if lp is not None and not 0 <= lp <= 5:
            raise ApiError(f"'logprobs' must be in [0, 5], got {lp}", param="logprobs",
                           code="invalid_value")
        mt = _max_tokens(body, ("max_tokens",), 16, srv.capacity, len(ids))
        sp = _sampling(body, mt, logprobs=lp is not None, top_logprobs=lp or 0)
        n = _n(body)
        opts = _get(body, "stream_options", "object", {})
        reqs, q = await srv.submit(ids, _seeded(sp, n))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return StreamingResponse(
                _completion_stream(srv, reqs, q, http, rid, created, lp is not None,
                                   bool(opts.get("include_usage"))),
                media_type="text/event-stream")
        acc = [{"text": "", "outs": [], "finish": None, "ct": 0, "cached": 0}
               for _ in range(n)]
        async for i, o in _outputs(q, reqs, http):
            _error_finish(o)
            acc[i]["text"] += o.text
            acc[i]["outs"].append(o)
            if o.finish_reason is not None:
                acc[i]["finish"], acc[i]["ct"] = o.finish_reason, o.completion_tokens
                acc[i]["cached"] = o.cached_tokens
        choices = [{"index": i, "text": a["text"], "finish_reason": a["finish"],
                    "logprobs": _completion_logprobs(srv, a["outs"]) if lp is not None else None}
                   for i, a in enumerate(acc)]
        return {"id": rid, "object": "text_completion", "created": created, "model": srv.model,
                "choices": choices,
                "usage": _usage(srv, reqs, len(ids), sum(a["ct"] for a in acc),
                                acc[0]["cached"])}

    return app


def _completion_logprobs(srv, outs, offset: int = 0):
    toks, lps, tops, offs = [], [], [], []
    for o in outs:
        for x in o.logprobs:
            s = srv.token_text(x.token)
            toks.append(s)
            lps.append(x.logprob)
            tops.append({srv.token_text(t): v for t, v in x.top})
            offs.append(offset)
            offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


async def _chat_stream(srv, reqs, q, http, parsers, rid, created, want_lp, usage):
    def chunk(i, delta, finish=None, logprobs=None):
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": srv.model,
                     "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish}]})

    try:
        async for piece in _chat_chunks(srv, reqs, q, http, parsers, chunk, want_lp, usage,
                                        rid, created):
            yield piece
    finally:   # the client went away while a chunk was being sent
        for r in reqs:
            if not r.done:
                r.cancel()


async def _chat_chunks(srv, reqs, q, http, parsers, chunk, want_lp, usage, rid, created):
    n = len(reqs)
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    n_calls = [0] * n
    total = 0
    async for i, o in _outputs(q, reqs, http):
        if o.finish_reason == "error":
            yield _sse({"error": {"message": f"generation failed: {o.error}",
                                  "type": "server_error", "param": None, "code": None}})
            break
        events = parsers[i].feed(o.text)
        if o.finish_reason is not None:
            events += parsers[i].finish()
        lp = {"content": _chat_logprobs(srv, o)} if want_lp and o.logprobs else None
        for kind, v in events:
            if kind == "tool_calls":
                delta = {"tool_calls": _tool_calls(v, n_calls[i], with_index=True)}
                n_calls[i] += len(v)
            else:
                delta = {"content" if kind == "content" else "reasoning_content": v}
            yield chunk(i, delta, logprobs=lp)
            lp = None
        if lp is not None:   # tokens whose text is still held back
            yield chunk(i, {}, logprobs=lp)
        if o.finish_reason is not None:
            total += o.completion_tokens
            reason = "tool_calls" if n_calls[i] and o.finish_reason == "stop" else o.finish_reason
            yield chunk(i, {}, finish=reason)
    if usage:
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": srv.model, "choices": [],
                    "usage": _usage(srv, reqs, len(reqs[0].prompt), total,
                                    reqs[0].cached_tokens)})
    yield "data: [DONE]\n\n"


async def _completion_stream(srv, reqs, q, http, rid, created, want_lp, usage):
    try:
        async for piece in _completion_chunks(srv, reqs, q, http, rid, created, want_lp,
                                              usage):
            yield piece
    finally:   # the client went away while a chunk was being sent
        for r in reqs:
            if not r.done:
                r.cancel()


async def _completion_chunks(srv, reqs, q, http, rid, created, want_lp, usage):
    total = 0
    offsets = [0] * len(reqs)
    async for i, o in _outputs(q, reqs, http):
        if o.finish_reason == "error":
            yield _sse({"error": {"message": f"generation failed: {o.error}",
                                  "type": "server_error", "param": None, "code": None}})
            break
        lp = None
        if want_lp:
            lp = _completion_logprobs(srv, [o], offsets[i])
        offsets[i] += len(o.text)
        if o.finish_reason is not None:
            total += o.completion_tokens
        yield _sse({"id": rid, "object": "text_completion", "created": created,
                    "model": srv.model,
                    "choices": [{"index": i, "text": o.text, "logprobs": lp,
                                 "finish_reason": o.finish_reason}]})
    if usage:
        yield _sse({"id": rid, "object": "text_completion", "created": created,
                    "model": srv.model, "choices": [],
                    "usage": _usage(srv, reqs, len(reqs[0].prompt), total,
                                    reqs[0].cached_tokens)})
    yield "data: [DONE]\n\n"
