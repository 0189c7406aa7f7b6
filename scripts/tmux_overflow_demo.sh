#!/usr/bin/env bash
# Shows a conversation outgrowing its context in a real terminal (tmux): `swiftspec chat` on the embedded
# model with a 256-token context, three questions, and the notice that the oldest turn was left out; the
# chat goes on without an error. Prints the captured pane.
#
#   scripts/tmux_overflow_demo.sh              # 100x32
#   COLS=140 ROWS=40 scripts/tmux_overflow_demo.sh --mode ar
#
# Extra arguments go to `swiftspec chat`. CAPTURE=FILE also writes the pane (with colours) to FILE. The
# conversation is kept in a scratch data dir (SWIFTSPEC_DATA_DIR), not in your history.
set -euo pipefail
COLS=${COLS:-100}
ROWS=${ROWS:-32}
source "$(dirname "$0")/tmux_common.sh"

SCRATCH=$(mktemp -d)
trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true; rm -rf "$SCRATCH"' EXIT
SWIFTSPEC="env SWIFTSPEC_DATA_DIR=$SCRATCH $SWIFTSPEC"  # the pane gets the tmux server's environment, not ours

start_chat --max-seq-len 256 --max-new-tokens 96 "$@"
for question in "Name three rivers in Europe." "Tell me about the longest one." "And which is the shortest?" \
        "Thank you! One more: which flows through Vienna?"; do
    send "$question"
    wait_idle "$ANSWER_TIMEOUT" "the answer to: $question"
    if pane | grep -q "Context full"; then
        break
    fi
done
wait_for 5 "Context full" "the overflow notice"
if pane | grep -Eq "No answer|Does not fit|Error"; then
    fail "an error was shown"
fi

pane
if [ -n "${CAPTURE:-}" ]; then
    pane -e > "$CAPTURE"
fi
tmux send-keys -t "$SESSION" C-q
