"""`swiftspec serve`: an OpenAI-compatible HTTP server on one warm engine (``app``), the requests it takes
(``api``), the queue in front of the engine (``host``), its Prometheus figures (``metrics``), and the
client that lets the chat attach to it (``remote``)."""

SHUTDOWN_TIMEOUT_S = 5.0  # serve --shutdown-timeout's default, here so that the command line need not import the server
MAX_SHUTDOWN_TIMEOUT_S = 3600.0
