"""Builds and runs the torchrun command line for the worker group, and ends it.

torchrun starts every worker in a session of its own (``start_new_session`` in torch.distributed.elastic),
so "the whole group" is the launcher's process group plus each worker's: the Engine learns the workers'
pids in the leader's ``hello`` and ends all of those groups, SIGTERM first, then SIGKILL. Each worker dies
with torchrun (``lifeline``), also when torchrun is killed before the Engine has heard from them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple

from swiftspec.engine.config import ConfigError, Device, DraftKind, EngineConfig
from swiftspec.engine.host.lifeline import ENV_ENGINE_PID

LOCAL_RENDEZVOUS = "swiftspec-local"  # see swiftspec.engine.worker.torchrun
ENV_STORE = "SWIFTSPEC_STORE"  # the FileStore through which the workers of one node meet
RUN_DIR_PREFIX, RUN_LOCK = "swiftspec-run-", ".lock"
_run_locks: dict[Path, IO[bytes]] = {}  # run directory -> its lock, held while its Engine lives


@dataclass(frozen=True)
class Layout:
    """How many processes each group gets, and on which CUDA devices (None: the group runs on CPU)."""

    n_target: int
    n_draft: int
    target_devices: list[int] | None = None
    draft_devices: list[int] | None = None

    @property
    def world(self) -> int:
        return self.n_target + self.n_draft

    @property
    def cuda(self) -> bool:
        return self.target_devices is not None


GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, ROCm, WSL


def visible_gpus(device: str) -> int:
    """The CUDA devices the workers will see. torch (slow to import) is asked only where a GPU driver
    is installed: without one of its device nodes, no CUDA device can be visible."""
    if device == Device.CPU or (device == Device.AUTO and not any(map(os.path.exists, GPU_DRIVER_NODES))):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_devices(devices: list[int], n_gpus: int, what: str) -> None:
    bad = [i for i in devices if not 0 <= i < n_gpus]
    if bad:
        raise ConfigError(f"{what} {bad} do not exist ({n_gpus} CUDA device(s) visible)")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{what} list a device twice: {devices}")


def plan_layout(config: EngineConfig, n_gpus: int) -> Layout:
    """Turns the config's device flags into a process layout.

    The suffix drafter needs no accelerator: its single process runs on the CPU and every GPU goes to the
    target; without a draft (``none``) there is no draft group. With a draft model and only ``--gpus N``, the draft group gets a quarter of the GPUs (at least
    one; with one GPU both groups share it).
    """
    suffix = config.builtin_draft is DraftKind.SUFFIX
    use_cuda = config.device == Device.CUDA or (config.device == Device.AUTO and n_gpus > 0)
    if config.device == Device.CUDA and n_gpus == 0:
        raise ConfigError("device cuda was asked for, but no CUDA device is visible")
    if use_cuda and config.builtin_draft is DraftKind.INT8:
        raise ConfigError("the int8 draft runs on the CPU only: on GPUs pass a draft model path "
                          "(or --device cpu)")
    if not use_cuda:
        if config.target_devices or config.draft_devices or config.gpus:
            raise ConfigError("GPU devices were given, but the engine runs on the CPU (no CUDA visible)")
        if not config.speculative:
            return Layout(config.target_procs, 0)
        if suffix and config.draft_procs != 1:
            raise ConfigError("the suffix drafter runs in one process: draft-procs must be 1")
        return Layout(config.target_procs, config.draft_procs)
    if not config.speculative:
        target = list(config.target_devices or range(config.gpus or n_gpus))
        _check_devices(target, n_gpus, "target devices")
        return Layout(len(target), 0, target, [])
    if config.target_devices:
        target = list(config.target_devices)
        draft = [] if suffix else list(config.draft_devices or [])
        if not suffix and not draft:
            raise ConfigError("with --target-devices and a draft model, give --draft-devices too")
        _check_devices(target, n_gpus, "target devices")
        _check_devices(draft, n_gpus, "draft devices")
        if set(target) & set(draft):
            raise ConfigError(f"target devices {target} and draft devices {draft} overlap")
        return Layout(len(target), 1 if suffix else len(draft), target, draft)
    n = config.gpus or n_gpus
    if not 1 <= n <= n_gpus:
        raise ConfigError(f"--gpus {n}: only {n_gpus} CUDA device(s) visible")
    if suffix:
        return Layout(n, 1, list(range(n)), [])
    if n == 1:
        return Layout(1, 1, [0], [0])
    n_draft = max(1, n // 4)
    return Layout(n - n_draft, n_draft, list(range(n - n_draft)), list(range(n - n_draft, n)))


GLOO, GLOO_NCCL = "gloo", "cpu:gloo,cuda:nccl"
DRAFT_MEMORY_SHARE = 0.25  # of a GPU that the draft group shares with the target group


def rank_devices(layout: Layout) -> list[str]:
    """Each rank's device: "cpu", "cuda:N", or "cuda" for a GPU of its own that torchrun's LOCAL_RANK
    picks (``--device cuda`` without device lists, as on several nodes)."""
    if layout.target_devices is None:
        return ["cpu"] * layout.world
    draft = [f"cuda:{i}" for i in layout.draft_devices or []] or ["cpu"] * layout.n_draft
    return [f"cuda:{i}" for i in layout.target_devices] + draft


@dataclass(frozen=True)
class GroupSpec:
    ranks: tuple[int, ...]
    backend: str


def process_groups(devices: list[str], n_target: int) -> dict[str, GroupSpec]:
    """The communicators, given each rank's device (rank_devices).

    ``world`` carries control only (requests, barriers, the int64 subtree/verdict messages between the
    group leaders, all CPU tensors) and is gloo alone, so no NCCL communicator ever spans the two groups:
    they may share a GPU (one-GPU layouts), and NCCL refuses two ranks on one device. ``target`` and
    ``draft`` are the TP groups: gloo for the leader's CPU messages to its followers, plus NCCL for the
    all-reduces when the group spans several GPUs, which must then be distinct.
    """
    def tp(ranks: range) -> GroupSpec:
        devs = [devices[r] for r in ranks]
        gpus = [d for d in devs if d.startswith("cuda:")]  # CPU ranks share the host, as they should
        if len(set(gpus)) != len(gpus):
            raise ConfigError(f"ranks {list(ranks)} of one tensor-parallel group share a GPU: {devs}")
        gpu = len(devs) > 1 and all(d.startswith("cuda") for d in devs)
        return GroupSpec(tuple(ranks), GLOO_NCCL if gpu else GLOO)

    world = len(devices)
    return {"world": GroupSpec(tuple(range(world)), GLOO), "target": tp(range(n_target)),
            "draft": tp(range(n_target, world))}


def memory_fraction(devices: list[str], rank: int, n_target: int) -> float | None:
    """The share of its GPU a rank may take when the two groups share that GPU (None: not shared)."""
    mine = devices[rank]
    if mine in (Device.CPU, Device.CUDA) or devices.count(mine) == 1:
        return None
    return DRAFT_MEMORY_SHARE if rank >= n_target else 1.0 - DRAFT_MEMORY_SHARE


def build_command(worker: list[str], nproc_per_node: int, run_dir: Path | None = None, nnodes: int = 1,
                  rdzv_endpoint: str | None = None, rdzv_id: str = "swiftspec", cuda: bool = False) -> list[str]:
    """torchrun, run by the same interpreter as the Engine. No restarts: a failed worker must fail the
    Engine, not loop.

    One node runs ``swiftspec.engine.worker.torchrun`` (torchrun with the ``swiftspec-local`` rendezvous: nothing
    listens on the network) and keeps torchrun's logs in ``run_dir``; on the CPU it forks the workers from
    itself (torchrun's ``--start-method=fork``), on GPUs it starts them as programs, never forking a process
    that may have touched CUDA. Several nodes use torchrun's c10d rendezvous at ``rdzv_endpoint`` (which
    assigns the node ranks; the node that gets rank 0 holds the leader).
    """
    common = [f"--nproc-per-node={nproc_per_node}", "--max-restarts=0", "--monitor-interval=0.1"]
    if nnodes == 1:
        if run_dir is None:
            raise ConfigError("one node needs the run directory for torchrun's logs")
        cmd = [sys.executable, "-m", "swiftspec.engine.worker.torchrun", *common, f"--rdzv-backend={LOCAL_RENDEZVOUS}",
               f"--rdzv-id={rdzv_id}", f"--log-dir={run_dir / 'logs'}", f"--start-method={'spawn' if cuda else 'fork'}"]
    else:
        if not rdzv_endpoint:
            raise ConfigError("multi-node needs a rendezvous endpoint (host:port)")
        cmd = [sys.executable, "-m", "torch.distributed.run", *common, f"--nnodes={nnodes}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", "swiftspec.engine.worker", *worker]


def new_run_dir() -> Path:
    """A private (0700) directory for one worker group: the workers' FileStore and torchrun's logs. The
    Engine holds its lock until ``remove_run_dir``; directories whose lock is free belonged to an Engine
    that was killed, and are removed here."""
    for old in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            with (old / RUN_LOCK).open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # held by a live Engine, not ours, or already gone
            continue
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    lock = (run_dir / RUN_LOCK).open("wb")
    fcntl.flock(lock, fcntl.LOCK_EX)
    _run_locks[run_dir] = lock
    return run_dir


def remove_run_dir(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    if lock := _run_locks.pop(run_dir, None):
        lock.close()


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def spawn(cmd: list[str], env: dict[str, str], run_dir: Path) -> subprocess.Popen:
    """Starts torchrun in a new session (its pid is its process group id), output piped together.

    The workers of this node meet through a FileStore in ``run_dir`` and talk over the loopback interface
    (gloo, and NCCL's bootstrap). OpenMP threads sleep instead of spinning while they wait: spinning
    threads slow decoding many times over as soon as another process wants a core (benchmarks/contention.py;
    the README gives figures).
    No process of the group imports from the directory it was started in (PYTHONSAFEPATH: ``python -m``
    would put it first on sys.path, where a folder named like a library, such as a checkout's kernels/,
    would hide that library).
    """
    lo = _loopback_interface()
    full_env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONSAFEPATH": "1", "GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo,
                ENV_STORE: str(run_dir / "store"), ENV_ENGINE_PID: str(os.getpid()), **env}
    return subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def alive_groups(pgids: Iterable[int]) -> list[int]:
    """The process groups among ``pgids`` that still have a live (non-zombie) member."""
    pgids = set(pgids)
    if not os.path.isdir("/proc/self"):
        return [g for g in pgids if _signal_group(g, 0)]
    return sorted({p.pgrp for p in processes() if p.pgrp in pgids and p.state not in "ZX"})


class ProcessStat(NamedTuple):
    """A process as /proc/PID/stat describes it."""

    pid: int
    name: str  # its comm: at most 15 bytes
    state: str
    ppid: int
    pgrp: int


def processes() -> Iterator[ProcessStat]:
    """Every process /proc shows (Linux), read one by one: one that ends meanwhile is left out."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid, pgrp = stat[stat.rindex(")") + 2:].split(" ", 3)[:3]
        yield ProcessStat(int(entry.name), stat[stat.index("(") + 1:stat.rindex(")")], state, int(ppid), int(pgrp))


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_groups(pgids: Iterable[int], grace_s: float = 2.0) -> None:
    """SIGTERM every process group, then SIGKILL whatever is left after ``grace_s``."""
    pgids = set(pgids)
    for pgid in alive_groups(pgids):
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := alive_groups(pgids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pgid in left:
        _signal_group(pgid, signal.SIGKILL)
