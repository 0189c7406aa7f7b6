"""What the server does with a hostile client, a foreign page and a stop signal: every bad body a JSON
400, Host and Origin checks, the drain on SIGTERM, connection deadlines and their cap; on the stand-in
engine of tests/helpers/gated.py."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from helpers.engines import in_thread
from helpers.gated import KEY, USER, GatedEngine, post, running, streaming, until

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import StepEvent, StepStats
from swiftspec.engine.host.failures import EngineError
from swiftspec.server.app import ServerSettings, build_app
from swiftspec.server.host import EngineHost
from swiftspec.server.metrics import Metrics


# ------------------------------------------------------------------ what a hostile client may send
@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1e30}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "swiftspec": {"ignore_eos": "yes"}}, "swiftspec.ignore_eos"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": []}, "stream_options"),
    ("/v1/chat/completions", {"messages": USER, "model": 123}, "model"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/swiftspec/v1/tokenize", {"messages": [{"role": "hacker", "content": "hi"}]}, "messages[0].role"),
    ("/swiftspec/v1/tokenize", {"messages": "hi"}, "messages"),
])
def test_every_bad_body_is_a_json_400_naming_its_field(served, route, body, param):
    _, engines, url = served
    response = httpx.post(url + route, json=body, headers=KEY)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and error["request_id"]
    assert error["request_id"] == response.headers["x-request-id"] and not engines[0].started


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/swiftspec/v1/tokenize"])
@pytest.mark.parametrize("raw", [
    b'"\\ud800"', b'"a\\udfffb"', b'"\xed\xa0\x80"', b'"\xff"',  # lone surrogates (escaped, raw), not UTF-8
])
def test_a_string_that_is_not_utf8_is_a_400(served, route, raw):
    _, engines, url = served
    field = b'"prompt"' if route == "/v1/completions" else b'"messages": [{"role": "user", "content"'
    body = b"{" + field + b": " + raw + (b"}" if route == "/v1/completions" else b"}]}")
    response = httpx.post(url + route, content=body, headers={**KEY, "content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert not engines[0].started


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b"[" * 300 + b"]" * 300 + b"}",
                                  b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'])
def test_deep_nesting_and_nan_are_400s(served, body):
    _, _, url = served
    response = httpx.post(url + "/v1/chat/completions", content=body, headers=KEY)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_a_bug_of_ours_is_a_json_500_whose_id_the_log_has(served, monkeypatch, caplog):
    host, _, url = served
    monkeypatch.setattr(host, "prompt_ids", lambda request: {}["no such key"])
    response = post(url, {"messages": USER})
    error = response.json()["error"]
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    assert error["request_id"] in error["message"] and "KeyError" not in error["message"]
    assert any(error["request_id"] in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_failed_answer_shows_no_path_of_the_servers_disk(served, monkeypatch, caplog):
    host, engines, url = served
    report = "the target worker (rank 0) was killed by signal 9\nthe workers' full output: /home/me/.cache/w.log"

    def dying(ids, params):  # once the answer has begun
        yield StepEvent([0], "t0 ", StepStats(generated=1), False, None)
        engines[0].die()
        raise EngineError(report)

    monkeypatch.setattr(engines[0], "generate_ids", dying)
    response = post(url, {"messages": USER})
    assert response.status_code == 503 and response.headers["retry-after"]
    error = response.json()["error"]
    assert "/home/me" not in response.text and error["request_id"]
    assert any(error["request_id"] in r.getMessage() and "/home/me/.cache/w.log" in r.getMessage()
               for r in caplog.records)


# ----------------------------------------------------------------------- Host and Origin checks
ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/swiftspec/v1/info"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/swiftspec/v1/tokenize"),
          ("OPTIONS", "/v1/chat/completions"), ("GET", "/nowhere")]


@pytest.mark.settings(cors_origins=("http://localhost:3000",))
def test_a_foreign_host_is_refused_on_every_route_and_localhost_is_answered(served):
    _, engines, url = served
    for method, path in ROUTES:
        for host in ("attacker.example", "attacker.example:8080", "127.0.0.1.nip.io", "localhost.attacker.example"):
            response = httpx.request(method, url + path, headers={**KEY, "Host": host},
                                     content=json.dumps({"messages": USER}))
            assert response.status_code == 421 and response.json()["error"]["code"] == "host_not_allowed", (path, host)
    assert not engines[0].started
    port = url.rsplit(":", 1)[1]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", f"app.localhost:{port}"):
        assert httpx.get(url + "/v1/models", headers={**KEY, "Host": host}).status_code == 200, host


@pytest.mark.settings(allowed_hosts=("llm.internal",))
def test_allowed_hosts_adds_names(served):
    _, _, url = served
    assert httpx.get(url + "/health", headers={"Host": "llm.internal:443"}).status_code == 200
    assert httpx.get(url + "/health", headers={"Host": "other.internal"}).status_code == 421


def test_the_host_rules():
    from swiftspec.server.app import HostRules

    loopback, everywhere, named = HostRules("127.0.0.1"), HostRules("0.0.0.0"), HostRules("box.lan")
    for header in ("LOCALHOST.", "127.9.9.9:80", "[::1]:8080", "a.b.localhost"):
        assert loopback.allows(header) and everywhere.allows(header) and named.allows(header)
    for header in ("", "[::1", "evil.example", "localhost.evil.example", "192.168.1.5"):
        assert not loopback.allows(header)
    for header in ("evil.example\\@localhost", "evil.example@localhost", "localhost:80@evil.example", "localhost/x",
                   "evil.example#@localhost", "localhost:", "localhost:8080:1", "[::1]x"):  # only host[:port]
        assert not loopback.allows(header) and not everywhere.allows(header), header
    assert everywhere.allows("192.168.1.5:8080") and everywhere.allows("[fe80::1]")  # IP literals: not rebindable
    assert not everywhere.allows("evil.example") and named.allows("box.lan:8080") and not named.allows("10.0.0.1")


def test_a_cross_origin_browser_request_is_refused(served):
    _, engines, url = served
    for method, path in ROUTES:
        response = httpx.request(method, url + path, headers={**KEY, "Origin": "http://evil.example",
                                                              "Content-Type": "text/plain"},
                                 content=json.dumps({"messages": USER}))
        assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed", path
        assert "access-control-allow-origin" not in response.headers
    assert not engines[0].started


@pytest.mark.settings(cors_origins=("http://localhost:3000",))
def test_cors_origin_lets_that_origin_in(served):
    _, _, url = served
    page = {"Origin": "http://localhost:3000"}
    preflight = httpx.options(url + "/v1/models", headers={**page, "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page["Origin"]
    assert httpx.get(url + "/v1/models", headers={**KEY, **page}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={**KEY, "Origin": "http://localhost:3001"}).status_code == 403


# ------------------------------------------------------------------------------ graceful shutdown
def test_draining_fails_the_waiting_and_lets_the_running_answer_finish_within_the_grace(served):
    host, engines, url = served
    engine = engines[0]
    with streaming(url, engine) as lines:
        queued = [in_thread(post, url, {"messages": USER}) for _ in range(2)]
        assert until(lambda: host.waiting == 2)
        draining = in_thread(host.drain, 10.0)
        for result in queued:
            response = result()
            assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert post(url, {"messages": USER}).status_code == 503  # nothing new is taken
        assert httpx.get(url + "/health").json()["status"] == "draining"
        engine.release(2)
        rest = [line for line in lines if line.startswith("data: ")]
        draining()
    assert '"finish_reason": "length"' in rest[-2] and rest[-1] == "data: [DONE]"


def test_an_answer_longer_than_the_grace_is_cut_with_an_error_event_and_done(served):
    host, engines, url = served
    with streaming(url, engines[0]) as lines:
        host.drain(0.2)
        rest = [line for line in lines if line.startswith("data: ")]
    assert '"engine_unavailable"' in rest[-2] and "shutting down" in rest[-2] and rest[-1] == "data: [DONE]"


@contextlib.contextmanager
def stoppable(tokenizer, grace_s: float):
    """A DrainingServer on a GatedEngine, run in a thread: the server, its host, engine, URL and thread."""
    import uvicorn

    from swiftspec.server.serve import DrainingServer

    engine = GatedEngine(tokenizer)
    host = EngineHost(engine, lambda: engine, max_queue=2, metrics=Metrics())
    app = build_app(host, SamplingParams(), ServerSettings(model_id="tiny"))
    server = DrainingServer(uvicorn.Config(app, log_level="error", lifespan="off"), host, grace_s=grace_s)
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert until(lambda: server.started)
    try:
        yield server, host, engine, f"http://127.0.0.1:{sock.getsockname()[1]}", thread
    finally:
        server.should_exit = True
        thread.join(5)
        host.close()


def test_a_stop_signal_keeps_answering_503s_through_the_grace_then_ends(tokenizer):
    with stoppable(tokenizer, grace_s=30.0) as (server, host, engine, url, thread):
        with streaming(url, engine) as lines:
            queued = in_thread(post, url, {"messages": USER})
            assert until(lambda: host.waiting == 1)
            server.handle_exit(signal.SIGTERM, None)  # as the signal would (off the main thread: called here)
            assert queued().status_code == 503
            late = httpx.post(url + "/v1/chat/completions", json={"messages": USER})  # a new connection
            assert late.status_code == 503 and late.headers["retry-after"]
            assert thread.is_alive()  # the running answer has its grace
            engine.release(2)
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"finish_reason": "length"' in rest[-2] and rest[-1] == "data: [DONE]"
        thread.join(10)
        assert not thread.is_alive() and server.stopped_by == signal.SIGTERM


def test_a_second_stop_signal_cuts_the_answer_and_stops_at_once(tokenizer):
    with stoppable(tokenizer, grace_s=30.0) as (server, host, engine, url, thread):
        with streaming(url, engine) as lines:
            server.handle_exit(signal.SIGTERM, None)
            assert until(lambda: host.state == "draining")
            server.handle_exit(signal.SIGTERM, None)  # within the grace, the answer still running
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"engine_unavailable"' in rest[-2] and rest[-1] == "data: [DONE]"
        thread.join(3)
        assert not thread.is_alive() and server.stopped_by == signal.SIGTERM


# ------------------------------------------------------------------------------ connection limits
def test_a_connection_that_sends_no_whole_headers_is_closed(monkeypatch):
    from swiftspec.server import serve

    monkeypatch.setattr(serve, "HEADERS_TIMEOUT_S", 0.3)
    app = build_app(EngineHost(GatedEngine(None), lambda: None, 1, Metrics()), SamplingParams(), ServerSettings())
    with running(app, http=serve.Deadlines) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as slow, socket.create_connection(("127.0.0.1", port)) as idle:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # and never the blank line
            slow.settimeout(5)
            idle.settimeout(5)
            assert slow.recv(100) == b"" and idle.recv(100) == b""  # closed by the server (else a TimeoutError)
        assert httpx.get(url + "/health").status_code == 200  # a whole request is answered


def test_at_the_cap_a_new_connection_closes_the_longest_idle_one_and_only_busy_ones_make_it_a_json_503(monkeypatch):
    from swiftspec.server import serve

    monkeypatch.setattr(serve, "MAX_CONNECTIONS", 2)
    app = build_app(EngineHost(GatedEngine(None), lambda: None, 1, Metrics()), SamplingParams(), ServerSettings())
    with running(app, http=serve.Deadlines) as url:
        port = int(url.rsplit(":", 1)[1])
        oldest = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.05)
        idle = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.2)
        assert httpx.get(url + "/health").status_code == 200  # idle connections cannot lock a client out
        oldest.settimeout(5)
        idle.settimeout(0.3)
        assert oldest.recv(100) == b""  # closed for it
        with pytest.raises(TimeoutError):
            idle.recv(100)
        busy = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for sock in busy:  # a request in progress: its body is still to come
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 9\r\n\r\n")
            time.sleep(0.1)
        refused = httpx.get(url + "/health")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections"
        assert refused.headers["retry-after"] == "1"
        for sock in [oldest, idle, *busy]:
            sock.close()
        assert until(lambda: httpx.get(url + "/health").status_code == 200)


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n",
                                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -5\r\n\r\n"])
def test_a_request_that_is_not_http_is_a_json_400(raw):
    from swiftspec.server import serve

    app = build_app(EngineHost(GatedEngine(None), lambda: None, 1, Metrics()), SamplingParams(), ServerSettings())
    with running(app, http=serve.Deadlines) as url, socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(raw)
        sock.settimeout(5)
        answer = b""
        while chunk := sock.recv(4096):  # until the server closes it
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"content-type: application/json" in head
    assert json.loads(body)["error"]["code"] == "invalid_http"


def test_a_group_that_dies_while_idle_is_started_again_at_once_and_the_next_request_waits_for_it(served):
    host, engines, url = served
    starting = threading.Event()
    original = host._start

    def slow_start():  # the restart takes until the test lets it finish
        starting.set()
        assert until(lambda: host.waiting == 1)
        return original()

    host._start = slow_start
    engines[0].die()  # as the Engine's watch tells it: no polling
    assert starting.wait(5.0) and host.state == "restarting"
    asked = in_thread(post, url, {"messages": USER})  # arrives during the restart: it waits, then is answered
    assert until(lambda: len(engines) == 2)
    engines[1].release(3)
    assert asked().status_code == 200 and not engines[0].started
