"""What of a long conversation the model sees: the newest turns that fit in its context with room left for
the answer. The oldest turns are left out, whole, never the system prompt; the chat and the history keep
them. The window only moves forward, so the prompt's prefix stays the same from turn to turn and the
workers reuse its KV cache until the next overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from swiftspec.engine.host.protocol import TakesIds


class Context(NamedTuple):
    """What a conversation must fit into: how its messages count, the context's length, the model's own
    limit (0: unknown) and, where the engine templates on this side, how they become token ids
    (``encode``: the ids the window is fitted with are then the ones sent). An engine gives it (``of``);
    so does the tokenizer alone, before one starts."""

    count_tokens: Callable[[list[dict]], int]
    length: int
    limit: int = 0
    encode: Callable[[list[dict]], list[int]] | None = None

    @classmethod
    def of(cls, engine) -> Context:
        encode = engine.encode_chat if isinstance(engine, TakesIds) else None
        return cls(engine.count_tokens, engine.info.context_length, engine.info.max_context, encode)


class Fit(NamedTuple):
    """Where the window starts, and the prompt from there as token ids (None: the context only counts)."""

    start: int
    ids: tuple[int, ...] | None


class ContextError(ValueError):
    """The newest message alone, with room for its answer, does not fit in the context."""


def answer_room(max_new_tokens: int, context_length: int) -> int:
    """Tokens kept free for the answer: max_new_tokens, but at most half the context, so that a small
    context still holds some conversation (an answer that outgrows it ends with finish reason "context")."""
    return min(max_new_tokens, context_length // 2)


def fit(messages: list[dict], start: int, system: str | None, context: Context, max_new_tokens: int) -> Fit:
    """Where the window starts now (>= ``start``): the first of ``messages`` (the conversation without its
    system prompt) that the model is shown, with the prompt's ids where ``context`` encodes. Whole turns
    are dropped, oldest first, until the prompt plus the answer's room fits; the newest user message is
    always kept. The context's limit decides whether a raised --max-seq-len could help."""
    head = [{"role": "system", "content": system}] if system else []
    room = answer_room(max_new_tokens, context.length)
    start = min(start, len(messages))
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    candidates = [start] + [i for i in range(start + 1, last_user + 1) if messages[i]["role"] == "user"]
    encoded: dict[int, list[int]] = {}  # by candidate: the chosen one's ids are sent as they are

    def size(candidate: int) -> int:
        prompt = head + messages[candidate:]
        if context.encode is None:
            return context.count_tokens(prompt)
        encoded[candidate] = context.encode(prompt)
        return len(encoded[candidate])

    def fits(candidate: int) -> bool:
        return size(candidate) + room <= context.length

    def chosen(candidate: int) -> Fit:
        ids = encoded.get(candidate)
        return Fit(candidate, None if ids is None else tuple(ids))

    if fits(candidates[0]):  # the usual case: the window stays where it is
        return chosen(candidates[0])
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
        used = size(candidates[-1])
        advice = ("shorten it or lower --max-new-tokens (the context is already the model's maximum)"
                  if 0 < context.limit <= context.length else
                  "shorten it, lower --max-new-tokens or raise --max-seq-len")
        raise ContextError(f"the newest message needs {used} tokens plus {room} for the answer, more than the "
                           f"context of {context.length} tokens: {advice}")
    return chosen(candidates[lo])


def turns_between(messages: list[dict], start: int, end: int) -> int:
    """How many turns (user messages) lie in messages[start:end]: what a notice reports as dropped."""
    return sum(1 for m in messages[start:end] if m["role"] == "user")
