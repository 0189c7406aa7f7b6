"""The command line's one voice for usage errors, and the parsers that check each kind of value where its
option is declared.

Every usage error, click's own parser's (an unknown option, a missing value) as much as a value a parser
or a setting's validation refused, is one line on stderr, ``swiftspec: FLAG: WHAT IS WRONG; WHAT IS
ACCEPTED``, exit 2: the flag as the user typed it (or the environment variable, or the config file's key,
that gave the value), never a box or a traceback. The Typer app is a ``CommandLine`` for that; its groups
and commands also show no metavar for a flag that takes no value.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from typer._click.exceptions import (
    BadOptionUsage,
    BadParameter,
    MissingParameter,
    NoArgsIsHelpError,
    NoSuchOption,
    UsageError,
)
from typer.core import TyperCommand, TyperGroup

from swiftspec.engine.config import ConfigError
from swiftspec.settings import config_path

EXIT_USAGE = 2
ARGS = "swiftspec.args"  # ctx.meta: the command line as typed, to name a flag the way the user did


class Refused(BadParameter):
    """A value an option's parser refused: what is wrong with it and what the option accepts."""

    def __init__(self, wrong: str, accepted: str):
        super().__init__(f"{wrong}; {accepted}")
        self.wrong, self.accepted = wrong, accepted


@dataclass(frozen=True)
class Parser:
    """An option's parser (typer's ``parser=``): turns the typed text, or a config file's value, into the
    option's value, or refuses it saying what the option accepts."""

    convert: Callable[[Any], Any]
    accepted: str

    def __call__(self, value: Any) -> Any:
        return self.convert(value)


