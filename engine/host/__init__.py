"""The Engine's side of the worker processes: start-up, the socket protocol, the answers."""
