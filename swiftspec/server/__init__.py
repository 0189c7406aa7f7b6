"""`swiftspec serve`: an OpenAI-compatible HTTP server on one warm engine (``app``), the requests it takes
(``api``), the queue in front of the engine (``host``), its Prometheus figures (``metrics``), and the
client that lets the chat attach to it (``remote``)."""