def _whole(value: Any, accepted: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise Refused(f"{value!r} is not a whole number", accepted) from None


def _real(value: Any, accepted: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        raise Refused(f"{value!r} is not a number", accepted) from None


def _out_of_range(value: Any) -> str:
    return f"{value!r} is out of range" if isinstance(value, (int, float)) else f"{value!r} is not accepted"


def whole_number(at_least: int, at_most: int | None = None, meaning: str = "") -> Parser:
    """A count or an index of the command line's own (a setting of no dataclass): in at_least..at_most."""
    accepted = (f"a whole number >= {at_least}" if at_most is None else f"a whole number in {at_least}..{at_most}")
    accepted += f" ({meaning})" if meaning else ""

    def convert(value: Any) -> int:
        number = _whole(value, accepted)
        if number < at_least or (at_most is not None and number > at_most):
            raise Refused(_out_of_range(number), accepted)
        return number

    return Parser(convert, accepted)


def _real_in(accepted: str, within: Callable[[float], bool]) -> Parser:
    """A number of the command line's own, refused unless ``within`` holds for it."""

    def convert(value: Any) -> float:
        number = _real(value, accepted)
        if not within(number):
            raise Refused(_out_of_range(number), accepted)
        return number

    return Parser(convert, accepted)


def positive_number(meaning: str = "") -> Parser:
    """A finite number > 0 (a learning rate)."""
    return _real_in("a finite number > 0" + (f" ({meaning})" if meaning else ""), lambda n: 0 < n < math.inf)


def number_below(at_least: float, below: float, meaning: str = "") -> Parser:
    """A number in [at_least, below) (a timeout in seconds)."""
    return _real_in(f"a number in [{at_least:g}, {below:g})" + (f" ({meaning})" if meaning else ""),
                    lambda n: at_least <= n < below)


def field_value(cls: type, name: str, kind: type = int) -> Parser:
    """A number that is a field of a settings dataclass (SamplingParams, TreeParams, EngineConfig): parsed
    as ``kind``, then checked by the dataclass's own validate(), the one place its range is said."""
    described = "a whole number such as 8" if kind is int else "a number such as 0.7"

    def convert(value: Any) -> Any:
        number = (_whole if kind is int else _real)(value, described)
        try:
            cls(**{name: number}).validate()
        except ConfigError as e:
            raise Refused(_out_of_range(number), e.accepted or str(e)) from None
        return number

    return Parser(convert, described)


def choice(choices: Sequence[str], what: str) -> Parser:
    """One of ``choices`` (named, in the error, as a ``what``: "mode", "switch")."""
    accepted = ", ".join(choices[:-1]) + f" or {choices[-1]}"

    def convert(value: Any) -> str:
        if value not in choices:
            raise Refused(f"{value!r} is not a {what}", accepted)
        return value

    return Parser(convert, accepted)


def model_path(role: str, words: Sequence[str] = ()) -> Parser:
    """A ``role`` model's path (the target's, the draft's), or one of ``words`` (the built-in drafts),
    refused when it does not exist. Checked when a command that loads it runs (options.check_model_paths),
    not as typer's parser: the config file's values are parsed for every command, and a model removed
    since must not stop `swiftspec history`."""
    accepted = "a Hugging Face model directory or a .gguf file"
    if words:
        accepted = f"{', '.join(words)}, or a model directory, a draft head directory or a .gguf file"

    def convert(value: Any) -> Any:
        if value is None or value in words:
            return value
        if not Path(str(value)).expanduser().exists():
            raise Refused(f"no {role} at {str(value)!r}", accepted)
        return value

    return Parser(convert, accepted)


GPU_INDICES = "distinct numbers such as 0,1,2"


def device_list(value: Any) -> list[int] | None:
    """'0,1,2' -> [0, 1, 2]: distinct GPU indices."""
    if value is None or isinstance(value, list):
        return value
    try:
        devices = [int(piece) for piece in str(value).split(",") if piece.strip()]
    except ValueError:
        devices = []
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise Refused(f"{value!r} is not a list of GPU indices", GPU_INDICES)
    return devices


DEVICES = Parser(device_list, GPU_INDICES)


def typed_name(ctx: typer.Context, name: str) -> str:
    """How the user gave parameter ``name``: the flag as typed (-m, not --model), the environment variable,
    or the config file and key; a flag left out is named by its first long name. ``name``: the parameter's,
    or its long flag's without dashes (set, for --set's prompt_set)."""
    flag = "--" + name.replace("_", "-")
    param = next((p for p in ctx.command.params if p.name == name or flag in p.opts), None)
    if param is None:
        return flag
    if param.param_type_name == "argument":
        return param.metavar or param.name.upper()
    source = ctx.get_parameter_source(param.name)
    if source is not None and source.name == "ENVIRONMENT" and param.envvar:
        return str(param.envvar)
    if source is not None and source.name == "DEFAULT_MAP":
        return f"{config_path()}: {param.name.replace('_', '-')}"
    names = [*param.opts, *param.secondary_opts]
    for arg in ctx.meta.get(ARGS, ()):
        if arg.split("=", 1)[0] in names:
            return arg.split("=", 1)[0]
    return next((n for n in names if n.startswith("--")), names[0])


def refused_line(flag: str, error: Refused) -> str:
    return f"{flag}: {error.wrong}; {error.accepted}"


def refusal(ctx: typer.Context, error: ConfigError) -> str:
    """A setting's refused value (ConfigError.refused) said as a usage error of the flag that gave it;
    another ConfigError (a combination of settings) as its own message."""
    if error.setting is None:
        return str(error)
    name = error.setting.replace("-", "_")
    return f"{typed_name(ctx, name)}: {error.wrong or _out_of_range(error.value)}; {error.accepted}"


def usage_line(error: UsageError) -> str:
    """A parser's usage error in the one voice (without the leading 'swiftspec: ')."""
    ctx = error.ctx
    command = ctx.command_path if ctx is not None else "swiftspec"
    see = f"see {command} --help"
    if isinstance(error, BadParameter) and error.param is not None and ctx is not None:
        flag = typed_name(ctx, error.param.name)
        if isinstance(error, MissingParameter):
            return f"{flag}: missing; {see}"
        if isinstance(error, Refused):
            return refused_line(flag, error)
        return f"{flag}: {error.message.rstrip('.')}; {see}"
    if isinstance(error, NoSuchOption):
        maybe = f"did you mean {' or '.join(sorted(error.possibilities))}?" if error.possibilities else see
        return f"{error.option_name}: no such option; {maybe}"
    if isinstance(error, BadOptionUsage) and "requires an argument" in error.message:
        param = next((p for p in ctx.command.params if error.option_name in p.opts), None) if ctx else None
        parser = getattr(getattr(getattr(param, "type_descriptor", None), "parameter_info", None), "parser", None)
        return f"{error.option_name}: needs a value; {getattr(parser, 'accepted', None) or see}"
    if isinstance(error, BadOptionUsage):
        return f"{error.option_name}: {error.message.rstrip('.')}; {see}"
    said = f"{error.message[:1].lower()}{error.message[1:].rstrip('.')}; {see}"
    subcommand = command.partition(" ")[2]
    return f"{subcommand}: {said}" if subcommand else said


class _Parsed:
    """A command whose parser's errors know the command (click's own parser raises some without it), and
    whose flags, which take no value, name none in the help (typer's own would show "<bool>")."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except UsageError as e:
            if e.ctx is None:
                e.ctx, e.cmd = ctx, ctx.command
            raise

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(_Parsed, TyperCommand):
    """A swiftspec command."""


class Group(_Parsed, TyperGroup):
    """A group of commands; as the program's root group, it speaks every usage error in the one voice."""

    def parse_args(self, ctx, args):
        ctx.meta.setdefault(ARGS, tuple(args))  # the root's: the whole command line
        return super().parse_args(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except NoArgsIsHelpError as e:  # the help is the answer; typer printed it
            if e.message:
                e.show()
            code = EXIT_USAGE
        except UsageError as e:
            typer.echo(f"swiftspec: {usage_line(e)}", err=True)
            code = EXIT_USAGE
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


class CommandLine(typer.Typer):
    """A Typer app whose groups and commands are the ones above."""

    def __init__(self, **kwargs):
        super().__init__(cls=Group, **kwargs)

    def command(self, *args, **kwargs):
        return super().command(*args, cls=Command, **kwargs)
