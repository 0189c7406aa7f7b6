#!/usr/bin/env bash
# Runs `swiftspec chat` in a real terminal (tmux) on the embedded default model, sends one prompt, waits
# for the answer to finish and prints the captured pane: the answer and the live stats panel.
#
#   scripts/tmux_demo.sh                       # 80x24, default prompt
#   COLS=140 ROWS=40 PROMPT="Explain RoPE" scripts/tmux_demo.sh --mode sync
#
# Extra arguments go to `swiftspec chat`. CAPTURE=FILE also writes the pane (with colours) to FILE.
set -euo pipefail
source "$(dirname "$0")/tmux_common.sh"

PROMPT=${PROMPT:-"Write a Python function that checks whether a number is prime."}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}

start_chat --max-new-tokens "$MAX_NEW_TOKENS" "$@"
send "$PROMPT"
# The answer's border shows its figures ("… 12.3 tok/s …") once it has finished.
wait_for "$ANSWER_TIMEOUT" "[0-9] tok/s" "the answer"
sleep 0.5

pane
if [ -n "${CAPTURE:-}" ]; then
    pane -e > "$CAPTURE"
fi
tmux send-keys -t "$SESSION" C-q
