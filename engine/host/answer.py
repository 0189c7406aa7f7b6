"""The Engine's side of one answer: the workers send token ids and figures (events.Step); here they
become text (incremental detokenisation, stop strings) and StepEvents with running stats, off the
workers' critical path."""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from swiftspec.engine.events import CUT_SHORT, FinishReason, Step, StepEvent, StepStats
from swiftspec.engine.host.detok import IncrementalDetokenizer


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
        self.forced = self.nodes = 0
        self.mask_ms = 0.0
        self.t_first = self.t_last = time.perf_counter()
        self.latencies: list[float] = []  # every token's, sorted: the median is per token

    def events(self, steps: list[Step]) -> list[StepEvent]:
        """An event for each of a frame's steps, in order. The text of all their tokens comes with the last
        (one detokenisation a frame), which a stop string in it ends. Each token's latency is its step's
        own interval in the leader (Step.interval_ms), which a frame's arrival does not show; an answer's
        first step, sent at once, takes the time from the request to its arrival."""
        now = time.perf_counter()
        tokens = [t for s in steps for t in s.tokens]
        reason = steps[-1].finish
        text, hit = self.stops.push(self.detok.push(tokens) if tokens else "")
        if hit:
            reason = "stop"
        elif reason is not None:
            tail, hit = self.stops.push(self.detok.flush())
            text += tail if hit else tail + self.stops.flush()
            reason = "stop" if hit else reason
        last = len(steps) - 1
        return [StepEvent(step.tokens, text if i == last else "", self._stats(step, now),
                          i == last and reason is not None, reason if i == last else None)
                for i, step in enumerate(steps)]

    def _stats(self, step: Step, now: float) -> StepStats:
        """The running figures with ``step`` counted; ``now``: when its frame arrived."""
        tokens = step.tokens
        if self.generated == 0:
            self.t_first = now
            self.prefill_tokens = step.prefill_tokens
        self.generated += len(tokens)
        self.forced += step.forced
        self.mask_ms += step.mask_ms
        self.nodes += step.tree_size or 1
        if step.tree_size:
            self.verifies += 1
            self.accepted += step.accepted
            self.verified += step.tree_size - 1
        interval_ms = step.interval_ms or (now - self.t_last) * 1e3
        latency = interval_ms / max(1, len(tokens))
        for _ in tokens:
            bisect.insort(self.latencies, latency)
        elapsed = now - self.t_first
        self.t_last = now
        return StepStats(
            accepted=step.accepted, tree_size=step.tree_size, draft_ms=step.draft_ms, target_ms=step.target_ms,
            token_latency_ms=latency, ms_per_token_p50=_median(self.latencies),
            ms_per_token_p95=_quantile(self.latencies, 0.95),
            acceptance_rate=self.accepted / self.verified if self.verified else 0.0,
            mean_accepted=(self.accepted + self.verifies) / self.verifies if self.verifies else 0.0,
            tokens_per_s=(self.generated - 1) / elapsed if elapsed > 0 else 0.0,
            d=self.d, prefill_tokens=self.prefill_tokens, generated=self.generated,
            forced_share=self.forced / self.generated if self.generated else 0.0,
            mask_ms_per_node=self.mask_ms / self.nodes, grammar_complete=step.complete)


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    if not n:
        return 0.0
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted figures (0 for none)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else 0.0


@dataclass
class AnswerSummary:
    """An answer's figures as it ended (or so far): what the history keeps with it, scripted mode prints
    and the chat shows under it. Stored as a flat dict (``to_dict``); ``from_dict`` reads older rows too."""

    mode: str = "?"
    finish_reason: FinishReason | None = None
    stats: StepStats = dataclasses.field(default_factory=StepStats)  # the last step's

    @classmethod
    def of(cls, mode: str, last: StepEvent | None) -> AnswerSummary:
        return cls(mode, last.finish_reason if last else None, last.stats if last else StepStats())

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self.stats)
        del out["accepted"]  # the last step's count: the answer's figures are acceptance_rate and mean_accepted
        return {**out, "mode": self.mode, "finish_reason": self.finish_reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnswerSummary:
        names = {f.name for f in dataclasses.fields(StepStats)}
        return cls(data.get("mode", "?"), data.get("finish_reason"),
                   StepStats(**{k: v for k, v in data.items() if k in names}))

    def line(self, short: bool = False) -> str:
        """On one line: scripted mode's stderr and exports (full), a chat footer (short)."""
        s, speculative = self.stats, self.mode != "ar"
        bits = [self.mode, f"{s.generated} tok", f"{s.tokens_per_s:.1f} tok/s"]
        if speculative:
            bits.append(f"acc {100 * s.acceptance_rate:.0f}%")
        if not short:
            if speculative:
                bits.append(f"{s.mean_accepted:.2f} tok/verify")
            bits.append(f"p50 {s.ms_per_token_p50:.1f} ms/tok")
        reason = self.finish_reason
        if reason and (not short or reason in CUT_SHORT):
            bits.append(reason)
        return " · ".join(bits)
