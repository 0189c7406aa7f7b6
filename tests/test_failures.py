"""Failures and what they leave behind: no listener beyond loopback, bad requests, killed or hung
processes at every stage (no process left, the next start works), and reports that name the worker
that failed."""

from __future__ import annotations

import ipaddress
import os
import platform
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers.engines import PROMPTS, Exited, in_thread, start
from helpers.processes import children_by_parent, descendants, listening_addresses

from swiftspec.engine.config import ConfigError, EngineConfig, SamplingParams
from swiftspec.engine.host import launcher, protocol
from swiftspec.engine.host.client import EngineError
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.host.failures import WorkerOutput
from swiftspec.engine.host.worker_spec import WorkerSpec
from swiftspec.engine.worker.torchrun import WORKER_NAME


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.slow
def test_no_listener_beyond_loopback_and_no_torchelastic_dir(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torchrun's own temporary directories land here
    with start(target_dir, max_seq_len=256) as eng:
        procs = descendants(eng._proc.pid)
        assert {r.pid for r in eng.info.ranks} <= procs
        listeners = listening_addresses(procs | {os.getpid()})
        assert listeners, "gloo listens on loopback: the scan must see it"
        assert [x for x in listeners if not is_loopback(x[1])] == []
        list(eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4)))
        run_dir = eng._run_dir
        assert run_dir.is_dir() and oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert not run_dir.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("torchelastic_")] == []


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
    from swiftspec.cli import chat as cli_chat

    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(cli_chat, "_start_engine", lambda *a: started.append(a))
    result = CliRunner().invoke(cli.app, cli.normalise_argv(["chat", "-p", "hi", *flags]))
    assert result.exit_code == 2 and message in result.output and not started


