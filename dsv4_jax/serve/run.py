"""Running the server: build it from an Engine, serve it with uvicorn (the `dsv4 serve`
command), or run it on a background thread (tests, benchmarks/serve_load.py)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .api import Server, create_app
from .metrics import Metrics
from .scheduler import Scheduler, SchedulerConfig


def build(engine, tokenizer, model_name: str, config: SchedulerConfig = SchedulerConfig(),
          warm_up: bool = True, seed: int | None = None) -> Server:
    """A Server over `engine` with Prometheus metrics; warm_up compiles every program
    serving uses before the first request."""
    sch = Scheduler(engine, tokenizer, config, seed=seed)
    if warm_up:
        sch.warm_up()
    metrics = Metrics(model_name)   # after the warm-up: its request is no client's
    sch.observer = metrics
    return Server(sch, tokenizer, model_name, metrics)


def serve(srv: Server, host: str, port: int, log_level: str = "info") -> None:
    """Serve until interrupted (uvicorn handles Ctrl-C and SIGTERM)."""
    uvicorn.run(create_app(srv), host=host, port=port, log_level=log_level)


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
        self._uv = uvicorn.Server(uvicorn.Config(create_app(srv), host=host, port=self.port,
                                                 log_level="warning"))
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
