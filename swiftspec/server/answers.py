"""The answers of `swiftspec serve` as JSON: OpenAI's shapes for chat and completions, whole and streamed,
plus one documented ``swiftspec`` object of our own figures (README, "The server")."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from swiftspec.engine.events import StepStats
from swiftspec.engine.host.answer import AnswerSummary
from swiftspec.server.tools import read_calls

FINISH = {"eos": "stop", "stop": "stop", "repetition": "stop", "length": "length", "context": "length",
          "cancelled": "stop"}


@dataclass
class Reply:
    """How one answer is written back: its id, model, the object names of its kind."""

    kind: Literal["chat", "completion"]
    model: str
    tools: bool = False  # the answer may be tool calls
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = self.created or int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": name + (".chunk" if chunk and self.kind == "chat" else ""),
                "created": self.created, "model": self.model}

    def _choice(self, text: str, finish: str | None, chunk: bool, role: bool = False) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def whole(self, text: str, summary: AnswerSummary, prompt_tokens: int) -> dict[str, Any]:
        choice = self._choice(text, FINISH.get(summary.finish_reason), False)
        if self.tools and (calls := read_calls(text)) is not None:
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
        return {**self._head(False), "choices": [choice], "usage": usage(summary, prompt_tokens),
                "swiftspec": extension(summary)}

    def delta_chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk of a chat answer's ``delta`` as it is (tool calls)."""
        return {**self._head(True), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}

    def chunk(self, text: str, first: bool = False, finish: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self._head(True), "choices": [self._choice(text, finish, True, role=first)], **(extra or {})}

    def last(self, summary: AnswerSummary, called: bool = False) -> dict[str, Any]:
        """The closing chunk; ``called``: the answer was tool calls."""
        finish = "tool_calls" if called and summary.finish_reason == "eos" else FINISH.get(summary.finish_reason)
        return self.chunk("", finish=finish, extra={"swiftspec": extension(summary)})

    def usage_chunk(self, summary: AnswerSummary, prompt_tokens: int) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage(summary, prompt_tokens)}


def usage(summary: AnswerSummary, prompt_tokens: int) -> dict[str, int]:
    generated = summary.stats.generated
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def extension(summary: AnswerSummary) -> dict[str, Any]:
    """The ``swiftspec`` object of an answer (README, "The server"): the figures no other server gives."""
    s = summary.stats
    return {"mode": summary.mode, "finish_reason": summary.finish_reason,
            "tokens_per_verification": round(s.mean_accepted, 4), "acceptance_rate": round(s.acceptance_rate, 4),
            "ms_per_token_p50": round(s.ms_per_token_p50, 3), "ms_per_token_p95": round(s.ms_per_token_p95, 3),
            "tokens_per_s": round(s.tokens_per_s, 3), "prefill_tokens": s.prefill_tokens, "d": s.d,
            **({} if s.grammar_complete is None else {  # an answer with a grammar
                "structure_complete": s.grammar_complete, "forced_share": round(s.forced_share, 4),
                "mask_ms_per_node": round(s.mask_ms_per_node, 4)})}


def step_extension(token_ids: list[int], stats: StepStats, finish_reason: str | None) -> dict[str, Any]:
    """A streamed chunk's ``swiftspec`` object when the request asked for ``stream_stats``."""
    return {"swiftspec": {"token_ids": token_ids, "stats": stats.to_dict(), "finish_reason": finish_reason}}
