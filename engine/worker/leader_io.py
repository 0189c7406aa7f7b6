"""The target leader's two ends towards a user: the Engine's socket (``SocketIO``), or stdout for a
``--prompt`` run without an Engine (``ScriptIO``). Either gets token ids and figures only (``step``);
text is the Engine's work, off the decoding loop's critical path."""

from __future__ import annotations

import queue
import threading
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


class SocketIO:
    """The leader's side of the Engine socket. A reader thread queues incoming messages, so the decode
    loop only ever does a non-blocking check for a cancel between steps; a writer thread sends, so the
    loop only queues a step."""

    def __init__(self, conn: protocol.Connection, speculative: bool):
        self.conn, self.speculative = conn, speculative
        self.inbox: queue.Queue[Frame | BadRequest] = queue.Queue()
        self.outbox: queue.Queue[Frame | None] = queue.Queue()
        self.pending: deque[Generate | BadRequest] = deque()
        self.cancel_ids: set[int] = set()
        self.shutdown = False
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
        if step.finish is not None:
            self.cancel_ids.discard(rid)
        self.send(Stepped(rid, step))

    def progress(self, text: str) -> None:
        self.send(Progress(text))

    def send(self, frame: Frame) -> None:
        self.outbox.put(frame)

    def flush(self) -> None:
        """Sends everything queued, then stops the writer."""
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
