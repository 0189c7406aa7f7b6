"""The chat app: conversation on the left, live stats on the right, the engine in thread workers.

Threads never touch widgets: the start worker posts messages, the generate worker fills an AnswerBuffer
that a timer drains into the UI a few times a second, so rendering never slows decoding.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header

from swiftspec import window
from swiftspec.config import MODES, ConfigError, SamplingParams
from swiftspec.engine.protocol import EngineAPI
from swiftspec.history import (
    HistoryError,
    HistoryStore,
    exports_dir,
    local_time,
    stats_line,
    title_from,
    to_markdown,
)
from swiftspec.history import Message as StoredMessage
from swiftspec.tui.clipboard import copy_with_tools
from swiftspec.tui.commands import NAMES
from swiftspec.tui.dialogs import ConfirmScreen
from swiftspec.tui.history_screen import HistoryResult, HistoryScreen
from swiftspec.tui.screens import ErrorScreen, HelpScreen, LoadingScreen
from swiftspec.tui.stream import AnswerBuffer
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.notice import Notice
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel

EngineFactory = Callable[[Callable[[str], None]], EngineAPI]


def describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


class EngineProgress(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class EngineReady(Message):
    pass


class EngineFailed(Message):
    def __init__(self, cause: str) -> None:
        super().__init__()
        self.cause = cause


@dataclass
class Turn:
    """An answer being generated: a new one after the last user message, or more of the last answer."""

    box: MessageBox
    buffer: AnswerBuffer
    continuing: bool  # /continue: the answer grows in its existing box
    window_start: int  # where the context window started before this turn (restored if it fails)
    notice: Notice | None  # the "turns left out" notice this turn added


@dataclass
class AnswerDone(Message):
    turn: Turn
    error: str | None = None
    fatal: bool = False  # the engine is gone, not just this answer


@dataclass
class CopyDone(Message):
    tool: str | None  # the clipboard tool that took the text, if any
    error: str | None  # why the tools that were tried failed


class SwiftSpecApp(App[int]):
    """``engine_factory(progress)`` starts the engine (blocking); the app calls it in a thread worker,
    again after a failure when the user asks for a restart."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so subclasses elsewhere find it too
    TITLE = "SwiftSpec"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (72, "-normal"), (120, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+o", "copy_last", "Copy"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("f2", "history", "History"),
        Binding("f1", "help", "Help"),
    ]
    CUT_SHORT = ("length", "context", "repetition", "cancelled")  # finish reasons that /continue can pick up
    FLUSH_INTERVAL = 1 / 12  # seconds between UI refreshes while an answer streams

    def __init__(self, engine_factory: EngineFactory, params: SamplingParams, system: str | None = None,
                 store: HistoryStore | None = None, resume: int | None = None, model_line: str = "") -> None:
        super().__init__()
        self.engine_factory = engine_factory
        self.params = params
        self.system = system
        self.store = store or HistoryStore()
        self.model_line = model_line
        self.engine: EngineAPI | None = None
        self.messages: list[dict] = []  # the conversation as shown (system prompt excluded)
        self.message_ids: list[int | None] = []  # each message's id in the store (None: not saved)
        self.window_start = 0  # the first of `messages` that the model still sees (see swiftspec.window)
        self.last_finish: str | None = None  # the last answer's finish reason, for /continue
        self.conversation_id: int | None = None
        self._resume = resume
        self._turn: Turn | None = None  # set while an answer is being generated
        self._store_problem_shown = False
        self._engine_lock = threading.Lock()  # hands a started engine over, or closes it if we are leaving
        self._leaving = False

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield ChatView(id="chat")
                yield PromptInput(id="prompt")
            yield StatsPanel(id="stats")
        yield Footer()

    @property
    def _buffer(self) -> AnswerBuffer | None:
        return self._turn.buffer if self._turn else None

    async def on_mount(self) -> None:
        self._flush_timer = self.set_interval(self.FLUSH_INTERVAL, self._flush_answer, pause=True)
        self._update_subtitle()
        if self.store.notice:
            self.notify(self.store.notice, title="History", severity="warning", markup=False, timeout=15)
        self._check_store()
        if self._resume is not None:
            await self.resume_conversation(self._resume)
        self._start_engine(None)

    def on_unmount(self) -> None:
        with self._engine_lock:
            self._leaving = True
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.cancel()
            engine.close()

    # --- engine lifecycle -------------------------------------------------------------------------

    def _start_engine(self, old: EngineAPI | None) -> None:
        self.push_screen(LoadingScreen(self.model_line))
        self._run_start(old)

    @work(thread=True, exclusive=True, group="engine")
    def _run_start(self, old: EngineAPI | None) -> None:
        if old is not None:
            try:
                old.close()
            except Exception:  # it is already broken; the new start is what matters
                pass

        def progress(line: str) -> None:
            if self._leaving:  # the user quit while loading: abort, and Engine.start ends what it spawned
                raise RuntimeError("the app closed while the engine was starting")
            self.post_message(EngineProgress(line))

        try:
            engine = self.engine_factory(progress)
        except Exception as e:  # any failure to start is shown with its cause, and can be retried
            if not self._leaving:
                self.post_message(EngineFailed(describe(e)))
            return
        with self._engine_lock:
            if self._leaving:
                engine.close()
                return
            self.engine = engine
        self.post_message(EngineReady())

    def on_engine_progress(self, message: EngineProgress) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.add_line(message.text)

    def on_engine_ready(self) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        info = self.engine.info
        self.model_line = f"{info.target} ← {info.draft}"
        self.query_one(StatsPanel).set_info(info)
        self._update_subtitle()
        self.query_one(PromptInput).focus()

    def on_engine_failed(self, message: EngineFailed) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.push_screen(ErrorScreen(message.cause), self._after_error)

    def _after_error(self, restart: bool | None) -> None:
        if restart:
            with self._engine_lock:
                old, self.engine = self.engine, None
            self._start_engine(old)

    # --- sending and streaming --------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if text.startswith("/") and not event.edit:
            if await self.run_slash(text):
                event.prompt_input.clear()
            return
        if self.engine is None:
            self.notify("The engine is not ready yet.", severity="warning")
            return
        if self._turn is not None:
            self.notify("Still answering — Esc stops it.", severity="warning")
            return
        if event.edit and not await self._edit_fits(text):
            return  # the turn it would replace stays, and the edit stays in the input
        event.prompt_input.clear()
        if event.edit:  # the edited message replaces the last one, in the recall list too
            event.prompt_input.forget(await self._drop_last_turn())
        event.prompt_input.remember(text)
        await self.send(text)

    async def send(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        self.message_ids.append(None)
        await self.query_one(ChatView).add("user", text)
        await self._answer(continuing=False, params=self.params)

    async def _answer(self, continuing: bool, params: SamplingParams) -> None:
        """Starts an answer to the conversation as it stands, leaving out its oldest turns if they no
        longer fit with room for the answer (with a notice in the chat)."""
        start = self.window_start
        try:  # in a thread: tokenizing a long conversation takes a moment, the screen keeps drawing
            self.window_start = await asyncio.to_thread(
                window.fit, list(self.messages), start, self.system, self.engine.count_tokens,
                self.engine.info.context_length, params.max_new_tokens)
        except window.ContextError as e:
            if not continuing:
                await self._take_back_prompt()
            self.notify(str(e), title="Does not fit", severity="error", markup=False, timeout=10)
            return
        if not continuing and self.message_ids[-1] is None:  # saved once it is sure to be sent
            self.message_ids[-1] = self._save("user", self.messages[-1]["content"])
        chat = self.query_one(ChatView)
        notice = None
        if self.window_start > start:
            dropped = window.turns_between(self.messages, start, self.window_start)
            kept = window.turns_between(self.messages, self.window_start, len(self.messages))
            what = "the oldest turn" if dropped == 1 else f"the {dropped} oldest turns"
            notice = await chat.add_notice(f"Context full: left out {what} (still shown here and saved); "
                                           f"the model sees the last {_turns(kept)}.")
            if not continuing:  # the notice goes above the question it was made room for
                chat.move_child(notice, before=chat.messages[-1])
        if continuing:
            box = chat.messages[-1]
            box.resume()
        else:
            box = await chat.add("assistant", streaming=True)
        self._turn = Turn(box, AnswerBuffer(params.mode), continuing, start, notice)
        self.query_one(PromptInput).editable = None
        self.query_one(StatsPanel).start_turn(params.mode)
        self._flush_timer.resume()
        self.refresh_bindings()
        self._generate(self.engine, self._engine_messages(), replace(params), self._turn)

    def _engine_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages[self.window_start:]]

    @work(thread=True, group="generate")
    def _generate(self, engine: EngineAPI, messages: list[dict], params: SamplingParams, turn: Turn) -> None:
        try:
            for ev in engine.generate(messages, params):
                turn.buffer.push(ev)
        except Exception as e:  # the engine refused this answer, or died (EngineError either way)
            self.post_message(AnswerDone(turn, describe(e), fatal=not engine.alive))
            return
        self.post_message(AnswerDone(turn))

    async def _flush_answer(self) -> None:
        if self._turn is None:
            return
        text, steps = self._turn.buffer.drain()
        if text:
            await self._turn.box.append(text)
        if steps:
            self.query_one(StatsPanel).add_steps(steps)

    async def on_answer_done(self, message: AnswerDone) -> None:
        await self._flush_answer()
        self._flush_timer.pause()
        turn = message.turn
        self._turn = None
        self.refresh_bindings()
        summary = turn.buffer.recorder.summary()
        if message.error is not None and not turn.continuing:
            await self._turn_failed(turn, message.error, message.fatal)
            return
        await turn.box.finish(stats_line(summary, short=True))
        self.last_finish = summary["finish_reason"]
        if turn.continuing:  # what was added so far stays, even when the engine failed half-way
            self.messages[-1]["content"] = turn.box.text
            if self.message_ids[-1] is not None:
                self.store.update(self.message_ids[-1], turn.box.text, summary)
                self._check_store()
        else:
            self.messages.append({"role": "assistant", "content": turn.box.text})
            self.message_ids.append(self._save("assistant", turn.box.text, summary))
        self._update_editable()
        if message.error is not None:
            self._report_failure(message.error, message.fatal)
        elif self.last_finish == "repetition":
            self.notify("The answer was stopped: it kept repeating itself (the loop guard) — /continue goes on.",
                        timeout=6)
        elif self.last_finish in ("length", "context"):
            self.notify(f"The answer was cut by the {'context' if self.last_finish == 'context' else 'token limit'}"
                        " — /continue goes on.", timeout=6)

    async def _turn_failed(self, turn: Turn, cause: str, fatal: bool) -> None:
        """The answer never completed: its boxes go, its prompt goes back into the input (before anything
        typed since) and out of the saved copy; if the engine died, the error screen offers a restart."""
        await turn.box.remove()
        if turn.notice is not None:
            await turn.notice.remove()
        self.window_start = turn.window_start
        await self._take_back_prompt()
        self._report_failure(cause, fatal)

    def _report_failure(self, cause: str, fatal: bool) -> None:
        if fatal:
            self.on_engine_failed(EngineFailed(cause))
        else:
            self.notify(cause, title="No answer", severity="error", markup=False, timeout=10)

    async def _take_back_prompt(self) -> None:
        """Removes the last user message (screen, context, saved copy) and puts it back into the input."""
        prompt = self.messages[-1]["content"]
        await self._drop_last(1)
        if not self.messages and self.conversation_id is not None:  # it never had a turn: not worth a record
            self.store.delete(self.conversation_id)
            self.conversation_id = None
        box = self.query_one(PromptInput)
        box.load_text(prompt + ("\n" + box.text if box.text else ""))
        self._update_editable()

    async def _drop_last(self, n: int) -> None:
        """Removes the last n messages from the screen, the context and the saved copy."""
        if n <= 0:
            return
        first_saved = next((i for i in self.message_ids[-n:] if i is not None), None)
        if first_saved is not None and self.conversation_id is not None:
            self.store.truncate(self.conversation_id, first_saved)
            self._check_store()
        for box in self.query_one(ChatView).messages[-n:]:
            await box.remove()
        del self.messages[-n:]
        del self.message_ids[-n:]
        self.window_start = min(self.window_start, len(self.messages))

    async def _edit_fits(self, text: str) -> bool:
        """Whether the edited message would fit, checked before the turn it replaces is dropped."""
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        edited = self.messages[:last_user] + [{"role": "user", "content": text}]
        try:
            await asyncio.to_thread(window.fit, edited, min(self.window_start, last_user), self.system,
                                    self.engine.count_tokens, self.engine.info.context_length,
                                    self.params.max_new_tokens)
        except window.ContextError as e:
            self.notify(str(e), title="Does not fit", severity="error", markup=False, timeout=10)
            return False
        return True

    async def _drop_last_turn(self) -> str:
        """Removes the last user message and what answered it (an edit replaces them); returns its text."""
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        text = self.messages[last_user]["content"]
        await self._drop_last(len(self.messages) - last_user)
        return text

    def _update_editable(self) -> None:
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        self.query_one(PromptInput).editable = users[-1] if users and self._turn is None else None

    def _save(self, role: str, content: str, stats: dict | None = None) -> int | None:
        """Saves one message as soon as it exists (a crash loses at most the answer in flight). If the
        conversation was deleted meanwhile (elsewhere), it is saved afresh, whole."""
        if self.conversation_id is not None:
            try:
                message_id = self.store.add(self.conversation_id, role, content, stats)
                self._check_store()
                return message_id
            except HistoryError:
                self.notify(f"Conversation #{self.conversation_id} was deleted elsewhere; saving it anew.",
                            severity="warning")
                self.conversation_id = None
        first_prompt = next(m["content"] for m in self.messages if m["role"] == "user")
        self.conversation_id = self.store.create(title_from(first_prompt), self.system)
        if self.conversation_id is not None:
            earlier = len(self.messages) - (1 if role == "user" else 0)  # an answer is not in messages yet
            for i, m in enumerate(self.messages[:earlier]):
                self.message_ids[i] = self.store.add(self.conversation_id, m["role"], m["content"])
        message_id = self.store.add(self.conversation_id, role, content, stats) if self.conversation_id else None
        self._check_store()
        return message_id

    def _check_store(self) -> None:
        """Says once, plainly, that the conversation is not being saved, and why."""
        if self.store.problem and not self._store_problem_shown:
            self._store_problem_shown = True
            self.notify(f"{self.store.problem}. The chat goes on, but nothing is saved.",
                        title="Not saved", severity="error", markup=False, timeout=20)
            self._update_subtitle()

    # --- actions ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat keys are hidden while the loading or error screen is up, Stop unless answering."""
        if action in ("stop", "copy_last", "new_chat", "history", "help") and isinstance(
            self.screen, (LoadingScreen, ErrorScreen)
        ):
            return False
        if action == "stop":
            return self._turn is not None
        return True

    def action_stop(self) -> None:
        if self._turn is not None and self.engine is not None:
            self.engine.cancel()

    def action_copy_last(self) -> None:
        """OSC 52 through the terminal, and the system clipboard tool where there is one: only a tool can
        confirm that the text arrived, so only then does the notice say "copied"."""
        text = self.query_one(ChatView).last_answer
        if text is None:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(text)
        self._copy_with_tools(text)

    @work(thread=True, group="clipboard")
    def _copy_with_tools(self, text: str) -> None:
        tool, error = copy_with_tools(text)
        self.post_message(CopyDone(tool, error))

    def on_copy_done(self, message: CopyDone) -> None:
        if message.tool is not None:
            self.notify(f"Copied the last answer to the clipboard ({message.tool}).")
            return
        why = f"{message.error}; " if message.error else "no clipboard tool (wl-copy, xclip, pbcopy) found; "
        self.notify(f"Could not copy for sure: {why}the answer was sent to the terminal (OSC 52), which "
                    "copies it only if the terminal supports that.", severity="warning", markup=False, timeout=10)

    async def action_new_chat(self) -> None:
        await self.run_slash("/new")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_history(self) -> None:
        if not self._idle("open the history"):
            return
        if self.store.problem:
            self.notify(self.store.problem, title="History", severity="error", markup=False)
            return
        self.push_screen(HistoryScreen(self.store, self.conversation_id), self._after_history)

    async def _after_history(self, result: HistoryResult | None) -> None:
        if result is None:
            return
        if self.conversation_id in result.deleted:
            await self._reset()
            self.notify("The open conversation was deleted; this is a new one.")
        if result.open is not None:
            await self.resume_conversation(result.open)

    def _update_subtitle(self) -> None:
        temp = "greedy" if self.params.greedy else f"T={self.params.temperature:g}"
        unsaved = "not saved" if self.store.problem else ""
        self.sub_title = " · ".join(x for x in (self.model_line, self.params.mode, temp, unsaved) if x)

    # --- slash commands ---------------------------------------------------------------------------

    async def run_slash(self, text: str) -> bool:
        """Runs ``/name args``; returns whether it worked (the input is cleared only then)."""
        name, _, arg = text[1:].partition(" ")
        if name not in NAMES:
            self.notify(f"Unknown command /{name} — /help lists them.", severity="error")
            return False
        try:
            return await getattr(self, f"_slash_{name}")(arg.strip())
        except (ConfigError, ValueError, OSError, HistoryError) as e:  # a bad argument, an unwritable file,
            self.notify(f"/{name}: {e}", severity="error", markup=False)  # a conversation deleted elsewhere
            return False

    def _idle(self, what: str) -> bool:
        if self._turn is not None:
            self.notify(f"Stop the answer first (Esc), then {what}.", severity="warning")
            return False
        return True

    def _can_answer(self, what: str) -> bool:
        if self.engine is None:
            self.notify("The engine is not ready yet.", severity="warning")
            return False
        return self._idle(what)

    async def _slash_help(self, arg: str) -> bool:
        self.action_help()
        return True

    async def _slash_history(self, arg: str) -> bool:
        self.action_history()
        return True

    async def _slash_continue(self, arg: str) -> bool:
        if not self._can_answer("continue"):
            return False
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.notify("There is no answer to continue.", severity="warning")
            return False
        if self.last_finish not in self.CUT_SHORT:
            self.notify(f"The last answer is complete ({self.last_finish or 'unknown'}); /retry writes a new one.",
                        severity="warning", markup=False)
            return False
        await self._answer(continuing=True, params=self.params)
        return True

    async def _slash_retry(self, arg: str) -> bool:
        if not self._can_answer("retry"):
            return False
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.notify("There is no answer to retry.", severity="warning")
            return False
        await self._drop_last(1)
        if self.params.greedy:
            params = self.params
            self.notify("Greedy decoding (temperature 0) gives the same answer again; /temp 0.7 samples "
                        "a different one.", timeout=8)
        else:
            params = replace(self.params, seed=random.randrange(2**31))
            self.notify(f"Retrying with seed {params.seed}.")
        await self._answer(continuing=False, params=params)
        return True

    async def _slash_edit(self, arg: str) -> bool:
        if not self._idle("edit"):
            return False
        prompt = self.query_one(PromptInput)
        if prompt.editable is None:
            self.notify("There is no message to edit.", severity="warning")
            return False
        prompt.start_edit(prompt.editable)
        return False  # the input now holds the message being edited: it must not be cleared

    async def _slash_clear(self, arg: str) -> bool:
        if not self._idle("clear"):
            return False
        if self.conversation_id is None or not self.store.available:
            await self._clear()
            return True

        async def answered(yes: bool | None) -> None:
            if yes:
                await self._clear()

        title = self.store.get(self.conversation_id).title
        self.push_screen(ConfirmScreen(
            f"Erase the messages of “{title}” from the screen and from the history? This cannot be undone.",
            "Erase"), answered)
        return True

    async def _clear(self) -> None:
        await self.query_one(ChatView).clear()
        if self.conversation_id is not None:
            self.store.clear(self.conversation_id)
            self._check_store()
        self._forget_messages()
        self.notify("Conversation cleared.")

    def _forget_messages(self) -> None:
        self.messages, self.message_ids, self.window_start, self.last_finish = [], [], 0, None
        self._update_editable()

    async def _reset(self) -> None:
        await self.query_one(ChatView).clear()
        self._forget_messages()
        self.conversation_id = None

    async def _slash_new(self, arg: str) -> bool:
        if not self._idle("start a new conversation"):
            return False
        await self._reset()
        self.notify("New conversation.")
        return True

    async def _slash_system(self, arg: str) -> bool:
        if not arg:
            self.notify(f"System prompt: {self.system or '(none)'}", markup=False)
            return True
        self.system = None if arg == "off" else arg
        if self.conversation_id is not None:
            self.store.set_system(self.conversation_id, self.system)
            self._check_store()
        self.notify("System prompt removed." if self.system is None else "System prompt set.")
        return True

    async def _slash_mode(self, arg: str) -> bool:
        if arg not in MODES:
            raise ConfigError(f"choose one of {', '.join(MODES)}")
        return self._set_params(mode=arg)

    async def _slash_temp(self, arg: str) -> bool:
        return self._set_params(temperature=float(arg))

    async def _slash_max(self, arg: str) -> bool:
        return self._set_params(max_new_tokens=int(arg))

    def _set_params(self, **changes: Any) -> bool:
        self.params = replace(self.params, **changes).validate()
        self._update_subtitle()
        self.notify(", ".join(f"{k.replace('_', ' ')} = {v}" for k, v in changes.items()))
        return True

    async def _slash_save(self, arg: str) -> bool:
        if self.store.problem:
            self.notify(f"Cannot save: {self.store.problem}", severity="error", markup=False)
            return False
        if self.conversation_id is None:
            self.notify("Nothing to save yet: send a message first.", severity="warning")
            return False
        if arg:
            self.store.rename(self.conversation_id, arg)
        title = self.store.get(self.conversation_id).title
        self.notify(f"Saved as #{self.conversation_id}: {title} (swiftspec chat --resume "
                    f"{self.conversation_id})", markup=False)
        return True

    async def _slash_export(self, arg: str) -> bool:
        if not self.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return False
        stamp = time.strftime("%Y%m%d-%H%M%S")
        default = exports_dir() / f"swiftspec-{self.conversation_id or 'unsaved'}-{stamp}.md"
        path = (Path(arg).expanduser() if arg else default).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        first_prompt = next((m["content"] for m in self.messages if m["role"] == "user"), "SwiftSpec chat")
        title = title_from(first_prompt)
        if self.conversation_id is not None and self.store.available:
            title = self.store.get(self.conversation_id).title
        # what is on screen, with each answer's figures where they were saved
        stats = {m.id: m.stats for m in self.store.messages(self.conversation_id)} if self.conversation_id else {}
        messages = [StoredMessage(m["role"], m["content"], stats.get(mid))
                    for m, mid in zip(self.messages, self.message_ids, strict=True)]
        path.write_text(to_markdown(title, self.system, messages), encoding="utf-8")
        self.notify(f"Exported to {path}", markup=False, timeout=10)
        return True

    async def _slash_copy(self, arg: str) -> bool:
        self.action_copy_last()
        return True

    async def _slash_quit(self, arg: str) -> bool:
        self.exit(0)
        return True

    # --- history ----------------------------------------------------------------------------------

    async def resume_conversation(self, conversation_id: int) -> None:
        if not self._idle("resume"):
            return
        conversation = self.store.get(conversation_id)
        stored = self.store.messages(conversation_id)
        chat = self.query_one(ChatView)
        await chat.clear()
        for m in stored:
            await chat.add(m.role, m.content, footer=stats_line(m.stats, short=True) if m.stats else "")
        self.messages = [{"role": m.role, "content": m.content} for m in stored]
        self.message_ids = [m.id for m in stored]
        self.window_start = 0
        last = stored[-1] if stored else None
        self.last_finish = (last.stats or {}).get("finish_reason") if last and last.role == "assistant" else None
        self.conversation_id = conversation.id
        self.system = self.system or conversation.system
        prompt = self.query_one(PromptInput)
        prompt.recall = [m.content for m in stored if m.role == "user"]
        self._update_editable()
        self.notify(f"Resumed #{conversation.id}: {conversation.title}", markup=False)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New conversation", "Start afresh; this one stays saved", self.action_new_chat)
        yield SystemCommand("History", "Saved conversations: open, rename, delete (F2)", self.action_history)
        yield SystemCommand("Stop the answer", "Cancel the answer being generated (Esc)", self.action_stop)
        yield SystemCommand("Continue the answer", "Go on where the last answer was cut (/continue)",
                            partial(self.run_slash, "/continue"))
        yield SystemCommand("Retry the answer", "Write the last answer again (/retry)",
                            partial(self.run_slash, "/retry"))
        yield SystemCommand("Copy last answer", "To the clipboard", self.action_copy_last)
        yield SystemCommand("Export to Markdown", "Write this conversation to a .md file",
                            partial(self.run_slash, "/export"))
        yield SystemCommand("Help", "Slash commands and keys", self.action_help)
        for mode in MODES:
            yield SystemCommand(f"Mode: {mode}", "Decoding mode for the next answers",
                                partial(self.run_slash, f"/mode {mode}"))
        for conv in self.store.list(20):
            yield SystemCommand(f"Resume #{conv.id}: {conv.title}", f"Saved {local_time(conv.updated)}, "
                                f"{_turns(conv.turns)}", partial(self.resume_conversation, conv.id),
                                discover=False)


def _turns(n: int) -> str:
    return f"{n} turn{'s' if n != 1 else ''}"

