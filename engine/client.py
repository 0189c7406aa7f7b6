"""The in-process Engine: starts the torchrun worker group, talks to its leader, streams answers.

    with Engine.start(EngineConfig()) as engine:
        for event in engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(mode="async")):
            print(event.text, end="")

The workers run in their own process groups (see ``launcher``); whatever happens to them, the Engine
raises EngineError with the tail of their output, and leaves no process behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import queue
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

from swiftspec import window
from swiftspec.config import BUILTIN_DRAFTS, EngineConfig, SamplingParams, StepEvent
from swiftspec.engine import launcher, protocol
from swiftspec.engine.answer import Answer
from swiftspec.engine.failures import WorkerOutput, worker_log_path
from swiftspec.engine.model_dir import LoadError
from swiftspec.engine.protocol import EngineInfo, Step

POLL_S = 0.25  # how often a blocked receive looks at the worker processes
CLOSE_GRACE_S = 1.0  # for a clean exit after "shutdown", before signals
# After Ctrl-C, the workers stop at their next step; not stopped after this long, they are taken for hung
# (only a long prefill of a big model on CPU takes longer, and Ctrl-C asked to stop anyway).
CANCEL_TIMEOUT_S = 10.0


class EngineError(RuntimeError):
    """The engine cannot do what was asked: its workers failed, or the request is impossible."""


def _models(config: EngineConfig, say: Callable[[str], None]) -> tuple[Path, str, Path | None, int]:
    """The target's directory, the draft as resolved, the draft model's directory (None: no model), and
    the positions both models hold."""
    from swiftspec.engine.model_dir import read_args, resolve_draft, resolve_model_dir

    target_dir = resolve_model_dir(config.target, say)
    draft = resolve_draft(config.draft, target_dir, say)
    draft_model = None if draft in BUILTIN_DRAFTS or _is_head_dir(Path(draft)) else Path(draft)
    limit = min(read_args(d).context_limit for d in [target_dir] + ([draft_model] if draft_model else []))
    return target_dir, draft, draft_model, limit


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the answer
    (``add_generation_prompt=True``), or, when the last message is the assistant's, ready to continue
    that answer where it stops (``/continue``). A tokenizer without a template gets plain "role: content"
    lines."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise EngineError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    continuing = messages[-1]["role"] == "assistant"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continuing,
                                             continue_final_message=continuing)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    text = text[:-1] if continuing else text + "assistant:"
    return list(tokenizer(text)["input_ids"])


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for engine in list(_live_engines):
        engine.close()


class Engine:
    """A running worker group. Use ``Engine.start``; one answer at a time; ``close()`` (or ``with``) ends
    every worker process.

    ``info`` (EngineInfo): model names, every rank's role / device / TP position / threads / pid, d and
    the profiled step times it came from, bs, w, context length, backend. ``tokenizer``: the target's.
    """

    def __init__(self, config: EngineConfig, proc: subprocess.Popen, conn: protocol.Connection, tail: WorkerOutput,
                 pgids: set[int], run_dir: Path, info: EngineInfo, tokenizer):
        self.config, self.info, self.tokenizer = config, info, tokenizer
        self._proc, self._conn, self._tail, self._pgids, self._run_dir = proc, conn, tail, pgids, run_dir
        self._ids = itertools.count(1)
        self._current: int | None = None  # the request whose events are still to be read
        self._closed = False
        self._dead: str | None = None
        _live_engines.add(self)
        threading.Thread(target=self._watch, daemon=True, name="engine-watch").start()

    # ------------------------------------------------------------------------------------ start-up
    @classmethod
    def start(cls, config: EngineConfig | None = None,
              progress: Callable[[str], None] | None = None) -> Engine:
        """Resolves (and converts, once) the models here, then starts the workers and waits until they
        are loaded and profiled. ``progress`` receives one line per loading stage.

        Raises ConfigError / LoadError / VocabMismatch for bad settings, model paths or a draft with
        another vocabulary (before any process starts), LoadError for a tokenizer that cannot be loaded
        (it loads while the workers start; they are ended), EngineError if the workers fail.
        """
        from swiftspec.engine.history_corpus import summarise, tokenizer_fingerprint
        from swiftspec.engine.model_dir import load_tokenizer

        config = (config or EngineConfig()).validate()
        say = progress or (lambda _text: None)
        say("resolving the models")
        target_dir, draft, draft_model, limit = _models(config, say)
        if config.max_seq_len > limit:  # the KV cache is allocated for max_seq_len: never beyond the model
            say(f"max-seq-len {config.max_seq_len} is beyond the models' {limit} positions: using {limit}")
            config = dataclasses.replace(config, max_seq_len=limit)
        tokenizer = None
        if draft_model is not None:  # a clear error now rather than garbage proposals later
            from swiftspec.engine.drafters import check_vocab_compatible

            tokenizer = load_tokenizer(target_dir, config.trust_remote_code)
            check_vocab_compatible(tokenizer, load_tokenizer(draft_model, config.trust_remote_code))
        corpus = _draft_corpus(config)
        if corpus is not None and config.draft_corpus != "auto":  # the shipped one is the embedded model's
            from swiftspec.engine.corpus import check_corpus

            tokenizer = tokenizer or load_tokenizer(target_dir, config.trust_remote_code)
            check_corpus(corpus, tokenizer)
        layout = launcher.plan_layout(config, launcher.visible_gpus(config.device))
        target_name = _target_name(config)
        worker = launcher.worker_args(config, layout, target_dir, draft, corpus) + [f"--target-name={target_name}"]
        run_dir = launcher.new_run_dir()
        try:
            cmd = launcher.build_command(worker, layout.world, run_dir)
            listener = socket.create_server(("127.0.0.1", 0))
            key = protocol.new_key()
            addr = f"127.0.0.1:{listener.getsockname()[1]}"
            where = "GPU" if layout.cuda else "CPU"
            say(f"starting {layout.world} worker processes on {where} ({layout.n_target} target, "
                f"{layout.n_draft} draft)")
            proc = launcher.spawn(cmd, {protocol.ENV_ADDR: addr, protocol.ENV_KEY: key}, run_dir)
        except BaseException:
            launcher.remove_run_dir(run_dir)
            raise
        if tokenizer is None:  # its imports (~2 s) run while the workers start, not before
            tokenizer = _in_background(load_tokenizer, target_dir, config.trust_remote_code)
        tail = WorkerOutput(proc.stdout, worker_log_path(), layout.n_target)
        pgids = {proc.pid}
        conn = None
        try:
            vocab = tokenizer_fingerprint(target_dir)  # while the workers import torch
            if config.drafts_from_store:
                say(summarise(Path(config.history_db), vocab).line())
            deadline = time.monotonic() + config.startup_timeout_s
            conn = _accept_worker(listener, key, proc, tail, deadline)
            info = dataclasses.replace(_wait_ready(conn, proc, tail, deadline, pgids, say), max_context=limit,
                                       vocab=vocab)
            if isinstance(tokenizer, Future):
                tokenizer = tokenizer.result()
        except BaseException as e:
            launcher.kill_groups(pgids)
            proc.wait()
            launcher.remove_run_dir(run_dir)
            if not isinstance(e, Exception):  # Ctrl-C: nothing failed, no log to keep
                tail.log_path.unlink(missing_ok=True)
            if conn is not None:
                conn.close()
            if isinstance(e, (EngineError, LoadError)) or not isinstance(e, Exception):
                raise
            raise EngineError(f"the engine failed to start: {e}") from e
        finally:
            listener.close()
        say(f"ready: d={info.d}, context {info.context_length} tokens")
        return cls(config, proc, conn, tail, pgids, run_dir, info, tokenizer)

    @staticmethod
    def context(config: EngineConfig, progress: Callable[[str], None] | None = None) -> window.Context:
        """The context a started engine would have, from the tokenizer and the model files alone: an
        over-long prompt is refused in a second instead of after the workers' start."""
        from swiftspec.engine.model_dir import load_tokenizer

        target_dir, _, _, limit = _models(config.validate(), progress or (lambda _text: None))
        tokenizer = load_tokenizer(target_dir, config.trust_remote_code)
        return window.Context(lambda messages: len(encode_chat(tokenizer, messages)), min(config.max_seq_len, limit),
                              limit)

    # ------------------------------------------------------------------------------------- answers
    def generate(self, messages: list[dict], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        """Streams the answer to ``messages`` (chat format) as StepEvents; the last has finished=True.
        When the last message is the assistant's, the answer continues it.

        An answer ends with finish reason "context" when the context, not max_new_tokens, cut it; keeping
        a long conversation within the context is the caller's part (``swiftspec.window``).

        Ctrl-C while waiting cancels the answer (the KeyboardInterrupt is re-raised once the workers have
        stopped), and abandoning the iterator cancels it too; either way the engine stays usable. Workers
        that do not stop within CANCEL_TIMEOUT_S of a Ctrl-C, or a second Ctrl-C, end the worker group.
        """
        params = (params or SamplingParams()).validate()
        if params.mode != "ar" and self.info.draft == "none":
            raise EngineError(f"mode {params.mode} needs a draft, but this engine was started without one "
                              "(--mode ar): start it again with another --mode")
        ids = encode_chat(self.tokenizer, messages)
        if len(ids) >= self.info.context_length:
            raise EngineError(f"the conversation is {len(ids)} tokens, but the context length is "
                              f"{self.info.context_length}: shorten it or raise --max-seq-len")
        return self._stream(ids, params)

    def count_tokens(self, messages: list[dict]) -> int:
        """The prompt length of ``messages`` as generate() would send them."""
        return len(encode_chat(self.tokenizer, messages))

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[StepEvent]:
        self._check_alive()
        self._finish_pending()
        rid = next(self._ids)
        self._current = rid
        self._send("generate", id=rid, token_ids=ids, params=params.to_dict())
        answer = Answer(self.tokenizer, params.stop, 0 if params.mode == "ar" else self.info.d)
        try:
            while True:
                if self._current != rid:
                    raise EngineError("this answer was abandoned for a newer generate() call")
                step = self._next_step(rid)
                event = answer.event(step)
                if step.finish is not None:
                    self._current = None
                elif event.finished:  # a stop string: the workers stop at their next step
                    self.cancel()
                yield event
                if event.finished:
                    return
        except KeyboardInterrupt:
            try:
                self._finish_pending(CANCEL_TIMEOUT_S)
            except (EngineError, KeyboardInterrupt):  # hung workers, or Ctrl-C again: end them now
                self._abandon("the answer was interrupted and the workers did not stop")
            raise
        finally:
            if self._current == rid and self._dead is None:  # abandoned: stop the workers' loop
                self.cancel()
                self._finish_pending()

    def cancel(self) -> None:
        """Stops the current answer at the next step (thread-safe; its last event says "cancelled")."""
        rid = self._current
        if rid is not None and self._dead is None:
            try:
                self._conn.send("cancel", id=rid)
            except OSError:
                pass

    def _finish_pending(self, timeout_s: float | None = None) -> None:
        """Reads away the rest of a cancelled or abandoned answer. Workers that have not stopped after
        ``timeout_s`` are taken for hung: the group is ended (EngineError)."""
        rid = self._current
        if rid is None:
            return
        self.cancel()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._next_step(rid, deadline).finish is None:
            pass
        self._current = None

    def _abandon(self, why: str) -> None:
        """Ends the group at once, without waiting for anything from it."""
        self._dead = self._dead or why
        self._current = None
        self._end_processes(grace_s=0.5)

    def _next_step(self, rid: int, deadline: float | None = None) -> Step:
        while True:
            try:
                msg = self._conn.recv(POLL_S)
            except (OSError, protocol.ProtocolError) as e:
                self._fail(f"lost the connection to the workers ({e})")
            if msg is None:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    self._fail("the workers did not stop after a cancel: they are hung and were ended")
                continue
            if msg["type"] == "step" and msg.get("id") == rid:
                return Step.from_dict(msg["step"])
            if msg["type"] == "error":
                if msg.get("fatal", True):
                    self._fail(f"a worker failed: {msg.get('message')}")
                if msg.get("id") == rid:
                    self._current = None
                    raise EngineError(str(msg.get("message")))

    def _send(self, type_: str, **fields) -> None:
        try:
            self._conn.send(type_, **fields)
        except OSError as e:
            self._fail(f"lost the connection to the workers ({e})")

    # --------------------------------------------------------------------------------- failures, end
    def _check_alive(self) -> None:
        if self._closed:
            raise EngineError("the engine is closed")
        if self._dead is not None or self._proc.poll() is not None:
            self._fail(self._dead or f"the workers exited (torchrun exit code {self._proc.returncode})")

    def _fail(self, why: str):
        """Ends the whole group and raises EngineError with the workers' last output."""
        self._dead = self._dead or why
        self._current = None
        message = self._tail.report(why, self._proc)
        self._end_processes(grace_s=1.0)
        raise EngineError(message)

    def _watch(self) -> None:
        """When torchrun exits (a worker died and it tore the rest down, or it was killed), makes sure no
        worker outlives it, even while no answer is being read."""
        code = self._proc.wait()
        if not self._closed and self._dead is None:
            self._dead = f"the workers exited (torchrun exit code {code})"
        launcher.kill_groups(self._pgids, grace_s=1.0)

    def _end_processes(self, grace_s: float) -> None:
        launcher.kill_groups(self._pgids, grace_s=grace_s)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._conn.close()
        launcher.remove_run_dir(self._run_dir)

    def close(self) -> None:
        """Asks the workers to exit, then ends every process of the group (SIGTERM, then SIGKILL)."""
        if self._closed:
            return
        self._closed = True
        _live_engines.discard(self)
        if self._dead is None:
            try:
                self._conn.send("shutdown")
                self._proc.wait(timeout=CLOSE_GRACE_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._end_processes(grace_s=1.0)
        if self._dead is None:  # nothing went wrong: the log is not worth keeping
            self._tail.thread.join(1.0)
            self._tail.log_path.unlink(missing_ok=True)

    @property
    def alive(self) -> bool:
        return not self._closed and self._dead is None and self._proc.poll() is None

    @property
    def pgids(self) -> set[int]:
        """The process groups of torchrun and of every worker (what close() ends)."""
        return set(self._pgids)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _target_name(config: EngineConfig) -> str:
    """What the title bar calls the target (the workers add the precision it runs at)."""
    from swiftspec.embedded import EMBEDDED_NAME

    return EMBEDDED_NAME if config.target is None else Path(config.target).name


def _draft_corpus(config: EngineConfig) -> Path | None:
    """The suffix drafter's corpus file: with "auto", the one shipped for the embedded default (none for
    other targets); "none"; or the user's file."""
    if config.draft != "suffix" or config.draft_corpus == "none":
        return None
    if config.draft_corpus != "auto":
        return Path(config.draft_corpus).expanduser()
    from swiftspec.engine.corpus import builtin_corpus

    shipped = builtin_corpus()
    return shipped if config.target is None and shipped.is_file() else None


def _is_head_dir(path: Path) -> bool:
    from swiftspec.engine.draft_head import is_head_dir  # imports torch: only for a draft path

    return is_head_dir(path)


def _in_background(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread at the lowest priority. Not a ThreadPoolExecutor: the interpreter
    joins those at exit, so a start that failed while transformers was still importing at nice 19 on a
    busy machine kept its process alive for a minute."""
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


def _accept_worker(listener: socket.socket, key: str, proc: subprocess.Popen, tail: WorkerOutput,
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
            protocol.server_handshake(conn, key)
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


def _wait_ready(conn: protocol.Connection, proc: subprocess.Popen, tail: WorkerOutput, deadline: float,
                pgids: set[int], say: Callable[[str], None]) -> EngineInfo:
    while True:
        try:
            msg = conn.recv(POLL_S)
        except (OSError, protocol.ProtocolError) as e:
            raise EngineError(tail.report(f"the workers dropped the connection during start-up ({e})", proc)) from None
        if msg is None:
            if proc.poll() is not None:
                raise EngineError(tail.report(
                    f"the workers exited during start-up (torchrun exit code {proc.returncode})", proc))
            if time.monotonic() > deadline:
                raise EngineError(tail.report("the workers were not ready before the start-up timeout", proc))
            continue
        kind = msg["type"]
        if kind == "hello":
            pgids.update(int(pid) for _, pid in msg["pids"])
        elif kind == "progress":
            say(str(msg.get("text")))
        elif kind == "error":
            raise EngineError(tail.report(f"the workers failed to start: {msg.get('message')}", proc))
        elif kind == "ready":
            return EngineInfo.from_dict(msg["info"])
