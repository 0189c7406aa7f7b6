"""The Engine <-> target leader messages after the handshake, one dataclass per kind, and the one table
that encodes them into ``protocol.Connection``'s JSON frames and decodes them back with their fields
checked. Both ends dispatch on the dataclass (``match``), never on a frame's ``type`` string.

    engine -> leader   Generate, Cancel, Shutdown
    leader -> engine   Hello (before loading: every worker's pid), Progress, Ready, Stepped, Failure
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from swiftspec.engine.config import ConfigError, SamplingParams
from swiftspec.engine.events import Step
from swiftspec.engine.host.protocol import Connection, EngineInfo, ProtocolError


class BadRequest(ProtocolError):
    """A ``generate`` whose fields are wrong; ``id`` is the request's, when it had an integer one."""

    def __init__(self, message: str, id: int | None):
        super().__init__(message)
        self.id = id


@dataclass(frozen=True)
class Generate:
    """Answer ``token_ids`` (the chat, encoded) with ``params``; steps come back as Stepped ``id``."""

    id: int
    token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Cancel:
    """Stop answering ``id``."""

    id: int


@dataclass(frozen=True)
class Shutdown:
    """End the workers: the Engine is closing."""


@dataclass(frozen=True)
class Hello:
    """The leader's first frame, before the models load."""

    pids: list[list[int]]  # [rank, pid] of every worker: the Engine ends their sessions on close


@dataclass(frozen=True)
class Progress:
    """A line of start-up progress ("loading target ...")."""

    text: str


@dataclass(frozen=True)
class Ready:
    """Loaded and profiled: what the workers hold and measured."""

    info: EngineInfo


@dataclass(frozen=True)
class Stepped:
    """Consecutive decoding steps of answer ``id``, in order: the leader sends an answer's first and last
    step at once and the others at most every STREAM_INTERVAL_S (engine/worker/leader_io.py)."""

    id: int
    steps: list[Step]


@dataclass(frozen=True)
class Failure:
    """An error, said to the Engine before the workers go (``fatal``) or for one request."""

    message: str
    id: int | None = None  # the request that failed; None: the workers as a whole
    fatal: bool = True  # the worker group exits after sending it


Frame = Generate | Cancel | Shutdown | Hello | Progress | Ready | Stepped | Failure


def _id(msg: dict) -> int:
    v = msg.get("id")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"{msg['type']!r} without an integer id")
    return v


def _generate(msg: dict) -> Generate:
    rid = msg.get("id")
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    if rid is None:
        raise BadRequest("request without an integer id", None)
    ids = msg.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise BadRequest("token_ids must be a non-empty list of integers", rid)
    try:
        return Generate(rid, ids, SamplingParams.from_dict(msg.get("params") or {}))
    except (ConfigError, TypeError) as e:
        raise BadRequest(str(e), rid) from None


def _stepped(msg: dict) -> Stepped:
    steps = msg["steps"]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise ProtocolError("malformed 'steps' message: not a list of steps")
    return Stepped(_id(msg), [Step.from_dict(s) for s in steps])


def _failure(msg: dict) -> Failure:
    rid = msg.get("id")
    return Failure(str(msg.get("message")), rid if isinstance(rid, int) else None, bool(msg.get("fatal", True)))


# type on the wire -> (dataclass, its fields as JSON, the dataclass from a checked frame)
_TABLE: dict[str, tuple[type, Any, Any]] = {
    "generate": (Generate, lambda f: {"id": f.id, "token_ids": f.token_ids, "params": f.params.to_dict()}, _generate),
    "cancel": (Cancel, lambda f: {"id": f.id}, lambda m: Cancel(_id(m))),
    "shutdown": (Shutdown, lambda f: {}, lambda m: Shutdown()),
    "hello": (Hello, lambda f: {"pids": f.pids}, lambda m: Hello([[int(r), int(p)] for r, p in m["pids"]])),
    "progress": (Progress, lambda f: {"text": f.text}, lambda m: Progress(str(m.get("text")))),
    "ready": (Ready, lambda f: {"info": f.info.to_dict()}, lambda m: Ready(EngineInfo.from_dict(m["info"]))),
    "steps": (Stepped, lambda f: {"id": f.id, "steps": [s.to_dict() for s in f.steps]}, _stepped),
    "error": (Failure, dataclasses.asdict, _failure),
}
_TYPES = {cls: name for name, (cls, _, _) in _TABLE.items()}


def send(conn: Connection, frame: Frame) -> None:
    name = _TYPES[type(frame)]
    conn.send(name, **_TABLE[name][1](frame))


def decode(msg: dict) -> Frame:
    """The dataclass of a received frame; ProtocolError for an unknown type or missing fields (BadRequest
    for a generate that names its id)."""
    entry = _TABLE.get(msg["type"])
    if entry is None:
        raise ProtocolError(f"unexpected message {msg['type']!r}")
    try:
        return entry[2](msg)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"malformed {msg['type']!r} message: {e}") from None


def recv(conn: Connection, timeout: float | None = None) -> Frame | None:
    """The next frame, decoded; None if none arrived within ``timeout``."""
    msg = conn.recv(timeout)
    return None if msg is None else decode(msg)
