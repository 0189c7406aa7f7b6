"""The messages between ranks (engine/spec/messages.py) and the TP follower loops that read them: every kind
round-trips (also over the leaders' socket, which takes only its peer), and what does not fit or is not
known is a clear error, never a silently wrong step."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

import pytest
import torch

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.spec.loop import Request
from swiftspec.engine.spec.messages import (
    Follow,
    FollowerStep,
    Kind,
    Plain,
    Start,
    Subtree,
    Verdict,
    Wire,
    WireError,
)
from swiftspec.engine.worker.serve import follow_draft, follow_target
from swiftspec.engine.worker.wire import SocketLink, connect_leaders

BS = 4


@pytest.mark.parametrize("msg", [Start(7), Start(7, reuse=3, hidden_size=64), Subtree([5, 6, 7], [-1, 0, 0], 2, 1500),
                                 Plain(1), Plain(BS), Verdict([9]), Verdict([1, 2, 3, 4], last=True),
                                 Verdict([3], verify_us=5400)])
def test_leader_messages_round_trip(msg):
    wire = Wire(BS)
    t = wire.pack(msg)
    assert t.shape == (wire.size,) and t.dtype == torch.int64
    assert wire.unpack(t) == msg
    data = wire.encode(msg)
    assert data == t.numpy().astype("<i8").tobytes()  # the socket's bytes are gloo's tensor, word for word
    assert wire.decode(bytearray(data)) == msg


@pytest.mark.parametrize("step", [FollowerStep(Follow.END), FollowerStep(Follow.EXPAND),
                                  FollowerStep(Follow.VERIFY, [1, 2], [-1, 0]), FollowerStep(Follow.REROOT, [3, 4])])
def test_follower_steps_round_trip(step):
    wire = Wire(BS)
    got = wire.unpack_step(wire.pack_step(step))
    assert (got.op, list(got.tokens)) == (step.op, list(step.tokens))
    if step.parents:
        assert list(got.parents) == list(step.parents)


def test_what_does_not_fit_is_refused_by_the_sender():
    wire = Wire(BS)
    with pytest.raises(WireError, match="do not fit"):
        wire.pack(Subtree(list(range(BS + 1)), list(range(-1, BS))))
    with pytest.raises(WireError, match="parents"):
        wire.pack(Subtree([1, 2], [-1]))
    with pytest.raises(WireError, match="do not fit"):
        wire.pack_step(FollowerStep(Follow.REROOT, list(range(BS + 1))))
    for steps in (0, BS + 1):  # their verdict could not hold them
        with pytest.raises(WireError, match="plain steps"):
            wire.pack(Plain(steps))


def _raw(kind: int, n: int) -> torch.Tensor:
    t = Wire(BS).buffer()
    t[0], t[1] = kind, n
    return t


@pytest.mark.parametrize("read", ["unpack", "decode"])
def test_unknown_or_over_long_leader_messages_are_errors(read):
    wire = Wire(BS)
    unpack = wire.unpack if read == "unpack" else lambda t: wire.decode(t.numpy().astype("<i8").tobytes())
    with pytest.raises(WireError, match="unknown leader message"):
        unpack(_raw(99, 1))
    with pytest.raises(WireError, match="more than bs"):
        unpack(_raw(Kind.SUBTREE, BS + 1))
    with pytest.raises(WireError, match="unknown leader message"):
        unpack(_raw(Kind.START, 2))  # a start names one root
    with pytest.raises(WireError, match="unknown leader message"):
        unpack(_raw(Kind.PLAIN, 0))  # no steps


class _Target:
    """Stands in for TargetState: records the model calls a follower makes."""

    device = torch.device("cpu")
    vocab = None

    def __init__(self):
        self.calls = []

    def prefill(self, prompt, sampler):
        self.calls.append(("prefill", list(prompt)))

    def decode_step(self, token, sampler):
        self.calls.append(("decode", token))

    def verify(self, tokens, parents, sampler):
        self.calls.append(("verify", list(tokens), list(parents)))


class _Draft:
    def __init__(self):
        self.calls = []

    def prefill(self, prompt, grammar=None, draft_forced=True):
        self.calls.append(("prefill",))

    def start(self, root):
        self.calls.append(("start", root))

    def expand(self):
        self.calls.append(("expand",))

    def reroot(self, path):
        self.calls.append(("reroot", list(path)))

    def advance(self, path):
        self.calls.append(("advance", list(path)))


def _feed(*tensors: torch.Tensor):
    """A follower's ``next_step`` that decodes these tensors, as the group's broadcast delivers them."""
    wire, it = Wire(BS), iter(tensors)
    return lambda: wire.unpack_step(next(it))


REQ = Request(-1, [1, 2, 3], SamplingParams(mode="sync"))


def test_followers_mirror_their_leaders_steps():
    wire = Wire(BS)
    target = _Target()
    follow_target(target, REQ, _feed(wire.pack_step(FollowerStep(Follow.VERIFY, [4, 5], [-1, 0])),
                                     wire.pack_step(FollowerStep(Follow.DECODE, [6])),
                                     wire.pack_step(FollowerStep(Follow.END))))
    assert target.calls == [("prefill", [1, 2, 3]), ("verify", [4, 5], [-1, 0]), ("decode", 6)]
    draft = _Draft()
    follow_draft(draft, REQ, _feed(*(wire.pack_step(s) for s in [
        FollowerStep(Follow.START, [4]), FollowerStep(Follow.EXPAND), FollowerStep(Follow.REROOT, [4, 5]),
        FollowerStep(Follow.ADVANCE, [6, 7, 8]), FollowerStep(Follow.END)])))
    assert draft.calls == [("prefill",), ("start", 4), ("expand",), ("reroot", [4, 5]), ("advance", [6, 7, 8])]


@pytest.mark.parametrize("follow, state", [(follow_target, _Target), (follow_draft, _Draft)])
def test_each_follower_refuses_an_unknown_op(follow, state):
    with pytest.raises(WireError, match="unknown follower step: op 99"):
        follow(state(), REQ, _feed(_raw(99, 0)))


@pytest.mark.parametrize("follow, state, op", [(follow_target, _Target, Follow.VERIFY),
                                               (follow_draft, _Draft, Follow.REROOT)])
def test_each_follower_refuses_an_over_long_subtree(follow, state, op):
    with pytest.raises(WireError, match=f"claims {BS + 1} tokens, more than bs = {BS}"):
        follow(state(), REQ, _feed(_raw(op, BS + 1)))


@pytest.mark.parametrize("follow, state, step", [
    (follow_target, _Target, FollowerStep(Follow.EXPAND)),  # a draft's step on a target rank
    (follow_target, _Target, FollowerStep(Follow.DECODE, [1, 2])),  # ar decodes one token
    (follow_draft, _Draft, FollowerStep(Follow.VERIFY, [1], [-1])),
    (follow_draft, _Draft, FollowerStep(Follow.START, [])),
    (follow_target, _Target, FollowerStep(Follow.ADVANCE, [1])),
])
def test_each_follower_refuses_a_step_that_is_not_its_own(follow, state, step):
    with pytest.raises(WireError, match="follower cannot take"):
        follow(state(), REQ, _feed(Wire(BS).pack_step(step)))


def test_the_socket_link_carries_every_message_and_features():
    a, b = socket.socketpair()
    wire = Wire(BS)
    left, right = SocketLink(wire, a), SocketLink(wire, b)
    for msg in (Start(7, 2, 16), Subtree([5, 6, 7], [-1, 0, 0], 2, 1500), Plain(3), Verdict([1, 2], last=True)):
        left.send(msg)
        assert right.post_recv()() == msg
    hidden = torch.randn(3, 16)
    right.send_features(hidden)
    assert torch.equal(left.recv_features(3, 16), hidden.half().float())
    a.close()
    with pytest.raises(WireError, match="closed"):
        right.recv()


def test_the_leaders_socket_takes_only_the_peer_with_the_secret(monkeypatch):
    """The target leader's listener closes a connection that does not present the secret (another local
    process found the port) and goes on waiting for its peer; the hello travels over gloo, faked here."""
    from datetime import timedelta

    from swiftspec.engine.worker import wire as wire_mod

    hello: queue.Queue = queue.Queue()
    monkeypatch.setattr(wire_mod.dist, "send", lambda t, dst: hello.put(t.clone()))
    monkeypatch.setattr(wire_mod.dist, "recv", lambda t, src: t.copy_(hello.get()))
    intruded = threading.Event()

    def intruder_then_peer():
        sent = hello.get()  # the intruder learns the port (and puts the hello back for the peer)
        hello.put(sent)
        port = int(sent[0])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"x" * wire_mod.SECRET_BYTES)
            assert s.recv(1) == b""  # closed on it
        intruded.set()
        peer.append(connect_leaders(Wire(BS), 1, 0, timedelta(seconds=30)))

    peer: list = []
    thread = threading.Thread(target=intruder_then_peer)
    thread.start()
    leader = connect_leaders(Wire(BS), 0, 1, timedelta(seconds=30))
    thread.join()
    assert intruded.is_set()
    leader.send(Verdict([4]))
    assert peer[0].recv() == Verdict([4])


@pytest.mark.parametrize("unix", [False, True])
def test_an_idle_intruder_does_not_keep_the_peer_out_and_one_machine_uses_a_unix_socket(monkeypatch, tmp_path, unix):
    """An intruder that connects and says nothing is dropped after SECRET_TIMEOUT_S, not after the whole
    start-up timeout; with a path, the listener is a Unix socket (0600, in a 0700 directory)."""
    from datetime import timedelta

    from swiftspec.engine.worker import wire as wire_mod

    monkeypatch.setattr(wire_mod, "SECRET_TIMEOUT_S", 0.3)
    hello: queue.Queue = queue.Queue()
    monkeypatch.setattr(wire_mod.dist, "send", lambda t, dst: hello.put(t.clone()))
    monkeypatch.setattr(wire_mod.dist, "recv", lambda t, src: t.copy_(hello.get()))
    path = str(tmp_path / wire_mod.LEADERS_SOCKET) if unix else None
    peer: list = []

    def idle_intruder_then_peer():
        sent = hello.get()
        hello.put(sent)
        if unix:
            assert int(sent[0]) == 0 and os.stat(path).st_mode & 0o777 == 0o600
            intruder = socket.socket(socket.AF_UNIX)
            intruder.connect(path)
        else:
            intruder = socket.create_connection(("127.0.0.1", int(sent[0])))
        with intruder:  # held open, silent, while the peer comes
            peer.append(connect_leaders(Wire(BS), 1, 0, timedelta(seconds=30), path))

    thread = threading.Thread(target=idle_intruder_then_peer)
    thread.start()
    leader = connect_leaders(Wire(BS), 0, 1, timedelta(seconds=30), path)  # 30 s: the intruder would hold it
    thread.join(10)
    leader.send(Verdict([7]))
    assert peer[0].recv() == Verdict([7])


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.0065, 0.03])
def test_a_receive_due_at_a_time_gets_the_message_whenever_it_comes(monkeypatch, delay_s):
    """Due in 5 ms, polled from 1 ms before it for at most 1 ms past it: a message already there, one that
    ends the sleep, one that comes while polling and one that comes after the polling gave up (the read
    then blocks) are each read whole, in order."""
    monkeypatch.setattr(SocketLink, "POLL_LEAD_S", 1e-3)
    monkeypatch.setattr(SocketLink, "POLL_MAX_S", 1e-3)
    a, b = socket.socketpair()
    wire = Wire(BS)
    left, right = SocketLink(wire, a), SocketLink(wire, b)
    due = time.perf_counter() + 5e-3
    sender = threading.Timer(delay_s, lambda: (left.send(Verdict([3, 4])), left.send(Verdict([5], last=True))))
    sender.start()
    assert right.post_recv(due)() == Verdict([3, 4])
    assert right.recv(due) == Verdict([5], last=True)
    sender.join()