@pytest.mark.slow
def test_bad_requests_leave_the_engine_usable(target_dir):
    with start(target_dir, max_seq_len=256) as eng:
        with pytest.raises(ConfigError, match="temperature"):
            list(eng.generate(PROMPTS[0], SamplingParams(temperature=float("nan"))))
        ids = encode_chat(eng.tokenizer, PROMPTS[0])
        # past the Engine's own check, straight to the workers: they refuse it and carry on
        for bad in (SamplingParams(temperature=float("nan")), SamplingParams(seed=2**70)):
            with pytest.raises(EngineError, match="invalid request"):
                list(eng._stream(ids, bad))
        events = list(eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.8, seed=2**64 - 1)))
        assert events[-1].finished and eng.alive


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
    return set(children_by_parent().get(pid, []))


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.3])
@pytest.mark.parametrize("programs", [False, True], ids=["forked", "programs"])
def test_workers_die_with_a_torchrun_killed_before_they_import_torch(target_dir, delay_s, programs):
    """torchrun SIGKILLed right after it started its workers, forked (the CPU's) or as programs (the
    GPUs', which take seconds to import torch before they can connect anywhere): no worker may survive it."""
    marker = uuid.uuid4().hex
    cfg = EngineConfig(target=str(target_dir), max_seq_len=256)
    run_dir = launcher.new_run_dir()
    try:
        spec = WorkerSpec(cfg, launcher.Layout(1, 1), str(target_dir), "suffix")
        proc = launcher.spawn(launcher.build_command([f"--spec={spec.write(run_dir)}"], 2, run_dir, cuda=programs),
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
        launcher.remove_run_dir(run_dir)

DRIVER = r"""
import sys
from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.host.client import Engine, EngineError

target, stage = sys.argv[1], sys.argv[2]
say = lambda text: print(text, flush=True)
try:
    engine = Engine.start(EngineConfig(target=target, max_seq_len=4096), progress=lambda t: say("progress " + t))
    say("ranks " + " ".join(f"{r.role}:{r.pid}" for r in engine.info.ranks))
    if stage == "idle":
        say("idle")
        sys.stdin.readline()
    params = SamplingParams(max_new_tokens=4000, ignore_eos=True)
    for i, _ in enumerate(engine.generate([{"role": "user", "content": "Count to a thousand."}], params)):
        if i == 0:
            say("streaming")
    say("finished")
except EngineError as e:
    say("engine-error " + str(e).splitlines()[0])
    sys.exit(1)
"""

VICTIMS = ("engine", "torchrun", "target", "draft")

STAGES = ("start-up", "mid-answer", "idle")

FAULT_ROUNDS = 20


def _rank_pids(torchrun: int) -> dict[str, int]:
    """The workers torchrun has forked so far, by role (RANK 0 is the target, 1 the draft), by the names
    they give themselves."""
    found = {}
    for pid in children(torchrun):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == f"{WORKER_NAME}0":
            found["target"] = pid
        elif name == f"{WORKER_NAME}1":
            found["draft"] = pid
    return found


def _wait_for(what, lines: list[str], timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := what()) is not None:
            return value
        time.sleep(0.01)
    raise AssertionError(f"the stage was not reached; the engine's process said {lines[-3:]}")


def _victim_pid(victim: str, stage: str, driver, lines: list[str]) -> int:
    """Waits until the stage is reached, then names the process to kill."""
    if stage != "start-up":
        _wait_for(lambda: True if (lines and lines[-1] in ("streaming", "idle")) else None, lines)
    if victim == "engine":
        if stage == "start-up":
            _wait_for(lambda: True if any(x.startswith("progress starting") for x in lines) else None, lines)
        return driver.pid
    torchrun = _wait_for(lambda: next(iter(children(driver.pid)), None), lines)
    if victim == "torchrun":
        return torchrun
    return _wait_for(lambda: _rank_pids(torchrun).get(victim), lines)


@pytest.mark.slow
def test_fault_injection_leaves_no_process_and_the_next_start_works(target_dir, tmp_path, monkeypatch):
    """Kills each of our processes (the engine's, torchrun, a target rank, a draft rank) at start-up,
    mid-answer and idle, FAULT_ROUNDS times in a row: every time the engine reports the failure (or is
    the victim), no process is left, and a start after them all works and removes every run directory
    they left."""
    import subprocess
    import sys

    for round_ in range(FAULT_ROUNDS):
        victim, stage = VICTIMS[round_ % len(VICTIMS)], STAGES[round_ % len(STAGES)]
        marker = uuid.uuid4().hex
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(target_dir), stage], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "SWIFTSPEC_TEST_MARK": marker, "TMPDIR": str(tmp_path)})
        lines: list[str] = []
        reader = threading.Thread(target=lambda out, into: into.extend(line.strip() for line in out),
                                  args=(driver.stdout, lines), daemon=True)
        reader.start()
        try:
            pid = _victim_pid(victim, stage, driver, lines)
            time.sleep((0.0, 0.2, 0.6)[round_ % 3] if stage == "start-up" else 0.0)
            os.kill(pid, signal.SIGKILL)
            if stage == "idle" and victim != "engine":
                driver.stdin.write("answer\n")
                driver.stdin.flush()
            driver.wait(60)
            reader.join(5)
            where = f"round {round_}: {victim} killed at {stage}"
            if victim != "engine":
                assert driver.returncode == 1 and lines[-1].startswith("engine-error"), (where, lines[-3:])
            assert gone_within(marker, 20) == set(), where
        finally:
            for pid in marked_processes(marker) | ({driver.pid} if driver.poll() is None else set()):
                os.kill(pid, signal.SIGKILL)
            driver.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the next start sweeps the rounds' run dirs
    with start(target_dir, max_seq_len=256) as eng:
        events = list(eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4)))
        assert events[-1].finished
    assert list(tmp_path.glob("swiftspec-run-*")) == []


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2, 0])
def test_ctrl_c_with_a_hung_worker_ends_the_group(target_dir, presses):
    """The target rank stops responding mid-answer (SIGSTOP); Ctrl-C gives up on it after
    CANCEL_TIMEOUT_S, a second Ctrl-C at once; abandoning the answer (presses 0: the iterator is closed)
    returns within CANCEL_TIMEOUT_S and the group's end, as Engine.generate documents."""
    from swiftspec.engine.host import client

    eng = start(target_dir, max_seq_len=4096)
    streaming = threading.Event()

    def hang_then_ctrl_c():
        streaming.wait(120)
        os.kill(eng.info.ranks[0].pid, signal.SIGSTOP)
        for _ in range(presses):
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see test_runtime)
    interrupter = threading.Thread(target=hang_then_ctrl_c)
    try:
        if presses:
            with pytest.raises(KeyboardInterrupt):
                interrupter.start()
                for _ in eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4000, ignore_eos=True, mode="ar")):
                    if not streaming.is_set():
                        t0 = time.monotonic()
                        streaming.set()
        else:
            interrupter.start()
            events = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4000, ignore_eos=True, mode="ar"))
            next(events)
            streaming.set()
            interrupter.join()
            time.sleep(0.5)
            t0 = time.monotonic()
            events.close()
        elapsed = time.monotonic() - t0
        interrupter.join()
    finally:
        signal.signal(signal.SIGINT, previous)
        eng.close()
    assert elapsed < (client.CANCEL_TIMEOUT_S + 6 if presses < 2 else 5), elapsed
    assert not eng.alive and launcher.alive_groups(eng.pgids) == []

