#!/usr/bin/env bash
# GPU acceptance for the kernels (issue 7), one command: the CUDA-only tests (pytest -m gpu), then
# benchmarks/kernels_bench.py (micro-benchmarks + 1B/8B decode-step HBM share). Extra arguments go to the
# benchmark, e.g. `scripts/gpu_check.sh --peak-bw 3.35e12` on an H100 SXM. Fails without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the first interpreter whose torch sees a GPU (the dev .venv may be a CPU build)
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 &&
      "$cand" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
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
"$PY" -c "import torch, triton; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" || exit 1

"$PY" -m pytest -m gpu -q -rs tests
tests=$?
"$PY" benchmarks/kernels_bench.py "$@"
bench=$?
echo "gpu_check: tests exit $tests, benchmark exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
