"""The Engine's start-up before it has a worker group to talk to: the models resolved (without torch), the
tokenizer loaded beside the workers' start, the leader's connection among impostors, and its wait for
the workers to be ready."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from swiftspec.engine.config import Activations, DraftCorpus, DraftKind, Dtype, EngineConfig
from swiftspec.engine.host import frames, protocol
from swiftspec.engine.host.failures import EngineError, WorkerOutput
from swiftspec.engine.host.frames import Failure, Hello, Progress, Ready
from swiftspec.engine.host.protocol import EngineInfo
from swiftspec.engine.model.embedded import EMBEDDED_ID, EMBEDDED_NAME
from swiftspec.engine.model.model_dir import LoadError, read_args, resolve_model_dir, stored_float_dtype
from swiftspec.engine.spec.draft_spec import DraftSpec

POLL_S = 0.25  # how often a blocked receive looks at the worker processes


def resolve_models(config: EngineConfig, say: Callable[[str], None]) -> tuple[Path, DraftSpec, int]:
    """The target's directory, the draft as resolved, and the positions both models hold. LoadError for bf16
    activations on a target that --dtype auto would not run as bfloat16 (the workers would refuse it)."""
    target_dir = resolve_model_dir(config.target, say)
    if config.activations is Activations.BF16 and config.dtype is Dtype.AUTO \
            and stored_float_dtype(target_dir) is not Dtype.BFLOAT16:
        raise LoadError(f"--activations bf16 multiplies bfloat16 weights, and --dtype auto runs {target_name(config)} "
                        "at the width it is stored at, not bfloat16 (use --dtype bfloat16)")
    draft = resolve_draft(config.draft, target_dir, say)
    limit = min(read_args(d).context_limit for d in [target_dir] + ([draft.model_dir] if draft.model_dir else []))
    return target_dir, draft, limit


def resolve_draft(draft: str, target_dir: Path, progress: Callable[[str], None] | None = None) -> DraftSpec:
    """A built-in draft as it is; a draft head checked against the target (hidden size, vocabulary,
    readable weights); otherwise a draft model, resolved like a target."""
    spec = DraftSpec.of(draft)
    if spec.kind is DraftKind.HEAD:
        from swiftspec.engine.spec.draft_head import load_head  # torch, and only for a draft head

        load_head(spec.path, read_args(target_dir), "meta")
    elif spec.kind is DraftKind.MODEL:
        return DraftSpec(DraftKind.MODEL, resolve_model_dir(draft, progress, role="draft"))
    return spec


def target_name(config: EngineConfig) -> str:
    """What the title bar calls the target (the workers add the precision it runs at)."""
    return EMBEDDED_NAME if config.target is None else Path(config.target).name


def model_id(config: EngineConfig) -> str:
    """The target's name as a server lists it (/v1/models): a file's stem or a directory's name."""
    return EMBEDDED_ID if config.target is None else Path(config.target).expanduser().resolve().stem


def draft_corpus(config: EngineConfig) -> Path | None:
    """The suffix drafter's corpus file: the user's, else with ``auto`` the one shipped for the embedded
    default (none for other targets)."""
    if config.builtin_draft is not DraftKind.SUFFIX or config.draft_corpus == DraftCorpus.NONE:
        return None
    if config.corpus_file is not None:
        return Path(config.corpus_file).expanduser()
    from swiftspec.engine.spec.corpus import builtin_corpus  # numpy: only for the suffix drafter's corpus

    shipped = builtin_corpus()
    return shipped if config.target is None and shipped.is_file() else None


def in_background(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread at the lowest priority. Not a ThreadPoolExecutor: the interpreter
    joins those at exit, so a start that failed while transformers was still importing at nice 19 on a
    busy machine would keep its process alive until that import ended."""
    future: Future = Future()

    def run() -> None:
        _lowest_priority()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="engine-tokenizer", daemon=True).start()
    return future


def _lowest_priority() -> None:
    """Linux threads have their own nice value: a thread at 19 leaves the cores to the workers' start."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


MAX_PENDING_HANDSHAKES = 32  # connections still proving themselves; more are closed at once
PEER_HANDSHAKE_S = 2.0  # a peer that has not proven it holds the key by then is dropped (the leader is at once)
SOCKET_NAME = "engine.sock"


def listen(run_dir: Path) -> tuple[socket.socket, str]:
    """The Engine's start-up listener and its address (ENV_ADDR) for a worker group on this machine: a
    Unix socket in the private (0700) run directory, so that no other user can even connect to it."""
    path = run_dir / SOCKET_NAME
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen()
    except BaseException:
        listener.close()
        raise
    return listener, protocol.UNIX + str(path)


def accept_worker(listener: socket.socket, key: str, proc: subprocess.Popen, tail: WorkerOutput,
                   deadline: float) -> protocol.Connection:
    """Waits for the leader to connect and authenticate. Every connection gets its handshake in a thread
    of its own, with its own deadline, so idle or slow peers cannot hold up the leader's; peers without
    the key are refused and the wait goes on."""
    listener.settimeout(POLL_S)
    winner: queue.Queue[protocol.Connection] = queue.Queue()
    pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
    done = threading.Event()

    def handshake(conn: protocol.Connection) -> None:
        try:
            protocol.server_handshake(conn, key, PEER_HANDSHAKE_S)
            if not done.is_set():
                winner.put(conn)
                return
        except (OSError, protocol.ProtocolError):
            pass
        finally:
            pending.release()
        conn.close()

    try:
        while True:
            try:
                return winner.get_nowait()
            except queue.Empty:
                pass
            if proc.poll() is not None:
                raise EngineError(tail.report(f"the workers exited during start-up (torchrun exit code "
                                              f"{proc.returncode}), before their leader had connected", proc))
            if time.monotonic() > deadline:
                raise EngineError(tail.report("no worker connected and completed the start-up handshake before "
                                              "the start-up timeout", proc))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = protocol.Connection(sock)
            if not pending.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=handshake, args=(conn,), daemon=True, name="engine-handshake").start()
    finally:
        done.set()
        while not winner.empty():  # a second peer that authenticated too: only the first is kept
            winner.get_nowait().close()


def wait_ready(conn: protocol.Connection, proc: subprocess.Popen, tail: WorkerOutput, deadline: float,
                pgids: set[int], say: Callable[[str], None]) -> EngineInfo:
    while True:
        try:
            frame = frames.recv(conn, POLL_S)
        except (OSError, protocol.ProtocolError) as e:
            raise EngineError(tail.report(f"the workers dropped the connection during start-up ({e})", proc)) from None
        match frame:
            case None:
                if proc.poll() is not None:
                    raise EngineError(tail.report(
                        f"the workers exited during start-up (torchrun exit code {proc.returncode})", proc))
                if time.monotonic() > deadline:
                    raise EngineError(tail.report("the workers were not ready before the start-up timeout", proc))
            case Hello(pids):
                pgids.update(pid for _, pid in pids)
            case Progress(text):
                say(text)
            case Failure(message):
                raise EngineError(tail.report(f"the workers failed to start: {message}", proc))
            case Ready(info):
                return info
            case _:
                raise EngineError(tail.report(f"the workers sent {frame!r} during start-up", proc))
