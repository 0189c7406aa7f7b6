"""The messages between ranks as fixed-size int64 tensors (gloo needs the size known to the receiver),
and the torch.distributed Link between the two group leaders."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from swiftspec.engine.loop import Message, Op


class Wire:
    """int64[4 + 2 bs]: kind, n, a, b, tokens[bs], parents[bs]."""

    def __init__(self, bs: int):
        self.bs = bs
        self.size = 4 + 2 * bs

    def pack(self, msg: Message) -> Tensor:
        kind, tokens, parents, a, b = msg
        vals = [kind, len(tokens), a, b, *tokens, *[0] * (self.bs - len(tokens)), *parents,
                *[0] * (self.bs - len(parents))]
        return torch.tensor(vals, dtype=torch.int64)

    def buffer(self) -> Tensor:
        return torch.zeros(self.size, dtype=torch.int64)

    def unpack(self, t: Tensor) -> Message:
        v = t.tolist()
        n = v[1]
        return Message(Op(v[0]), v[4:4 + n], v[4 + self.bs:4 + self.bs + n], v[2], v[3])


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

    def send(self, msg: Message) -> None:
        dist.send(self.wire.pack(msg), dst=self.peer)

    def recv(self) -> Message:
        dist.recv(self.buf, src=self.peer)
        return self.wire.unpack(self.buf)

    def post_recv(self) -> Callable[[], Message]:
        work = dist.irecv(self.buf, src=self.peer)

        def wait() -> Message:
            work.wait()
            return self.wire.unpack(self.buf)

        return wait

    def send_features(self, hidden: Tensor) -> None:
        dist.send(features_to_wire(hidden), dst=self.peer)

    def recv_features(self, rows: int, dim: int) -> Tensor:
        t = torch.empty(rows, dim, dtype=torch.int16)
        dist.recv(t, src=self.peer)
        return features_from_wire(t)
