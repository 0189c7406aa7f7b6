"""What a worker group is started with, in one object: the Engine's settings, the process layout and the
models as the Engine resolved them. The Engine writes it as JSON into its private run directory and
every worker reads it (``--spec``), so a setting is defined once, in ``EngineConfig``, and reaches the
workers without a flag of its own."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiftspec.engine.config import EngineConfig
from swiftspec.engine.host.launcher import Layout
from swiftspec.engine.spec.draft_spec import DraftSpec

SPEC_FILE = "spec.json"


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    layout: Layout
    target_dir: str  # the target as a Hugging Face directory (a GGUF converted once by the Engine)
    draft: str  # a builtin draft's name, a draft model's or draft head's directory
    corpus: str | None = None  # the suffix drafter's corpus file, resolved
    target_name: str | None = None  # what the title bar calls the target (None: its directory's name)
    vocab_size: int | None = None  # a draft model's vocabulary shared with the target (the Engine checked it)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "layout": dataclasses.asdict(self.layout),
                "target_dir": self.target_dir, "draft": self.draft, "corpus": self.corpus,
                "target_name": self.target_name, "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerSpec:
        return cls(EngineConfig.from_dict(data["config"]), Layout(**data["layout"]), data["target_dir"],
                   data["draft"], data.get("corpus"), data.get("target_name"), data.get("vocab_size"))

    def write(self, run_dir: Path) -> Path:
        path = run_dir / SPEC_FILE
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def read(cls, path: Path) -> WorkerSpec:
        return cls.from_dict(json.loads(path.read_text()))

    @functools.cached_property
    def draft_spec(self) -> DraftSpec:
        """The draft, parsed once (the Engine resolved it: a path is a directory)."""
        return DraftSpec.of(self.draft)

    @property
    def name(self) -> str:
        return self.target_name or Path(self.target_dir).name
