"""``swiftspec cache list|clear``: what the cache holds (GGUF files converted to Hugging Face directories,
the step times profiled at start-up, the workers' logs of failed sessions) and its size, so that
gigabytes of converted weights can be found and removed. A removed conversion is redone, once, the next
time its GGUF is used; removed profiles are measured again at the next start."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from swiftspec.engine.model.gguf_io import CONVERSION_FORMAT, FORMAT_METADATA, GGUF_METADATA
from swiftspec.engine.paths import cache_dir


class CacheError(ValueError):
    """A name that is not in the cache; the message lists what is."""


@dataclass
class CacheEntry:
    name: str  # converted/<name>, "profiles" or "logs"
    path: Path
    size: int  # bytes
    what: str  # one line: what the weights are stored as, or how many logs


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _stored_as(model_dir: Path) -> str:
    """What the weights are stored as, from the safetensors header (no weights read): the GGUF block types
    kept and the float dtypes, most bytes first; a conversion by an older version is marked unused."""
    try:
        with (model_dir / "model.safetensors").open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        meta = header.pop("__metadata__", {})
        blocks = json.loads(meta.get(GGUF_METADATA, "{}"))
        sizes: dict[str, int] = {}
        for k, v in header.items():
            kind = blocks.get(k) or {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(v["dtype"], v["dtype"])
            sizes[kind] = sizes.get(kind, 0) + v["data_offsets"][1] - v["data_offsets"][0]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "incomplete"
    what = f"{' + '.join(sorted(sizes, key=sizes.get, reverse=True))} weights"
    if meta.get(FORMAT_METADATA) != str(CONVERSION_FORMAT):
        what += " (an older format, no longer used: clear it)"
    return what


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Converted models (by name), then the profiles and the worker logs as one entry each; hidden
    in-progress work left out."""
    root = root or cache_dir()
    out = [CacheEntry(d.name, d, _size(d), f"converted GGUF, {_stored_as(d)}")
           for d in sorted((root / "converted").glob("[!.]*")) if d.is_dir()]
    profiles = sorted((root / "profiles").glob("*.json"))
    if profiles:
        out.append(CacheEntry("profiles", root / "profiles", sum(_size(f) for f in profiles),
                              f"{len(profiles)} step-time profile(s): removed, the next start measures again"))
    logs = sorted((root / "logs").glob("*.log"))
    if logs:
        out.append(CacheEntry("logs", root / "logs", sum(_size(f) for f in logs),
                              f"{len(logs)} worker log(s): a running session's, or kept after a failure"))
    return out


def clear(name: str | None = None, root: Path | None = None) -> list[CacheEntry]:
    """Removes every entry, or the one called ``name``; returns what was removed."""
    found = entries(root)
    chosen = found if name is None else [e for e in found if e.name == name]
    if name is not None and not chosen:
        held = f"it holds {', '.join(e.name for e in found)}" if found else "it is empty"
        raise CacheError(f"the cache has no entry called {name!r}; {held}")
    for entry in chosen:
        shutil.rmtree(entry.path, ignore_errors=True)
    return chosen


def human_size(n: int) -> str:
    units = ["B", "KB", "MB", "GB", "TB"]
    size, i = float(n), 0
    while size >= 1000 and i < len(units) - 1:
        size, i = size / 1000, i + 1
    return f"{n} B" if i == 0 else f"{size:.1f} {units[i]}"
