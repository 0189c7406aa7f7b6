"""The Engine's side of an answer: the chat template, stop strings held back until they cannot match, and
the figures an answer is kept and shown with (AnswerSummary)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engines import PROMPTS
from tiny_models import tiny_model_dir

from swiftspec.engine.events import Step
from swiftspec.engine.host.answer import Answer, AnswerSummary, StopMatcher
from swiftspec.engine.host.client import EngineError
from swiftspec.engine.host.encode import encode_chat


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["\nUser:", "END"])
    assert m.push("Hello\nUs") == ("Hello", False)
    assert m.push("ual text E") == ("\nUsual text ", False)
    assert m.push("N") == ("", False)
    assert m.push("D and more") == ("", True)
    m = StopMatcher(["aab"])
    assert m.push("xaa") == ("x", False)
    assert m.push("ab") == ("a", True)
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False) and m.flush() == ""


def test_encode_chat_uses_the_template():
    from swiftspec.engine.model.model_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    ids = encode_chat(tok, PROMPTS[0])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(EngineError, match="messages"):
        encode_chat(tok, [{"role": "user"}])


def test_encode_chat_continues_a_final_answer():
    """/continue: a last assistant message is left open, so the answer goes on where it stopped."""
    from swiftspec.engine.model.model_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    question = encode_chat(tok, PROMPTS[0])
    partial = encode_chat(tok, PROMPTS[0] + [{"role": "assistant", "content": "The answer is"}])
    assert partial[:len(question)] == question  # the prefix the workers already hold
    assert tok.decode(partial[len(question):]) == "The answer is"


def test_the_answers_latency_is_each_steps_own_and_its_summary_round_trips(monkeypatch):
    """A frame carries several steps (the leader sends them at most every STREAM_INTERVAL_S): each gets its
    event, and each token the latency of its own step in the leader, which the frame's arrival does not
    show; the answer's first step (sent at once) waits for the prefill: its arrival counts."""
    from swiftspec.engine.host import answer as answer_module
    from swiftspec.engine.model.model_dir import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir())
    clock = iter([0.0, 0.030, 0.070])  # the Answer's start, then each frame's arrival
    monkeypatch.setattr(answer_module.time, "perf_counter", lambda: next(clock))
    answer = Answer(tokenizer, [], d=0)
    (first,) = answer.events([Step([5], prefill_tokens=4)])
    assert first.stats.token_latency_ms == 30.0 and first.stats.prefill_tokens == 4
    events = answer.events([Step([6, 7, 8], interval_ms=3.0), Step([9], "eos", interval_ms=9.0)])
    assert [e.token_ids for e in events] == [[6, 7, 8], [9]]
    assert [e.stats.token_latency_ms for e in events] == [1.0, 9.0]
    assert [e.finished for e in events] == [False, True] and events[-1].finish_reason == "eos"
    assert events[0].text == "" and first.text + events[-1].text == tokenizer.decode([5, 6, 7, 8, 9])
    last = events[-1]
    assert last.stats.ms_per_token_p50 == 1.0 and last.stats.ms_per_token_p95 == 30.0  # 1, 1, 1, 9, 30
    summary = AnswerSummary.of("async", last)
    assert summary.stats.ms_per_token_p50 == 1.0 and summary.finish_reason == "eos"
    assert summary.stats.generated == 5 and summary.mode == "async"
    stored = summary.to_dict()
    assert "accepted" not in stored and AnswerSummary.from_dict(stored) == dataclasses.replace(
        summary, stats=dataclasses.replace(summary.stats, accepted=0))
    old = AnswerSummary.from_dict({"mode": "ar", "generated": 3, "finish_reason": "length"})  # a row of fewer fields
    assert old.line() == "ar · 3 tok · 0.0 tok/s · p50 0.0 ms/tok · length"



def test_a_stop_string_inside_a_frame_ends_the_answer_at_its_last_event():
    from swiftspec.engine.model.model_dir import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir())
    ids = tokenizer.encode("alpha beta gamma delta")
    stop = tokenizer.decode(ids[1:2]).strip()
    answer = Answer(tokenizer, [stop], d=0)
    answer.events([Step(ids[:1])])
    events = answer.events([Step(ids[1:2], interval_ms=2.0), Step(ids[2:], interval_ms=2.0)])
    assert [e.finished for e in events] == [False, True] and events[-1].finish_reason == "stop"
    assert stop not in events[-1].text
