"""The Engine <-> leader socket protocol: versioned JSON frames, authenticated by HMAC.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON, an object with at least
``v`` (the protocol version) and ``type``. Nothing on the socket is ever unpickled.

Handshake (both sides prove they hold the random key, without sending it):
  engine -> worker  challenge {nonce}
  worker -> engine  auth {mac = HMAC(key, "worker:" + nonce), nonce2}
  engine -> worker  welcome {mac = HMAC(key, "engine:" + nonce2)}  or  refused {reason}

Then the messages of ``engine/host/frames.py``, one dataclass per kind: engine -> worker Generate, Cancel,
Shutdown; worker -> engine Hello (every worker's pid, sent before loading, so the Engine can end every
worker's session), Progress, Ready (EngineInfo), Stepped (consecutive Steps: token ids and the
target's figures; the Engine makes the text and a StepEvent each; the last step of a request has a finish
reason), Failure (fatal: the worker group exits after sending it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from swiftspec.engine.config import DraftKind, Role, SamplingParams
from swiftspec.engine.events import StepEvent

VERSION = 2
ENV_ADDR = "SWIFTSPEC_ENGINE_ADDR"  # the Engine's listening socket: unix:PATH on one machine, else host:port
UNIX = "unix:"
ENV_KEY = "SWIFTSPEC_ENGINE_KEY"  # hex of the random key
MAX_FRAME = 64 << 20
MAX_HANDSHAKE_FRAME = 4096  # nothing bigger is read from a peer that has not authenticated yet
HANDSHAKE_TIMEOUT_S = 10.0
_HEADER = struct.Struct(">I")


class ProtocolError(ConnectionError):
    """The peer broke the protocol (bad frame, wrong version, unexpected message)."""


class ConnectionClosed(ProtocolError):
    """The peer closed the socket."""


class AuthError(ProtocolError):
    """The peer does not hold the key, or the handshake did not finish in time."""


def new_key() -> str:
    return secrets.token_hex(32)


def _mac(key: str, role: str, nonce: str) -> str:
    return hmac.new(bytes.fromhex(key), f"{role}:{nonce}".encode(), hashlib.sha256).hexdigest()


class Connection:
    """A framed socket. recv() may be called with a timeout and keeps partial frames across calls;
    send() is thread-safe (the Engine's cancel() sends from another thread)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._send_lock = threading.Lock()
        self.max_frame = MAX_HANDSHAKE_FRAME

    def send(self, type_: str, **fields: Any) -> None:
        data = json.dumps({"v": VERSION, "type": type_, **fields}, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _frame(self) -> dict | None:
        if len(self._buf) < 4:
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        if n > self.max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds the limit of {self.max_frame}")
        if len(self._buf) < 4 + n:
            return None
        data = bytes(self._buf[4:4 + n])
        del self._buf[:4 + n]
        try:
            msg = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"malformed frame: {e}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError("malformed frame: not an object with a type")
        if msg.get("v") != VERSION:
            raise ProtocolError(f"protocol version {msg.get('v')!r} from the peer, {VERSION} here "
                                "(engine and workers come from different SwiftSpec installs)")
        return msg

    def recv(self, timeout: float | None = None) -> dict | None:
        """The next message; None if none arrived within ``timeout`` (None = wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (msg := self._frame()) is None:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(1 << 16)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise ConnectionClosed("the peer closed the connection")
            self._buf += chunk
        return msg

    def expect(self, type_: str, timeout: float | None = None) -> dict:
        msg = self.recv(timeout)
        if msg is None:
            raise AuthError(f"handshake timed out after {timeout:.0f} s waiting for {type_!r}")
        if msg["type"] != type_:
            raise ProtocolError(f"expected {type_!r}, got {msg['type']!r}")
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _str_field(msg: dict, name: str) -> str:
    v = msg.get(name)
    if not isinstance(v, str):
        raise ProtocolError(f"{msg['type']!r} lacks the string field {name!r}")
    return v


def server_handshake(conn: Connection, key: str, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Engine side: raises AuthError (after telling the peer) unless the peer proves it holds ``key``."""
    nonce = secrets.token_hex(16)
    conn.send("challenge", nonce=nonce)
    msg = conn.expect("auth", timeout)
    if not hmac.compare_digest(_str_field(msg, "mac"), _mac(key, "worker", nonce)):
        try:
            conn.send("refused", reason="wrong key")
        except OSError:
            pass
        raise AuthError("a peer connected with the wrong key and was refused")
    conn.send("welcome", mac=_mac(key, "engine", _str_field(msg, "nonce")))
    conn.max_frame = MAX_FRAME


def client_handshake(conn: Connection, key: str, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Worker side: answers the challenge and checks that the Engine holds the key too."""
    msg = conn.expect("challenge", timeout)
    nonce = secrets.token_hex(16)
    conn.send("auth", mac=_mac(key, "worker", _str_field(msg, "nonce")), nonce=nonce)
    reply = conn.recv(timeout)
    if reply is None:
        raise AuthError(f"handshake timed out after {timeout:.0f} s waiting for the engine's welcome")
    if reply["type"] == "refused":
        raise AuthError(f"the engine refused this worker: {reply.get('reason')}")
    if reply["type"] != "welcome" or not hmac.compare_digest(_str_field(reply, "mac"), _mac(key, "engine", nonce)):
        raise AuthError("the engine did not prove it holds the key")
    conn.max_frame = MAX_FRAME


def connect(addr: str, key: str, timeout: float = HANDSHAKE_TIMEOUT_S, retry_until: float | None = None) -> Connection:
    """The worker's side: connects to ``addr`` (ENV_ADDR) and completes the handshake. A connection the
    Engine dropped (it was busy with other peers' handshakes) is tried again, with backoff, until the
    monotonic time ``retry_until``; a refused key never is."""
    delay = 0.05
    while True:
        try:
            return _connect(addr, key, timeout)
        except (OSError, ConnectionClosed):
            if retry_until is None or time.monotonic() + delay > retry_until:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 1.0)


def _connect(addr: str, key: str, timeout: float) -> Connection:
    if addr.startswith(UNIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(addr.removeprefix(UNIX))
        except BaseException:
            sock.close()
            raise
    else:
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock)
    try:
        client_handshake(conn, key, timeout)
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass
class RankInfo:
    """One worker process: its role, device and share of the machine."""

    rank: int
    role: Role
    device: str  # "cpu", "cuda:0", ...
    tp_rank: int
    tp_world: int
    torch_threads: int  # torch's threads; a CPU target's kernels run on EngineInfo.kernel_threads instead
    host: str
    pid: int


@dataclass
class EngineInfo:
    """What the workers report once ready: models, device layout, tree policy and profiled timings."""

    target: str
    draft: str
    ranks: list[RankInfo]
    context_length: int
    backend: str
    bs: int
    w: int
    d: int  # draft expansions per round in use
    d_auto: bool  # d chosen from the profiled timings below (False: TreeParams.d)
    t_verify_ms: float  # profiled target forward over bs tree nodes
    t_expand_ms: float  # profiled draft expansion (w leaves)
    eos_token_ids: list[int] = field(default_factory=list)
    max_context: int = 0  # the models' own limit of positions (context_length is at most this); 0: unknown
    kernel_threads: dict[str, int] = field(default_factory=dict)  # the target's CPU kernel threads by mode
    vocab: str = ""  # the target tokenizer's fingerprint (history_corpus.tokenizer_fingerprint); "": unknown
    verify_cost: list[float] = field(default_factory=list)  # profiled verification of 1..bs nodes, in one-node
    # forwards, on sync's kernel threads ([]: not measured)

    @property
    def speculative(self) -> bool:
        """Whether a draft runs (``none``: ar only)."""
        return self.draft != DraftKind.NONE

    def kernel_threads_by_mode(self) -> str:
        """"ar 2, sync 2, async 1": the CPU kernels' threads as profiling chose them ("": no CPU kernels)."""
        return ", ".join(f"{mode} {n}" for mode, n in self.kernel_threads.items())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineInfo:
        return cls(**{**data, "ranks": [RankInfo(**r) for r in data["ranks"]]})


@runtime_checkable
class EngineAPI(Protocol):
    """What the TUI, scripted mode and bench use of an engine: the Engine, or a test's fake."""

    info: EngineInfo

    def generate(self, messages: list[dict], params: SamplingParams | None = None) -> Iterator[StepEvent]: ...

    def count_tokens(self, messages: list[dict]) -> int: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...


@runtime_checkable
class TakesIds(Protocol):
    """An engine that applies the chat template on this side (the Engine): a caller that has already
    tokenised a conversation (the chat, fitting it into the context) sends those ids. A served engine
    (RemoteEngine) is not one: its chat completions take messages, which the server templates."""

    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    def generate_ids(self, ids: list[int], params: SamplingParams | None = None) -> Iterator[StepEvent]: ...
