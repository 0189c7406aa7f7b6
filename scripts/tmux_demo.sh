#!/usr/bin/env bash
# Runs `swiftspec chat` in a real terminal (tmux) on the embedded default model, sends one prompt, waits
# for the answer to finish and prints the captured pane: the answer and the live stats panel.
#
#   scripts/tmux_demo.sh                       # 80x24, default prompt
#   COLS=140 ROWS=40 PROMPT="Explain RoPE" scripts/tmux_demo.sh --mode sync
#
# Extra arguments go to `swiftspec chat`. CAPTURE=FILE also writes the pane (with colours) to FILE.
set -euo pipefail

if ! command -v tmux >/dev/null 2>&1; then
    echo "tmux_demo: tmux is not installed (Debian/Ubuntu: apt-get install -y tmux)" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
SWIFTSPEC=${SWIFTSPEC:-$( [ -x .venv/bin/swiftspec ] && echo .venv/bin/swiftspec || command -v swiftspec || true )}
if [ -z "$SWIFTSPEC" ]; then
    echo "tmux_demo: swiftspec not found; run 'make chat' once (it creates .venv) or pip install the project" >&2
    exit 2
fi

COLS=${COLS:-80}
ROWS=${ROWS:-24}
PROMPT=${PROMPT:-"Write a Python function that checks whether a number is prime."}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}
START_TIMEOUT=${START_TIMEOUT:-300}   # the first run converts the GGUF (~25 s) before the workers start
ANSWER_TIMEOUT=${ANSWER_TIMEOUT:-300}
SESSION="swiftspec-demo-$$"

trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true' EXIT

pane() { tmux capture-pane -p -t "$SESSION" "$@"; }

wait_for() {  # wait_for SECONDS GREP-PATTERN WHAT
    local deadline=$((SECONDS + $1))
    until pane | grep -Eq "$2"; do
        if [ "$(tmux display-message -p -t "$SESSION" '#{pane_dead}')" = 1 ]; then
            echo "tmux_demo: swiftspec exited while waiting for $3; the pane:" >&2
            pane >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "tmux_demo: timed out after $1 s waiting for $3; the pane:" >&2
            pane >&2
            exit 1
        fi
        sleep 1
    done
}

# remain-on-exit (set before swiftspec starts) keeps the pane readable if it dies early.
tmux new-session -d -s "$SESSION" -x "$COLS" -y "$ROWS"
tmux set-option -t "$SESSION" remain-on-exit on >/dev/null
tmux respawn-pane -k -t "$SESSION" "$SWIFTSPEC chat --max-new-tokens $MAX_NEW_TOKENS $*"

wait_for "$START_TIMEOUT" "Message · /help" "the engine to start"
tmux send-keys -t "$SESSION" -l "$PROMPT"
sleep 0.5
tmux send-keys -t "$SESSION" Enter
# The answer's border shows its figures ("… 12.3 tok/s …") once it has finished.
wait_for "$ANSWER_TIMEOUT" "[0-9] tok/s" "the answer"
sleep 0.5

pane
if [ -n "${CAPTURE:-}" ]; then
    pane -e > "$CAPTURE"
fi
tmux send-keys -t "$SESSION" C-q
