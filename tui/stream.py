"""The hand-off between the thread that decodes and the event loop that renders, and the pace of the renders."""

from __future__ import annotations

import threading
import time

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


class DrawPace:
    """How often the UI draws a streaming answer: every SHORTEST seconds at most, less often when its thread
    (the caller's) took more than SHARE of a core since the last draw (mostly re-laying out and drawing the
    growing answer: ~30 ms a draw for a 256-token answer on a 140 x 40 terminal), down to LONGEST. Its
    drawing competes with decoding for the cores: on a 2-core Zen 4, during such an answer, 12 draws a
    second took 0.4-0.7 s of the UI's thread (~40 % of a core) and this pace 0.2-0.3 s, and the chat's `ar`
    decoded 5 % faster on average (7 answers each way in turn, 5 of them faster)."""

    SHORTEST = 1 / 12
    SHARE = 0.15
    LONGEST = 0.25

    def __init__(self) -> None:
        self._cpu = time.thread_time()  # the thread's CPU time at the last draw

    def next_delay(self) -> float:
        """Right after a draw: the seconds until the next."""
        now = time.thread_time()
        spent, self._cpu = now - self._cpu, now
        return min(max(spent / self.SHARE, self.SHORTEST), self.LONGEST)
