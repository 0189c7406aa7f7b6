"""A scripted stand-in for swiftspec.Engine: same API, canned tokens, deterministic stats.

It lets the TUI and scripted-mode tests run in milliseconds and reproduce exact screens; the real engine
is exercised by the tests marked ``slow``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.events import StepEvent, StepStats
from swiftspec.engine.host.client import EngineError
from swiftspec.engine.host.protocol import EngineInfo, RankInfo

ANSWER = (
    "Here is a function:\n\n"
    "```python\n"
    "def add(a, b):\n"
    "    return a + b\n"
    "```\n\n"
    "It **adds** two numbers."
)

INFO = EngineInfo(
    target="fake-target · gguf (Q4_1 blocks) · int16 activations · AVX2", draft="suffix",  # as the workers say
    ranks=[RankInfo(rank=0, role="target", device="cpu", tp_rank=0, tp_world=1, torch_threads=1, host="local", pid=1),
           RankInfo(rank=1, role="draft", device="cpu", tp_rank=0, tp_world=1, torch_threads=1, host="local", pid=2)],
    context_length=4096, backend="gloo", bs=8, w=8, d=4, d_auto=True, t_verify_ms=40.0, t_expand_ms=3.0,
    eos_token_ids=[999], max_context=8192, kernel_threads={"ar": 2, "sync": 2, "async": 1},
)
EOS = INFO.eos_token_ids[0]


def chunks(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class FakeEngine:
    """Streams ``answer`` in small pieces, a few "tokens" per step, with stats from a fixed cycle.

    step_delay slows each step (for Esc tests); die_after makes the engine die (EngineError) after that
    many steps; accept_gate, when given, holds each request until set, as the real engine does not have
    a request yet while a turn starts (a cancel then finds no answer to stop); loops_at makes an answer
    asked with a loop guard stop there ("repetition"); refuse makes generate() raise EngineError while the
    engine stays alive; draft "none" is an engine started with --mode ar, which refuses sync and async as
    the real one does; factory's start_error makes the start fail and start_gate, when given, holds it
    until set. An answer that ends with "eos" ends with a step of the EOS token alone, whose text is empty.

    A "token" is a 4-character chunk of the answer, and a message counts one token per word plus 4, so
    context_length can be filled as the real engine's is: an answer that reaches it ends with "context",
    a prompt that does not fit is refused. When the last message is the assistant's, the answer goes on
    from where that message's text leaves ``answer``.
    """

    ACCEPT_CYCLE = (3, 1, 0, 2)

    def __init__(self, answer: str = ANSWER, step_delay: float = 0.0, die_after: int | None = None,
                 refuse: str | None = None, context_length: int = INFO.context_length, draft: str = INFO.draft,
                 loops_at: int | None = None, accept_gate: threading.Event | None = None) -> None:
        self.answer = answer
        self.accept_gate = accept_gate
        self.loops_at = loops_at
        self.step_delay = step_delay
        self.die_after = die_after
        self.refuse = refuse
        self.dead = False
        self._when_dead: list[Callable[[], None]] = []
        self.info = replace(INFO, context_length=context_length, draft=draft)
        self.calls: list[tuple[list[dict], SamplingParams]] = []
        self.closed = False
        self._cancel = threading.Event()

    @classmethod
    def start(cls, config: EngineConfig, progress: Callable[[str], None] | None = None, **kwargs) -> FakeEngine:
        if progress:
            progress("loading target fake-target")
            progress("workers ready")
        return cls(**kwargs)

    @classmethod
    def factory(cls, start_error: str | None = None, start_gate: threading.Event | None = None,
                progress_lines: tuple[str, ...] = ("spawning 2 workers", "loading target fake-target"),
                **kwargs) -> Callable[[Callable[[str], None]], FakeEngine]:
        """What the TUI takes: a callable that starts an engine, reporting progress."""

        def start(progress: Callable[[str], None]) -> FakeEngine:
            for line in progress_lines:
                progress(line)
            if start_gate is not None:
                start_gate.wait(30)
            if start_error:
                raise EngineError(start_error)
            engine = cls(**kwargs)
            started.append(engine)
            return engine

        started: list[FakeEngine] = []
        start.started = started  # type: ignore[attr-defined]
        return start

    def generate(self, messages: list[dict], params: SamplingParams) -> Iterator[StepEvent]:
        if self.closed or self.dead:
            raise EngineError("the engine is closed")
        if self.refuse:
            raise EngineError(self.refuse)
        if params.mode != "ar" and self.info.draft == "none":
            raise EngineError(f"mode {params.mode} needs a draft, but this engine was started without one")
        prompt_tokens = self.count_tokens(messages)
        if prompt_tokens >= self.info.context_length:
            raise EngineError(f"the conversation is {prompt_tokens} tokens, but the context length is "
                              f"{self.info.context_length}")
        if self.accept_gate is not None:
            self.accept_gate.wait(30)
        self.calls.append(([dict(m) for m in messages], params))
        self._cancel.clear()
        done_before = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        rest = chunks(self.answer[len(done_before):] if self.answer.startswith(done_before) else self.answer)
        budget = min(params.max_new_tokens, self.info.context_length - prompt_tokens)
        cut_reason = "context" if budget < params.max_new_tokens else "length"
        pieces = rest[:budget]
        if params.loop_guard and self.loops_at is not None and self.loops_at < len(pieces):
            pieces, cut_reason = pieces[:self.loops_at], "repetition"
        produced = accepted_total = verified = steps = 0
        self._latencies: list[float] = []  # every token's, for the running median the Engine reports
        i = 0
        while i < len(pieces):
            if self._cancel.is_set():
                yield StepEvent([], "", self._stats(0, accepted_total, verified, steps, produced), True, "cancelled")
                return
            if self.die_after is not None and steps >= self.die_after:
                self.dead = True
                for callback in self._when_dead:
                    callback()
                raise EngineError("worker rank 0 exited with signal 9\n[stderr tail] Killed")
            accepted = self.ACCEPT_CYCLE[steps % len(self.ACCEPT_CYCLE)]
            n = min(accepted + 1, len(pieces) - i)
            text = "".join(pieces[i : i + n])
            i += n
            produced += n
            accepted_total += n - 1
            verified += 7
            steps += 1
            if self.step_delay:
                time.sleep(self.step_delay)
            done = i >= len(pieces)
            reason = (cut_reason if len(pieces) < len(rest) else "eos") if done else None
            stats = self._stats(n - 1, accepted_total, verified, steps, produced)
            if reason == "eos":  # the EOS comes as its own last step, as the real engine's often does
                yield StepEvent(list(range(produced - n, produced)), text, stats)
                yield StepEvent([EOS], "", stats, True, "eos")
                return
            yield StepEvent(list(range(produced - n, produced)), text, stats, done, reason)

    @staticmethod
    def count_tokens(messages: list[dict]) -> int:
        return sum(len(m["content"].split()) + 4 for m in messages)

    def _stats(self, accepted: int, accepted_total: int, verified: int, steps: int, produced: int) -> StepStats:
        latency = 40.0 / (accepted + 1)
        self._latencies += [latency] * (produced - len(self._latencies))
        return StepStats(
            accepted=accepted, tree_size=8, draft_ms=3.0, target_ms=40.0,
            token_latency_ms=latency, acceptance_rate=accepted_total / max(verified, 1),
            mean_accepted=produced / max(steps, 1), tokens_per_s=50.0, d=4, prefill_tokens=12,
            generated=produced, ms_per_token_p50=statistics.median(self._latencies) if self._latencies else 0.0,
        )

    @property
    def alive(self) -> bool:
        return not (self.closed or self.dead)

    def when_dead(self, callback: Callable[[], None]) -> None:
        """As Engine.when_dead: ``callback`` runs when the (pretend) workers die."""
        self._when_dead.append(callback)

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
