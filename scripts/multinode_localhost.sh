#!/usr/bin/env bash
# Two torchrun launchers on this machine acting as two nodes (--nnodes=2, c10d rendezvous): one node runs
# the target rank, the other the draft rank. Rank 0 (the leader) generates one answer in `ar` and in `async`
# mode and prints whether they agree token for token. Nothing here is SwiftSpec-specific plumbing: on two
# real machines, run the same torchrun line on each with --rdzv-endpoint=<first host>:<port>.
#
#   scripts/multinode_localhost.sh            # embedded model, suffix draft
#   TARGET=/path/to/model DRAFT=/path/to/draft scripts/multinode_localhost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-$($PY -c 'from swiftspec.engine.model.loader import resolve_model_dir; print(resolve_model_dir(None))')}
DRAFT=${DRAFT:-suffix}
PORT=${PORT:-$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
PROMPT=${PROMPT:-"Write a Python function that returns the n-th Fibonacci number, with a docstring."}
TOKENS=${TOKENS:-64}

launch() {  # c10d rendezvous assigns the node ranks: whichever node gets rank 0 leads
  OMP_NUM_THREADS=1 $PY -m torch.distributed.run --nnodes=2 --nproc-per-node=1 \
    --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$PORT" --rdzv-id="swiftspec-multinode-$$" \
    --max-restarts=0 \
    -m swiftspec.engine.worker --target "$TARGET" --draft "$DRAFT" --target-procs 1 --threads 1 \
    --prompt "$PROMPT" --modes ar,async --max-new-tokens "$TOKENS"
}

echo "== two launchers, c10d rendezvous at 127.0.0.1:$PORT; target: $TARGET; draft: $DRAFT"
launch &
other=$!
trap 'kill "$other" 2>/dev/null || true' EXIT
launch
wait "$other"
