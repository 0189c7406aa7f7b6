"""The hand-off between the thread that decodes and the event loop that renders."""

from __future__ import annotations

import threading

from swiftspec.engine.events import StepEvent, StepStats


class AnswerBuffer:
    """Filled per step by the generate worker, drained by the UI's flush timer a few times a second.

    The worker never waits for rendering: a push only takes a lock and appends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._steps: list[tuple[StepStats, int]] = []

    def push(self, ev: StepEvent) -> None:
        with self._lock:
            if ev.text:
                self._text.append(ev.text)
            self._steps.append((ev.stats, len(ev.token_ids)))

    def drain(self) -> tuple[str, list[tuple[StepStats, int]]]:
        with self._lock:
            text, steps = "".join(self._text), self._steps
            self._text, self._steps = [], []
        return text, steps
