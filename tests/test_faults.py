"""Faults, contention and hostile local peers (issue 16): listeners, orphans, start-up handshakes, request
validation, interrupted conversions, and a bounded fault-injection loop.

Every peer these tests start talks to loopback addresses only.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from tiny_models import tiny_model_dir

from swiftspec.config import ConfigError, EngineConfig, SamplingParams
from swiftspec.engine import launcher, protocol
from swiftspec.engine.client import Engine, EngineError, _accept_worker, _Tail, encode_chat

PROMPT = [{"role": "user", "content": "What is 17 times 23?"}]


@pytest.fixture(scope="module")
def target_dir():
    return tiny_model_dir(seed=0, layers=2)


def start(target_dir, **kw) -> Engine:
    return Engine.start(EngineConfig(target=str(target_dir), max_seq_len=kw.pop("max_seq_len", 256), **kw))


def descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it (by parent pid, read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split(" ")[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def listening_addresses(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by one of ``pids``."""
    listening = {}
    for name, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc/net prints the address as host-order 32-bit words
            ip = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            listening[inode] = (str(ipaddress.ip_address(ip)), int(hex_port, 16))
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                found.append((pid, *listening[link[8:-1]]))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


# ------------------------------------------------------------------------------------------ listeners

@pytest.mark.slow
def test_no_listener_beyond_loopback_and_no_torchelastic_dir(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torchrun's own temporary directories land here
    with start(target_dir) as eng:
        procs = descendants(eng._proc.pid)
        assert {r.pid for r in eng.info.ranks} <= procs
        listeners = listening_addresses(procs | {os.getpid()})
        assert listeners, "gloo listens on loopback: the scan must see it"
        assert [x for x in listeners if not is_loopback(x[1])] == []
        list(eng.generate(PROMPT, SamplingParams(max_new_tokens=4)))
        run_dir = eng._run_dir
        assert run_dir.is_dir() and oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert not run_dir.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("torchelastic_")] == []


# ------------------------------------------------------------------------------- start-up handshakes

class _Running:
    def poll(self):
        return None


def _closed_tail() -> _Tail:
    r, w = os.pipe()
    os.close(w)
    return _Tail(os.fdopen(r, "rb"))


def test_idle_connections_do_not_hold_up_the_workers_handshake():
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    key = protocol.new_key()
    idle = [socket.create_connection(("127.0.0.1", listener.getsockname()[1])) for _ in range(3)]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(conn=protocol.connect(addr, key, timeout=3.0)))
    worker.start()
    t0 = time.monotonic()
    conn = _accept_worker(listener, key, _Running(), _closed_tail(), time.monotonic() + 20)
    worker.join(5)
    assert time.monotonic() - t0 < 3, "the idle peers delayed the worker's handshake"
    conn.send("check")
    assert result["conn"].recv(2)["type"] == "check"
    for s in idle:
        s.close()
    listener.close()


def test_start_up_error_names_the_rank_that_failed_first():
    tail = _closed_tail()
    tail.lines.extend([
        "swiftspec.engine.protocol.AuthError: handshake timed out after 10 s waiting for 'challenge'",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    assert tail.headline().startswith("AuthError: handshake timed out")


# ---------------------------------------------------------------------------------- request validation

@pytest.mark.parametrize("fields, message", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"top_p": float("nan")}, "top-p"),
    ({"top_k": 2.5}, "top-k"),
    ({"seed": 99999999999999999999999}, "seed"),
    ({"seed": -1}, "seed"),
    ({"max_new_tokens": True}, "max-new-tokens"),
    ({"stop": "END"}, "stop"),
    ({"stop": ["x" * 100_000]}, "stop string"),
])
def test_sampling_params_refuse_what_the_sampler_cannot_take(fields, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**fields).validate()
    SamplingParams(seed=2**64 - 1, temperature=1e-3, stop=["x" * 1000]).validate()


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "temperature"),
    (["--seed", "99999999999999999999999"], "seed"),
])
def test_cli_refuses_bad_sampling_values_before_starting(flags, message, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from swiftspec import cli

    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(cli, "_start_engine", lambda *a: started.append(a))
    result = CliRunner().invoke(cli.app, cli.normalise_argv(["chat", "-p", "hi", *flags]))
    assert result.exit_code == 2 and message in result.output and not started


@pytest.mark.slow
def test_bad_requests_leave_the_engine_usable(target_dir):
    with start(target_dir) as eng:
        with pytest.raises(ConfigError, match="temperature"):
            list(eng.generate(PROMPT, SamplingParams(temperature=float("nan"))))
        ids = encode_chat(eng.tokenizer, PROMPT)
        # past the Engine's own check, straight to the workers: they refuse it and carry on
        for bad in (SamplingParams(temperature=float("nan")), SamplingParams(seed=2**70)):
            with pytest.raises(EngineError, match="invalid request"):
                list(eng._stream(ids, bad))
        events = list(eng.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.8, seed=2**64 - 1)))
        assert events[-1].finished and eng.alive


