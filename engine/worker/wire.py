"""The Link between the two group leaders: messages packed by ``engine/spec/messages.py``'s Wire, hidden
states as 16-bit tensors. Over a TCP connection on loopback when both leaders share a host
(``SocketLink``), else over torch.distributed (``DistLink``, gloo).

Why not gloo for both: a gloo point-to-point message costs CPU on each side and a chain of thread
wake-ups through its I/O thread, twice a round, where a socket's round trip costs a small fraction of it
(docs/ARCHITECTURE.md, Messages, gives figures).
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from swiftspec.engine.spec.messages import LeaderMessage, Wire, WireError

SECRET_BYTES = 32
LEADERS_SOCKET = "leaders.sock"  # the leaders' Unix socket, in the Engine's run directory
SECRET_TIMEOUT_S = 2.0  # a connection to the TCP listener that has not presented the secret by then is closed


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

    def recv(self, due: float | None = None) -> LeaderMessage:
        dist.recv(self.buf, src=self.peer)
        return self.wire.unpack(self.buf)

    def post_recv(self, due: float | None = None) -> Callable[[], LeaderMessage]:
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


class SocketLink:
    """A leader's Link to the other group's leader over a connected TCP socket (``connect_leaders``).

    A receive with a ``due`` time polls the socket from POLL_LEAD_S before it until the message is in (at
    most POLL_MAX_S past it, or past the call, whichever is later), sleeping only before: a process that
    slept through a verification wakes up late (most of all on a VM's idle vCPU; docs/ARCHITECTURE.md
    gives figures), twice a round on the critical path."""

    POLL_LEAD_S = 300e-6
    POLL_MAX_S = 1e-3

    def __init__(self, wire: Wire, sock: socket.socket):
        self.wire, self.sock = wire, sock
        self.buf = bytearray(wire.layout.size)
        self.readable = select.poll()
        self.readable.register(sock, select.POLLIN)

    def _await(self, due: float) -> None:
        """Returns once the socket is readable, or once polling is over (the read then blocks)."""
        sleep_s = due - self.POLL_LEAD_S - time.perf_counter()
        if sleep_s > 0 and self.readable.poll(sleep_s * 1e3):
            return
        end = max(due, time.perf_counter()) + self.POLL_MAX_S
        while not self.readable.poll(0) and time.perf_counter() < end:
            pass

    def _read_into(self, buf: bytearray | Tensor) -> None:
        view = memoryview(buf if isinstance(buf, bytearray) else buf.numpy()).cast("B")
        while view:
            got = self.sock.recv_into(view)
            if not got:
                raise WireError("the other leader closed the link")
            view = view[got:]

    def send(self, msg: LeaderMessage) -> None:
        self.sock.sendall(self.wire.encode(msg))

    def recv(self, due: float | None = None) -> LeaderMessage:
        if due is not None:
            self._await(due)
        self._read_into(self.buf)
        return self.wire.decode(self.buf)

    def post_recv(self, due: float | None = None) -> Callable[[], LeaderMessage]:
        return lambda: self.recv(due)  # the kernel buffers the message until it is read

    def send_features(self, hidden: Tensor) -> None:
        self.sock.sendall(features_to_wire(hidden).numpy())

    def recv_features(self, rows: int, dim: int) -> Tensor:
        t = torch.empty(rows, dim, dtype=torch.int16)
        self._read_into(t)
        return features_from_wire(t)


def connect_leaders(wire: Wire, rank: int, peer: int, timeout: timedelta, path: str | None = None) -> SocketLink:
    """The two leaders' socket: the lower rank (the target leader) listens and sends a random secret
    (and the port) to its peer over gloo; the peer connects and presents the secret, and any other
    connection is closed. The listener closes once its peer is in. With ``path`` (a Unix socket in the
    Engine's private run directory) no other user can even connect; otherwise it listens on a free
    loopback port, and a peer gets SECRET_TIMEOUT_S to present the secret, so idle ones cannot hold it up."""
    if rank < peer:
        with _listener(path) as server:
            secret = secrets.token_bytes(SECRET_BYTES)
            port = 0 if path else server.getsockname()[1]
            dist.send(torch.tensor([port, *secret], dtype=torch.int64), dst=peer)
            deadline = time.monotonic() + timeout.total_seconds()
            while True:
                server.settimeout(max(deadline - time.monotonic(), 1e-3))  # beyond: TimeoutError
                sock, _ = server.accept()
                sock.settimeout(SECRET_TIMEOUT_S)
                try:
                    offered = sock.recv(SECRET_BYTES, socket.MSG_WAITALL)
                except OSError:
                    offered = b""
                if hmac.compare_digest(offered, secret):
                    break
                sock.close()
    else:
        hello = torch.zeros(1 + SECRET_BYTES, dtype=torch.int64)
        dist.recv(hello, src=peer)
        port, *secret = hello.tolist()
        if path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout.total_seconds())
            sock.connect(path)
        else:
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout.total_seconds())
        sock.sendall(bytes(secret))
    sock.settimeout(None)
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return SocketLink(wire, sock)


def _listener(path: str | None) -> socket.socket:
    if path is None:
        return socket.create_server(("127.0.0.1", 0))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        os.chmod(path, 0o600)
        server.listen()
    except BaseException:
        server.close()
        raise
    return server
