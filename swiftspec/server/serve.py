"""Runs `swiftspec serve` on the socket the command bound first (``swiftspec.server.listen``): the engine,
then uvicorn on that socket until SIGTERM or SIGINT, which drain (DrainingServer), then every worker
process ended. Slow or idle connections are dropped and their number capped (Deadlines)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from http import HTTPStatus

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from swiftspec.engine.config import ConfigError, EngineConfig, SamplingParams
from swiftspec.engine.host.client import Engine
from swiftspec.engine.host.startup import model_id
from swiftspec.server import MAX_SHUTDOWN_TIMEOUT_S
from swiftspec.server.api import APIError
from swiftspec.server.app import ServerSettings, build_app, is_loopback
from swiftspec.server.host import EngineHost
from swiftspec.server.metrics import Metrics

log = logging.getLogger("swiftspec.serve")
HEADERS_TIMEOUT_S = 10.0  # a connection that has not sent a request's headers by then is closed
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long
MAX_CONNECTIONS = 256  # beyond this a new connection closes the longest idle one (a 503 when none is idle)
FLUSH_S = 2.0  # after the drain, for a cut answer's last event to reach its client before uvicorn ends
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_settings(settings: ServerSettings) -> None:
    """A server reachable from other machines needs a key (ConfigError otherwise)."""
    if not is_loopback(settings.host) and not settings.api_key:
        raise ConfigError.refused("host", "give an --api-key (or SWIFTSPEC_API_KEY) too, or serve on 127.0.0.1",
                                  settings.host, wrong=f"{settings.host} is reachable from other machines")
    if not 0 <= settings.port <= 65535:
        raise ConfigError.refused("port", "a whole number in 0..65535", settings.port)
    if settings.max_queue < 1:
        raise ConfigError.refused("max-queue", "a whole number >= 1", settings.max_queue)
    if not 0 <= settings.shutdown_timeout_s < MAX_SHUTDOWN_TIMEOUT_S:
        raise ConfigError.refused("shutdown-timeout", f"a number in [0, {MAX_SHUTDOWN_TIMEOUT_S:g}) (seconds)",
                                  settings.shutdown_timeout_s)


class Deadlines(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with what it lacks against slow or idle clients: a deadline for each
    request's headers (slowloris) and a cap on open connections, at which a new connection closes the
    longest idle one (no request in progress) so that idle connections cannot lock clients out, and only
    with every connection busy is it a 503 (the rest of the limits: Config's). A request that is not HTTP
    gets a JSON 400, not uvicorn's plain text."""

    idle_since: float | None = None  # when its last response ended (or it connected); None while a request runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        if len(self.connections) > MAX_CONNECTIONS and not self._close_longest_idle():
            self._refuse(APIError(503, f"the server has {MAX_CONNECTIONS} requests in progress: try again shortly",
                                  "server_error", None, "too_many_connections", retry_after=1))
            return
        self._arm()

    def _close_longest_idle(self) -> bool:
        idle = [c for c in self.connections if c is not self and getattr(c, "idle_since", None) is not None
                and not c.transport.is_closing()]
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since).transport.close()
        return True

    def _refuse(self, error: APIError) -> None:
        """Answers ``error`` in JSON and closes the connection, whatever state its HTTP is in."""
        body = json.dumps(error.body()).encode()
        retry = b"retry-after: %d\r\n" % error.retry_after if error.retry_after is not None else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (error.status, HTTPStatus(error.status).phrase.encode(),
                                                               retry, len(body), body))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._refuse(APIError(400, "the request is not valid HTTP/1.1", code="invalid_http"))

    def _arm(self) -> None:
        self._disarm()
        self._headers_due = self.loop.call_later(HEADERS_TIMEOUT_S, self._headers_late)

    def _disarm(self) -> None:
        if (due := getattr(self, "_headers_due", None)) is not None:
            due.cancel()
            self._headers_due = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # a request's headers came whole
            self._disarm()
            self.idle_since = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.idle_since = self.loop.time()
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopped the way process managers expect: the first SIGTERM or SIGINT drains the
    EngineHost (the waiting requests, and every new one, get a 503 with Retry-After; the running answer
    ``grace_s`` to finish before it is cut with an error event and ``[DONE]``), then uvicorn stops
    accepting and ends; a second signal stops at once. The signal is not raised again on the way out:
    ``serve`` ends the workers, then returns 128 + its number."""

    def __init__(self, config: uvicorn.Config, host: EngineHost, grace_s: float):
        super().__init__(config)
        self.host, self.grace_s = host, grace_s
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
            log.warning("stopping: the running answer has %g s to finish", self.grace_s)
            # a thread of its own: a signal handler must not wait for the host's lock
            threading.Thread(target=self._drain, name="drain", daemon=True).start()
        else:
            log.warning("stopping now")
            threading.Thread(target=self.host.drain, args=(0,), name="drain-now", daemon=True).start()
            self.should_exit = self.force_exit = True

    def _drain(self) -> None:
        self.host.drain(self.grace_s)
        self.should_exit = True  # uvicorn's loop looks every 0.1 s


def serve(config: EngineConfig, defaults: SamplingParams, settings: ServerSettings, sock: socket.socket,
          say: Callable[[str], None]) -> int:
    """Serves on ``sock`` (``listen``'s) until stopped, and closes it; returns the exit code (128 + the
    stopping signal). Raises what Engine.start raises."""
    logging.basicConfig(level=logging.INFO, format="swiftspec: %(message)s", stream=sys.stderr)
    try:
        check_settings(settings)
        settings = dataclasses.replace(settings, model_id=model_id(config))
        engine = Engine.start(config, progress=say)
    except BaseException:
        sock.close()
        raise
    host = EngineHost(engine, lambda: Engine.start(config, progress=lambda line: log.info("%s", line)),
                      settings.max_queue, Metrics())
    try:
        app = build_app(host, defaults, settings)
        server = DrainingServer(uvicorn.Config(
            app, log_level="warning", lifespan="off", http=Deadlines, timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=FLUSH_S), host, settings.shutdown_timeout_s)
        port = sock.getsockname()[1]
        where = f"[{settings.host}]" if sock.family == socket.AF_INET6 else settings.host
        say(f"serving {settings.model_id} on http://{where}:{port}/v1 (OpenAI API"
            f"{', key required' if settings.api_key else ''}); Ctrl-C stops")
        server.run(sockets=[sock])
    finally:
        host.close()
        sock.close()
    return 128 + server.stopped_by if server.stopped_by else 0
