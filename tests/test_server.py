"""`swiftspec serve` itself, on the tiny target, through the real `openai` client and raw HTTP: what an
editor or an agent sees. (tests/test_server_api.py covers the queue and the checks on a stand-in.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from swiftspec.engine.host.launcher import ENV_STORE

pytestmark = pytest.mark.slow

KEY = "test-key"
TOKENS = 24
QUESTIONS = [f"Question {i}: what is {i} plus {i + 3}?" for i in range(8)]
LONG_ANSWER, LONG_CONTEXT = 28000, 32768  # an answer that takes the tiny model 15-30 s


class Served:
    """A `swiftspec serve` process on the tiny target and a free loopback port."""

    def __init__(self, target_dir, *flags: str, max_seq_len: int = 4096):
        self.args = ["--model", str(target_dir), "--max-seq-len", str(max_seq_len), "--temperature", "0"]
        cmd = [sys.executable, "-m", "swiftspec", "serve", *self.args, "--port", "0", "--api-key", KEY, *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if " on http://" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180):
            self.stop()
            raise AssertionError("serve did not start:\n" + "".join(self.lines))
        self.url = re.search(r"http://\S+/v1", next(x for x in self.lines if " on http://" in x)).group(0)
        self.base = self.url.removesuffix("/v1")
        self.client = openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0)
        self.headers = {"Authorization": f"Bearer {KEY}"}

    def ask(self, content: str, **kw) -> str:
        answer = self.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=TOKENS, **kw)
        return answer.choices[0].message.content

    def health(self) -> dict:
        return httpx.get(self.base + "/health").json()

    def generated(self) -> float:
        """The tokens the server's engine has generated so far (its /metrics)."""
        text = httpx.get(self.base + "/metrics", headers=self.headers).text
        return next(float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("swiftspec_generated_tokens_total "))

    def worker_pids(self) -> list[int]:
        info = httpx.get(self.base + "/swiftspec/v1/info", headers=self.headers).json()["engine"]
        return [rank["pid"] for rank in info["ranks"]]

    def wait_healthy(self, within_s: float = 120.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.health()["status"] == "ok":
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def served(target_dir):
    server = Served(target_dir, "--max-queue", "8")
    yield server
    assert server.stop() == 130  # Ctrl-C, as a shell reports it


def test_streamed_chunks_make_the_whole_answer(served):
    whole = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=TOKENS)
    chunks = list(served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
    assert whole.usage.prompt_tokens > 0
    assert whole.model_extra["swiftspec"]["mode"] == "async"
    (figures,) = [c.model_extra["swiftspec"] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert figures["mode"] == "async" and figures["ms_per_token_p50"] <= figures["ms_per_token_p95"]
    assert figures["prefill_tokens"] < whole.usage.prompt_tokens  # the same prompt again: its KV was reused
    going_on = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": streamed},
                {"role": "user", "content": "And then?"}]
    later = served.client.chat.completions.create(model="tiny", messages=going_on, max_tokens=4)
    # at least the first turn's prompt is reused (the random model's answer need not tokenize back the same)
    assert later.model_extra["swiftspec"]["prefill_tokens"] <= later.usage.prompt_tokens - whole.usage.prompt_tokens + 1


def test_prompts_are_not_logged(served):
    served.ask("a private matter 7421")
    time.sleep(0.5)
    assert not any("7421" in line for line in served.lines)


def test_greedy_answers_equal_the_chats_and_the_attached_chats(served, target_dir):
    served_answer = served.ask(QUESTIONS[1])
    flags = ["-p", QUESTIONS[1], "--max-new-tokens", str(TOKENS), "-q", "--temperature", "0"]
    local = subprocess.run([sys.executable, "-m", "swiftspec", "chat", "--model", str(target_dir),
                            "--max-seq-len", "4096", *flags], capture_output=True, text=True, timeout=300)
    attached = subprocess.run([sys.executable, "-m", "swiftspec", "chat", "--server", served.base, "--api-key", KEY,
                               *flags], capture_output=True, text=True, timeout=120)
    assert local.returncode == 0 and attached.returncode == 0, local.stderr + attached.stderr
    assert local.stdout == attached.stdout == served_answer + "\n"


def test_eight_concurrent_clients_each_get_their_own_answer(served):
    alone = [served.ask(q) for q in QUESTIONS]
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, served.ask(QUESTIONS[i])))
               for i in range(len(QUESTIONS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [together.get(i) for i in range(len(QUESTIONS))] == alone
    assert len(set(alone)) > 1


def test_a_client_that_hangs_up_mid_stream_frees_the_engine_within_a_second(served):
    # An answer that runs for seconds even on a fast CPU (400 tokens of the tiny target could finish
    # before the health check), so "busy" is the answer still running, not a race.
    body = {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 3800, "stream": True,
            "swiftspec": {"ignore_eos": True}}
    with httpx.stream("POST", served.url + "/chat/completions", json=body, headers=served.headers) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert served.health()["busy"]
    gone = time.monotonic()
    while served.health()["busy"] and time.monotonic() - gone < 1.0:
        time.sleep(0.02)
    assert not served.health()["busy"]
    assert served.ask(QUESTIONS[3])


@pytest.mark.parametrize("request_kw, param", [
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "hi"}], n=2), "n"),
    (dict(messages=[{"role": "user", "content": "hi"}], logprobs=True), "logprobs"),
    (dict(messages=[{"role": "user", "content": "word " * 5000}]), "messages"),
])
def test_bad_requests_get_openai_shaped_400s(served, request_kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="tiny", max_tokens=4, **request_kw)
    assert e.value.body["param"] == param and e.value.body["message"]


