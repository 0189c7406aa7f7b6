"""The README stays true: every swiftspec command it shows parses with the real command line (flags,
values, subcommands), and it links nothing outside the repository."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from swiftspec import cli

README = Path(__file__).resolve().parent.parent / "README.md"


def documented_commands() -> list[list[str]]:
    """Each ``swiftspec ...`` command in the README's sh blocks, continuation lines joined, the part after
    a pipe taken, comments and redirections dropped."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        for part in line.split("|"):
            words = shlex.split(part, comments=True)
            if words and words[0].endswith("swiftspec"):
                commands.append([w for w in words[1:] if not w.startswith(("<", ">"))])
    return commands


def test_readme_shows_the_commands_users_need():
    shown = {" ".join(c[:1]) for c in documented_commands()}
    assert {"chat", "bench", "cache", "-V"} <= shown


@pytest.mark.parametrize("args", documented_commands(), ids=" ".join)
def test_every_documented_command_parses(args):
    if args == ["-V"]:  # runs at once: run it
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 0 and result.stdout.startswith("swiftspec ")
        return
    group = typer.main.get_command(cli.app)
    ctx = group.make_context("swiftspec", list(args))
    name, command, rest = group.resolve_command(ctx, ctx._protected_args + ctx.args)
    sub = command.make_context(name, rest, parent=ctx)
    while hasattr(command, "resolve_command") and (sub._protected_args or sub.args):  # cache list / clear
        name, command, rest = command.resolve_command(sub, sub._protected_args + sub.args)
        sub = command.make_context(name, rest, parent=sub)
    assert not sub.args, f"left over: {sub.args}"


def test_no_link_leaves_the_repository():
    text = README.read_text(encoding="utf-8")
    assert "DESIGN.md" not in text and "../" not in text
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert not target.startswith(("http", "/")) and (README.parent / target).exists(), target
