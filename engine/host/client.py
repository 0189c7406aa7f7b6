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
import select
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.events import Step, StepEvent
from swiftspec.engine.host import frames, launcher, protocol
from swiftspec.engine.host.answer import Answer
from swiftspec.engine.host.encode import encode_chat, encode_prompt
from swiftspec.engine.host.failures import EngineError, WorkerOutput, exit_of, worker_log_path
from swiftspec.engine.host.frames import Cancel, Failure, Generate, Shutdown, Stepped
from swiftspec.engine.host.protocol import EngineInfo
from swiftspec.engine.host.startup import (
    POLL_S,
    accept_worker,
    draft_corpus,
    in_background,
    listen,
    resolve_models,
    target_name,
    wait_ready,
)
from swiftspec.engine.host.worker_spec import WorkerSpec
from swiftspec.engine.model.model_dir import LoadError, load_tokenizer
from swiftspec.engine.spec import grammar
from swiftspec.engine.spec.corpus import check_corpus
from swiftspec.engine.spec.history_corpus import summarise, tokenizer_fingerprint

CLOSE_GRACE_S = 1.0  # for a clean exit after "shutdown", before signals
EXITS_SETTLE_S = 0.2  # after the first worker exits, for the watch to see any that exit with it
# After Ctrl-C or an abandoned answer, the workers stop at their next step; not stopped after this long,
# they are taken for hung (only a long prefill of a big model on CPU takes longer, and the caller asked to
# stop anyway).
CANCEL_TIMEOUT_S = 10.0


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
        self._when_dead: list[Callable[[], None]] = []
        _live_engines.add(self)
        tail.watched = threading.Event()
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
        config = (config or EngineConfig()).validate()
        say = progress or (lambda _text: None)
        say("resolving the models")
        target_dir, draft, limit = resolve_models(config, say)
        if config.max_seq_len > limit:  # the KV cache is allocated for max_seq_len: never beyond the model
            say(f"max-seq-len {config.max_seq_len} is beyond the models' {limit} positions: using {limit}")
            config = dataclasses.replace(config, max_seq_len=limit)
        tokenizer, vocab_size = None, None
        if draft.model_dir is not None:  # a clear error now rather than garbage proposals later, checked once
            from swiftspec.engine.spec.drafters import check_vocab_compatible  # torch: only for a draft model

            tokenizer = load_tokenizer(target_dir, config.trust_remote_code)
            vocab_size = check_vocab_compatible(tokenizer, load_tokenizer(draft.model_dir, config.trust_remote_code))
        corpus = draft_corpus(config)
        if corpus is not None and config.corpus_file is not None:  # the shipped one is the embedded model's
            tokenizer = tokenizer or load_tokenizer(target_dir, config.trust_remote_code)
            check_corpus(corpus, tokenizer)
        layout = launcher.plan_layout(config, launcher.visible_gpus(config.device))
        spec = WorkerSpec(config, layout, str(target_dir), str(draft), str(corpus) if corpus else None, target_name(config),
                          vocab_size)
        run_dir = launcher.new_run_dir()
        try:
            cmd = launcher.build_command([f"--spec={spec.write(run_dir)}"], layout.world, run_dir, cuda=layout.cuda)
            listener, addr = listen(run_dir)
            key = protocol.new_key()
            where = "GPU" if layout.cuda else "CPU"
            say(f"starting {layout.world} worker processes on {where} ({layout.n_target} target, "
                f"{layout.n_draft} draft)")
            proc = launcher.spawn(cmd, {protocol.ENV_ADDR: addr, protocol.ENV_KEY: key}, run_dir)
        except BaseException:
            launcher.remove_run_dir(run_dir)
            raise
        if tokenizer is None:  # its imports (seconds) run while the workers start, not before
            tokenizer = in_background(load_tokenizer, target_dir, config.trust_remote_code)
        tail = WorkerOutput(proc.stdout, worker_log_path(), layout.n_target)
        pgids = {proc.pid}
        conn = None
        try:
            vocab = tokenizer_fingerprint(target_dir)  # while the workers import torch
            if config.drafts_from_store:
                say(summarise(Path(config.history_db), vocab).line())
            deadline = time.monotonic() + config.startup_timeout_s
            conn = accept_worker(listener, key, proc, tail, deadline)
            info = dataclasses.replace(wait_ready(conn, proc, tail, deadline, pgids, say), max_context=limit,
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
    def context(config: EngineConfig, progress: Callable[[str], None] | None = None
                ) -> tuple[Callable[[list[dict]], int], int, int]:
        """The context a started engine would have, from the tokenizer and the model files alone (how
        messages count, the context's length, the models' limit): an over-long prompt is refused in a
        second instead of after the workers' start."""
        target_dir, _, limit = resolve_models(config.validate(), progress or (lambda _text: None))
        tokenizer = load_tokenizer(target_dir, config.trust_remote_code)
        return lambda messages: len(encode_chat(tokenizer, messages)), min(config.max_seq_len, limit), limit

    # ------------------------------------------------------------------------------------- answers
    def generate(self, messages: list[dict], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        """Streams the answer to ``messages`` (chat format) as StepEvents; the last has finished=True.
        When the last message is the assistant's, the answer continues it.

        An answer ends with finish reason "context" when the context, not max_new_tokens, cut it; keeping
        a long conversation within the context is the caller's part (``swiftspec.window``).

        Ctrl-C while waiting cancels the answer (the KeyboardInterrupt is re-raised once the workers have
        stopped), and abandoning the iterator (``close()``, or dropping it) cancels it too; either way the
        engine stays usable. Workers that do not stop within CANCEL_TIMEOUT_S of a Ctrl-C or of the
        abandon, or a second Ctrl-C, end the worker group: abandoning returns within CANCEL_TIMEOUT_S and
        the few seconds that ending the group takes, even with a hung worker.
        """
        return self.generate_ids(self.encode_chat(messages), params)

    def complete(self, prompt: str, params: SamplingParams | None = None) -> Iterator[StepEvent]:
        """Streams the continuation of a raw prompt (no chat template: the OpenAI completions API), as
        generate() streams an answer."""
        return self.generate_ids(encode_prompt(self.tokenizer, prompt), params)

    def generate_ids(self, ids: list[int], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        """Streams what follows the token ids ``ids``, as generate() does; the prompt's KV shared with the
        previous answer's is reused."""
        params = (params or SamplingParams()).validate()
        if params.grammar is not None:
            grammar.check(params.grammar)  # the library's refusal, here rather than from the workers
        if params.mode != "ar" and not self.info.speculative:
            raise EngineError(f"mode {params.mode} needs a draft, but this engine was started without one "
                              "(--mode ar): start it again with another --mode")
        if len(ids) >= self.info.context_length:
            raise EngineError(f"the conversation is {len(ids)} tokens, but the context length is "
                              f"{self.info.context_length}: shorten it or raise --max-seq-len")
        return self._stream(ids, params)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The token ids generate() sends for ``messages``: the chat keeps those it fitted into the context
        and sends them with generate_ids, so that a turn is templated once."""
        return encode_chat(self.tokenizer, messages)

    def count_tokens(self, messages: list[dict]) -> int:
        """The prompt length of ``messages`` as generate() would send them."""
        return len(self.encode_chat(messages))

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[StepEvent]:
        self._check_alive()
        self._finish_pending()
        rid = next(self._ids)
        self._current = rid
        self._send(Generate(rid, ids, params))
        answer = Answer(self.tokenizer, params.stop, 0 if params.mode == "ar" else self.info.d)
        try:
            while True:
                if self._current != rid:
                    raise EngineError("this answer was abandoned for a newer generate() call")
                steps = self._next_steps(rid)
                for event in answer.events(steps):
                    if event.finished:
                        if steps[-1].finish is not None:
                            self._current = None
                        else:  # a stop string: the workers stop at their next step
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
                try:
                    self._finish_pending(CANCEL_TIMEOUT_S)
                except EngineError:  # hung: the group is ended, and the next call says why
                    pass

    def cancel(self) -> None:
        """Stops the current answer at the next step (thread-safe; its last event says "cancelled")."""
        rid = self._current
        if rid is not None and self._dead is None:
            try:
                frames.send(self._conn, Cancel(rid))
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
        while self._next_steps(rid, deadline)[-1].finish is None:
            pass
        self._current = None

    def _abandon(self, why: str) -> None:
        """Ends the group at once, without waiting for anything from it."""
        self._dead = self._dead or why
        self._current = None
        self._end_processes(grace_s=0.5)

    def _next_steps(self, rid: int, deadline: float | None = None) -> list[Step]:
        while True:
            try:
                frame = frames.recv(self._conn, POLL_S)
            except (OSError, protocol.ProtocolError) as e:
                self._fail(f"lost the connection to the workers ({e})")
            match frame:
                case None:
                    self._check_alive()
                    if deadline is not None and time.monotonic() > deadline:
                        self._fail("the workers did not stop after a cancel: they are hung and were ended")
                case Stepped(sid, steps) if sid == rid:
                    return steps
                case Failure(message, fatal=True):
                    self._fail(f"a worker failed: {message}")
                case Failure(message, fid) if fid == rid:
                    self._current = None
                    raise EngineError(message)

    def _send(self, frame: frames.Frame) -> None:
        try:
            frames.send(self._conn, frame)
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

    def when_dead(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` (from another thread) as soon as the group is found dead, not closed."""
        self._when_dead.append(callback)
        if self._dead is not None and not self._closed:
            callback()

    def _watch(self) -> None:
        """Notices at once when torchrun or any worker exits, from the processes themselves (a pidfd each,
        no polling; torchrun takes seconds to tear the rest down), even while no answer is being read: the
        group is then dead (``alive`` False, the ``when_dead`` callbacks called). Once torchrun has exited,
        makes sure no worker outlives it."""
        exited = _first_exits(self._pgids)
        if exited and not self._closed:
            here = socket.gethostname()
            ranks = {r.pid: r.rank for r in self.info.ranks if r.host == here}
            # also where the answer's reader noticed the failure first (a lost connection): its report,
            # which waits for torchrun, names the worker from this
            self._tail.saw_exits([(ranks[pid], code) for pid, code in exited.items() if pid in ranks])
        self._tail.watched.set()
        if exited and not self._closed and self._dead is None:
            self._dead = f"a worker process (pid {next(iter(exited))}) exited"
            for callback in self._when_dead:
                callback()
        code = self._proc.wait()
        if not self._closed and self._dead is None:
            self._dead = f"the workers exited (torchrun exit code {code})"
            for callback in self._when_dead:
                callback()
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
                frames.send(self._conn, Shutdown())
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


def _first_exits(pids: set[int]) -> dict[int, int | None] | None:
    """Waits until one of ``pids`` (torchrun and every worker) exits; the pids that have exited by the
    time this thread runs (on a busy machine, a killed worker's peers may have followed it already), each
    with how it ended (``exit_of``). None where the kernel has no pidfds (then only torchrun's own exit
    tells)."""
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                return {pid: None}
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        exits = {fds[fd]: exit_of(fds[fd], fd) for fd, _ in poller.poll()}
        # a killed worker's sockets close before its exit is signalled, so on a busy machine its peer, failing
        # on the lost connection, can be seen to exit first: a moment for the rest
        time.sleep(EXITS_SETTLE_S)
        return exits | {fds[fd]: exit_of(fds[fd], fd) for fd, _ in poller.poll(0) if fds[fd] not in exits}
    except (AttributeError, OSError):  # no os.pidfd_open (not Linux 5.3+)
        return None
    finally:
        for fd in fds:
            os.close(fd)
