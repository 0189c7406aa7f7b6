"""``swiftspec cache list|clear``: what the cache holds (GGUF files converted to Hugging Face directories,
the workers' logs of failed sessions) and its size, so that gigabytes of converted weights can be found
and removed. A removed conversion is redone, once, the next time its GGUF is used."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from swiftspec.embedded import cache_dir


class CacheError(ValueError):
    """A name that is not in the cache; the message lists what is."""


@dataclass
class CacheEntry:
    name: str  # converted/<name> or "logs"
    path: Path
    size: int  # bytes
    what: str  # one line: the weights' dtype, or how many logs


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _weights_dtype(model_dir: Path) -> str:
    """The stored dtype, from the first tensor in the safetensors header (no weights read)."""
    try:
        with (model_dir / "model.safetensors").open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        dtype = next(v["dtype"] for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return "incomplete"
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(dtype, dtype)


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Converted models (by name), then the worker logs as one entry; hidden in-progress work left out."""
    root = root or cache_dir()
    out = [CacheEntry(d.name, d, _size(d), f"converted GGUF, {_weights_dtype(d)} weights")
           for d in sorted((root / "converted").glob("[!.]*")) if d.is_dir()]
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
