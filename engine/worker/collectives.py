"""The collectives between ranks outside a round (start-up, profiling, each request's header), one named
record each with its typed pack and unpack. Each travels as one fixed-size int64 or float64 tensor: gloo
needs the size known to the receiver, and nothing is pickled between ranks. A round's messages have
their own home (engine/spec/messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

HOST_BYTES = 48  # of a host name, NUL-padded


def broadcast_values(values: list | None, size: int, dtype: torch.dtype, group=None, src: int = 0) -> list:
    """``values`` (``size`` of them) as rank ``src`` gives them, on every rank of ``group``; the other
    ranks pass None, and so may ``src``, for zeros."""
    t = torch.zeros(size, dtype=dtype) if values is None else torch.tensor(values, dtype=dtype)
    if t.numel() != size:
        raise ValueError(f"a collective of {size} values was given {t.numel()}")
    dist.broadcast(t, src=src, group=group)
    return t.tolist()


def gather_values(values: list, dtype: torch.dtype) -> list[list]:
    """Every rank's ``values`` (the same length on each), in rank order, on every rank."""
    mine = torch.tensor(values, dtype=dtype)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Command(IntEnum):
    SHUTDOWN = 0
    GENERATE = 1


@dataclass(frozen=True)
class RequestHeader:
    """Rank 0 -> every rank, before each request: what follows (the prompt's ids, then its SamplingParams
    as JSON bytes), or the end of the worker group."""

    command: Command
    prompt_len: int = 0
    params_len: int = 0

    @classmethod
    def broadcast(cls, mine: RequestHeader | None) -> RequestHeader:
        values = None if mine is None else [mine.command, mine.prompt_len, mine.params_len]
        command, prompt_len, params_len = broadcast_values(values, 3, torch.int64)
        return cls(Command(command), prompt_len, params_len)


@dataclass(frozen=True)
class RankReport:
    """What each rank tells every other at start: its process, its share of the cores, its device."""

    pid: int
    threads: int
    cuda_index: int  # -1: the CPU
    host: str

    def pack(self) -> list[int]:
        host = self.host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        return [self.pid, self.threads, self.cuda_index, *host]

    @classmethod
    def unpack(cls, v: list[int]) -> RankReport:
        return cls(v[0], v[1], v[2], bytes(v[3:]).rstrip(b"\0").decode(errors="replace"))

    @classmethod
    def gather(cls, mine: RankReport) -> list[RankReport]:
        return [cls.unpack(v) for v in gather_values(mine.pack(), torch.int64)]


@dataclass(frozen=True)
class StepTimes:
    """The profiled times: the target's verification of bs nodes and the draft's expansion (ms), and the
    target's cost of verifying 1..bs nodes, in steps (``clean``: measured on a quiet machine)."""

    t_verify: float
    t_expand: float
    cost: list[float]
    clean: bool = True

    def pack(self) -> list[float]:
        return [self.t_verify, self.t_expand, float(self.clean), *self.cost]

    @classmethod
    def unpack(cls, v: list[float]) -> StepTimes:
        return cls(v[0], v[1], v[3:], bool(v[2]))

    @classmethod
    def broadcast(cls, mine: StepTimes | None, bs: int) -> StepTimes | None:
        """Rank 0's cached times on every rank (None where rank 0 has none)."""
        v = broadcast_values(None if mine is None else [1.0, *mine.pack()], 4 + bs, torch.float64)
        return cls.unpack(v[1:]) if v[0] else None

    @classmethod
    def gather(cls, mine: StepTimes) -> list[StepTimes]:
        return [cls.unpack(v) for v in gather_values(mine.pack(), torch.float64)]


@dataclass(frozen=True)
class KernelThreads:
    """The CPU kernels' threads of a target for each mode."""

    ar: int
    sync: int
    async_: int

    def by_mode(self) -> dict[str, int]:
        return {"ar": self.ar, "sync": self.sync, "async": self.async_}

    @classmethod
    def from_modes(cls, by_mode: dict) -> KernelThreads:
        """From ``by_mode``'s dict (KeyError, TypeError or ValueError for another shape)."""
        return cls(int(by_mode["ar"]), int(by_mode["sync"]), int(by_mode["async"]))

    @classmethod
    def broadcast(cls, mine: KernelThreads | None) -> KernelThreads:
        values = None if mine is None else [mine.ar, mine.sync, mine.async_]
        return cls(*broadcast_values(values, 3, torch.int64))


@dataclass(frozen=True)
class KernelThreadsPlan:
    """Rank 0 -> every rank: whether the kernels' threads are chosen at all on this layout, and the
    cached choice where there is one."""

    applies: bool
    cached: KernelThreads | None = None

    @classmethod
    def broadcast(cls, mine: KernelThreadsPlan | None) -> KernelThreadsPlan:
        values = None
        if mine is not None:
            c = mine.cached
            values = [int(mine.applies), int(c is not None), *([c.ar, c.sync, c.async_] if c else [0, 0, 0])]
        applies, found, *threads = broadcast_values(values, 5, torch.int64)
        return cls(bool(applies), KernelThreads(*threads) if found else None)


def broadcast_choice(mine: int | None, group=None) -> int:
    """An index rank 0 of ``group`` chose, on every rank of it."""
    return broadcast_values(None if mine is None else [mine], 1, torch.int64, group)[0]
