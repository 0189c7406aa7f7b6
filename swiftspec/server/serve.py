"""Runs `swiftspec serve`: the engine first (a bad model fails here, before any port is taken), then
uvicorn on the bound socket until Ctrl-C or SIGTERM, then every worker process ended."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import sys
from collections.abc import Callable

from swiftspec.config import ConfigError, EngineConfig, SamplingParams
from swiftspec.engine.startup import model_id
from swiftspec.server.app import ServerSettings, build_app
from swiftspec.server.host import EngineHost
from swiftspec.server.metrics import Metrics

log = logging.getLogger("swiftspec.serve")
SHUTDOWN_GRACE_S = 3  # open answers get this long at Ctrl-C before they are cut


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def check_settings(settings: ServerSettings) -> None:
    """A server reachable from other machines needs a key (ConfigError otherwise)."""
    if not is_loopback(settings.host) and not settings.api_key:
        raise ConfigError(f"--host {settings.host} is reachable from other machines: give an --api-key (or "
                          "SWIFTSPEC_API_KEY) too, or serve on 127.0.0.1")
    if not 0 <= settings.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, not {settings.port}")
    if settings.max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, not {settings.max_queue}")


def serve(config: EngineConfig, defaults: SamplingParams, settings: ServerSettings,
          say: Callable[[str], None]) -> int:
    """Serves until interrupted; returns the exit code. Raises what Engine.start raises."""
    import uvicorn

    from swiftspec.engine.client import Engine

    logging.basicConfig(level=logging.INFO, format="swiftspec: %(message)s", stream=sys.stderr)
    check_settings(settings)
    settings = dataclasses.replace(settings, model_id=model_id(config))
    engine = Engine.start(config, progress=say)
    try:
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        sock = socket.create_server((settings.host, settings.port), family=family)
    except OSError as e:
        engine.close()
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    host = EngineHost(engine, lambda: Engine.start(config, progress=lambda line: log.info("%s", line)),
                      settings.max_queue, Metrics())
    try:
        app = build_app(host, defaults, settings)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
        port = sock.getsockname()[1]
        where = f"[{settings.host}]" if family == socket.AF_INET6 else settings.host
        say(f"serving {settings.model_id} on http://{where}:{port}/v1 (OpenAI API"
            f"{', key required' if settings.api_key else ''}); Ctrl-C stops")
        server.run(sockets=[sock])
    finally:
        host.close()
        sock.close()
    return 0
