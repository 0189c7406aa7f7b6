"""Where a flag's value comes from when the command line leaves it out: a ``SWIFTSPEC_<FLAG>`` environment
variable, else the user's TOML config file, else the built-in default.

The config file holds flags by their long name (``max-new-tokens = 64``; ``max_new_tokens`` works too).
Top-level keys apply to every command that has the flag; a ``[chat]`` or ``[bench]`` table applies to that
command only and wins over the top level. click does the precedence itself: a flag beats its ``envvar``,
which beats the context's ``default_map`` (built here from the file), which beats the default.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import platformdirs

from swiftspec.engine.config import ConfigError, SamplingParams

# The chat's sampling defaults (TUI and chat -p) for the embedded model and GGUF files; a model directory's
# generation_config.json replaces the sampling ones. Chosen by benchmarks/loop_rate.py (loop rate and speed
# on the fresh set and its dev questions; docs/ARCHITECTURE.md has the figures). bench stays greedy.
CHAT_DEFAULTS = SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.1, loop_guard=64)

ENV_PREFIX = "SWIFTSPEC_"
# Flags that name what one run does rather than how it runs: no environment variable, no config key.
PER_RUN = {"prompt", "resume"}


def env_var(flag: str) -> str:
    """--max-new-tokens -> SWIFTSPEC_MAX_NEW_TOKENS."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def config_path() -> Path:
    """The config file: $SWIFTSPEC_CONFIG, else config.toml in the user config dir."""
    return Path(os.environ.get("SWIFTSPEC_CONFIG") or Path(platformdirs.user_config_dir("swiftspec")) / "config.toml")


def read_config(path: Path) -> dict[str, Any]:
    """The file's settings; {} when there is no file. A file that is not TOML is a ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the config file {path}: {e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the config file {path} is not valid TOML: {e}") from None


def _settable(command) -> dict[str, str]:
    """(``command`` is a click command: typer's own copy of click, hence no isinstance checks.)
    Config keys of a command's settable flags (long names, dashes or underscores) -> click param names."""
    keys = {}
    for param in command.params:
        if param.param_type_name != "option" or param.name in PER_RUN or not param.expose_value:
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                keys[opt[2:]] = keys[opt[2:].replace("-", "_")] = param.name
    return keys


def _check(command, name: str, key: str, value: Any, path: Path) -> None:
    """A value of the wrong type is a ConfigError naming the file and the key, as click's own message
    (which names the flag) would not."""
    param = next(p for p in command.params if p.name == name)
    try:
        param.process_value(None, value)
    except Exception as e:  # click's BadParameter, from typer's own copy of click
        why = getattr(e, "message", None) or str(e)  # a parser's refusal, without click's "Invalid value"
        raise ConfigError(f"{path}: {key} = {value!r}: {why}") from None


def default_map(settings: dict[str, Any], commands: dict[str, Any], path: Path) -> dict[str, dict]:
    """click's default_map for each command from the file's settings; an unknown key is a ConfigError."""
    settable = {name: _settable(cmd) for name, cmd in commands.items()}
    out: dict[str, dict[str, Any]] = {name: {} for name in commands}

    def put(command: str, key: str, value: Any) -> bool:
        param = settable[command].get(key)
        if param is not None:
            _check(commands[command], param, key, value, path)
            out[command][param] = value
        return param is not None

    for key, value in settings.items():
        if key in commands and isinstance(value, dict):
            continue
        if not [name for name in commands if put(name, key, value)]:
            raise ConfigError(f"{path}: unknown setting {key!r}; settings are flag names such as "
                              "max-new-tokens = 64 (see swiftspec chat --help)")
    for name in commands:
        table = settings.get(name)
        for key, value in (table.items() if isinstance(table, dict) else ()):
            if not put(name, key, value):
                raise ConfigError(f"{path}: [{name}] has no setting {key!r} (see swiftspec {name} --help)")
    return {name: values for name, values in out.items() if values}
