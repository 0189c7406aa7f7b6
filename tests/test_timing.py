"""The profiles' timer: a call whose threads waited for a core, or that ran while the hypervisor took the
cores, is timed again, and a figure that never ran undisturbed is not taken for a clean one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from swiftspec.engine import timing
from swiftspec.engine.timing import CleanTimer


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def no_pause(monkeypatch):
    monkeypatch.setattr(timing, "PAUSE_S", 0.0)


def test_a_call_that_kept_its_core_is_timed_once_and_clean():
    timer, calls = CleanTimer(), []
    assert 0.005 <= timer.seconds(lambda: calls.append(busy(0.005))) < 0.5
    assert len(calls) == 1 and timer.disturbed == 0 and timer.clean
    timer.seconds(lambda: time.sleep(0.005))  # a wait is no wait for a core
    assert timer.clean


def test_a_call_whose_threads_waited_for_a_core_is_timed_again(monkeypatch, no_pause):
    """Each call here reads as having had its working thread wait half its time for a core until the
    third: timed three times, clean; one that waits every time is counted. A thread that did not work
    through the call (it never ran) may wait as it likes."""
    ran, waited, calls = [0], [0], []
    monkeypatch.setattr(timing, "thread_schedstats", lambda: {"1": (ran[0], waited[0]), "2": (0, waited[0] * 9)})

    def call(wait_until: int) -> None:
        """Reads as having run the whole call and waited half of it: measured, so that a call that a busy
        machine stretches reads the same."""
        calls.append(1)
        start = time.perf_counter_ns()
        busy(0.002)
        took = time.perf_counter_ns() - start
        ran[0] += took
        waited[0] += took // 2 if len(calls) < wait_until else 0

    timer = CleanTimer()
    timer.seconds(lambda: call(wait_until=3))
    assert len(calls) == 3 and timer.clean
    calls.clear()
    timer.seconds(lambda: call(wait_until=99))
    assert len(calls) == timing.RETRIES + 1 and timer.disturbed == 1 and not timer.clean
    calls.clear()
    lockstep = CleanTimer(retries=0)  # a TP rank: its partners would not call again with it
    lockstep.seconds(lambda: call(wait_until=99))
    assert len(calls) == 1 and lockstep.disturbed == 1


def test_the_working_threads_waits_add_up():
    ms = 1_000_000
    before = {"main": (0, 0), "pool": (0, 0), "idle": (0, 0)}
    after = {"main": (10 * ms, 2 * ms), "pool": (9 * ms, 2 * ms), "idle": (ms // 10, 50 * ms)}
    assert not timing.waited_for_a_core(before, after, 0.015)  # 4 ms of 15: the idle thread's 50 ignored
    after["pool"] = (9 * ms, 4 * ms)
    assert timing.waited_for_a_core(before, after, 0.015)  # 6 ms of 15
    squeezed = {"main": (2 * ms, 12 * ms), "idle": (0, 0)}  # the caller ran 2 ms of 15 and waited 12
    assert not timing.waited_for_a_core({"main": (0, 0), "idle": (0, 0)}, squeezed, 0.015)
    assert timing.waited_for_a_core({"main": (0, 0), "idle": (0, 0)}, squeezed, 0.015, caller="main")


@pytest.mark.skipif(timing.thread_schedstats() is None, reason="no schedstat in /proc here")
def test_busy_processes_on_every_core_make_a_call_wait():
    """Twice as many spinning processes as cores: the timed thread gets a third of a core at most."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)  # they run
        timer = CleanTimer()
        timer.seconds(lambda: busy(0.1))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert timer.disturbed == 1 and not timer.clean


def test_without_schedstat_the_timing_threads_cpu_time_tells(monkeypatch, no_pause):
    """A sleeping call stands for one whose thread lost its core (its CPU time falls short of its wall
    time), unless the call may wait by nature (cpu_bound=False: a GPU forward's synchronisation)."""
    monkeypatch.setattr(timing, "thread_schedstats", lambda: None)
    timer = CleanTimer()
    timer.seconds(lambda: busy(0.005))
    assert timer.clean
    timer.seconds(lambda: time.sleep(0.005))
    assert timer.disturbed == 1
    waiting = CleanTimer(cpu_bound=False)
    assert waiting.seconds(lambda: time.sleep(0.005)) >= 0.005 and waiting.clean


def test_steal_time_while_timing_makes_the_figures_unclean(monkeypatch):
    stolen = [100.0]
    monkeypatch.setattr(timing, "steal_seconds", lambda: stolen[0])
    timer = CleanTimer()
    timer.seconds(lambda: busy(0.001))
    stolen[0] += 0.02  # a tick or two: noise
    assert timer.clean
    stolen[0] += timing.MAX_STEAL_SHARE * 64  # most of a second on every core of a big machine
    assert not timer.clean


def test_steal_time_is_read_from_proc_stat_where_there_is_one():
    first = timing.steal_seconds()
    assert first >= 0.0 and timing.steal_seconds() >= first
