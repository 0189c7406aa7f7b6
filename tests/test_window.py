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
    start = window.fit(messages, 0, "sys", count, context, max_new)
    assert messages[start]["role"] == "user"
    assert count(head + messages[start:]) + room <= context
    earlier = [i for i in range(start) if messages[i]["role"] == "user"]
    assert not earlier or count(head + messages[earlier[-1]:]) + room > context  # no more than needed
    assert window.fit(messages, start, "sys", count, context, max_new) == start  # stays put
    assert window.turns_between(messages, 0, start) == len(earlier)


def test_the_newest_message_alone_must_fit():
    messages = conversation([10]) + [{"role": "assistant", "content": "x" * 50}]  # a cut answer, continued
    assert window.fit(messages, 0, None, count, 115, 50) == 2  # 72 tokens in all, 57 from the newest question
    with pytest.raises(window.ContextError, match="more than the context of 100 tokens"):
        window.fit(messages, 0, None, count, 100, 50)
    assert window.answer_room(512, 300) == 150 and window.answer_room(64, 4096) == 64