def test_a_loop_guard_beyond_any_answer_is_answered_and_ends_no_worker(served):
    pids = served.worker_pids()
    for mode in ("ar", "async"):
        assert served.ask(QUESTIONS[0], extra_body={"swiftspec": {"mode": mode, "loop_guard": 10**12}})
    assert served.worker_pids() == pids


def test_malformed_json_and_keys(served):
    bad = httpx.post(served.url + "/chat/completions", content=b'{"messages": [', headers=served.headers)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    client = openai.OpenAI(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    missing = httpx.post(served.url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"

def test_the_model_is_listed_by_its_directory_name(served, target_dir):
    assert [m.id for m in served.client.models.list().data] == [target_dir.name]


def test_completions_models_and_metrics(served):
    completion = served.client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8)
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    metrics = httpx.get(served.base + "/metrics", headers=served.headers).text
    for name in ("swiftspec_requests_total", "swiftspec_generated_tokens_total", "swiftspec_queue_length",
                 "swiftspec_time_to_first_token_seconds_bucket", "swiftspec_token_latency_seconds_bucket",
                 "swiftspec_accepted_draft_tokens_total"):
        assert name in metrics
    assert 'route="/v1/completions",status="200"' in metrics


def test_metrics_label_what_runs_as_the_engine_info_says():
    from fake_engine import INFO

    from swiftspec.server.metrics import Metrics

    metrics = Metrics()
    metrics.describe(lambda: INFO)
    line = next(line for line in metrics.text().decode().splitlines() if line.startswith("swiftspec_engine_info"))
    assert f'model="{INFO.target}"' in line and f'draft="{INFO.draft}"' in line
    assert 'kernel_threads="ar 2, sync 2, async 1"' in line and 'ranks="target r0 cpu, draft r1 cpu"' in line


@pytest.fixture
def long_served():
    """A server with room for a long answer: the tiny model makes 1000-3000 tokens a second, and a short
    answer can end before a loaded machine's app sees it start, or before an Esc reaches the server."""
    from tiny_models import tiny_model_dir

    server = Served(tiny_model_dir(seed=0, layers=2, positions=LONG_CONTEXT), max_seq_len=LONG_CONTEXT)
    yield server
    assert server.stop() == 130


async def test_the_chat_attached_to_a_server_streams_with_live_figures_and_stops_on_escape(long_served, tmp_path):
    from helpers.pilot import figures, idle, ready, type_and_send, wait_for

    from swiftspec.conversation import Settings
    from swiftspec.history import HistoryStore
    from swiftspec.server.remote import RemoteEngine
    from swiftspec.tui.app import SwiftSpecApp
    from swiftspec.tui.widgets.chat_view import ChatView
    from swiftspec.tui.widgets.message import MessageBox

    served = long_served
    store = HistoryStore(tmp_path / "history.sqlite3")
    remote = RemoteEngine.connect(served.base, KEY)
    app = SwiftSpecApp(lambda progress: RemoteEngine.connect(served.base, KEY, progress),
                       Settings(params=remote.defaults), store=store, model_line=f"server {served.base}")
    last = lambda: app.query_one(ChatView).query(MessageBox).last()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, 60)
        await type_and_send(pilot, "/max 24")
        await type_and_send(pilot, QUESTIONS[6])
        await idle(pilot, 60)
        assert last().text == served.ask(QUESTIONS[6])
        assert "async" in figures(app) and "tokens/s" in figures(app)
        await type_and_send(pilot, f"/max {LONG_ANSWER}")
        await type_and_send(pilot, "/set ignore-eos on")
        await type_and_send(pilot, QUESTIONS[7])
        # Esc as soon as the answer starts: the app stops it once the server has taken it
        await wait_for(pilot, lambda: app._turn is not None, timeout=60)
        await pilot.press("escape")
        await idle(pilot, 30)
        assert "cancelled" in last().border_subtitle
    assert not served.health()["busy"]
    store.close()
    remote.close()


