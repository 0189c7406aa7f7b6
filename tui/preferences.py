"""What the chat remembers between runs that belongs to no conversation (the theme), in the data dir."""

from __future__ import annotations

import json
from typing import Any

from swiftspec.history import data_dir


def path():
    return data_dir() / "tui.json"


def load() -> dict[str, Any]:
    try:
        found = json.loads(path().read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: the defaults
        return {}
    return found if isinstance(found, dict) else {}


def save(**values: Any) -> None:
    """Merges ``values`` in; a data dir that cannot be written only loses the preference."""
    try:
        path().parent.mkdir(parents=True, exist_ok=True)
        path().write_text(json.dumps({**load(), **values}), encoding="utf-8")
    except OSError:
        pass
