"""`swiftspec serve`: an OpenAI-compatible HTTP server on one warm engine (``app``), the requests it takes
(``api``), the queue in front of the engine (``host``), its Prometheus figures (``metrics``), and the
client that lets the chat attach to it (``remote``)."""

import os
import socket

from swiftspec.engine.config import ConfigError

SHUTDOWN_TIMEOUT_S = 5.0  # serve --shutdown-timeout's default, here so that the command line need not import the server
MAX_SHUTDOWN_TIMEOUT_S = 3600.0


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening. `serve` takes it first, before it imports the server or
    starts a worker, so that a taken port is refused at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError.refused("port", "a free port, or 0 for any", port, wrong=f"cannot listen on "
                                  f"{host}:{port} ({os.strerror(e.errno) if e.errno else e})") from None
