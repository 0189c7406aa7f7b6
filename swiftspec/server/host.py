"""One engine, one answer at a time: the requests wait in a bounded FIFO queue, a thread of its own feeds
them to the engine and hands each answer's events to the request's event loop. A request that goes away
(a client that hangs up, queued or mid-answer) is cancelled at once; a dead worker group fails the answer
it was giving (503) and is started again, a bounded number of times in a row. ``drain`` is the server's
graceful stop: the waiting requests get a 503, the running answer may finish within a grace period and
is cut with an error otherwise. What the workers report goes to the server log under the request's id;
a client's error never shows a path on the server's disk."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import StepEvent
from swiftspec.engine.host.encode import encode_chat, encode_prompt
from swiftspec.engine.host.failures import EngineError
from swiftspec.engine.host.protocol import EngineAPI, EngineInfo
from swiftspec.server.api import APIError, Request, unavailable
from swiftspec.server.metrics import Metrics

log = logging.getLogger("swiftspec.serve")



class State(StrEnum):
    """Where the host stands (``/health`` says it): answering, starting the engine again, draining for a
    stop, given up after RESTARTS failed starts, or closed."""

    OK = "ok"
    RESTARTING = "restarting"
    DRAINING = "draining"
    FAILED = "failed"
    CLOSED = "closed"


RESTARTS = 3  # starts in a row that may fail before the server gives up (every request then gets a 503)
Item = StepEvent | APIError


@dataclass
class Job:
    """A request in the queue or being answered: its prompt's token ids and params, and where its events
    go (an asyncio queue of the request's loop, filled from the engine thread)."""

    request: Request
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    request_id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    cut: APIError | None = None  # why the server ended the answer (its last event, instead of "cancelled")
    requeued: bool = False  # it waits (once) for a restart: the workers died before its answer began

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def put(self, item: Item | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going down and nobody reads this
            pass


class EngineHost:
    """Owns the engine (and starts it again when its workers die); ``submit`` queues a Job, ``cancel``
    drops or stops it, ``close`` ends the engine. Thread-safe; the answers run on the ``engine`` thread."""

    def __init__(self, engine: EngineAPI, start: Callable[[], EngineAPI], max_queue: int, metrics: Metrics):
        self.engine, self._start, self.max_queue, self.metrics = engine, start, max_queue, metrics
        self.state = State.OK
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._current: Job | None = None
        metrics.queue_length.set_function(lambda: len(self._queue))
        metrics.engine_up.set_function(lambda: 1.0 if self.state == State.OK else 0.0)
        metrics.describe(lambda: self.engine.info)
        engine.when_dead(self._wake)
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine")
        self._thread.start()

    @property
    def info(self) -> EngineInfo:
        """The running engine's (a restarted one has new ranks)."""
        return self.engine.info

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------------------------- requests
    def prompt_ids(self, request: Request) -> list[int]:
        """The prompt's token ids; an over-long prompt is a 400, told before it waits in the queue."""
        try:
            ids = (encode_chat(self.tokenizer, request.messages) if request.kind == "chat"
                   else encode_prompt(self.tokenizer, request.prompt))
        except EngineError as e:
            raise APIError(400, str(e)) from None
        if len(ids) >= self.info.context_length:
            raise APIError(400, f"the prompt is {len(ids)} tokens, but the context length is "
                                f"{self.info.context_length}", param="messages" if request.kind == "chat" else "prompt",
                           code="context_length_exceeded")
        if request.params.mode != "ar" and not self.info.speculative:
            raise APIError(400, f"mode {request.params.mode} needs a draft; this server runs ar only",
                           param="swiftspec.mode")
        return ids

    def count_tokens(self, messages: list[dict]) -> int:
        try:
            return self.engine.count_tokens(messages)
        except EngineError as e:
            raise APIError(400, str(e), param="messages") from None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.state in (State.FAILED, State.CLOSED, State.DRAINING):
                raise unavailable("the engine is down: it failed to start again" if self.state == State.FAILED
                                  else "the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise APIError(429, f"the queue is full ({self.max_queue} requests wait): try again shortly",
                               "rate_limit_error", None, "queue_full", retry_after=1)
            self._queue.append(job)
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """Drops a queued job, or stops the answer at the engine's next step (the engine thread then
        moves on to the next job)."""
        with self._lock:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                return
            current = self._current is job
        if current:
            self.engine.cancel()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def waiting(self) -> int:
        return len(self._queue)

    # ---------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and self.state != State.CLOSED:
                    if self.state == State.OK and not self.engine.alive:
                        break
                    self._lock.wait()
                if self.state == State.CLOSED:
                    return
                job = self._queue.popleft() if self._queue else None
                self._current = job
            try:
                if not self.engine.alive:
                    self._restart("the workers died while idle")
                if job is not None:
                    self._answer(job)
            finally:
                with self._lock:
                    self._current = None
                    self._lock.notify_all()

    def _answer(self, job: Job) -> None:
        if self.state not in (State.OK, State.DRAINING):
            job.put(unavailable("the engine could not be started again"))
            return
        t0 = time.perf_counter()
        self.metrics.queue_seconds.observe(t0 - job.arrived)
        self.metrics.prompt_tokens.inc(len(job.ids))
        first, begun = True, False
        try:
            for event in self.engine.generate_ids(job.ids, job.params):
                begun = True
                if job.cancelled:
                    self.engine.cancel()
                if first and event.token_ids:
                    self.metrics.time_to_first_token.observe(time.perf_counter() - job.arrived)
                    first = False
                self.metrics.step(event)
                job.put(job.cut if event.finish_reason == "cancelled" and job.cut is not None else event)
        except EngineError as e:
            if self.engine.alive:
                job.put(APIError(400, str(e)))
                return
            log.error("request %s: the workers failed during its answer: %s", job.request_id, e)
            with self._lock:  # died before it began (while idle): it waits for the restart, once
                requeue = not begun and not job.requeued and self.state == State.OK
                if requeue:
                    job.requeued = True
                    self._queue.appendleft(job)
            if not requeue:
                job.put(unavailable("a worker failed during this answer; the engine is being started again"))
            self._restart("a worker failed")
        except Exception:  # a bug of ours: the request still gets an answer, and the server lives
            log.exception("request %s: its answer failed", job.request_id)
            job.put(APIError(500, f"internal error (request id {job.request_id} in the server log)", "server_error"))

    def _restart(self, why: str) -> None:
        with self._lock:
            if self.state in (State.CLOSED, State.DRAINING):  # a server going down starts no engine
                return
            self.state = State.RESTARTING
        self.metrics.restarts.inc()
        self.engine.close()
        for attempt in range(1, RESTARTS + 1):
            log.warning("%s: starting the engine again (attempt %d of %d)", why, attempt, RESTARTS)
            try:
                engine = self._start()
            except Exception as e:
                log.error("the engine failed to start: %s", e)
                time.sleep(min(5.0, 0.5 * 2 ** attempt))
                continue
            with self._lock:
                if self.state in (State.CLOSED, State.DRAINING):
                    engine.close()
                    return
                self.engine, self.state = engine, State.OK
            engine.when_dead(self._wake)
            log.warning("the engine is up again")
            return
        with self._lock:
            self.state = State.FAILED
            failed, self._queue = list(self._queue), collections.deque()
        log.error("the engine failed to start %d times in a row: every request gets a 503 now", RESTARTS)
        for job in failed:
            job.put(unavailable("the engine could not be started again"))

    def _wake(self) -> None:
        """The engine died (``Engine.when_dead``): the idle engine thread starts it again at once."""
        with self._lock:
            self._lock.notify_all()

    def drain(self, grace_s: float) -> None:
        """Refuses new requests and fails the waiting ones (503); gives the running answer ``grace_s`` to
        finish, then cuts it (its stream ends with an error event)."""
        with self._lock:
            if self.state in (State.OK, State.RESTARTING):
                self.state = State.DRAINING
            waiting, self._queue = list(self._queue), collections.deque()
        for job in waiting:
            job.put(unavailable("the server is shutting down"))
        with self._lock:
            if self._lock.wait_for(lambda: self._current is None, grace_s):
                return
            job = self._current
        self.cut(job, unavailable(f"the server is shutting down: the answer was cut after {grace_s:g} s"))

    def cut(self, job: Job | None, error: APIError) -> None:
        """Ends a running answer now, ``error`` its last event."""
        if job is not None:
            job.cut = error
            self.cancel(job)

    def close(self) -> None:
        """Fails what waits (503), stops the current answer and ends the engine's processes."""
        with self._lock:
            self.state = State.CLOSED
            waiting, self._queue = list(self._queue), collections.deque()
            self._lock.notify_all()
        for job in waiting:
            job.put(unavailable("the server is shutting down"))
        self.engine.cancel()
        self._thread.join(timeout=15)
        self.engine.close()
