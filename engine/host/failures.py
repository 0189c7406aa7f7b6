"""What the Engine knows when its workers fail: their output (kept in memory and in a log file), which
worker failed first and how, in words a person can act on."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from swiftspec.engine.paths import cache_dir


class EngineError(RuntimeError):
    """The engine cannot do what was asked: its workers failed, or the request is impossible."""


TORCHRUN_REPORT_S = 3.0  # after a failure, for torchrun to find which worker failed and end the rest
# the longest a report waits while torchrun runs and all it has shown is a peer's lost connection: torchrun
# names the worker that died only once it has ended the rest, which takes seconds on a loaded machine
TORCHRUN_NAMES_S = 15.0
WATCH_LOOKS_S = 2.0  # the longest a report waits for the Engine's watch once torchrun has exited


def worker_log_path() -> Path:
    """Where this Engine's workers' whole output goes: named in every error, removed after a clean close."""
    return cache_dir() / "logs" / f"workers-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def exit_of(pid: int, pidfd: int) -> int | None:
    """How a process that has exited ended (Popen's returncode: -signal or the exit code), ``pidfd`` one
    opened on it while it ran: from /proc while its parent has not reaped it, else from the pidfd (Linux
    6.15+ keeps the status there once it is reaped, as torchrun does within 0.1 s). None where neither
    says, or for 0 (what /proc shows where it may not say more)."""
    status = _status_unreaped(pid)
    if status is None:
        status = _status_reaped(pidfd)
    return None if status is None else os.waitstatus_to_exitcode(status) or None


def _status_unreaped(pid: int) -> int | None:
    """The wait status of a process that has exited but is not yet reaped, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    if len(fields) < 50 or fields[0] != "Z":  # field 3 the state, field 52 the exit status (Linux 3.5+)
        return None
    return int(fields[-1])


PIDFD_INFO_EXIT, PIDFD_INFO_SIZE = 1 << 3, 64  # linux/pidfd.h: struct pidfd_info, its first version
PIDFD_GET_INFO = (3 << 30) | (PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, ...)


def _status_reaped(pidfd: int) -> int | None:
    """The wait status of a reaped process from a pidfd opened on it before (PIDFD_GET_INFO's exit_code)."""
    info = bytearray(PIDFD_INFO_SIZE)
    struct.pack_into("Q", info, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, info)
    except OSError:  # a kernel before 6.13 (no PIDFD_GET_INFO)
        return None
    if not struct.unpack_from("Q", info, 0)[0] & PIDFD_INFO_EXIT:  # not reaped yet, or before 6.15
        return None
    return struct.unpack_from("i", info, 60)[0]


class WorkerOutput:
    """Keeps the last lines the workers wrote (stdout and stderr together), read by a thread, and writes
    every line to a log file for the full story."""

    def __init__(self, stream, log_path: Path, n_target: int):
        self.lines: deque[str] = deque(maxlen=400)
        self.log_path, self.n_target = log_path, n_target
        # (rank, Popen's returncode) of the worker seen to exit first, from the process itself: the cause
        self.first_exit: tuple[int, int] | None = None
        # set by the Engine's watch once it has looked at the processes that exited (None: no watch yet)
        self.watched: threading.Event | None = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w", encoding="utf-8")
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True, name="worker-output")
        self.thread.start()

    def _read(self, stream) -> None:
        with self._log:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append(line)
                self._log.write(line + "\n")
                self._log.flush()
        stream.close()

    def failed_worker(self) -> tuple[int, int] | None:
        """(rank, exit code) of the worker that failed first: the one seen to exit first where the Engine
        saw it, else from torchrun's report. When one worker dies its peers fail too, on a broken
        connection, and torchrun may name one of them alone, so the likeliest cause there is a worker
        killed by a signal other than torchrun's own SIGTERM, then one that did not fail on a connection,
        then the one torchrun names as the root cause."""
        if self.first_exit is not None:
            return self.first_exit
        text = "\n".join(self.lines)
        block = r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)"
        root = [(int(r), int(c)) for r, c in re.findall(block, text.partition("Root Cause")[2])]
        found = root + [(int(r), int(c)) for r, c in re.findall(block, text)]
        found += [(int(r), int(c)) for c, r in re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", text)]
        # a rank whose uncaught exception torch.distributed printed ("[rankN]: ...Error: ...") exited with 1,
        # though torchrun, which reports the first failure it polls, may name another
        found += [(int(r), 1) for r in dict.fromkeys(re.findall(r"^\[rank(\d+)\]: [\w.]+(?:Error|Exception): ", text, re.M))]

        return min(found, key=self._unlikely) if found else None  # min keeps the first of equals: root first

    def saw_exits(self, exits: list[tuple[int, int | None]]) -> None:
        """The workers (rank, Popen's returncode) that had exited when the Engine first looked: the
        likeliest cause among them is the one that failed first. A code is None where it could not be read
        (a kernel that keeps no status once torchrun reaps the process): then only a worker killed by a
        signal is sure to be the cause, and otherwise torchrun's report decides."""
        known = [e for e in exits if e[1] is not None]
        likeliest = min(known, key=self._unlikely, default=None)
        if likeliest is not None and (len(known) == len(exits) or not self._unlikely(likeliest)[0]):
            self.first_exit = likeliest

    def _unlikely(self, failure: tuple[int, int]) -> tuple[bool, bool]:
        """How unlikely a failure is the cause: (not killed by a signal, failed on a lost connection)."""
        rank, code = failure
        head = self.headline(rank) or ""
        return not (code < 0 and code != -signal.SIGTERM), "gloo" in head or "Connection" in head

    def report(self, why: str, torchrun: subprocess.Popen) -> str:
        """An error message: which worker failed and how (else what was noticed), its last exception line,
        the log's path. First gives torchrun a moment to notice the failure itself and say which worker."""
        deadline = time.monotonic() + TORCHRUN_NAMES_S
        while True:  # again while torchrun runs and all it has shown is a peer's lost connection
            try:
                torchrun.wait(timeout=TORCHRUN_REPORT_S)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
            # the workers' last words usually come right after a failure is noticed; once torchrun has
            # exited, its report is in the pipe: read to its end
            self.thread.join(TORCHRUN_REPORT_S if exited else 1.0)
            if exited and self.watched is not None:  # the watch, woken by the same exits, may not have run yet
                self.watched.wait(WATCH_LOOKS_S)
            failed = self.failed_worker()
            if exited or time.monotonic() > deadline:
                break
            # where the cause is known, torchrun's report is still wanted in the log
            if self.first_exit is None and (failed is None or self._unlikely(failed) != (True, True)):
                break
        if failed is None:
            head = self.headline()
            lines = [why] + ([head] if head and head not in why else [])
        else:
            rank, code = failed
            role = "target" if rank < self.n_target else "draft"
            when = " during start-up" if "start" in why else ""
            head = self.headline(rank)
            lines = [f"the {role} worker (rank {rank}) {describe_exit(code)}{when}"] + ([head] if head else [])
        return "\n".join(lines + [f"the workers' full output: {self.log_path}"])

    def headline(self, rank: int | None = None) -> str | None:
        """An exception line, e.g. ``LoadError: ...``: of one rank (its lines start "[rank1]:") the last,
        the outermost of a chain; of any rank the first, since the rank that failed first says why and the
        others then only report their lost connections to it."""
        prefix = "" if rank is None else f"[rank{rank}]:"
        for line in (self.lines if rank is None else reversed(self.lines)):
            m = re.search(r"\b(\w+(Error|Exception|Interrupt)): (.+)", line)
            if m and line.startswith(prefix) and "ChildFailedError" not in m.group(1):
                return f"{m.group(1)}: {m.group(3)}"
        return None