# --------------------------------------------------------------------------- the embedded conversion

def _fake_convert(gguf, out, console) -> None:
    """Stands in for the 25 s dequantisation: a small but well-formed converted directory."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1000)}, str(out / "model.safetensors"))
    (out / "config.json").write_text("{}")


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):

    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(4096))
    return gguf


def test_conversion_killed_half_way_is_cleaned_up_by_the_next_start(fake_gguf, monkeypatch):
    import subprocess
    import sys

    from swiftspec import embedded

    converted = embedded.converted_dir(fake_gguf).parent
    hang = ("import sys, time\nfrom swiftspec import embedded\n"
            "def hang(gguf, out, console):\n    (out / 'model.safetensors').write_bytes(b'x' * 4096)\n"
            "    time.sleep(60)\n"
            "embedded._convert = hang\nembedded.ensure_converted(embedded.Path(sys.argv[1]), quiet=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", hang, str(fake_gguf)])
    try:
        deadline = time.monotonic() + 30
        while not list(converted.glob(".tmp-*/model.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = list(converted.glob(".tmp-*"))
        assert len(running) == 1
        embedded._remove_stale_temp_dirs(converted)  # a conversion still running is left alone
        assert running[0].is_dir()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert running[0].is_dir()  # what a SIGKILL leaves behind
    monkeypatch.setattr(embedded, "_convert", _fake_convert)
    out = embedded.ensure_converted(fake_gguf, quiet=True)
    assert embedded.damage(out) is None
    assert sorted(p.name for p in converted.iterdir()) == [out.name]


@pytest.mark.parametrize("harm, why", [
    (lambda out: os.truncate(out / "model.safetensors", 2000), "bytes, its header says"),
    (lambda out: (out / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda out: (out / "model.safetensors").write_bytes(b"\xff" * 16), "no readable header"),
])
def test_damaged_conversion_is_detected_and_converted_again(harm, why, fake_gguf, monkeypatch, capsys):
    from swiftspec import embedded

    calls = []
    monkeypatch.setattr(embedded, "_convert", lambda *a: (calls.append(1), _fake_convert(*a)))
    out = embedded.ensure_converted(fake_gguf)
    assert embedded.ensure_converted(fake_gguf) == out and len(calls) == 1  # intact: used as it is
    harm(out)
    assert why in embedded.damage(out)
    assert embedded.ensure_converted(fake_gguf) == out and len(calls) == 2
    assert embedded.damage(out) is None
    assert "damaged" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ process faults

def marked_processes(marker: str) -> set[int]:
    """Live processes whose environment carries ``SWIFTSPEC_TEST_MARK=marker`` (found even after they
    were re-parented, which is what an orphan is)."""
    needle = f"SWIFTSPEC_TEST_MARK={marker}".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state not in "ZX":
            found.add(int(entry.name))
    return found


def gone_within(marker: str, seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def children(pid: int) -> set[int]:
    return descendants(pid) - {pid}


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_workers_die_with_a_torchrun_killed_before_they_import_torch(target_dir, delay_s):
    """torchrun SIGKILLed right after it spawned its workers (they take seconds to import torch before they
    can connect anywhere): no worker may survive it."""
    marker = uuid.uuid4().hex
    cfg = EngineConfig(target=str(target_dir), max_seq_len=256)
    worker = launcher.worker_args(cfg, launcher.Layout(1, 1), target_dir, "suffix")
    run_dir = launcher.new_run_dir()
    try:
        proc = launcher.spawn(launcher.build_command(worker, 2, run_dir),
                              {protocol.ENV_ADDR: "127.0.0.1:9", protocol.ENV_KEY: protocol.new_key(),
                               "SWIFTSPEC_TEST_MARK": marker}, run_dir)
        deadline = time.monotonic() + 60
        while len(children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(children(proc.pid)) >= 2, "torchrun did not start its workers"
        time.sleep(delay_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert gone_within(marker, 10) == set()
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
