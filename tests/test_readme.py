"""The README stays true: every swiftspec command it shows parses with the real command line (flags,
values, subcommands), it links nothing outside the repository, and it and `serve --help` state the server's
limits, shutdown and Host rules as the code has them."""

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
    args = cli.normalise_argv(args)  # as main() does: --resume alone means the latest
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


def _options(command) -> set[str]:
    found = {"--help", "-h"}
    for param in command.params:
        found |= set(getattr(param, "opts", [])) | set(getattr(param, "secondary_opts", []))
    for sub in getattr(command, "commands", {}).values():
        found |= _options(sub)
    return found


OTHER_PROGRAMS = {"--standalone": "torchrun", "--budget": "scripts/gpu_check.sh", "--dry-run": "scripts/gpu_check.sh",
                  "--check": "benchmarks/cpu_kernels.py", "--attention": "benchmarks/cpu_kernels.py",
                  "--widths": "benchmarks/activation_width.py"}


def test_every_flag_the_readme_names_exists():
    """Every --flag in the README is one of swiftspec's (or, named, another program's that it mentions)."""
    text = README.read_text(encoding="utf-8")
    ours = _options(typer.main.get_command(cli.app))
    for flag in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))):
        if flag in OTHER_PROGRAMS:
            where = README.parent / OTHER_PROGRAMS[flag]
            assert not where.exists() or flag in where.read_text(), flag
            continue
        assert flag in ours, f"the README names {flag}, which no swiftspec command has"


def test_every_environment_variable_the_readme_names_is_read():
    """SWIFTSPEC_<FLAG> of a settable flag, or a directory variable the code reads."""
    from swiftspec.settings import env_var

    text = README.read_text(encoding="utf-8")
    group = typer.main.get_command(cli.app)
    settable = {p.envvar for cmd in group.commands.values() for p in cmd.params if getattr(p, "envvar", None)}
    source = "".join(p.read_text() for d in ("swiftspec", "engine", "tui")
                     for p in (README.parent / d).rglob("*.py"))
    for name in sorted(set(re.findall(r"SWIFTSPEC_[A-Z_]+", text))):
        assert name in settable or f'"{name}"' in source, name
    assert env_var("--save") in settable  # was: --save alone read no variable


def test_serve_help_and_the_readme_state_the_limits_the_shutdown_and_the_host_rules():
    from helpers.cli import invoke

    from swiftspec.server.app import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_DEPTH
    from swiftspec.server.serve import HEADERS_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS

    facts = [f"{HEADERS_TIMEOUT_S:g} s", f"{KEEP_ALIVE_S:g} s", f"{BODY_TIMEOUT_S:g} s (408)", f"{MAX_CONNECTIONS} open connections",
             f"{MAX_BODY_BYTES >> 20} MiB", f"{MAX_DEPTH} deep", "longest idle", "143 (SIGTERM)", "130 (Ctrl-C)",
             "second signal stops at once", "--shutdown-timeout", "*.localhost", "--allowed-hosts", "421", "--cors-origin"]
    server = README.read_text(encoding="utf-8").split("## The server", 1)[1]
    help_text = " ".join(invoke(["serve", "--help"]).output.split())
    for fact in facts:
        assert fact in " ".join(server.split()) and fact in help_text, fact
