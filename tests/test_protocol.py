"""The Engine <-> leader socket: the HMAC handshake, framing, the typed messages (engine/host/frames.py), and
the Engine's wait for its worker among impostors and idle peers."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from helpers.engines import Running, closed_tail, in_thread, socket_pair

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import Step
from swiftspec.engine.host import frames, protocol
from swiftspec.engine.host.failures import WorkerOutput
from swiftspec.engine.host.protocol import EngineInfo, RankInfo
from swiftspec.engine.host.startup import accept_worker


def test_handshake_and_frames():
    server, client = socket_pair()
    key = protocol.new_key()
    done = in_thread(protocol.client_handshake, client, key)
    protocol.server_handshake(server, key)
    done()
    server.send("generate", id=1, token_ids=[1, 2, 3], params=SamplingParams().to_dict())
    msg = client.recv(1)
    assert msg["type"] == "generate" and msg["token_ids"] == [1, 2, 3] and msg["v"] == protocol.VERSION
    assert client.recv(0.05) is None  # a timeout keeps the connection usable
    server.send("cancel", id=1)
    assert client.recv(1)["type"] == "cancel"


def test_wrong_key_is_refused_on_both_sides():
    server, client = socket_pair()
    done = in_thread(protocol.client_handshake, client, protocol.new_key())
    with pytest.raises(protocol.AuthError, match="wrong key"):
        protocol.server_handshake(server, protocol.new_key())
    with pytest.raises(protocol.AuthError, match="refused"):
        done()


def test_engine_impostor_is_detected_by_the_worker():
    server, client = socket_pair()
    done = in_thread(protocol.client_handshake, client, protocol.new_key())
    server.send("challenge", nonce="00")
    assert server.recv(1)["type"] == "auth"
    server.send("welcome", mac="0" * 64)
    with pytest.raises(protocol.AuthError, match="did not prove"):
        done()


def test_handshake_timeouts_are_clear_errors():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never speaks
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(protocol.AuthError, match="handshake timed out"):
        protocol.connect(addr, protocol.new_key(), timeout=0.5)
    assert time.monotonic() - t0 < 3
    listener.close()
    server, _silent = socket_pair()
    with pytest.raises(protocol.AuthError, match="handshake timed out"):
        protocol.server_handshake(server, protocol.new_key(), timeout=0.3)


def test_bad_frames_are_protocol_errors():
    server, client = socket_pair()
    client.sock.sendall((protocol.MAX_HANDSHAKE_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        server.recv(1)
    server, client = socket_pair()
    client.sock.sendall(b"\0\0\0\x02{}")
    with pytest.raises(protocol.ProtocolError, match="malformed"):
        server.recv(1)
    server, client = socket_pair()
    data = b'{"v": 99, "type": "challenge"}'
    client.sock.sendall(len(data).to_bytes(4, "big") + data)
    with pytest.raises(protocol.ProtocolError, match="version"):
        server.recv(1)
    server, client = socket_pair()
    client.close()
    with pytest.raises(protocol.ConnectionClosed):
        server.recv(1)


def test_engine_refuses_impostors_and_keeps_waiting_for_its_worker(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    key = protocol.new_key()
    impostor = in_thread(protocol.connect, addr, protocol.new_key())
    worker = in_thread(lambda: (time.sleep(0.3), protocol.connect(addr, key))[1])
    r, w = os.pipe()
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=1)
    conn = accept_worker(listener, key, Running(), tail, time.monotonic() + 10)
    with pytest.raises(protocol.AuthError, match="refused"):
        impostor()
    conn.send("welcome-check")
    assert worker().recv(1)["type"] == "welcome-check"
    listener.close()


def test_idle_connections_do_not_hold_up_the_workers_handshake(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    key = protocol.new_key()
    idle = [socket.create_connection(("127.0.0.1", listener.getsockname()[1])) for _ in range(3)]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(conn=protocol.connect(addr, key, timeout=3.0)))
    worker.start()
    t0 = time.monotonic()
    conn = accept_worker(listener, key, Running(), closed_tail(tmp_path), time.monotonic() + 20)
    worker.join(5)
    assert time.monotonic() - t0 < 3, "the idle peers delayed the worker's handshake"
    conn.send("check")
    assert result["conn"].recv(2)["type"] == "check"
    for s in idle:
        s.close()
    listener.close()


def test_start_up_error_names_the_rank_that_failed_first(tmp_path):
    tail = closed_tail(tmp_path)
    tail.lines.extend([
        "swiftspec.engine.host.protocol.AuthError: handshake timed out after 10 s waiting for 'challenge'",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    assert tail.headline().startswith("AuthError: handshake timed out")


def _info() -> EngineInfo:
    rank = RankInfo(rank=0, role="target", device="cpu", tp_rank=0, tp_world=1, torch_threads=1, host="h", pid=1)
    return EngineInfo(target="t", draft="suffix", ranks=[rank], context_length=64, backend="gloo", bs=8, w=8,
                      d=2, d_auto=True, t_verify_ms=1.0, t_expand_ms=0.1)


def test_the_engine_info_names_each_kind_of_threads_once():
    """torch's threads per rank and the CPU kernels' threads per mode are different figures under different
    names (bench --json, /swiftspec/v1/info): was `ranks[].threads` 1 beside `kernel_threads` 2."""
    def keys(data):
        if isinstance(data, dict):
            return {k for k in data} | {k for v in data.values() for k in keys(v)}
        return {k for v in data for k in keys(v)} if isinstance(data, list) else set()

    assert {k for k in keys(_info().to_dict()) if "threads" in k} == {"torch_threads", "kernel_threads"}


@pytest.mark.parametrize("frame", [
    frames.Generate(3, [1, 2], SamplingParams(mode="sync", stop=["x"])), frames.Cancel(3), frames.Shutdown(),
    frames.Hello([[0, 11], [1, 12]]), frames.Progress("loading"), frames.Ready(_info()),
    frames.Stepped(3, [Step([4], interval_ms=4.5), Step([5, 6], "eos", accepted=1, tree_size=3, interval_ms=5.0)]),
    frames.Failure("boom", 3, fatal=False),
])
def test_every_frame_round_trips_as_its_dataclass(frame):
    a, b = socket_pair()
    frames.send(a, frame)
    assert frames.recv(b, 1) == frame


def test_frames_that_break_the_protocol_are_errors():
    a, b = socket_pair()
    a.send("whatever")
    with pytest.raises(protocol.ProtocolError, match="unexpected message 'whatever'"):
        frames.recv(b, 1)
    a.send("steps", id=1, steps=[{"tokens": [1], "colour": "red"}])
    with pytest.raises(protocol.ProtocolError, match="malformed 'steps'"):
        frames.recv(b, 1)
    for steps in ([], {"tokens": [1]}, [[1]]):
        a.send("steps", id=1, steps=steps)
        with pytest.raises(protocol.ProtocolError, match="malformed 'steps'"):
            frames.recv(b, 1)
    a.send("cancel", id="1")
    with pytest.raises(protocol.ProtocolError, match="integer id"):
        frames.recv(b, 1)
    a.send("generate", id=7, token_ids=[1], params={"temperature": -1})
    with pytest.raises(frames.BadRequest, match="temperature") as bad:  # answered to request 7, not fatal
        frames.recv(b, 1)
    assert bad.value.id == 7


def test_the_start_up_listener_is_a_unix_socket_only_its_user_can_reach(tmp_path):
    from swiftspec.engine.host.launcher import new_run_dir, remove_run_dir
    from swiftspec.engine.host.startup import listen

    run_dir = new_run_dir()
    try:
        listener, addr = listen(run_dir)
        path = addr.removeprefix(protocol.UNIX)
        assert addr.startswith(protocol.UNIX) and os.path.dirname(path) == str(run_dir)
        assert os.stat(run_dir).st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o777 == 0o600
        key = protocol.new_key()
        worker = in_thread(protocol.connect, addr, key)
        conn = accept_worker(listener, key, Running(), closed_tail(tmp_path), time.monotonic() + 10)
        conn.send("check")
        assert worker().recv(1)["type"] == "check"
        listener.close()
    finally:
        remove_run_dir(run_dir)


def test_a_flood_of_idle_connections_does_not_keep_the_leader_out(tmp_path, monkeypatch):
    from swiftspec.engine.host import startup

    monkeypatch.setattr(startup, "PEER_HANDSHAKE_S", 0.3)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    listener, addr = startup.listen(run_dir)
    flood = []
    for _ in range(2 * startup.MAX_PENDING_HANDSHAKES):  # every handshake slot taken, and as many waiting
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(addr.removeprefix(protocol.UNIX))
        flood.append(sock)
    key = protocol.new_key()
    worker = in_thread(protocol.connect, addr, key, 2.0, time.monotonic() + 10)  # retried until it gets in
    conn = accept_worker(listener, key, Running(), closed_tail(tmp_path), time.monotonic() + 10)
    conn.send("check")
    assert worker().recv(1)["type"] == "check"
    for sock in flood:
        sock.close()
    listener.close()


def test_the_leader_sends_an_answers_steps_in_frames_first_and_last_at_once(monkeypatch):
    """Its first step at once (the time to the first token), then frames at most every STREAM_INTERVAL_S,
    each step stamped with its own interval; its last at once, and anything held before another frame."""
    from swiftspec.engine.worker import leader_io

    now = [0.0]
    monkeypatch.setattr(leader_io.time, "perf_counter", lambda: now[0])
    a, b = socket_pair()
    io = leader_io.SocketIO(a, speculative=False)

    def step_at(t: float, rid: int, step: Step) -> None:
        now[0] = t
        io.step(rid, step)

    def frame():
        return frames.recv(b, 1)

    step_at(0.0, 1, Step([10], prefill_tokens=3))
    assert frame() == frames.Stepped(1, [Step([10], prefill_tokens=3)])
    step_at(0.004, 1, Step([11]))
    step_at(0.010, 1, Step([12]))
    assert frames.recv(b, 0.05) is None  # held: under STREAM_INTERVAL_S since the last frame
    step_at(0.017, 1, Step([13]))
    got = frame()
    assert [s.tokens for s in got.steps] == [[11], [12], [13]]
    assert [round(s.interval_ms, 6) for s in got.steps] == [4.0, 6.0, 7.0]
    step_at(0.020, 1, Step([14]))
    io.send(frames.Failure("boom", 1, fatal=False))
    assert frame() == frames.Stepped(1, [Step([14], interval_ms=pytest.approx(3.0))])
    assert frame() == frames.Failure("boom", 1, fatal=False)
    step_at(0.021, 1, Step([15], "eos"))
    assert frame() == frames.Stepped(1, [Step([15], "eos", interval_ms=pytest.approx(1.0))])
    step_at(0.022, 2, Step([20]))  # the next answer's first step: at once, no interval
    assert frame() == frames.Stepped(2, [Step([20])])
    io.flush()
