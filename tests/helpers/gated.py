"""A stand-in engine whose answers a test releases step by step (``GatedEngine``), a server on it
(``gated_server``) and the small HTTP helpers the server tests share."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
from fake_engine import INFO

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import StepEvent, StepStats
from swiftspec.engine.host.failures import EngineError
from swiftspec.server.app import ServerSettings, build_app
from swiftspec.server.host import EngineHost
from swiftspec.server.metrics import Metrics

USER = [{"role": "user", "content": "Hello there"}]


class GatedEngine:
    """Answers "a b c ..." one token per ``release()``; ``die()`` makes the current answer fail as a dead
    worker group would, and tells ``when_dead`` as the Engine's watch does."""

    def __init__(self, tokenizer, steps: int = 3):
        self.info, self.tokenizer, self.steps = INFO, tokenizer, steps
        self.gate = threading.Semaphore(0)
        self.started: list[list[int]] = []
        self._cancel = threading.Event()
        self._dead = False
        self.closed = False
        self._when_dead = []

    def generate_ids(self, ids, params):
        self.started.append(ids)
        self._cancel.clear()
        for i in range(self.steps):
            while not self.gate.acquire(timeout=0.01):
                if self._cancel.is_set():
                    yield StepEvent([], "", StepStats(generated=i), True, "cancelled")
                    return
                if self._dead:
                    raise EngineError("a worker failed: killed")
            last = i == self.steps - 1
            yield StepEvent([i], f"t{i} ", StepStats(generated=i + 1, token_latency_ms=1.0), last,
                            "length" if last else None)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def die(self) -> None:
        self._dead = True
        for callback in self._when_dead:
            callback()

    def when_dead(self, callback) -> None:
        self._when_dead.append(callback)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def alive(self) -> bool:
        return not self._dead and not self.closed

    def close(self) -> None:
        self.closed = True


@contextlib.contextmanager
def running(app, **config):
    """``app`` served by uvicorn (``config``: more of uvicorn.Config) on a free loopback port: its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off", **config))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5)


@contextlib.contextmanager
def gated_server(tokenizer, **settings):
    """A server on a GatedEngine (its host, its engines, its base URL); the restarts start fresh
    GatedEngines. ``settings``: more ServerSettings."""
    engines = [GatedEngine(tokenizer)]

    def restart():
        engines.append(GatedEngine(tokenizer))
        return engines[-1]

    host = EngineHost(engines[0], restart, max_queue=2, metrics=Metrics())
    try:
        with running(build_app(host, SamplingParams(), ServerSettings(api_key="sesame", model_id="tiny", **settings))) as url:
            yield host, engines, url
    finally:
        host.close()


KEY = {"Authorization": "Bearer sesame"}


def post(url, body, timeout=10.0, **kw):
    return httpx.post(url + "/v1/chat/completions", json=body, headers=KEY, timeout=timeout, **kw)


def until(condition, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@contextlib.contextmanager
def streaming(url, engine):
    """A streamed answer whose first step has come: the lines still to come."""
    engine.release()  # the headers go out with the first step
    with httpx.stream("POST", url + "/v1/chat/completions", headers=KEY,
                      json={"messages": USER, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        yield lines
