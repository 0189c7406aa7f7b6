"""A draft as the engine resolves it, once: its kind (``DraftKind``) and, for a path, its directory. Here,
and only here, a draft path is told apart as a draft head or a draft model.

Nothing here imports torch at the top: the Engine's own process parses the draft before any worker
starts, and importing torch would slow its start; the one torch import below serves an EAGLE
head stored as ``pytorch_model.bin``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from swiftspec.engine.config import BUILTIN_DRAFTS, DraftKind

HEAD_CONFIG_KEY = "swiftspec_draft_head"  # in a head directory's config.json: the format of our heads


class HeadError(ValueError):
    """A draft head directory that cannot be read or does not fit the target."""


@dataclass(frozen=True)
class DraftSpec:
    kind: DraftKind
    path: Path | None = None  # a head's or a model's directory (a GGUF draft: its conversion)

    @classmethod
    def of(cls, draft: str) -> DraftSpec:
        """The draft a word or a path names."""
        kind = DraftKind.named(draft)
        if kind is not None:
            return cls(kind)
        path = Path(draft).expanduser()
        return cls(DraftKind.HEAD if is_head_dir(path) else DraftKind.MODEL, path)

    def __str__(self) -> str:
        """As it travels to the workers: the word, or the path."""
        return str(self.path) if self.path is not None else self.kind.value

    @property
    def speculative(self) -> bool:
        return self.kind is not DraftKind.NONE

    @property
    def own_model(self) -> bool:
        """A model of its own (a draft model, or the target's int8 copy), as heavy as any rank; not the
        suffix drafter (light Python) or a draft head (one layer)."""
        return self.kind in (DraftKind.INT8, DraftKind.MODEL)

    @property
    def model_dir(self) -> Path | None:
        """A draft model's directory, whose positions and tokenizer the Engine checks."""
        return self.path if self.kind is DraftKind.MODEL else None

    @property
    def name(self) -> str:
        """Short, for labels: the word, or the directory's name."""
        return self.path.name if self.path is not None else self.kind.value

    @property
    def description(self) -> str:
        return BUILTIN_DRAFTS.get(self.kind) or f"draft {self.name}"


def is_head_dir(path: Path) -> bool:
    """A draft head directory (ours or EAGLE's), as opposed to a draft model."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return HEAD_CONFIG_KEY in data or _is_eagle(path, data)


def _is_eagle(path: Path, cfg: dict) -> bool:
    """EAGLE heads ship a Llama config of one layer whose weights start with ``fc.``."""
    if cfg.get("num_hidden_layers") != 1:
        return False
    names = _weight_names(path)
    return names is not None and "fc.weight" in names


def _weight_names(path: Path) -> set[str] | None:
    st = path / "model.safetensors"
    if st.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(st), framework="numpy") as fh:
                return set(fh.keys())
        except Exception:
            return None
    return set(read_bin(path)) if (path / "pytorch_model.bin").is_file() else None


def read_bin(path: Path) -> dict:
    """An EAGLE head's ``pytorch_model.bin``, loaded with ``weights_only`` (no code runs)."""
    import torch

    try:
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:
        raise HeadError(f"cannot read the draft head {path / 'pytorch_model.bin'}: {e}") from None
