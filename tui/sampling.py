"""The sampling settings as the chat shows and takes them: ``/set NAME VALUE`` over every field of
SamplingParams (parsed by the field's type, checked by SamplingParams itself), and the short line of the
settings in force that the title bar shows."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from swiftspec.engine.config import ConfigError, SamplingParams

FIELDS = typing.get_type_hints(SamplingParams)  # name -> type, e.g. "top_p" -> float
DEFAULTS = SamplingParams()
# Shown in the title bar when not the default; other fields show as name=value.
SHORT = {"top_p": "p", "top_k": "k", "min_p": "min-p", "repeat_penalty": "rep", "repeat_last_n": "rep-n",
         "presence_penalty": "pres", "frequency_penalty": "freq"}


def field_name(name: str) -> str:
    """'top-p' or 'top_p' -> 'top_p'; a ConfigError lists the names there are."""
    key = name.strip().replace("-", "_")
    if key not in FIELDS:
        raise ConfigError(f"no setting {name!r}; settings: {', '.join(n.replace('_', '-') for n in FIELDS)}")
    return key


def parse(name: str, text: str) -> Any:
    """The value ``text`` means for the field ``name``, by its type."""
    kind, text = FIELDS[name], text.strip()
    optional = type(None) in typing.get_args(kind)
    if optional and text.lower() in ("none", "off", ""):
        return None
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
    flag = name.replace("_", "-")
    if base is bool:
        if text.lower() in ("on", "true", "yes", "1"):
            return True
        if text.lower() in ("off", "false", "no", "0"):
            return False
        raise ConfigError(f"{flag} is on or off, not {text!r}")
    if typing.get_origin(base) is list:
        if text.lower() in ("", "none", "off"):
            return []
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag}: a JSON list such as [\"###\", \"END\"], not {text!r} ({e})") from None
        return [text]
    try:
        return base(text) if base in (int, float) else text
    except ValueError:
        what = "a whole number such as 8" if base is int else "a number such as 0.7"
        raise ConfigError(f"{flag} takes {what}, not {text!r}") from None


def with_setting(params: SamplingParams, name: str, text: str) -> SamplingParams:
    """``params`` with one field set from text; SamplingParams' own check says what is out of range."""
    key = field_name(name)
    return dataclasses.replace(params, **{key: parse(key, text)}).validate()


def listing(params: SamplingParams) -> str:
    """Every setting and its value, for ``/set`` alone."""
    return "\n".join(f"{name.replace('_', '-')} = {_value(getattr(params, name))}" for name in FIELDS)


def title_line(params: SamplingParams) -> str:
    """The settings in force, short enough for an 80-column title bar: 'async · T0.7 p0.9 · max 512'."""
    sampling = ["greedy" if params.greedy else f"T{params.temperature:g}"]
    for name in FIELDS:
        value = getattr(params, name)
        if name in ("mode", "temperature", "max_new_tokens") or value == getattr(DEFAULTS, name):
            continue
        if name == "stop":
            sampling.append(f"stop×{len(value)}")
        elif name == "ignore_eos":
            sampling.append("no-eos")
        elif name in SHORT:
            sampling.append(f"{SHORT[name]}{value:g}" if isinstance(value, float) else f"{SHORT[name]}{value}")
        else:
            sampling.append(f"{name.replace('_', '-')}={value}")
    return " · ".join([params.mode, " ".join(sampling), f"max {params.max_new_tokens}"])


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False)
    return "none" if value is None else str(value)
