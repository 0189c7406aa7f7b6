"""The server's request checks, its queue and its HTTP behaviour on a stand-in engine whose answers the
test releases step by step (tests/helpers/gated.py: so that queueing, hanging up and worker deaths happen
exactly when meant); tests/test_server_guards.py has what a hostile client or a stop signal meets, and
tests/test_server.py runs `swiftspec serve` itself on a real engine."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from helpers.engines import in_thread
from helpers.gated import KEY, USER, GatedEngine, post, streaming, until
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftspec.engine.config import ConfigError, Grammar, GrammarKind, SamplingParams
from swiftspec.engine.host.failures import EngineError
from swiftspec.server import api
from swiftspec.server.api import APIError
from swiftspec.server.app import ServerSettings
from swiftspec.server.host import EngineHost
from swiftspec.server.metrics import Metrics
from swiftspec.server.serve import check_settings
from swiftspec.settings import CHAT_DEFAULTS


# ----------------------------------------------------------------------------------- request checks
@pytest.mark.parametrize("field, value", [("n", 2), ("functions", [{"name": "f"}]), ("logprobs", True),
                                          ("logit_bias", {"1": 2}), ("tool_choice", "auto"), ("wibble", 1)])
def test_an_unsupported_field_is_a_400_naming_it(field, value):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": USER, field: value}, SamplingParams())
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("field, value", [("n", 1), ("logprobs", False), ("response_format", {"type": "text"}),
                                          ("tools", []), ("user", "me"), ("stream_options", {"include_usage": True})])
def test_fields_that_ask_for_nothing_we_lack_are_taken(field, value):
    assert api.parse_chat({"messages": USER, field: value}, SamplingParams()).messages == USER


@pytest.mark.parametrize("messages, param", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ([{"role": "tool", "tool_call_id": "x"}], "messages[0].content"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),
    ([], "messages"), ("hi", "messages")])
def test_bad_messages_are_400s(messages, param):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": messages}, SamplingParams())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("field, value, param", [
    ("temperature", -1, "temperature"), ("top_p", 0, "top_p"), ("max_tokens", 0, "max_tokens"), ("seed", -3, "seed"),
    ("stop", [1], "stop[0]"), ("presence_penalty", 9, "presence_penalty"), ("stream", "yes", "stream"),
    ("max_tokens", 1e30, "max_tokens"), ("stream_options", [], "stream_options"), ("model", 123, "model"),
    ("swiftspec", {"ignore_eos": "yes"}, "swiftspec.ignore_eos"), ("temperature", True, "temperature"),
    ("stop", ["x"] * 17, "stop"), ("swiftspec", {"mode": "fast"}, "swiftspec.mode")])
def test_a_wrong_type_or_value_is_a_400_naming_its_field(field, value, param):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": USER, field: value}, SamplingParams())
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


@pytest.mark.parametrize("role", [["user"], {"user": 1}, "hacker", None])
def test_a_role_that_is_not_one_of_ours_is_a_400(role):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": [{"role": role, "content": "hi"}]}, SamplingParams())
    assert e.value.param == "messages[0].role" and "'user'" in e.value.message


def test_a_request_fills_only_what_it_gives_over_the_server_defaults():
    request = api.parse_chat({"messages": [{"role": "developer", "content": "Be brief."}, *USER], "max_tokens": 7,
                              "stop": "\n", "swiftspec": {"mode": "sync"}}, CHAT_DEFAULTS)
    assert request.messages[0]["role"] == "system"
    assert request.params == dataclasses.replace(CHAT_DEFAULTS, max_new_tokens=7, stop=["\n"], mode="sync")
    assert api.parse_chat({"messages": USER, "max_completion_tokens": 5, "max_tokens": 9},
                          CHAT_DEFAULTS).params.max_new_tokens == 5


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(["ar", "sync", "async"]), temperature=st.floats(0, 2), top_k=st.integers(0, 50),
       seed=st.none() | st.integers(0, 2**64 - 1), stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
       repeat_penalty=st.floats(0.5, 2), loop_guard=st.integers(0, 64), ignore_eos=st.booleans(),
       grammar=st.sampled_from([None, Grammar(GrammarKind.JSON), Grammar(GrammarKind.REGEX, "[ab]+"),
                                Grammar(GrammarKind.JSON_SCHEMA, '{"type": "array"}'),
                                Grammar(GrammarKind.LARK, 'start: "x"')]))
def test_the_attached_chat_asks_for_exactly_its_params(mode, temperature, top_k, seed, stop, repeat_penalty,
                                                       loop_guard, ignore_eos, grammar):
    params = SamplingParams(mode=mode, temperature=temperature, top_k=top_k, seed=seed, stop=stop,
                            repeat_penalty=repeat_penalty, loop_guard=loop_guard, ignore_eos=ignore_eos,
                            grammar=grammar)
    # the server's defaults, all other (but the seed: `serve` has none, a request gives its own or none)
    other = SamplingParams(mode="ar", temperature=0.5, top_k=3, stop=["x"], max_new_tokens=9, ignore_eos=True)
    assert api.parse_chat({**api.sampling_body(params), "messages": USER}, other).params == params


def test_a_reachable_address_needs_a_key():
    with pytest.raises(ConfigError, match="api-key"):
        check_settings(ServerSettings(host="0.0.0.0"))
    check_settings(ServerSettings(host="0.0.0.0", api_key="k"))
    check_settings(ServerSettings(host="::1"))
    with pytest.raises(ConfigError, match="shutdown-timeout"):
        check_settings(ServerSettings(shutdown_timeout_s=-1))


# ------------------------------------------------------------------------ the queue, on a stand-in
def test_requests_wait_in_order_and_a_full_queue_is_a_429(served):
    host, engines, url = served
    bodies = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    results = []
    for i in range(3):  # one answering, two waiting: the queue holds 2
        results.append(in_thread(post, url, bodies[i]))
        assert until(lambda i=i: len(engines[0].started) + host.waiting == i + 1)
    refused = post(url, bodies[3])
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    engines[0].release(9)
    answers = [result().json() for result in results]
    assert [a["choices"][0]["message"]["content"] for a in answers] == ["t0 t1 t2 "] * 3
    assert [a["usage"]["completion_tokens"] for a in answers] == [3] * 3
    # answered in arrival order: the engine saw the prompts as they came
    assert [host.tokenizer.decode(ids) for ids in engines[0].started] == [
        host.tokenizer.decode(host.prompt_ids(api.parse_chat(b, SamplingParams()))) for b in bodies[:3]]


def test_a_client_that_hangs_up_frees_the_engine_queued_or_answering(served):
    host, engines, url = served
    engine = engines[0]
    with streaming(url, engine):
        queued = in_thread(post, url, {"messages": USER}, 0.5)  # gives up while it waits
        assert until(lambda: host.waiting == 1)
        with pytest.raises(httpx.ReadTimeout):
            queued()
        assert until(lambda: host.waiting == 0)  # dropped from the queue when it hung up
    assert until(lambda: not host.busy, 1.0)  # the answer was cancelled at once
    assert len(engine.started) == 1
    engine.release(3)
    assert post(url, {"messages": USER}).status_code == 200


def test_a_dead_worker_group_is_a_503_and_is_started_again(served):
    host, engines, url = served
    failing = in_thread(post, url, {"messages": USER})
    assert until(lambda: host.busy)
    engines[0].release()  # the answer has begun
    assert until(lambda: engines[0].gate._value == 0)
    engines[0].die()
    response = failing()
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    assert until(lambda: host.state == "ok" and len(engines) == 2)
    assert engines[0].closed
    asked = in_thread(post, url, {"messages": USER})
    engines[1].release(3)
    assert asked().status_code == 200
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert "swiftspec_engine_restarts_total 1.0" in httpx.get(url + "/metrics", headers=KEY).text


def test_a_request_whose_workers_died_before_its_answer_began_waits_for_the_restart(served, monkeypatch):
    host, engines, url = served

    def dead(ids, params):  # the workers died, unnoticed until this request finds out
        engines[0].die()
        raise EngineError("lost the connection to the workers")

    monkeypatch.setattr(engines[0], "generate_ids", dead)
    asked = in_thread(post, url, {"messages": USER})
    assert until(lambda: len(engines) == 2)
    engines[1].release(3)
    response = asked()
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "t0 t1 t2 "


def test_a_stream_that_fails_midway_ends_with_an_error_event(served):
    host, engines, url = served
    with streaming(url, engines[0]) as lines:
        engines[0].die()
        rest = [line for line in lines if line.startswith("data: ")]
    assert '"engine_unavailable"' in rest[-2] and rest[-1] == "data: [DONE]"


def test_every_route_but_health_needs_the_key(served):
    _, _, url = served
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer sesam"}, {"Authorization": "sesame"}):
        response = httpx.get(url + "/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/chat/completions", json={"messages": USER}, headers=headers).status_code == 401
    assert httpx.get(url + "/v1/models", headers=KEY).json()["data"][0]["id"] == "tiny"


def test_malformed_bodies_are_400s_and_big_ones_413s(served):
    _, _, url = served
    bad = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=KEY)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    big = httpx.post(url + "/v1/chat/completions", content=b" " * (5 << 20), headers=KEY)
    assert big.status_code == 413
    long = post(url, {"messages": [{"role": "user", "content": "word " * 5000}]})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(url + "/nowhere", headers=KEY).json()["error"]["code"] == "not_found"


def test_no_cors_unless_asked(served):
    _, _, url = served
    response = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in response.headers


def test_a_closed_host_fails_what_waits(tokenizer):
    engine = GatedEngine(tokenizer)
    host = EngineHost(engine, lambda: engine, max_queue=4, metrics=Metrics())
    host.close()
    assert engine.closed
    with pytest.raises(APIError) as e:
        host.submit(None)
    assert e.value.status == 503


def test_serve_refuses_a_reachable_address_without_a_key_before_any_engine_starts(monkeypatch):
    from helpers.cli import invoke

    from swiftspec.engine.host.client import Engine

    started = []
    monkeypatch.setattr(Engine, "start", lambda *a, **kw: started.append(a) or pytest.fail("an engine started"))
    result = invoke(["serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 2 and "api-key" in result.output and not started




@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"swiftspec": {"grammar": {"kind": "regex", "source": "[a-"}}}, "swiftspec.grammar"),
    ({"guided_grammar": 'start: "a" b'}, "guided_grammar"),
])
def test_a_grammar_the_library_refuses_or_a_second_one_is_a_400_naming_its_field(body, param):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": USER, **body}, SamplingParams())
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_each_way_of_asking_for_a_grammar_gives_its_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    asks = [({"response_format": {"type": "json_object"}}, Grammar(GrammarKind.JSON)),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}},
             Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))),
            ({"guided_json": schema}, Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))),
            ({"guided_regex": "a+"}, Grammar(GrammarKind.REGEX, "a+")),
            ({"swiftspec": {"grammar": {"kind": "lark", "source": 'start: "x"'}}}, Grammar(GrammarKind.LARK, 'start: "x"')),
            ({"response_format": {"type": "text"}}, None)]
    for body, grammar in asks:
        assert api.parse_chat({"messages": USER, **body}, SamplingParams()).params.grammar == grammar
    assert api.parse_completion({"prompt": "hi", "response_format": {"type": "json_object"}},
                                SamplingParams()).params.grammar == Grammar(GrammarKind.JSON)
