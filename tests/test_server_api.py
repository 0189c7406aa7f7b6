"""The server's request checks, its queue and its HTTP behaviour on a stand-in engine whose answers the
test releases step by step (so that queueing, hanging up and worker deaths happen exactly when meant);
tests/test_server.py runs `swiftspec serve` itself on a real engine."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import httpx
import pytest
from fake_engine import INFO
from helpers.engines import in_thread
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftspec.config import CHAT_DEFAULTS, ConfigError, SamplingParams, StepEvent, StepStats
from swiftspec.engine.failures import EngineError
from swiftspec.server import api
from swiftspec.server.api import APIError
from swiftspec.server.app import ServerSettings, build_app
from swiftspec.server.host import EngineHost
from swiftspec.server.metrics import Metrics
from swiftspec.server.serve import check_settings

USER = [{"role": "user", "content": "Hello there"}]


# ----------------------------------------------------------------------------------- request checks
@pytest.mark.parametrize("field, value", [("n", 2), ("tools", [{"type": "function"}]), ("logprobs", True),
                                          ("response_format", {"type": "json_object"}), ("logit_bias", {"1": 2}),
                                          ("tool_choice", "auto"), ("wibble", 1)])
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
    ([{"role": "tool", "content": "1", "tool_call_id": "x"}], "messages[0].role"),
    ([], "messages"), ("hi", "messages")])
def test_bad_messages_are_400s(messages, param):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": messages}, SamplingParams())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("max_tokens", 0), ("seed", -3),
                                          ("stop", [1]), ("presence_penalty", 9), ("stream", "yes")])
def test_a_value_out_of_range_is_a_400_naming_its_field(field, value):
    with pytest.raises(APIError) as e:
        api.parse_chat({"messages": USER, field: value}, SamplingParams())
    assert e.value.status == 400 and e.value.param == field


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
       repeat_penalty=st.floats(0.5, 2), loop_guard=st.integers(0, 64), ignore_eos=st.booleans())
def test_the_attached_chat_asks_for_exactly_its_params(mode, temperature, top_k, seed, stop, repeat_penalty,
                                                       loop_guard, ignore_eos):
    params = SamplingParams(mode=mode, temperature=temperature, top_k=top_k, seed=seed, stop=stop,
                            repeat_penalty=repeat_penalty, loop_guard=loop_guard, ignore_eos=ignore_eos)
    # the server's defaults, all other (but the seed: `serve` has none, a request gives its own or none)
    other = SamplingParams(mode="ar", temperature=0.5, top_k=3, stop=["x"], max_new_tokens=9, ignore_eos=True)
    assert api.parse_chat({**api.sampling_body(params), "messages": USER}, other).params == params


def test_a_reachable_address_needs_a_key():
    with pytest.raises(ConfigError, match="api-key"):
        check_settings(ServerSettings(host="0.0.0.0"))
    check_settings(ServerSettings(host="0.0.0.0", api_key="k"))
    check_settings(ServerSettings(host="::1"))


# ------------------------------------------------------------------------ the queue, on a stand-in
class GatedEngine:
    """Answers "a b c ..." one token per ``release()``; ``die()`` makes the current answer fail as a dead
    worker group would."""

    def __init__(self, tokenizer, steps: int = 3):
        self.info, self.tokenizer, self.steps = INFO, tokenizer, steps
        self.gate = threading.Semaphore(0)
        self.started: list[list[int]] = []
        self._cancel = threading.Event()
        self._dead = False
        self.closed = False

    def generate_ids(self, ids, params):
        self.started.append(ids)
        self._cancel.clear()
        for i in range(self.steps):
            while not self.gate.acquire(timeout=0.01):
                if self._cancel.is_set():
                    yield StepEvent([], "", StepStats(generated=i), True, "cancelled")
                    return
                if self._dead:
                    raise EngineError("a worker failed: killed")
            last = i == self.steps - 1
            yield StepEvent([i], f"t{i} ", StepStats(generated=i + 1, token_latency_ms=1.0), last,
                            "length" if last else None)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def die(self) -> None:
        self._dead = True

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def alive(self) -> bool:
        return not self._dead and not self.closed

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def tokenizer(target_dir):
    from swiftspec.engine.model_dir import load_tokenizer

    return load_tokenizer(target_dir)


@pytest.fixture
def served(tokenizer):
    """A server on a GatedEngine (its host, its base URL); the restarts start fresh GatedEngines."""
    import uvicorn

    engines = [GatedEngine(tokenizer)]

    def restart():
        engines.append(GatedEngine(tokenizer))
        return engines[-1]

    host = EngineHost(engines[0], restart, max_queue=2, metrics=Metrics())
    app = build_app(host, SamplingParams(), ServerSettings(api_key="sesame", model_id="tiny"))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield host, engines, url
    server.should_exit = True
    thread.join(5)
    host.close()


KEY = {"Authorization": "Bearer sesame"}


def post(url, body, timeout=10.0, **kw):
    return httpx.post(url + "/v1/chat/completions", json=body, headers=KEY, timeout=timeout, **kw)


def until(condition, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


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
    engine.release()  # the headers go out with the first step
    with httpx.stream("POST", url + "/v1/chat/completions", headers=KEY,
                      json={"messages": USER, "stream": True}) as answering:
        lines = answering.iter_lines()
        assert next(lines).startswith("data: ")
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


def test_a_stream_that_fails_midway_ends_with_an_error_event(served):
    host, engines, url = served
    engines[0].release()
    with httpx.stream("POST", url + "/v1/chat/completions", headers=KEY,
                      json={"messages": USER, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
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

    from swiftspec.engine.client import Engine

    started = []
    monkeypatch.setattr(Engine, "start", lambda *a, **kw: started.append(a) or pytest.fail("an engine started"))
    result = invoke(["serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 2 and "api-key" in result.output and not started
