#!/usr/bin/env bash
# The GPU acceptance run, one command, at most ~8 minutes on one H200: the gpu-marked tests, the engine
# end to end on one GPU (ar/sync/async identical in bf16), the 8B decode step and its HBM share, the
# verification cost by tree size, CUDA graphs on/off, batch-invariant kernels vs cuBLAS, tree attention
# vs SDPA. Writes one JSON report ($OUT/gpu_check.json, else ./gpu_check.json; --report PATH) and prints
# a table; stops cleanly at its --budget (seconds, default 450).
#
# Needs only PyTorch, Triton, transformers, safetensors and tokenizers, plus the packages the engine and
# the gpu-marked test modules import: if they are missing, put their wheels (for the interpreter that runs
# this) in a folder and pass WHEELS=DIR. The lent H200 image lacks textual, platformdirs, gguf, pydantic
# (with pydantic-core, annotated-types, typing-inspection), starlette, uvicorn, llguidance, pytest-asyncio,
# mdit-py-plugins, linkify-it-py and uc-micro-py.
# `scripts/gpu_check.sh --dry-run` runs every step that needs no CUDA on the CPU, with scaled-down models.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry=1; done
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/swiftspec-wheels "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/swiftspec-wheels${PYTHONPATH:+:$PYTHONPATH}
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the first interpreter whose torch sees a GPU (the dev .venv may be a CPU build)
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 &&
      "$cand" -c "import sys, torch; sys.exit(not ($dry or torch.cuda.is_available()))" 2>/dev/null; then
      PY=$cand
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no CUDA device visible to torch (tried .venv/bin/python, python3, python; set PYTHON=...)" >&2
  exit 1
fi
if ! "$PY" -c "import swiftspec.kernels" 2>/dev/null; then
  echo "gpu_check: installing swiftspec into $PY (editable, no dependencies)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
"$PY" -c "import torch; print('gpu_check: torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
exec "$PY" benchmarks/gpu_check.py "$@"
