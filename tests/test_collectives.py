"""The records ranks exchange outside a round: typed, packed into fixed-size tensors and back unchanged,
over a real gloo group of two processes."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swiftspec.engine.worker.collectives import (
    Command,
    KernelThreads,
    KernelThreadsPlan,
    RankReport,
    RequestHeader,
    StepTimes,
    any_rank,
    broadcast_choice,
    broadcast_values,
)


def test_records_pack_and_unpack_unchanged():
    report = RankReport(4321, 3, -1, "a-rather-long-host-name.example")
    assert RankReport.unpack(report.pack()) == report and len(report.pack()) == 3 + 48
    times = StepTimes(12.5, 0.75, [1.0, 1.5, 2.25], clean=False)
    assert StepTimes.unpack(times.pack()) == times
    assert KernelThreads.from_modes(KernelThreads(2, 1, 2).by_mode()) == KernelThreads(2, 1, 2)
    with pytest.raises(KeyError):
        KernelThreads.from_modes({"ar": 2, "sync": 1})


def _exchange(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        lead = rank == 0
        got = {
            "header": RequestHeader.broadcast(RequestHeader(Command.GENERATE, 5, 7) if lead else None),
            "prompt": broadcast_values([1, 2, 3, 4, 5] if lead else None, 5, torch.int64),
            "ranks": RankReport.gather(RankReport(100 + rank, 1 + rank, -1, f"host{rank}")),
            "cached": StepTimes.broadcast(StepTimes(9.0, 0.5, [1.0, 2.0]) if lead else None, 2),
            "none cached": StepTimes.broadcast(None, 2),
            "gathered": StepTimes.gather(StepTimes(1.0 + rank, 2.0, [1.0, 1.5], clean=rank == 0)),
            "plan": KernelThreadsPlan.broadcast(KernelThreadsPlan(True, KernelThreads(2, 1, 2)) if lead else None),
            "no plan": KernelThreadsPlan.broadcast(KernelThreadsPlan(False) if lead else None),
            "choice": broadcast_choice(3 if lead else None),
            "any": any_rank(rank == 1),
        }
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_agree_on_every_record():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_exchange, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results[0] == results[1]
    got = results[1]
    assert got["header"] == RequestHeader(Command.GENERATE, 5, 7) and got["prompt"] == [1, 2, 3, 4, 5]
    assert got["ranks"] == [RankReport(100, 1, -1, "host0"), RankReport(101, 2, -1, "host1")]
    assert got["cached"] == StepTimes(9.0, 0.5, [1.0, 2.0]) and got["none cached"] is None
    assert [t.clean for t in got["gathered"]] == [True, False] and got["gathered"][1].t_verify == 2.0
    assert got["plan"] == KernelThreadsPlan(True, KernelThreads(2, 1, 2)) and got["no plan"] == KernelThreadsPlan(False)
    assert got["choice"] == 3 and got["any"] is True
