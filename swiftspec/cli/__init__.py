"""The ``swiftspec`` command line: ``chat`` (TUI or scripted), ``serve``, ``bench``, ``train-draft``,
``cache`` and ``history``.

What lives where: options.py holds the Typer ``app``, its root callback and what several commands share
(the option declarations, the engine's and the sampling options); usage.py the usage errors' one voice
and the parsers that check each kind of value; chat.py, bench.py,
serve.py and train.py one command each; cache.py and history.py a sub-app each. Importing them registers
their commands on the app, in the order ``swiftspec --help`` lists them. This module is the program:
``main`` and ``run``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from swiftspec.cli.options import app

# Each registers its command; the order they do it in is the order `swiftspec --help` lists them.
# isort: off
from swiftspec.cli import chat, bench, serve, train, cache, history  # noqa: F401
# isort: on


def normalise_argv(argv: list[str]) -> list[str]:
    """`--resume` without an id means the latest conversation (click has no optional option values)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("latest")
    return out


def main(argv: list[str] | None = None) -> None:
    app(args=normalise_argv(sys.argv[1:] if argv is None else argv), prog_name="swiftspec")


def run() -> NoReturn:
    """The ``swiftspec`` program: main(), then what Python's own exit does (wait for non-daemon threads,
    run the atexit handlers, which close an Engine still open), flushed output, and an exit that skips the
    interpreter's teardown of the ~2,000 modules torch and transformers bring (about a second at the end
    of every command). Nothing is left half-written: the history database commits each write."""
    try:
        main()
        code: object = 0
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # sys.exit("message"), as Python itself would report it
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code if isinstance(code, int) else 0)
