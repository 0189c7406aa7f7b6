"""The tool-call format (swiftspec/server/tools.py): each tool choice's grammar compiles and allows
exactly its answers; calls are read back whole and streamed piece by piece; earlier calls and tool
results go back to the model in the documented format."""

import json

import pytest
from tiny_models import EOS_ID, tiny_model_dir

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.spec.grammar import Vocabulary, check
from swiftspec.server import api
from swiftspec.server.tools import CallStream, NamedChoice, Tool, Toolbox, read_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def accepts(grammar, text: str) -> bool:
    import llguidance

    tok = Vocabulary(tiny_model_dir(seed=1) / "tokenizer.json", (EOS_ID,)).tokenizer()  # built once
    matcher = llguidance.LLMatcher(tok, check(grammar), log_level=0)
    ids = tok.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("choice, parallel, allowed, refused", [
    ("auto", True, ["Hello there.", CALL, CALL + "\n" + CALL], ["<b>hi</b>", CALL + " and text"]),
    ("required", False, [CALL], ["Hello", CALL + "\n" + CALL]),
    (NamedChoice(type="function", function={"name": "get_time"}), True,
     ['<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'], [CALL]),
])
def test_each_tool_choice_allows_exactly_its_answers(choice, parallel, allowed, refused):
    grammar = Toolbox([Tool.model_validate(WEATHER), Tool.model_validate(TIME)], choice, parallel).grammar()
    for text in allowed:
        assert accepts(grammar, text), text
    for text in refused:
        assert not accepts(grammar, text), text


def test_calls_are_read_whole_and_streamed():
    text = CALL + "\n" + CALL.replace("Paris", "Rome")
    calls = read_calls(text)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert read_calls("Hello") is None and read_calls(CALL[:-3]) is None
    stream, deltas = CallStream(), []
    for i in range(0, len(text), 7):
        deltas += stream.feed(text[i:i + 7])
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 1] and stream.finish() == []
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    words = CallStream()
    assert words.feed("Hel") + words.feed("lo") == [{"content": "Hel"}, {"content": "lo"}]
    cut = CallStream()
    assert cut.feed(CALL[:20]) == [] and cut.finish() == [{"content": CALL[:20]}]


def test_earlier_calls_and_results_go_back_in_the_format():
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [WEATHER]}
    request = api.parse_chat(body, SamplingParams())
    system, _, called, result = request.messages
    assert system["content"].startswith("Be brief.\n\nYou can call functions") and "get_weather" in system["content"]
    assert called == {"role": "assistant", "content": CALL}
    assert result == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert request.tools is not None and request.params.grammar is not None
    plain = api.parse_chat({**body, "tool_choice": "none"}, SamplingParams())
    assert plain.tools is None and plain.params.grammar is None and len(plain.messages) == 4
