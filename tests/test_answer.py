"""The Engine's side of an answer: the chat template, and stop strings held back until they cannot match."""

from __future__ import annotations

import pytest
from helpers.engines import PROMPTS
from tiny_models import tiny_model_dir

from swiftspec.engine.answer import StopMatcher
from swiftspec.engine.client import EngineError, encode_chat


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
    from swiftspec.engine.model_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    ids = encode_chat(tok, PROMPTS[0])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(EngineError, match="messages"):
        encode_chat(tok, [{"role": "user"}])


def test_encode_chat_continues_a_final_answer():
    """/continue: a last assistant message is left open, so the answer goes on where it stopped."""
    from swiftspec.engine.model_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    question = encode_chat(tok, PROMPTS[0])
    partial = encode_chat(tok, PROMPTS[0] + [{"role": "assistant", "content": "The answer is"}])
    assert partial[:len(question)] == question  # the prefix the workers already hold
    assert tok.decode(partial[len(question):]) == "The answer is"