TORCHRUN_REPORT = """\
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17334: Connection reset by peer
E1130 18:08:20.559000 1 api.py:882] failed (exitcode: 1) local_rank: 0 (pid: 11) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
swiftspec.engine.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_18:08:20
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  traceback : Signal 9 (SIGKILL) received by PID 12
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_18:08:20
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
============================================================
"""


@pytest.mark.parametrize("output, n_target, said", [
    # the killed draft is the cause, though torchrun saw the target's exit first
    (TORCHRUN_REPORT, 1, "the draft worker (rank 1) was killed by signal 9 (SIGKILL)\nthe workers' full output: "),
    # with two target ranks, rank 1 is the target's
    (TORCHRUN_REPORT, 2, "the target worker (rank 1) was killed by signal 9 (SIGKILL)\n"),
    # a worker's own exception wins over a peer's broken connection, and its exception line is given
    ("[rank1]: LoadError: weights do not match the config\n[rank0]: RuntimeError: gloo Connection closed by peer\n"
     "failed (exitcode: 1) local_rank: 0 (pid: 11)\nfailed (exitcode: 1) local_rank: 1 (pid: 12)\n", 1,
     "the draft worker (rank 1) exited with code 1\nLoadError: weights do not match the config\n"),
    # torchrun names only the first failure it polls (workers it forked): the rank whose own exception
    # was printed is found too
    ("[rank1]: swiftspec.engine.model.model_dir.LoadError: weights do not match the config\n"
     "[rank0]: RuntimeError: gloo Connection closed by peer\nfailed (exitcode: 1) local_rank: 0 (pid: 11) of fn: "
     "forked_worker (start_method: fork)\n", 1,
     "the draft worker (rank 1) exited with code 1\nLoadError: weights do not match the config\n"),
    # nothing from torchrun: what was noticed, and the log
    ("[rank0]: hello\n", 1, "lost the connection to the workers\nthe workers' full output: "),
])
def test_failure_report_names_the_worker_and_the_log(tmp_path, output, n_target, said):
    r, w = os.pipe()
    os.write(w, output.encode())
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=n_target)
    message = tail.report("lost the connection to the workers", Exited())
    assert message.startswith(said), message
    assert message.endswith(str(tmp_path / "workers.log")) and "exitcode" not in message
    assert (tmp_path / "workers.log").read_text() == output


def test_a_report_waits_for_torchrun_to_name_the_worker_that_died(tmp_path, monkeypatch):
    """A peer's lost connection shows first; torchrun, slow on a loaded machine, names the killed worker
    seconds later, and the report waits for it rather than blaming the peer."""
    from swiftspec.engine.host import failures

    monkeypatch.setattr(failures, "TORCHRUN_REPORT_S", 0.2)
    r, w = os.pipe()
    os.write(w, b"[rank0]: ConnectionResetError: [Errno 104] Connection reset by peer\n")
    reported = threading.Event()

    def torchrun_reports_late():
        time.sleep(3.0)  # past the two rounds (0.2 s + 1 s each) that a report waited before
        os.write(w, TORCHRUN_REPORT.encode())
        os.close(w)
        reported.set()

    class Running:
        """torchrun's Popen, running until it has written its report."""

        def wait(self, timeout=None):
            if not reported.wait(timeout):
                raise subprocess.TimeoutExpired("torchrun", timeout)
            return 1

    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=1)
    threading.Thread(target=torchrun_reports_late, daemon=True).start()
    message = tail.report("lost the connection to the workers", Running())
    assert message.startswith("the draft worker (rank 1) was killed by signal 9 (SIGKILL)\n"), message


def test_an_unreaped_process_tells_how_it_ended():
    """The watch reads how a worker ended before torchrun reaps it (from /proc): a signal, or a code."""
    from swiftspec.engine.host.failures import exit_of

    killed, failed = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sh", "-c", "exit 3"])
    fds = [os.pidfd_open(p.pid) for p in (killed, failed)]
    try:
        killed.kill()
        for p in (killed, failed):
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        assert [exit_of(p.pid, fd) for p, fd in zip((killed, failed), fds, strict=True)] == [-signal.SIGKILL, 3]
        assert (killed.wait(), failed.wait()) == (-signal.SIGKILL, 3)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.skipif(tuple(map(int, re.findall(r"\d+", platform.release())[:2])) < (6, 15),
                    reason="a pidfd keeps the status of a reaped process from Linux 6.15 on")
