"""Where the engine keeps what it makes once and reuses: converted models, measured CPU backends and
profiles, worker logs. ``SWIFTSPEC_CACHE`` overrides it (the tests point it at a temporary directory)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    return Path(os.environ.get("SWIFTSPEC_CACHE") or platformdirs.user_cache_dir("swiftspec"))
