"""What of a long conversation the model sees: the newest turns that fit in its context with room left for
the answer. The oldest turns are left out, whole, never the system prompt; the chat and the history keep
them. The window only moves forward, so the prompt's prefix stays the same from turn to turn and the
workers reuse its KV cache until the next overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Context(NamedTuple):
    """What a conversation must fit into: how its messages count, the context's length and the model's
    own limit (0: unknown). An engine gives it (``of``); so does the tokenizer alone, before one starts."""

    count_tokens: Callable[[list[dict]], int]
    length: int
    limit: int = 0

    @classmethod
    def of(cls, engine) -> Context:
        return cls(engine.count_tokens, engine.info.context_length, engine.info.max_context)


class ContextError(ValueError):
    """The newest message alone, with room for its answer, does not fit in the context."""


def answer_room(max_new_tokens: int, context_length: int) -> int:
    """Tokens kept free for the answer: max_new_tokens, but at most half the context, so that a small
    context still holds some conversation (an answer that outgrows it ends with finish reason "context")."""
    return min(max_new_tokens, context_length // 2)


def fit(messages: list[dict], start: int, system: str | None, count_tokens: Callable[[list[dict]], int],
        context_length: int, max_new_tokens: int, max_context: int = 0) -> int:
    """Returns where the window starts now (>= ``start``): the first of ``messages`` (the conversation
    without its system prompt) that the model is shown. Whole turns are dropped, oldest first, until the
    prompt plus the answer's room fits; the newest user message is always kept. ``max_context`` (the
    model's own limit, 0 when unknown) decides whether a raised --max-seq-len could help."""
    head = [{"role": "system", "content": system}] if system else []
    room = answer_room(max_new_tokens, context_length)
    start = min(start, len(messages))
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    candidates = [start] + [i for i in range(start + 1, last_user + 1) if messages[i]["role"] == "user"]

    def fits(candidate: int) -> bool:
        return count_tokens(head + messages[candidate:]) + room <= context_length

    if fits(candidates[0]):  # the usual case: the window stays where it is
        return candidates[0]
    # A later start never needs more tokens: binary search for the first that fits (a few tokenizer
    # passes, not one per turn, for a long resumed conversation).
    lo, hi = 1, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(candidates):
        used = count_tokens(head + messages[candidates[-1]:])
        advice = ("shorten it or lower --max-new-tokens (the context is already the model's maximum)"
                  if 0 < max_context <= context_length else "shorten it, lower --max-new-tokens or raise --max-seq-len")
        raise ContextError(f"the newest message needs {used} tokens plus {room} for the answer, more than the "
                           f"context of {context_length} tokens: {advice}")
    return candidates[lo]


def turns_between(messages: list[dict], start: int, end: int) -> int:
    """How many turns (user messages) lie in messages[start:end]: what a notice reports as dropped."""
    return sum(1 for m in messages[start:end] if m["role"] == "user")
