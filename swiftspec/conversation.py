"""One conversation, as the chat and scripted mode hold it: its messages (with their ids in the history
store and each answer's figures), the part of it the model still sees, and its own settings.

An answer goes plan -> run: ``plan`` fits the request into the context and changes nothing; ``run``
sends it, and only once the engine has accepted it (its first event) does anything change, on screen as
in the store. So a refusal, a prompt that no longer fits or a dead engine deletes nothing. The answer is
saved as it streams (marked "partial" until it ends), so quitting or a crash mid-answer keeps it, and
``/continue`` picks it up after ``--resume``.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from swiftspec import window
from swiftspec.engine.config import ConfigError, SamplingParams
from swiftspec.engine.events import CUT_SHORT, StepEvent
from swiftspec.engine.host.answer import AnswerSummary
from swiftspec.engine.host.protocol import EngineAPI
from swiftspec.history import HistoryError, HistoryStore, title_from, to_markdown
from swiftspec.history import Message as StoredMessage

SAVE_EVERY_S = 1.0  # how often a streaming answer is written to the store
SETTABLE = tuple(f.name for f in dataclasses.fields(SamplingParams))  # per conversation, like the system prompt

Kind = Literal["ask", "retry", "edit", "continue"]


class CannotAnswer(ValueError):
    """The request makes no sense now (no answer to retry, a complete answer to continue)."""


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    key: int  # unique in its Conversation, for as long as it runs: what a widget showing it is named after
    id: int | None = None  # in the history store; None while not saved
    stats: dict[str, Any] | None = None  # an answer's figures (AnswerSummary.to_dict, as stored)

    @property
    def finish_reason(self) -> str | None:
        return (self.stats or {}).get("finish_reason")


@dataclass
class Settings:
    """What a conversation is answered with; kept with it in the store and restored on resume."""

    system: str | None = None
    params: SamplingParams = field(default_factory=SamplingParams)

    def copy(self) -> Settings:
        return Settings(self.system, dataclasses.replace(self.params, stop=list(self.params.stop)))


@dataclass(frozen=True)
class ReplyPlan:
    """What an answer is to be, fixed by ``Conversation.plan`` before anything is sent: what it answers and
    replaces, what the engine is sent and where the context window moves. Frozen: running it sends exactly
    what was fitted into the context."""

    kind: Kind
    question: str | None  # the user message it answers (ask, edit); None for retry and continue
    messages: tuple[dict, ...]  # what the engine is sent
    ids: tuple[int, ...] | None  # their token ids as fitted into the context, sent so; None: the engine templates
    params: SamplingParams
    window_start: int  # where the context window starts for this answer
    left_out: int  # turns this answer newly leaves out of the context (0: the window did not move)
    kept: int  # turns the model sees
    earlier: int  # turns before the question, in all
    replaces: int  # the index of the first message the answer replaces (its question's, for ask)


@dataclass
class Reply:
    """One answer as it runs: its plan, how far it got and how it ended. ``answer`` is set once the engine
    accepted the request."""

    plan: ReplyPlan
    last: StepEvent | None = None  # the answer's latest event: its figures so far
    answer: Message | None = None
    tokens: list[int] = field(default_factory=list)  # the answer's (this run's part), for the drafter's history
    generated_before: int = 0  # a continued answer's tokens before this run: its figures count the whole
    vocab: str = ""  # the tokenizer that wrote them (EngineInfo.vocab; "": not kept)
    error: str | None = None  # why the engine did not answer (or stopped answering)
    fatal: bool = False  # the engine is gone, not just this answer
    done: bool = False
    saved_at: float = 0.0

    @property
    def accepted(self) -> bool:
        return self.answer is not None


def describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


class Conversation:
    """The messages of one chat and the operations on them that the front ends share. ``store`` None
    saves nothing (scripted runs without --save). Front ends read ``warnings`` (e.g. "deleted elsewhere,
    saved anew") after each operation, and ``store.problem`` for a history that cannot be written."""

    def __init__(self, store: HistoryStore | None, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.id: int | None = None
        self.title: str | None = None
        self.messages: list[Message] = []
        self.window_start = 0  # the first of `messages` that the model still sees (see swiftspec.window)
        self.start_system = settings.system  # the system prompt of the first answer
        self.system_changes: list[tuple[int, str | None]] = []  # (messages before it, the new system prompt)
        self.warnings: list[str] = []
        self._stored_settings: dict | None = None  # the settings as the store has them
        self._keys = itertools.count()
        self._lock = threading.RLock()  # an answer streams in from the TUI's generate thread

    # --- loading ----------------------------------------------------------------------------------

    @classmethod
    def resume(cls, store: HistoryStore, conversation_id: int, defaults: Settings,
               prefer: Collection[str] = ()) -> Conversation:
        """A saved conversation with the settings it was saved with, except those named in ``prefer``
        (given for this run), which come from ``defaults``, as do settings that no longer validate (with
        a warning). HistoryError when there is no such conversation."""
        saved = store.get(conversation_id)
        self = cls(store, defaults.copy())
        self.id, self.title, self.start_system = saved.id, saved.title, saved.system
        system = saved.system
        for m in store.messages(conversation_id):
            if m.role == "system":
                self.system_changes.append((len(self.messages), m.content or None))
                system = m.content or None
            else:
                self.messages.append(Message(m.role, m.content, next(self._keys), m.id, m.stats))
        if "system" not in prefer:
            self.settings.system = system
        elif defaults.system != system:
            self.set_system(defaults.system)
        kept = {k: v for k, v in (saved.settings or {}).items() if k in SETTABLE and k not in prefer}
        try:
            self.settings.params = dataclasses.replace(defaults.params, **kept).validate()
        except (ConfigError, TypeError) as e:
            self.warnings.append(f"its saved settings no longer apply ({e}); using this session's")
        self._stored_settings = saved.settings
        return self

    # --- what the front ends read -----------------------------------------------------------------

    @property
    def params(self) -> SamplingParams:
        return self.settings.params

    @property
    def last_finish(self) -> str | None:
        """The last answer's finish reason, while it is the last message."""
        last = self.messages[-1] if self.messages else None
        return last.finish_reason if last and last.role == "assistant" else None

    @property
    def editable(self) -> str | None:
        users = [m.content for m in self.messages if m.role == "user"]
        return users[-1] if users else None

    def engine_messages(self, dialogue: list[dict], start: int) -> list[dict]:
        head = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return head + dialogue[start:]

    def take_warnings(self) -> list[str]:
        warnings, self.warnings = self.warnings, []
        return warnings

    # --- settings ---------------------------------------------------------------------------------

    def set_params(self, params: SamplingParams) -> None:
        self.settings.params = params.validate()
        self._store_settings()

    def _store_settings(self) -> None:
        if self.id is not None and self.store is not None and self._stored_settings != self.params.to_dict():
            self._stored_settings = self.params.to_dict()
            self.store.set_settings(self.id, self._stored_settings)

    def set_system(self, system: str | None) -> None:
        """A new system prompt for the next answers. Set mid-conversation it is kept where it was set, so an
        export does not show it above answers it never applied to."""
        self.settings.system = system
        if not self.messages:
            self.start_system = system
            if self.id is not None and self.store is not None:
                self.store.set_system(self.id, system)
            return
        if self.id is not None:
            self._save("system", system or "")
        self.system_changes.append((len(self.messages), system))

    def rename(self, title: str) -> None:
        if self.id is not None and self.store is not None:
            self.store.rename(self.id, title)
            self.title = self.store.get(self.id).title

    # --- answering --------------------------------------------------------------------------------

    def plan(self, kind: Kind, context: window.Context, text: str | None = None) -> ReplyPlan:
        """What the engine will be sent for this request; changes nothing. ContextError when it cannot
        fit, CannotAnswer when there is nothing to retry or continue."""
        dialogue = [{"role": m.role, "content": m.content} for m in self.messages]
        params = self.params
        last = self.messages[-1] if self.messages else None
        if kind == "ask":
            replaces = len(dialogue)
            dialogue.append({"role": "user", "content": text})
        elif kind == "edit":
            replaces = max(i for i, m in enumerate(self.messages) if m.role == "user")
            dialogue[replaces:] = [{"role": "user", "content": text}]
        elif last is None or last.role != "assistant":
            raise CannotAnswer(f"There is no answer to {kind}.")
        elif kind == "retry":
            replaces = len(dialogue) - 1
            del dialogue[-1]
            if not params.greedy:
                params = dataclasses.replace(params, seed=random.randrange(2**31))
        else:
            if last.finish_reason not in CUT_SHORT:
                raise CannotAnswer(f"The last answer is complete ({last.finish_reason or 'unknown'}); "
                                   "/retry writes a new one.")
            replaces = len(dialogue) - 1
        start = min(self.window_start, replaces)
        new_start, ids = window.fit(dialogue, start, self.settings.system, context, params.max_new_tokens)
        question = len(dialogue) - 1 if kind in ("ask", "edit") else len(dialogue)
        return ReplyPlan(kind, text if kind in ("ask", "edit") else None,
                         tuple(self.engine_messages(dialogue, new_start)), ids, params, new_start,
                         window.turns_between(dialogue, start, new_start),
                         window.turns_between(dialogue, new_start, len(dialogue)),
                         window.turns_between(dialogue, 0, question), replaces)

    def run(self, reply: Reply, engine: EngineAPI, on_accept: Callable[[Reply], None] | None = None,
            on_event: Callable[[StepEvent], None] | None = None) -> Reply:
        """Generates the answer to ``reply.plan`` (blocking), saving it as it streams; returns the reply with
        its end. An engine that refuses or fails sets ``reply.error``; what the callbacks raise (a closed
        stdout, Ctrl-C) ends the answer as cancelled, saved, and is raised again."""
        plan = reply.plan
        reply.vocab = engine.info.vocab
        try:
            try:
                events = iter(engine.generate(list(plan.messages), plan.params) if plan.ids is None
                              else engine.generate_ids(list(plan.ids), plan.params))
            except Exception as e:  # refused before anything ran
                return self._failed(reply, e, engine)
            while True:
                try:
                    event = next(events)
                except StopIteration:
                    break
                except Exception as e:  # the engine refused, or died (EngineError either way)
                    return self._failed(reply, e, engine)
                if reply.answer is None:
                    self._accept(reply)
                    if on_accept is not None:
                        on_accept(reply)
                self._record(reply, event)
                if on_event is not None:
                    on_event(event)
        except BaseException:
            self.finish(reply, "cancelled")
            raise
        self.finish(reply)
        return reply

    def _failed(self, reply: Reply, error: Exception, engine: EngineAPI) -> Reply:
        reply.error, reply.fatal = describe(error), not engine.alive
        self.finish(reply, "error")
        return reply

    def _accept(self, reply: Reply) -> None:
        """The engine took the request: now the conversation becomes what was sent."""
        plan = reply.plan
        with self._lock:
            self.window_start = plan.window_start
            self._store_settings()
            if plan.kind == "continue":
                reply.answer = self.messages[-1]
                reply.generated_before = (reply.answer.stats or {}).get("generated", 0)
                reply.answer.stats = {**(reply.answer.stats or {}), "finish_reason": "partial"}
                self._store_update(reply.answer)
                return
            gone = self.messages[plan.replaces:]
            first_saved = next((m.id for m in gone if m.id is not None), None)
            if first_saved is not None and self.id is not None and self.store is not None:
                self.store.truncate(self.id, first_saved)
            del self.messages[plan.replaces:]
            # a system prompt set after the replaced messages applies to what replaces them: it moves up
            moved = [system for at, system in self.system_changes if at > plan.replaces]
            self.system_changes = [(at, system) for at, system in self.system_changes if at <= plan.replaces]
            for system in moved:
                if self.id is not None:
                    self._save("system", system or "")
                self.system_changes.append((plan.replaces, system))
            if plan.question is not None:
                self._append("user", plan.question)
            reply.answer = self._append("assistant", "", {"mode": plan.params.mode, "finish_reason": "partial"})
            reply.saved_at = time.monotonic()

    def _record(self, reply: Reply, event: StepEvent) -> None:
        with self._lock:
            if reply.done:  # ended meanwhile (the app quit): what was saved stays
                return
            reply.last = event
            reply.tokens += event.token_ids
            reply.answer.content += event.text
            if time.monotonic() - reply.saved_at >= SAVE_EVERY_S:
                reply.answer.stats = {**self._figures(reply, self._summary(reply, event)), "finish_reason": "partial"}
                self._store_update(reply.answer)
                reply.saved_at = time.monotonic()

    @staticmethod
    def _summary(reply: Reply, event: StepEvent | None) -> AnswerSummary:
        """The answer's figures at ``event``: the last step's, with the tokens of the whole message (a
        continued answer's earlier part too)."""
        summary = AnswerSummary.of(reply.plan.params.mode, event)
        summary.stats = dataclasses.replace(summary.stats, generated=summary.stats.generated + reply.generated_before)
        return summary

    @staticmethod
    def _figures(reply: Reply, summary: AnswerSummary) -> dict[str, Any]:
        """The figures saved with an answer: its summary, and the temperature it was sampled at (what
        /retry's notice says of the answer it replaces)."""
        return {**summary.to_dict(), "temperature": reply.plan.params.temperature}

    def finish(self, reply: Reply, reason: str | None = None) -> None:
        """Ends the answer (once): its text and figures are saved. ``reason`` names why it ended where the
        engine did not say (an error, a stop from this side)."""
        with self._lock:
            if reply.done:
                return
            reply.done = True
            if reply.answer is None:
                return
            summary = self._summary(reply, reply.last)
            summary.finish_reason = summary.finish_reason or reason or "cancelled"
            reply.answer.stats = self._figures(reply, summary)
            self._store_update(reply.answer)
            if reply.vocab and reply.tokens and reply.answer.id is not None and self.store is not None:
                self.store.append_tokens(reply.answer.id, reply.vocab, reply.tokens)

    # --- clearing ---------------------------------------------------------------------------------

    def clear(self) -> None:
        """Erases the messages, and the saved conversation with them; the settings stay."""
        if self.id is not None and self.store is not None:
            self.store.delete(self.id)
        self.id = self.title = None
        self.messages, self.window_start, self.system_changes = [], 0, []
        self.start_system = self.settings.system

    # --- export -----------------------------------------------------------------------------------

    def _in_order(self) -> list[Message | str | None]:
        """The messages, with each change of system prompt (a str, or None: removed) where it happened."""
        out: list[Message | str | None] = []
        changes = list(self.system_changes)
        for i in range(len(self.messages) + 1):
            while changes and changes[0][0] == i:
                out.append(changes.pop(0)[1])
            if i < len(self.messages):
                out.append(self.messages[i])
        return out

    def transcript(self) -> list[StoredMessage]:
        return [StoredMessage(m.role, m.content, m.stats, m.id) if isinstance(m, Message)
                else StoredMessage("system", m or "") for m in self._in_order()]

    def to_markdown(self) -> str:
        if self.id is not None and self.store is not None and self.store.available:
            self.title = self.store.get(self.id).title  # renamed in the history screen, perhaps
        first = next((m.content for m in self.messages if m.role == "user"), "SwiftSpec chat")
        title = self.title or title_from(first)
        return to_markdown(title, self.start_system, self.transcript())

    # --- saving -----------------------------------------------------------------------------------

    def _append(self, role: str, content: str, stats: dict | None = None) -> Message:
        message = Message(role, content, next(self._keys), self._save(role, content, stats), stats)
        self.messages.append(message)
        return message

    def _save(self, role: str, content: str, stats: dict | None = None) -> int | None:
        """Saves one message as soon as it exists (before it joins the lists). The first creates the
        conversation; one deleted meanwhile (elsewhere) is saved afresh, whole."""
        if self.store is None:
            return None
        if self.id is not None:
            try:
                return self.store.add(self.id, role, content, stats)
            except HistoryError:
                self.warnings.append(f"Conversation #{self.id} was deleted elsewhere; saving it anew.")
        title = title_from(next((m.content for m in self.messages if m.role == "user"), content))
        self._stored_settings = self.params.to_dict()
        self.id = self.store.create(title, self.start_system, self._stored_settings)
        if self.id is None:
            return None
        self.title = title
        for m in self._in_order():
            if isinstance(m, Message):
                m.id = self.store.add(self.id, m.role, m.content, m.stats)
            else:
                self.store.add(self.id, "system", m or "")
        return self.store.add(self.id, role, content, stats)

    def _store_update(self, message: Message) -> None:
        if self.store is not None and message.id is not None:
            self.store.update(message.id, message.content, message.stats)
