"""Running the server: build it from an Engine, serve it with uvicorn (the `dsv4 serve`
command), or run it on a background thread (tests, benchmarks/serve_load.py)."""
from __future__ import annotations

import logging
import socket
import sys
import threading
import time

import uvicorn

from .api import MAX_BODY_BYTES, Server, create_app
from .metrics import Metrics
from .scheduler import Scheduler, SchedulerConfig


def build(engine, tokenizer, model_name: str, config: SchedulerConfig = SchedulerConfig(),
          warm_up: bool = True, seed: int | None = None,
          max_body_bytes: int = MAX_BODY_BYTES) -> Server:
    """A Server over `engine` with Prometheus metrics; warm_up compiles every program
    serving uses before the first request."""
    sch = Scheduler(engine, tokenizer, config, seed=seed)
    if warm_up:
        sch.warm_up()
    metrics = Metrics(model_name)   # after the warm-up: its request is no client's
    metrics.on_step(sch)   # the pool's gauges read right before the first request too
    sch.observer = metrics
    return Server(sch, tokenizer, model_name, metrics, max_body_bytes=max_body_bytes)


class _CurrentStream(logging.StreamHandler):
    """A StreamHandler writing to sys.stderr / sys.stdout as they are when a record comes
    (a test's captured stream is closed after it)."""

    def __init__(self, which: str):
        self.which = which
        super().__init__()

    @property
    def stream(self):
        return getattr(sys, self.which)

    @stream.setter
    def stream(self, value):
        pass


def _uvicorn_logging() -> None:
    """uvicorn's log lines (its formats, stderr and the access log on stdout), set up
    without its logging.config.dictConfig: that closes every handler in the process,
    jax's and a test runner's included."""
    from uvicorn.logging import AccessFormatter, DefaultFormatter
    for name, fmt, which in (
            ("uvicorn", DefaultFormatter("%(levelprefix)s %(message)s"), "stderr"),
            ("uvicorn.access", AccessFormatter(
                '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'),
             "stdout")):
        log = logging.getLogger(name)
        if not any(isinstance(h, _CurrentStream) for h in log.handlers):
            h = _CurrentStream(which)
            h.setFormatter(fmt)
            log.addHandler(h)
        log.propagate = False


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, calling on_ready() once it listens."""

    def __init__(self, config: uvicorn.Config, on_ready=None):
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets=None):
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_ready is not None:
            self.on_ready()


def http_server(srv: Server, log_level: str = "info", on_ready=None, **config) -> _Uvicorn:
    """The uvicorn server of `srv`'s app (config: more uvicorn.Config fields)."""
    _uvicorn_logging()
    return _Uvicorn(uvicorn.Config(create_app(srv), log_level=log_level, log_config=None,
                                   **config), on_ready)


def serve(srv: Server, sock: socket.socket, log_level: str = "info", on_ready=None) -> None:
    """Serve on a bound socket until interrupted (uvicorn handles Ctrl-C and SIGTERM);
    on_ready() runs once it listens. A start that fails is a RuntimeError (exit 1), not
    uvicorn's own exit status."""
    server = http_server(srv, log_level, on_ready)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:   # uvicorn exits 3 when the app's startup fails
        if e.code:
            raise RuntimeError(f"the HTTP server did not start (uvicorn exit {e.code}; its "
                               "log above says why)") from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The real HTTP server on a thread of this process: `with BackgroundServer(srv) as
    url: ...` (url: "http://127.0.0.1:PORT")."""

    def __init__(self, srv: Server, host: str = "127.0.0.1", port: int | None = None):
        self.srv, self.host, self.port = srv, host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._uv = http_server(srv, "warning", host=host, port=self.port)
        self._thread = threading.Thread(target=self._uv.run, name="dsv4-http", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        t0 = time.monotonic()
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > 60:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc):
        self._uv.should_exit = True
        self._thread.join(timeout=60)
