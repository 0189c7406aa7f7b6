"""Builds and runs the torchrun command line for the worker group, and ends it.

torchrun starts every worker in a session of its own (``start_new_session`` in torch.distributed.elastic),
so "the whole group" is the launcher's process group plus each worker's: the Engine learns the workers'
pids in the leader's ``hello`` and ends all of those groups, SIGTERM first, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swiftspec.config import ConfigError, EngineConfig


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


def _check_devices(devices: list[int], n_gpus: int, what: str) -> None:
    bad = [i for i in devices if not 0 <= i < n_gpus]
    if bad:
        raise ConfigError(f"{what} {bad} do not exist ({n_gpus} CUDA device(s) visible)")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{what} list a device twice: {devices}")


def plan_layout(config: EngineConfig, n_gpus: int) -> Layout:
    """Turns the config's device flags into a process layout.

    The suffix drafter needs no accelerator: its single process runs on the CPU and every GPU goes to the
    target. With a draft model and only ``--gpus N``, the draft group gets a quarter of the GPUs (at least
    one; with one GPU both groups share it).
    """
    suffix = config.draft == "suffix"
    use_cuda = config.device == "cuda" or (config.device == "auto" and n_gpus > 0)
    if config.device == "cuda" and n_gpus == 0:
        raise ConfigError("device cuda was asked for, but no CUDA device is visible")
    if use_cuda and config.draft == "int8":
        raise ConfigError("the int8 draft runs on the CPU only: on GPUs pass a draft model path "
                          "(or --device cpu)")
    if not use_cuda:
        if config.target_devices or config.draft_devices or config.gpus:
            raise ConfigError("GPU devices were given, but the engine runs on the CPU (no CUDA visible)")
        if suffix and config.draft_procs != 1:
            raise ConfigError("the suffix drafter runs in one process: draft-procs must be 1")
        return Layout(config.target_procs, config.draft_procs)
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
    if mine in ("cpu", "cuda") or devices.count(mine) == 1:
        return None
    return DRAFT_MEMORY_SHARE if rank >= n_target else 1.0 - DRAFT_MEMORY_SHARE


def worker_args(config: EngineConfig, layout: Layout, target_dir: Path, draft: str) -> list[str]:
    """The worker's own flags (see ``python -m swiftspec.engine.worker --help``)."""
    args = ["--target", str(target_dir), "--draft", draft, "--target-procs", str(layout.n_target),
            "--dtype", config.dtype, "--batch-invariant", config.batch_invariant,
            "--max-seq-len", str(config.max_seq_len),
            "--tree-bs", str(config.tree.bs), "--tree-w", str(config.tree.w)]
    if config.tree.d is not None:
        args += ["--tree-d", str(config.tree.d)]
    if config.threads:
        args += ["--threads", str(config.threads)]
    if config.trust_remote_code:
        args.append("--trust-remote-code")
    if not config.draft_history:
        args.append("--no-draft-history")
    if layout.cuda:
        args += ["--target-devices", ",".join(map(str, layout.target_devices or []))]
        args += ["--draft-devices", ",".join(map(str, layout.draft_devices or []))]
    return args


def build_command(worker: list[str], nproc_per_node: int, nnodes: int = 1, rdzv_endpoint: str | None = None,
                  rdzv_id: str = "swiftspec") -> list[str]:
    """torchrun through ``python -m torch.distributed.run`` (the same interpreter as the Engine).

    One node uses torchrun's standalone rendezvous (a free local port); several nodes use c10d
    rendezvous at ``rdzv_endpoint`` (which assigns the node ranks; the node that gets rank 0 holds the
    leader). No restarts: a failed worker must fail the Engine, not loop.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
           "--max-restarts=0", "--monitor-interval=0.1"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise ConfigError("multi-node needs a rendezvous endpoint (host:port)")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", "swiftspec.engine.worker", *worker]


def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Starts torchrun in a new session (its pid is its process group id), output piped together."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def alive_groups(pgids: Iterable[int]) -> list[int]:
    """The process groups among ``pgids`` that still have a live (non-zombie) member."""
    pgids = set(pgids)
    if not os.path.isdir("/proc/self"):
        return [g for g in pgids if _signal_group(g, 0)]
    alive = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split(" ", 3)[:3]
        if int(pgrp) in pgids and state not in "ZX":
            alive.add(int(pgrp))
    return sorted(alive)


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