def test_a_request_after_a_killed_draft_or_torchrun_is_answered_with_every_tcp_port_held(served):
    """kill -9 of the draft, then of torchrun (the target: the test below), while idle connections are
    held on every TCP port that the server and its workers listen on: more than the connection cap on the
    server's own, and some on each port the new workers open while they restart. A request 0.3 s after
    each kill is answered."""
    from helpers.processes import children_by_parent, descendants, listening_addresses

    from swiftspec.server.serve import MAX_CONNECTIONS

    held, seen, stop = [], set(), threading.Event()
    http_port = int(served.base.rsplit(":", 1)[1])

    def hold():
        while not stop.is_set():
            for _, address, port in listening_addresses(descendants(served.proc.pid)):
                if (address, port) in seen:
                    continue
                seen.add((address, port))
                for _ in range(MAX_CONNECTIONS + 8 if port == http_port else 32):
                    try:
                        held.append(socket.create_connection((address, port), timeout=1))
                    except OSError:  # a listener that closed meanwhile
                        break
            time.sleep(0.05)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert until_true(lambda: len(seen) >= 2 and len(held) > MAX_CONNECTIONS)  # the server's port and a worker's
        at_first = len(seen)
        for victim in ("draft", "torchrun"):
            info = httpx.get(served.base + "/swiftspec/v1/info", headers=served.headers).json()["engine"]
            ranks = {rank["role"]: rank["pid"] for rank in info["ranks"]}
            (torchrun,) = [pid for pid in children_by_parent()[served.proc.pid] if ranks["draft"] in descendants(pid)]
            os.kill(torchrun if victim == "torchrun" else ranks["draft"], signal.SIGKILL)
            time.sleep(0.3)
            assert served.ask(QUESTIONS[victim == "torchrun"]), victim  # a 200, after the restart
        assert len(seen) > at_first  # the restarted workers' ports were held too
    finally:
        stop.set()
        holder.join(5)
        for sock in held:
            sock.close()
    assert served.wait_healthy()


def test_killed_workers_are_survived_and_sigterm_drains_leaving_no_process_or_file():
    """One server for all of it (each start costs seconds): a worker killed mid-answer, one killed while
    idle, then a SIGTERM during a streamed answer longer than the grace period, with two requests queued.
    The answers have long_served's room: 3800 tokens once took longer than the grace, but the tiny model
    now makes up to ~3000 tokens a second."""
    from tiny_models import tiny_model_dir

    from swiftspec.engine.paths import cache_dir

    server = Served(tiny_model_dir(seed=0, layers=2, positions=LONG_CONTEXT), "--log-prompts", "--shutdown-timeout",
                    "1", "--max-queue", "4", max_seq_len=LONG_CONTEXT)
    groups = [server.worker_pids()]
    try:
        box = {}
        # Long enough that the engine is still busy when the health check comes, on any CPU.
        body = {"messages": [{"role": "user", "content": QUESTIONS[4]}], "max_tokens": LONG_ANSWER,
                "swiftspec": {"ignore_eos": True}}
        asking = threading.Thread(target=lambda: box.setdefault("response", httpx.post(
            server.url + "/chat/completions", json=body, headers=server.headers, timeout=120)))
        asking.start()
        # begun: a job the workers die under before its first token waits for the restart instead (and gets
        # a 200); busy alone came a prefill too early under a loaded CI
        assert until_true(lambda: server.health()["busy"] and server.generated() > 0)
        os.kill(groups[0][0], signal.SIGKILL)
        asking.join(60)
        response = box["response"]  # the answer it was giving fails; nothing else is lost
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
        assert "/" not in response.json()["error"]["message"]  # no path of the server's disk
        assert server.wait_healthy()
        assert server.ask(QUESTIONS[5])
        assert any("starting the engine again" in line for line in server.lines)
        assert any(QUESTIONS[5] in line for line in server.lines)  # --log-prompts
        groups.append(server.worker_pids())

        os.kill(groups[1][0], signal.SIGKILL)  # while idle: noticed at once, and a request soon after waits
        time.sleep(0.3)
        assert server.ask(QUESTIONS[6])
        groups.append(server.worker_pids())
        assert not set(groups[0]) & set(groups[1]) and not set(groups[1]) & set(groups[2])

        run_dir = os.path.dirname(worker_env(groups[2][0])[ENV_STORE])
        lines: list[str] = []
        stream_body = {**body, "stream": True}

        def stream():
            with httpx.stream("POST", server.url + "/chat/completions", json=stream_body, headers=server.headers,
                              timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert until_true(lambda: server.health()["busy"])
        queued = [{} for _ in range(2)]
        askers = [threading.Thread(target=lambda box=box: box.setdefault("response", httpx.post(
            server.url + "/chat/completions", json=body, headers=server.headers, timeout=60))) for box in queued]
        for asker in askers:
            asker.start()
        assert until_true(lambda: server.health()["waiting"] == 2)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 143  # once everything below is done
        streaming.join(10)
        for asker in askers:
            asker.join(10)
        assert '"engine_unavailable"' in lines[-2] and lines[-1] == "data: [DONE]"  # cut after the grace
        assert [box["response"].status_code for box in queued] == [503, 503]  # a status, never a reset
        assert all(box["response"].headers["retry-after"] for box in queued)
    finally:
        if server.proc.poll() is None:
            server.stop()
    for pid in (pid for group in groups for pid in group):  # every group: nothing is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(run_dir)
    logs = list((cache_dir() / "logs").glob(f"workers-*-{server.proc.pid}.log"))
    assert len(logs) == 2  # the two killed groups' logs are kept for the user; the last group's is removed


def worker_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(v.decode().split("=", 1) for v in f.read().split(b"\0") if b"=" in v)


def until_true(condition, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()
