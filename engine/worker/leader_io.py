"""The target leader's two ends towards a user: the Engine's socket (``SocketIO``), or stdout for a
``--prompt`` run without an Engine (``ScriptIO``). Either gets token ids and figures only (``step``);
text is the Engine's work, off the decoding loop's critical path."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import Step
from swiftspec.engine.host import frames, protocol
from swiftspec.engine.host.frames import (
    BadRequest,
    Cancel,
    Failure,
    Frame,
    Generate,
    Progress,
    Ready,
    Shutdown,
    Stepped,
)
from swiftspec.engine.spec.loop import Request

# How often the leader sends an answer's steps after its first: each frame wakes the writer thread and the
# Engine, whose work (a frame, the text, the figures: ~0.4 ms of CPU a frame on a 2-core Zen 4) then
# competes with the next forward for the cores. A step every ~4 ms sent on its own cost `ar` 7 % of its
# speed there and `sync` 6 % (16 fresh questions, each way in turn); a display's frame of 16 ms is as
# often as a reader sees text change. Slower steps go out one by one, each as it comes.
STREAM_INTERVAL_S = 0.016


class SocketIO:
    """The leader's side of the Engine socket. A reader thread queues incoming messages, so the decode
    loop only ever does a non-blocking check for a cancel between steps; a writer thread sends, so the
    loop only queues a frame. An answer's steps go out in frames (``Stepped``): its first and its last at
    once, the others once STREAM_INTERVAL_S has passed since the answer's last frame, each stamped with
    its own interval (``Step.interval_ms``), so the Engine's per-token figures stay per step."""

    def __init__(self, conn: protocol.Connection, speculative: bool):
        self.conn, self.speculative = conn, speculative
        self.inbox: queue.Queue[Frame | BadRequest] = queue.Queue()
        self.outbox: queue.Queue[Frame | None] = queue.Queue()
        self.pending: deque[Generate | BadRequest] = deque()
        self.cancel_ids: set[int] = set()
        self.shutdown = False
        self.held: list[Step] = []  # steps of answer ``answer`` not yet sent
        self.answer: int | None = None  # the answer whose steps are being sent
        self.last_step = self.last_frame = 0.0  # when its last step came and its last frame went
        threading.Thread(target=self._read, daemon=True, name="engine-socket-in").start()
        self.writer = threading.Thread(target=self._write, daemon=True, name="engine-socket-out")
        self.writer.start()

    def _read(self) -> None:
        try:
            while True:
                try:
                    self.inbox.put(frames.recv(self.conn))
                except BadRequest as e:  # answered in turn, as the request it was meant to be
                    self.inbox.put(e)
        except (OSError, protocol.ProtocolError):  # the Engine went away, or broke the protocol: finish and exit
            self.inbox.put(Shutdown())

    def _write(self) -> None:
        while (frame := self.outbox.get()) is not None:
            try:
                frames.send(self.conn, frame)
            except OSError:
                self.inbox.put(Shutdown())

    def _note(self, frame: Frame | BadRequest) -> None:
        match frame:
            case Generate() | BadRequest():
                self.pending.append(frame)
            case Cancel(rid):
                self.cancel_ids.add(rid)
            case Shutdown():
                self.shutdown = True
            case _:
                raise protocol.ProtocolError(f"the Engine sent {frame!r}, which only workers send")

    def next_request(self) -> Request | None:
        while True:
            while not self.pending and not self.shutdown:
                self._note(self.inbox.get())
            if self.shutdown:
                return None
            req = self.pending.popleft()
            if isinstance(req, Generate) and req.params.mode != "ar" and not self.speculative:
                req = BadRequest(f"mode {req.params.mode} needs a draft, and these workers have none", req.id)
            if isinstance(req, BadRequest):
                self.send(Failure(f"invalid request: {req}", req.id, fatal=False))
                continue
            if req.id in self.cancel_ids:
                self.cancel_ids.discard(req.id)
                self.step(req.id, Step([], "cancelled"))
                continue
            return Request(req.id, req.token_ids, req.params)

    def cancelled(self, rid: int) -> bool:
        while True:
            try:
                self._note(self.inbox.get_nowait())
            except queue.Empty:
                break
        return self.shutdown or rid in self.cancel_ids

    def step(self, rid: int, step: Step) -> None:
        now = time.perf_counter()
        first = rid != self.answer
        if first:
            self._send_held()  # an answer cut off without its last step (a failure) keeps what it made
            self.answer = rid
        else:
            step = dataclasses.replace(step, interval_ms=(now - self.last_step) * 1e3)
        self.last_step = now
        self.held.append(step)
        done = step.finish is not None
        if first or done or now - self.last_frame >= STREAM_INTERVAL_S:
            self._send_held()
            self.last_frame = now
        if done:
            self.cancel_ids.discard(rid)
            self.answer = None

    def _send_held(self) -> None:
        if self.held:
            self.outbox.put(Stepped(self.answer, self.held))
            self.held = []

    def progress(self, text: str) -> None:
        self.send(Progress(text))

    def send(self, frame: Frame) -> None:
        """Sends ``frame`` after any steps held back."""
        self._send_held()
        self.outbox.put(frame)

    def flush(self) -> None:
        """Sends everything queued, then stops the writer."""
        self._send_held()
        self.outbox.put(None)
        self.writer.join()


class ScriptIO:
    """``--prompt`` without an Engine: one request per mode; prints each answer and compares them."""

    def __init__(self, tokenizer, prompt_ids: list[int], requests: list[SamplingParams]):
        self.tokenizer = tokenizer
        self.todo = deque(Request(i, prompt_ids, params) for i, params in enumerate(requests))
        self.results: list[tuple[str, list[int]]] = []
        self.steps: list[Step] = []

    def next_request(self) -> Request | None:
        if not self.todo:
            return None
        self.mode, self.steps = self.todo[0].params.mode, []
        return self.todo.popleft()

    def cancelled(self, rid: int) -> bool:
        return False

    def step(self, rid: int, step: Step) -> None:
        self.steps.append(step)
        if step.finish is None:
            return
        tokens = [t for s in self.steps for t in s.tokens]
        self.results.append((self.mode, tokens))
        verified = [s for s in self.steps if s.tree_size]
        mean = sum(s.accepted + 1 for s in verified) / len(verified) if verified else 0.0
        print(f"[{self.mode}] {len(tokens)} tokens, {len(self.steps) - 1} steps after the prefill, mean "
              f"accepted {mean:.2f}, finish={step.finish}\n{self.tokenizer.decode(tokens)}\n", flush=True)

    def progress(self, text: str) -> None:
        print(f"-- {text}", flush=True)

    def send(self, frame: Frame) -> None:
        if isinstance(frame, Ready):
            info = frame.info
            print(f"-- ready: d={info.d} (t_verify {info.t_verify_ms:.1f} ms, "
                  f"t_expand {info.t_expand_ms:.2f} ms)", flush=True)
            for r in info.ranks:
                print(f"   rank {r.rank}: {r.role} tp {r.tp_rank}/{r.tp_world} on "
                      f"{r.host} {r.device} ({r.torch_threads} torch threads)", flush=True)

    def flush(self) -> None:
        first = self.results[0]
        for mode, tokens in self.results[1:]:
            print(f"{mode} == {first[0]}: {tokens == first[1]}", flush=True)
