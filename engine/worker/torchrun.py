"""torchrun for one machine with nothing listening on the network: ``python -m swiftspec.engine.worker.torchrun``
takes torchrun's arguments and runs torchrun's own main, with the ``swiftspec-local`` rendezvous.

``--standalone`` would make torchrun's rendezvous a TCPStore listening on every interface, unauthenticated
and uncapped, for as long as the chat runs. One node needs no network to agree with itself: this
rendezvous keeps its store in torchrun's memory, and the workers meet through a FileStore in the Engine's
private run directory (``worker.setup``), with gloo bound to the loopback interface (``launcher.spawn``).

Its workers are forked from it (``forked_worker``): torch and the worker's modules are imported once, here,
rather than once more in each worker.

It also records its pid in the workers' environment, so that a worker can tell whether torchrun was
killed before the worker set its death signal (``lifeline``), and it ends itself (and so its workers) when
the Engine that started it dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from torch.distributed import HashStore, PrefixStore
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from swiftspec.engine.host.launcher import ENV_STORE, processes
from swiftspec.engine.host.launcher import LOCAL_RENDEZVOUS as BACKEND
from swiftspec.engine.host.lifeline import ENV_ENGINE_PID, ENV_LAUNCHER_PID, die_with_launcher, name_process

ENGINE_POLL_S = 0.2
WORKER_NAME = "swiftspec-r"  # a forked worker's name (ps, top), its rank after it
EXIT_POLL_S = 0.02  # torchrun polls its workers every 0.1 s: their exits are seen here first


class LocalRendezvous(RendezvousHandler):
    """The rendezvous of a single node with itself: rank 0 of 1, an in-memory store, no listener."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._store = HashStore()

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers use their own FileStore, never a TCPStore at MASTER_ADDR

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1, RendezvousStoreInfo("127.0.0.1", 0))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous is for one node, not {params.max_nodes}")
    return LocalRendezvous(params.run_id)


def _follow_engine(engine_pid: int) -> None:
    """Until the workers have connected, nothing else would tell them that the Engine is gone: when it
    dies (this process is re-parented), end torchrun, whose workers die with it, and remove the run
    directory the Engine can no longer remove."""
    while os.getppid() == engine_pid:
        time.sleep(ENGINE_POLL_S)
    torchrun = os.getpid()
    if os.fork() == 0:  # removes the run directory once torchrun can no longer write into it
        while os.getppid() == torchrun:
            time.sleep(0.01)
        _remove_run_dir()
        os._exit(0)
    os.kill(torchrun, signal.SIGKILL)


def _remove_run_dir() -> None:
    if store := os.environ.get(ENV_STORE):
        shutil.rmtree(Path(store).parent, ignore_errors=True)


def forked_worker(*argv: str) -> None:
    """A worker forked from this torchrun: torch and the worker's modules are imported already (once, in
    torchrun, instead of once more in every worker, which on a small CPU is a large part of a start). As a worker that
    torchrun starts as a program, it dies with torchrun and has a session of its own."""
    die_with_launcher()
    os.setsid()
    name_process(f"{WORKER_NAME}{os.environ.get('RANK', '')}")  # a fork shares torchrun's command line: ps, top
    for stream in (sys.stdout, sys.stderr):  # as `python -u`: a killed worker's last words reach the log
        stream.reconfigure(write_through=True)
    from swiftspec.engine.worker.serve import main as serve  # imported before the fork (_launch): a lookup

    try:
        code = serve(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # as the interpreter would: sys.excepthook (torch.distributed's: "[rankN]:" lines), 1
        sys.excepthook(*sys.exc_info())
        code = 1
    if code:  # a failure, as torchrun sees one: a non-zero exit code (returning would be a success)
        os._exit(code)


@record
def _launch(argv: list[str] | None) -> None:
    """torchrun's own launch. With ``--start-method=fork`` (the CPU) its workers are forked from this
    process (``forked_worker``); otherwise (GPUs: a fork must not follow any CUDA use) they are started as
    ``python -m swiftspec.engine.worker``, as torchrun starts a module."""
    from torch.distributed import run
    from torch.distributed.launcher.api import elastic_launch

    args = run.parse_args(argv)
    if args.start_method != "fork":
        run.run(args)
        return
    # torch and the worker's modules, once, before the fork for every worker; the GPUs' torchrun starts
    # its workers as programs and never needs them
    import swiftspec.engine.worker.serve  # noqa: F401

    config, _, cmd_args = run.config_from_args(args)
    worker_args = cmd_args[cmd_args.index(args.training_script) + 1:]
    ended = threading.Event()
    threading.Thread(target=_report_exits, args=(int(args.nproc_per_node), ended), daemon=True,
                     name="report-exits").start()
    try:
        elastic_launch(config=config, entrypoint=forked_worker)(*worker_args)
    finally:
        ended.set()


def _report_exits(n_workers: int, ended: threading.Event) -> None:
    """Says how every forked worker that failed ended, in the words of torchrun's own report ("failed
    (exitcode: -9) local_rank: 1 ..."), which for forked workers names only the first failure it polls:
    a worker killed by a signal is then told apart from the peers that failed on their broken connections
    to it (failures.WorkerOutput). It peeks (WNOWAIT) and leaves the reaping to torchrun."""
    workers: dict[int, int] = {}  # pid -> rank, by the names the workers give themselves
    told: set[int] = set()
    while not ended.wait(EXIT_POLL_S):
        if len(workers) < n_workers:
            workers.update(_named_children())
        for pid, rank in workers.items():
            if pid in told:
                continue
            try:
                status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped already
                told.add(pid)
                continue
            if status is None:
                continue
            told.add(pid)
            code = status.si_status if status.si_code == os.CLD_EXITED else -status.si_status
            if code:
                sys.stderr.write(f"swiftspec.engine.worker.torchrun: failed (exitcode: {code}) local_rank: {rank} "
                                 f"(pid: {pid}) of a forked worker\n")


def _named_children() -> dict[int, int]:
    """This process's forked workers that have named themselves (WORKER_NAME + rank): pid -> rank."""
    me = os.getpid()
    return {p.pid: int(p.name[len(WORKER_NAME):]) for p in processes()
            if p.ppid == me and p.name.startswith(WORKER_NAME) and p.name[len(WORKER_NAME):].isdigit()}


def main(argv: list[str] | None = None) -> None:
    if engine := os.environ.get(ENV_ENGINE_PID):
        threading.Thread(target=_follow_engine, args=(int(engine),), daemon=True, name="follow-engine").start()
    os.environ[ENV_LAUNCHER_PID] = str(os.getpid())
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    try:
        _launch(argv)
    finally:
        if engine and os.getppid() != int(engine):  # the workers ended on their own after the Engine died
            _remove_run_dir()
    # Every worker has ended well: skip the interpreter's teardown of torch, which the Engine would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
