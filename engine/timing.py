"""Timings for the cached profiles that notice when other work held the cores.

What a first start measures (engine/worker/profiling.py: the verify cost, the step times, the kernels'
threads, --dtype auto's backend) is kept for every later start, so one figure taken while the machine
was busy would mis-size every later answer's trees. Two signs of it are read: the threads that did the
call's work waited for a core (their run-queue delay in /proc's schedstat, summed; the threads that worked
are the calling thread and those that ran for a quarter of the call or more, so a background thread that
woke and waited meanwhile does not count, and a caller squeezed to a fifth of a core still does; a quiet
worker's threads also wait a little behind the process's own communication threads, far less than beside
a busy process: docs/ARCHITECTURE.md gives figures; where schedstat is missing, the timing thread's CPU
time falling short of its wall time), and the hypervisor took the machine's cores away (steal time in
/proc/stat). A disturbed call is timed again after a pause; a timer with a call that never ran clean says
so (``clean``), and its figures then serve their run without being cached.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

MAX_RUN_DELAY = 0.3  # of a call's wall time: the most its working threads may wait for a core, in all
WORKED = 0.25  # of a call's wall time: a thread that ran this long did the call's work
MIN_CPU_SHARE = 0.9  # of a call's wall time, on the thread that timed it (without schedstat)
RETRIES = 3
PAUSE_S = 0.05  # before a retry: lets what held the core go on
MAX_STEAL_SHARE = 0.05  # of the cores' time while the timer ran


def steal_seconds() -> float:
    """CPU time the hypervisor has taken from this machine's cores since boot (0 where not reported)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_schedstats() -> dict[str, tuple[int, int]] | None:
    """Each of this process's threads' nanoseconds on a core and waiting for one (None without
    schedstat)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            out[tid] = (int(ran), int(waited))
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile
    return out or None


def waited_for_a_core(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], wall: float,
                      caller: str | None = None) -> bool:
    """Whether the threads that worked through a call of ``wall`` seconds (``caller``, the thread that
    made it, among them) waited too long for a core."""
    ns = wall * 1e9
    return sum(after[t][1] - waited for t, (ran, waited) in before.items()
               if t in after and (t == caller or after[t][0] - ran >= WORKED * ns)) > MAX_RUN_DELAY * ns


class CleanTimer:
    """Times calls, retrying those that ran disturbed. ``cpu_bound``: the call keeps its thread busy (a CPU
    forward), so that thread's CPU time may stand in for the run-queue delay where schedstat is missing
    (a GPU forward's thread may sleep in a synchronisation). ``retries``: 0 where ranks time the same
    collective calls (tensor parallelism), which one rank alone must not repeat; a disturbed call is
    then only counted."""

    def __init__(self, cpu_bound: bool = True, retries: int = RETRIES):
        self.cpu_bound, self.retries = cpu_bound, retries
        self.disturbed = 0  # calls that never ran clean
        self._started, self._steal = time.perf_counter(), steal_seconds()

    def seconds(self, fn: Callable[[], object]) -> float:
        """Wall seconds of one undisturbed call of fn (of the last try, counted in ``disturbed``, when no
        try was undisturbed)."""
        for attempt in range(self.retries + 1):
            stats, cpu = thread_schedstats(), time.thread_time()
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
            if stats is not None:
                ok = not waited_for_a_core(stats, thread_schedstats() or {}, wall, str(threading.get_native_id()))
            else:
                ok = not self.cpu_bound or time.thread_time() - cpu >= MIN_CPU_SHARE * wall
            if ok:
                return wall
            if attempt < self.retries:
                time.sleep(PAUSE_S)
        self.disturbed += 1
        return wall

    @property
    def clean(self) -> bool:
        """Every call ran undisturbed at last, and the hypervisor took little of the cores meanwhile."""
        span = (time.perf_counter() - self._started) * (os.cpu_count() or 1)
        return self.disturbed == 0 and steal_seconds() - self._steal <= MAX_STEAL_SHARE * max(span, 1.0)
