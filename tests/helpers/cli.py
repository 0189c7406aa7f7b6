"""Running the command line in-process."""

from __future__ import annotations

from typer.testing import CliRunner

from swiftspec import cli


def invoke(args, stdin: bytes = b""):
    return CliRunner().invoke(cli.app, cli.normalise_argv(args), input=stdin)
