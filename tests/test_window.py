"""The context window: the fewest oldest whole turns are left out, never the system prompt or the newest
message, and the window only moves forward."""

from __future__ import annotations

import random

import pytest

from swiftspec import window


def count(messages: list[dict]) -> int:
    return sum(len(m["content"]) + 2 for m in messages)  # a "token" per character, 2 per message


def conversation(sizes: list[int]) -> list[dict]:
    out = []
    for i, size in enumerate(sizes):
        out += [{"role": "user", "content": "q" * (i % 3 + 1)}, {"role": "assistant", "content": "a" * size}]
    return out + [{"role": "user", "content": "now"}]


@pytest.mark.parametrize("seed", range(20))
def test_drops_the_fewest_oldest_turns(seed):
    rng = random.Random(seed)
    messages = conversation([rng.randrange(1, 60) for _ in range(rng.randrange(1, 15))])
    context, max_new = rng.randrange(80, 400), rng.randrange(1, 300)
    room = window.answer_room(max_new, context)
    head = [{"role": "system", "content": "sys"}]
    start = window.fit(messages, 0, "sys", window.Context(count, context), max_new).start
    assert messages[start]["role"] == "user"
    assert count(head + messages[start:]) + room <= context
    earlier = [i for i in range(start) if messages[i]["role"] == "user"]
    assert not earlier or count(head + messages[earlier[-1]:]) + room > context  # no more than needed
    assert window.fit(messages, start, "sys", window.Context(count, context), max_new).start == start  # stays put
    assert window.turns_between(messages, 0, start) == len(earlier)


def test_the_newest_message_alone_must_fit():
    messages = conversation([10]) + [{"role": "assistant", "content": "x" * 50}]  # a cut answer, continued
    assert window.fit(messages, 0, None, window.Context(count, 115), 50) == (2, None)  # 72 tokens, 57 from the last question
    with pytest.raises(window.ContextError, match="more than the context of 100 tokens"):
        window.fit(messages, 0, None, window.Context(count, 100), 50)
    assert window.answer_room(512, 300) == 150 and window.answer_room(64, 4096) == 64


def test_the_fitted_window_comes_with_the_ids_it_was_measured_by():
    """Where the context encodes (an Engine's), the chosen window's token ids come from the pass that
    measured it: what the chat sends, templated once."""
    head, seen = [{"role": "system", "content": "sys"}], []

    def encode(messages: list[dict]) -> list[int]:
        seen.append(messages)
        return [ord(c) for m in messages for c in m["content"] + "  "]  # as many as ``count``

    messages = conversation([30, 30, 30])  # 118 tokens with the system prompt
    start, ids = window.fit(messages, 0, "sys", window.Context(count, 120, encode=encode), 10)
    assert start == 2 and seen.count(head + messages[2:]) == 1 and list(ids) == encode(head + messages[2:])
