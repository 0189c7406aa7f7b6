"""The torch.distributed Link between the two group leaders: messages packed by ``engine/messages.py``'s
Wire, hidden states as 16-bit tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from swiftspec.engine.messages import LeaderMessage, Wire


def features_to_wire(hidden: Tensor) -> Tensor:
    """Hidden states as 16 bits a value: float16 bit-cast to int16, which gloo carries whatever its
    support for floating dtypes."""
    return hidden.detach().to("cpu", torch.float16).contiguous().view(torch.int16)


def features_from_wire(t: Tensor) -> Tensor:
    return t.view(torch.float16).float()


class DistLink:
    """A leader's Link to the other group's leader over the world group (gloo, CPU tensors)."""

    def __init__(self, wire: Wire, peer: int):
        self.wire, self.peer = wire, peer
        self.buf = wire.buffer()

    def send(self, msg: LeaderMessage) -> None:
        dist.send(self.wire.pack(msg), dst=self.peer)

    def recv(self) -> LeaderMessage:
        dist.recv(self.buf, src=self.peer)
        return self.wire.unpack(self.buf)

    def post_recv(self) -> Callable[[], LeaderMessage]:
        work = dist.irecv(self.buf, src=self.peer)

        def wait() -> LeaderMessage:
            work.wait()
            return self.wire.unpack(self.buf)

        return wait

    def send_features(self, hidden: Tensor) -> None:
        dist.send(features_to_wire(hidden), dst=self.peer)

    def recv_features(self, rows: int, dim: int) -> Tensor:
        t = torch.empty(rows, dim, dtype=torch.int16)
        dist.recv(t, src=self.peer)
        return features_from_wire(t)
