"""The chat app: conversation on the left, live stats on the right, the engine in thread workers.

Threads never touch widgets: the start worker posts messages, the generate worker fills an AnswerBuffer
that a timer drains into the UI a few times a second, so rendering never slows decoding.
"""

from __future__ import annotations

import threading
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

from swiftspec.config import MODES, ConfigError, SamplingParams
from swiftspec.history import HistoryStore, stats_line, title_from, to_markdown
from swiftspec.history import Message as StoredMessage
from swiftspec.tui.commands import NAMES
from swiftspec.tui.screens import ErrorScreen, HelpScreen, LoadingScreen
from swiftspec.tui.stream import AnswerBuffer
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel

EngineFactory = Callable[[Callable[[str], None]], Any]


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
class AnswerDone(Message):
    buffer: AnswerBuffer
    error: str | None = None
    fatal: bool = False  # the engine is gone, not just this answer


class SwiftSpecApp(App[int]):
    """``engine_factory(progress)`` starts the engine (blocking); the app calls it in a thread worker,
    again after a failure when the user asks for a restart."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so subclasses elsewhere find it too
    TITLE = "SwiftSpec"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (72, "-normal"), (120, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+o", "copy_last", "Copy answer"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("f1", "help", "Help"),
    ]
    FLUSH_INTERVAL = 1 / 12  # seconds between UI refreshes while an answer streams

    def __init__(self, engine_factory: EngineFactory, params: SamplingParams, system: str | None = None,
                 store: HistoryStore | None = None, resume: int | None = None, model_line: str = "") -> None:
        super().__init__()
        self.engine_factory = engine_factory
        self.params = params
        self.system = system
        self.store = store or HistoryStore()
        self.model_line = model_line
        self.engine: Any = None
        self.messages: list[dict] = []  # the conversation sent to the engine, system prompt excluded
        self.conversation_id: int | None = None
        self._resume = resume
        self._buffer: AnswerBuffer | None = None  # set while an answer is being generated
        self._answer: MessageBox | None = None
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

    async def on_mount(self) -> None:
        self._flush_timer = self.set_interval(self.FLUSH_INTERVAL, self._flush_answer, pause=True)
        self._update_subtitle()
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

    def _start_engine(self, old: Any) -> None:
        self.push_screen(LoadingScreen(self.model_line))
        self._run_start(old)

    @work(thread=True, exclusive=True, group="engine")
    def _run_start(self, old: Any) -> None:
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
        info = self.engine.info.to_dict()
        self.model_line = f"{info['target']} ← {info['draft']}"
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
        if text.startswith("/"):
            if await self.run_slash(text):
                event.prompt_input.clear()
            return
        if self.engine is None:
            self.notify("The engine is not ready yet.", severity="warning")
            return
        if self._buffer is not None:
            self.notify("Still answering — Esc stops it.", severity="warning")
            return
        event.prompt_input.clear()
        event.prompt_input.remember(text)
        await self.send(text)

    async def send(self, text: str) -> None:
        chat = self.query_one(ChatView)
        await chat.add("user", text)
        self._answer = await chat.add("assistant", streaming=True)
        self.messages.append({"role": "user", "content": text})
        self._buffer = AnswerBuffer(self.params.mode)
        self.query_one(StatsPanel).start_turn(self.params.mode)
        self._flush_timer.resume()
        self.refresh_bindings()
        self._generate(self.engine, self._engine_messages(), replace(self.params), self._buffer)

    def _engine_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    @work(thread=True, group="generate")
    def _generate(self, engine: Any, messages: list[dict], params: SamplingParams, buffer: AnswerBuffer) -> None:
        try:
            for ev in engine.generate(messages, params):
                buffer.push(ev)
        except Exception as e:  # the engine refused this answer, or died (EngineError either way)
            self.post_message(AnswerDone(buffer, describe(e), fatal=not engine.alive))
            return
        self.post_message(AnswerDone(buffer))

    async def _flush_answer(self) -> None:
        if self._buffer is None or self._answer is None:
            return
        text, steps = self._buffer.drain()
        if text:
            await self._answer.append(text)
        if steps:
            self.query_one(StatsPanel).add_steps(steps)

    async def on_answer_done(self, message: AnswerDone) -> None:
        await self._flush_answer()
        self._flush_timer.pause()
        answer, prompt = self._answer, self.messages[-1]["content"]
        self._buffer = self._answer = None
        self.refresh_bindings()
        if message.error is not None:
            await self._turn_failed(answer, prompt, message.error, message.fatal)
            return
        summary = message.buffer.recorder.summary()
        await answer.finish(stats_line(summary, short=True))
        self.messages.append({"role": "assistant", "content": answer.text})
        conversation = self._ensure_conversation(prompt)
        self.store.add(conversation, "user", prompt)
        self.store.add(conversation, "assistant", answer.text, summary)

    async def _turn_failed(self, answer: MessageBox, prompt: str, cause: str, fatal: bool) -> None:
        """The turn never completed: its boxes go, its prompt goes back into the input (before anything
        typed since); if the engine died, the error screen offers a restart."""
        self.messages.pop()
        boxes = list(self.query_one(ChatView).query(MessageBox))
        await boxes[-2].remove()
        await answer.remove()
        box = self.query_one(PromptInput)
        box.load_text(prompt + ("\n" + box.text if box.text else ""))
        if fatal:
            self.on_engine_failed(EngineFailed(cause))
        else:
            self.notify(cause, title="No answer", severity="error", markup=False, timeout=10)

    def _ensure_conversation(self, first_prompt: str) -> int:
        if self.conversation_id is None:
            self.conversation_id = self.store.create(title_from(first_prompt), self.system)
        return self.conversation_id

    # --- actions ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat keys are hidden while the loading or error screen is up, Stop unless answering."""
        if action in ("stop", "copy_last", "new_chat", "help") and isinstance(
            self.screen, (LoadingScreen, ErrorScreen)
        ):
            return False
        if action == "stop":
            return self._buffer is not None
        return True

    def action_stop(self) -> None:
        if self._buffer is not None and self.engine is not None:
            self.engine.cancel()

    def action_copy_last(self) -> None:
        text = self.query_one(ChatView).last_answer
        if text is None:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify("Copied the last answer (OSC 52).")

    async def action_new_chat(self) -> None:
        await self.run_slash("/new")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def _update_subtitle(self) -> None:
        temp = "greedy" if self.params.greedy else f"T={self.params.temperature:g}"
        self.sub_title = " · ".join(x for x in (self.model_line, self.params.mode, temp) if x)

    # --- slash commands ---------------------------------------------------------------------------

    async def run_slash(self, text: str) -> bool:
        """Runs ``/name args``; returns whether it worked (the input is cleared only then)."""
        name, _, arg = text[1:].partition(" ")
        if name not in NAMES:
            self.notify(f"Unknown command /{name} — /help lists them.", severity="error")
            return False
        try:
            return await getattr(self, f"_slash_{name}")(arg.strip())
        except (ConfigError, ValueError, OSError) as e:  # a bad argument, or a file that cannot be written
            self.notify(f"/{name}: {e}", severity="error", markup=False)
            return False

    def _idle(self, what: str) -> bool:
        if self._buffer is not None:
            self.notify(f"Stop the answer first (Esc), then {what}.", severity="warning")
            return False
        return True

    async def _slash_help(self, arg: str) -> bool:
        self.action_help()
        return True

    async def _slash_clear(self, arg: str) -> bool:
        if not self._idle("clear"):
            return False
        await self.query_one(ChatView).clear()
        self.messages = []
        if self.conversation_id is not None:
            self.store.clear(self.conversation_id)
        self.notify("Conversation cleared.")
        return True

    async def _slash_new(self, arg: str) -> bool:
        if not self._idle("start a new conversation"):
            return False
        await self.query_one(ChatView).clear()
        self.messages = []
        self.conversation_id = None
        self.notify("New conversation.")
        return True

    async def _slash_system(self, arg: str) -> bool:
        if not arg:
            self.notify(f"System prompt: {self.system or '(none)'}", markup=False)
            return True
        self.system = None if arg == "off" else arg
        if self.conversation_id is not None:
            self.store.set_system(self.conversation_id, self.system)
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
        path = Path(arg or f"swiftspec-chat-{self.conversation_id or 'unsaved'}.md").expanduser()
        title = self.store.get(self.conversation_id).title if self.conversation_id else "SwiftSpec chat"
        messages = (self.store.messages(self.conversation_id) if self.conversation_id
                    else [StoredMessage(m["role"], m["content"]) for m in self.messages])
        path.write_text(to_markdown(title, self.system, messages), encoding="utf-8")
        self.notify(f"Exported to {path}", markup=False)
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
        self.conversation_id = conversation.id
        self.system = self.system or conversation.system
        self.query_one(PromptInput).recall = [m.content for m in stored if m.role == "user"]
        self.notify(f"Resumed #{conversation.id}: {conversation.title}", markup=False)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New conversation", "Start afresh; this one stays saved", self.action_new_chat)
        yield SystemCommand("Stop the answer", "Cancel the answer being generated (Esc)", self.action_stop)
        yield SystemCommand("Copy last answer", "To the clipboard, through OSC 52", self.action_copy_last)
        yield SystemCommand("Export to Markdown", "Write this conversation to a .md file",
                            partial(self.run_slash, "/export"))
        yield SystemCommand("Help", "Slash commands and keys", self.action_help)
        for mode in MODES:
            yield SystemCommand(f"Mode: {mode}", "Decoding mode for the next answers",
                                partial(self.run_slash, f"/mode {mode}"))
        for conv in self.store.list(20):
            yield SystemCommand(f"Resume #{conv.id}: {conv.title}", "A saved conversation",
                                partial(self.resume_conversation, conv.id), discover=False)
