"""One engine, one answer at a time: the requests wait in a bounded FIFO queue, a thread of its own feeds
them to the engine and hands each answer's events to the request's event loop. A request that goes away
(a client that hangs up, queued or mid-answer) is cancelled at once; a dead worker group fails the answer
it was giving (503) and is started again, a bounded number of times in a row."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from swiftspec.config import SamplingParams, StepEvent
from swiftspec.engine.client import encode_chat, encode_prompt
from swiftspec.engine.failures import EngineError
from swiftspec.engine.protocol import EngineAPI, EngineInfo
from swiftspec.server.api import APIError, Request, unavailable
from swiftspec.server.metrics import Metrics

log = logging.getLogger("swiftspec.serve")

State = Literal["ok", "restarting", "failed", "closed"]
RESTARTS = 3  # starts in a row that may fail before the server gives up (every request then gets a 503)
IDLE_CHECK_S = 0.5  # how often an idle engine thread looks whether the workers still live
Item = StepEvent | APIError


@dataclass
class Job:
    """A request in the queue or being answered: its prompt's token ids and params, and where its events
    go (an asyncio queue of the request's loop, filled from the engine thread)."""

    request: Request
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

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
        self.state: State = "ok"
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._current: Job | None = None
        metrics.queue_length.set_function(lambda: len(self._queue))
        metrics.engine_up.set_function(lambda: 1.0 if self.state == "ok" else 0.0)
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
        if request.params.mode != "ar" and self.info.draft == "none":
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
            if self.state in ("failed", "closed"):
                raise unavailable(f"the engine is {'down: it failed to start again' if self.state == 'failed' else 'closed'}")
            if len(self._queue) >= self.max_queue:
                raise APIError(429, f"the queue is full ({self.max_queue} requests wait): try again shortly",
                               "rate_limit_error", None, "queue_full")
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
                while not self._queue and self.state != "closed":
                    self._lock.wait(IDLE_CHECK_S)
                    if not self._queue and self.state == "ok" and not self.engine.alive:
                        break
                if self.state == "closed":
                    return
                job = self._queue.popleft() if self._queue else None
                self._current = job
            try:
                if not self.engine.alive:
                    self._restart("the workers died while idle")
                if job is not None:
                    self._answer(job)
            finally:
                self._current = None

    def _answer(self, job: Job) -> None:
        if self.state != "ok":
            job.put(unavailable("the engine could not be started again"))
            return
        t0 = time.perf_counter()
        self.metrics.queue_seconds.observe(t0 - job.arrived)
        self.metrics.prompt_tokens.inc(len(job.ids))
        first = True
        try:
            for event in self.engine.generate_ids(job.ids, job.params):
                if job.cancelled:
                    self.engine.cancel()
                if first and event.token_ids:
                    self.metrics.time_to_first_token.observe(time.perf_counter() - job.arrived)
                    first = False
                self.metrics.step(event)
                job.put(event)
        except EngineError as e:
            if self.engine.alive:
                job.put(APIError(400, str(e)))
                return
            log.error("the workers failed during an answer: %s", str(e).splitlines()[0])
            job.put(unavailable(f"the engine failed during this answer and is being restarted: {e}"))
            self._restart("a worker failed")
        except Exception as e:  # a bug of ours: the request still gets an answer, and the server lives
            log.exception("an answer failed")
            job.put(APIError(500, f"internal error: {e}", "server_error"))

    def _restart(self, why: str) -> None:
        with self._lock:
            if self.state == "closed":
                return
            self.state = "restarting"
        self.metrics.restarts.inc()
        self.engine.close()
        for attempt in range(1, RESTARTS + 1):
            log.warning("%s: starting the engine again (attempt %d of %d)", why, attempt, RESTARTS)
            try:
                engine = self._start()
            except Exception as e:
                log.error("the engine failed to start: %s", str(e).splitlines()[0] if str(e) else e)
                time.sleep(min(5.0, 0.5 * 2 ** attempt))
                continue
            with self._lock:
                if self.state == "closed":
                    engine.close()
                    return
                self.engine, self.state = engine, "ok"
            log.warning("the engine is up again")
            return
        with self._lock:
            self.state = "failed"
            failed, self._queue = list(self._queue), collections.deque()
        log.error("the engine failed to start %d times in a row: every request gets a 503 now", RESTARTS)
        for job in failed:
            job.put(unavailable("the engine could not be started again"))

    def close(self) -> None:
        """Fails what waits (503), stops the current answer and ends the engine's processes."""
        with self._lock:
            self.state = "closed"
            waiting, self._queue = list(self._queue), collections.deque()
            self._lock.notify_all()
        for job in waiting:
            job.put(unavailable("the server is shutting down"))
        self.engine.cancel()
        self._thread.join(timeout=15)
        self.engine.close()
