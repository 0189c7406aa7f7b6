"""The Engine's side of one answer: the workers send token ids and figures (protocol.Step); here they
become text (incremental detokenisation, stop strings) and StepEvents with running stats, off the
workers' critical path."""

from __future__ import annotations

import time

from swiftspec.config import StepEvent, StepStats
from swiftspec.engine.detok import IncrementalDetokenizer
from swiftspec.engine.protocol import Step


class StopMatcher:
    """Finds stop strings across streamed deltas, holding back text that could still begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        buf = self.held + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Answer:
    """Turns one answer's steps into events. A stop string ends the answer here (finish reason "stop");
    the caller then cancels the workers' loop and drops what they sent meanwhile."""

    def __init__(self, tokenizer, stops: list[str], d: int):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(stops)
        self.d = d
        self.generated = self.verifies = self.accepted = self.verified = self.prefill_tokens = 0
        self.t_first = self.t_last = time.perf_counter()

    def event(self, step: Step) -> StepEvent:
        now = time.perf_counter()
        tokens, reason = step.tokens, step.finish
        if self.generated == 0:
            self.t_first = now
            self.prefill_tokens = step.prefill_tokens
        self.generated += len(tokens)
        if step.tree_size:
            self.verifies += 1
            self.accepted += step.accepted
            self.verified += step.tree_size - 1
        text, hit = self.stops.push(self.detok.push(tokens) if tokens else "")
        if hit:
            reason = "stop"
        elif reason is not None:
            tail, hit = self.stops.push(self.detok.flush())
            text += tail if hit else tail + self.stops.flush()
            reason = "stop" if hit else reason
        elapsed = now - self.t_first
        stats = StepStats(
            accepted=step.accepted, tree_size=step.tree_size, draft_ms=step.draft_ms, target_ms=step.target_ms,
            token_latency_ms=(now - self.t_last) * 1e3 / max(1, len(tokens)),
            acceptance_rate=self.accepted / self.verified if self.verified else 0.0,
            mean_accepted=(self.accepted + self.verifies) / self.verifies if self.verifies else 0.0,
            tokens_per_s=(self.generated - 1) / elapsed if elapsed > 0 else 0.0,
            d=self.d, prefill_tokens=self.prefill_tokens, generated=self.generated)
        self.t_last = now
        return StepEvent(tokens, text, stats, reason is not None, reason)
