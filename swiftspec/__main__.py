"""``python -m swiftspec``: the same command line as the ``swiftspec`` script."""

from swiftspec.cli import run

run()
