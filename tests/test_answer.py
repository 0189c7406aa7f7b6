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


def test_the_answers_median_latency_is_per_token_and_its_summary_round_trips(monkeypatch):
    from swiftspec.engine.host import answer as answer_module
    from swiftspec.engine.model.model_dir import load_tokenizer

    clock = iter([0.0, 0.030, 0.070])  # the Answer's start, then each step's arrival
    monkeypatch.setattr(answer_module.time, "perf_counter", lambda: next(clock))
    answer = Answer(load_tokenizer(tiny_model_dir()), [], d=0)
    answer.event(Step([5, 6, 7]))  # 10 ms a token
    last = answer.event(Step([8], "eos"))  # 40 ms
    summary = AnswerSummary.of("async", last)
    assert summary.stats.ms_per_token_p50 == 10.0 and summary.finish_reason == "eos"
    assert summary.stats.generated == 4 and summary.mode == "async"
    stored = summary.to_dict()
    assert "accepted" not in stored and AnswerSummary.from_dict(stored) == dataclasses.replace(
        summary, stats=dataclasses.replace(summary.stats, accepted=0))
    old = AnswerSummary.from_dict({"mode": "ar", "generated": 3, "finish_reason": "length"})  # a row of fewer fields
    assert old.line() == "ar · 3 tok · 0.0 tok/s · p50 0.0 ms/tok · length"

