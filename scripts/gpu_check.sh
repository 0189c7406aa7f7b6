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

# CUDA graphs (engine/cuda_graphs.py) against eager forwards on a random 1B-shaped model: step times for
# an ar step and an 8-token verification, and the logits' agreement (teacher-forced, same cache).
"$PY" - <<'EOF'
import time

import torch

from swiftspec.engine.cuda_graphs import GraphedModel
from swiftspec.engine.model import ModelArgs, Transformer

torch.manual_seed(0)
args = ModelArgs(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                 intermediate_size=8192, rope_theta=500000.0)
with torch.device("cuda"):
    model = Transformer(args).to(torch.bfloat16)
graphed = GraphedModel(model)
graphed.setup_cache(2048)
prompt = 512
ids = torch.randint(0, args.vocab_size, (prompt + 64,), device="cuda")


def call(fn, start, n):
    pos = torch.arange(start, start + n, device="cuda")
    return fn(ids[start:start + n], pos, pos, torch.ones(n, start + n, dtype=torch.bool, device="cuda").tril(start))


def ms_per_call(fn, n, calls=50):
    call(fn, prompt, n)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call(fn, prompt, n)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


call(model, 0, prompt)
worst = 0.0
for i in range(prompt, prompt + 20):
    for n in (1, 8):
        want, got = call(model, i, n), call(graphed, i, n)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
for n in (1, 8):
    eager, replay = ms_per_call(model, n), ms_per_call(graphed, n)
    print(f"gpu_check graphs: {n} token(s)/forward, eager {eager:.2f} ms, graphed {replay:.2f} ms "
          f"({eager / replay:.1f}x)")
print(f"gpu_check graphs: max |graphed - eager| / max |eager| over the logits: {worst:.1e} (limit 0.1)")
raise SystemExit(worst > 0.1)
EOF
graphs=$?
echo "gpu_check: tests exit $tests, benchmark exit $bench, graphs exit $graphs"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$graphs" -eq 0 ]
