"""Ties a process to its parent's life: imports nothing heavy, so a worker can call it first thing.

A worker sets its death signal before it imports torch (seconds): a torchrun killed in that window would
otherwise leave it orphaned for good, stuck in ``init_process_group``.
"""

from __future__ import annotations

import os
import signal
import sys

ENV_LAUNCHER_PID = "SWIFTSPEC_LAUNCHER_PID"  # torchrun's pid, set by swiftspec.engine.worker.torchrun
ENV_ENGINE_PID = "SWIFTSPEC_ENGINE_PID"  # the Engine's pid, set by launcher.spawn


def die_with_launcher() -> None:
    """SIGKILL this process when its launcher dies (Linux PR_SET_PDEATHSIG), and exit now if the launcher
    is already gone: a launcher killed between spawning us and this call leaves us with another parent."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if launcher and os.getppid() != int(launcher):
        sys.stderr.write(f"the launcher (pid {launcher}) exited before this worker started: exiting\n")
        os._exit(1)


def name_process(name: str) -> None:
    """The name ps, top and /proc/PID/comm show (Linux keeps 15 bytes of it)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