def test_a_reaped_process_tells_how_it_ended_through_a_pidfd_opened_before():
    """torchrun reaps a killed worker within 0.1 s, often before the watch reads it: the pidfd still says."""
    from swiftspec.engine.host.failures import exit_of

    parents = [subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True)
               for script in ("sleep 60 & echo $!; wait", "(sleep 0.5; exit 3) & echo $!; wait")]
    children = [int(p.stdout.readline()) for p in parents]  # not this process's: their parent reaps them
    fds = [os.pidfd_open(pid) for pid in children]
    try:
        os.kill(children[0], signal.SIGKILL)
        for p in parents:
            p.wait()
            p.stdout.close()
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)
        assert [exit_of(pid, fd) for pid, fd in zip(children, fds, strict=True)] == [-signal.SIGKILL, 3]
    finally:
        for fd in fds:
            os.close(fd)


def test_the_worker_seen_to_exit_first_is_the_cause(tmp_path):
    """torchrun may name only the peer that failed on the lost connection; the worker the Engine saw
    exit first, killed, is named instead."""
    r, w = os.pipe()
    os.write(w, b"[rank0]: ConnectionResetError: [Errno 104] Connection reset by peer\n"
                b"failed (exitcode: 1) local_rank: 0 (pid: 11) of fn: forked_worker (start_method: fork)\n")
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=1)
    assert tail.report("lost the connection to the workers", Exited()).startswith("the target worker (rank 0) ")
    tail.saw_exits([(1, -signal.SIGKILL)])
    message = tail.report("lost the connection to the workers", Exited())
    assert message.startswith("the draft worker (rank 1) was killed by signal 9 (SIGKILL)\nthe workers'"), message


def test_of_the_workers_seen_exited_at_once_the_killed_one_is_the_cause(tmp_path):
    """A watch that ran late (a busy machine) finds the killed worker and its peer, which failed on the lost
    connection, both exited: whatever order the pidfds come in, the killed one is named."""
    r, w = os.pipe()
    os.write(w, b"[rank1]: ConnectionResetError: [Errno 104] Connection reset by peer\n")
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=1)
    tail.thread.join()
    for seen in ([(1, 1), (0, -signal.SIGKILL)], [(0, -signal.SIGKILL), (1, 1)]):
        tail.saw_exits(seen)
        message = tail.report("lost the connection to the workers", Exited())
        assert message.startswith("the target worker (rank 0) was killed by signal 9 (SIGKILL)"), message


def test_a_worker_reaped_before_the_watch_looked_leaves_the_cause_to_torchrun(tmp_path):
    """A watch that ran late finds the killed draft reaped by torchrun already (its code gone) and the
    target, which failed on the lost connection, unreaped: the target is not blamed, torchrun's report
    names the draft. A worker seen killed by a signal is the cause whatever else was reaped."""
    r, w = os.pipe()
    os.write(w, TORCHRUN_REPORT.encode())
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=1)
    tail.thread.join()
    tail.saw_exits([(0, 1), (1, None)])
    message = tail.report("lost the connection to the workers", Exited())
    assert message.startswith("the draft worker (rank 1) was killed by signal 9 (SIGKILL)\n"), message
    tail.saw_exits([(0, -signal.SIGKILL), (1, None)])
    message = tail.report("lost the connection to the workers", Exited())
    assert message.startswith("the target worker (rank 0) was killed by signal 9 (SIGKILL)\n"), message


def test_the_watch_tells_which_processes_exited_from_the_processes_themselves():
    from swiftspec.engine.host.client import _first_exits

    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        watching = in_thread(_first_exits, {p.pid for p in sleepers})
        time.sleep(0.2)  # the watch waits on the pidfds meanwhile
        sleepers[1].kill()  # not reaped: a zombie still counts as exited
        assert watching() == {sleepers[1].pid: -signal.SIGKILL}
        sleepers[2].kill()
        os.waitid(os.P_PID, sleepers[2].pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        exited = {sleepers[1].pid: -signal.SIGKILL, sleepers[2].pid: -signal.SIGKILL}
        assert _first_exits({p.pid for p in sleepers}) == exited
        assert _first_exits({sleepers[0].pid, 2 ** 22 + 12345}) == {2 ** 22 + 12345: None}  # gone already
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
