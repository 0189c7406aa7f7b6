# Shared by the tmux scripts: finds swiftspec, starts it in a detached tmux session of COLS x ROWS and
# offers `pane` (capture it), `wait_for SECONDS PATTERN WHAT` and `wait_idle SECONDS WHAT`.
# Source it after `set -euo pipefail`; it ends the session on exit.

if ! command -v tmux >/dev/null 2>&1; then
    echo "$(basename "$0"): tmux is not installed (Debian/Ubuntu: apt-get install -y tmux)" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
SWIFTSPEC=${SWIFTSPEC:-$( [ -x .venv/bin/swiftspec ] && echo .venv/bin/swiftspec || command -v swiftspec || true )}
if [ -z "$SWIFTSPEC" ]; then
    echo "$(basename "$0"): swiftspec not found; run 'make chat' once (it creates .venv) or pip install the project" >&2
    exit 2
fi

COLS=${COLS:-80}
ROWS=${ROWS:-24}
START_TIMEOUT=${START_TIMEOUT:-300}   # the first run converts the GGUF (~25 s) before the workers start
ANSWER_TIMEOUT=${ANSWER_TIMEOUT:-300}
SESSION="swiftspec-demo-$$"

trap 'tmux kill-session -t "$SESSION" 2>/dev/null || true' EXIT

pane() { tmux capture-pane -p -t "$SESSION" "$@"; }

fail() {  # fail MESSAGE: says why, shows the pane, exits 1
    echo "$(basename "$0"): $1; the pane:" >&2
    pane >&2
    exit 1
}

wait_for() {  # wait_for SECONDS GREP-PATTERN WHAT
    local deadline=$((SECONDS + $1))
    until pane | grep -Eq "$2"; do
        [ "$(tmux display-message -p -t "$SESSION" '#{pane_dead}')" = 1 ] && fail "swiftspec exited while waiting for $3"
        [ "$SECONDS" -ge "$deadline" ] && fail "timed out after $1 s waiting for $3"
        sleep 1
    done
}

wait_idle() {  # wait_idle SECONDS WHAT: the footer offers "Stop" while an answer streams: until it is gone
    local started=$((SECONDS + 30))  # a very short answer may be over before it is seen
    until pane | grep -q "esc Stop" || [ "$SECONDS" -ge "$started" ]; do sleep 0.2; done
    local deadline=$((SECONDS + $1))
    while pane | grep -q "esc Stop"; do
        [ "$SECONDS" -ge "$deadline" ] && fail "timed out after $1 s waiting for $2"
        sleep 0.5
    done
}

start_chat() {  # start_chat ARGS...: swiftspec chat ARGS in the session, until the prompt box shows
    # remain-on-exit (set before swiftspec starts) keeps the pane readable if it dies early.
    tmux new-session -d -s "$SESSION" -x "$COLS" -y "$ROWS"
    tmux set-option -t "$SESSION" remain-on-exit on >/dev/null
    tmux respawn-pane -k -t "$SESSION" "$SWIFTSPEC chat $*"
    wait_for "$START_TIMEOUT" "Message · /help" "the engine to start"
}

send() {  # send TEXT: types TEXT into the prompt box and presses Enter
    tmux send-keys -t "$SESSION" -l "$1"
    sleep 0.5
    tmux send-keys -t "$SESSION" Enter
}
