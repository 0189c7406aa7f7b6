"""The chat app: conversation on the left, live stats on the right, the engine in thread workers.

The conversation itself (messages, settings, saving) is a swiftspec.conversation.Conversation, shared
with scripted mode; this app shows it, one MessageBox per message, named by the message's key. Threads
never touch widgets: the start worker posts messages, the generate worker fills an AnswerBuffer that a
timer drains into the UI a few times a second, as seldom as keeps the UI's share of a core small: its
rendering competes with decoding for the cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header

from swiftspec import window
from swiftspec.conversation import CannotAnswer, Conversation, Kind, Reply, Settings, describe
from swiftspec.engine.config import MODES
from swiftspec.engine.events import AT_LIMIT
from swiftspec.engine.host.answer import AnswerSummary
from swiftspec.engine.host.protocol import EngineAPI
from swiftspec.history import HistoryStore
from swiftspec.tui import clipboard, commands, preferences
from swiftspec.tui.history_screen import HistoryResult, HistoryScreen
from swiftspec.tui.messages import (
    AnswerAccepted,
    AnswerDone,
    CopyDone,
    EngineFailed,
    EngineProgress,
    EngineReady,
    Turn,
)
from swiftspec.tui.sampling import title_line
from swiftspec.tui.screens import ErrorScreen, HelpScreen, LoadingScreen
from swiftspec.tui.stream import AnswerBuffer, DrawPace
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel

EngineFactory = Callable[[Callable[[str], None]], EngineAPI]


def _retry_notice(params, replaced_temperature: float | None) -> str:
    """What /retry says, true for the answer it replaces (sampled at ``replaced_temperature``; None:
    not known, an answer saved before answers kept it)."""
    if not params.greedy:
        return f"Retrying with seed {params.seed}."
    if replaced_temperature == 0:
        return "Greedy decoding (temperature 0) gives the same answer again; /temp 0.7 samples a different one."
    return "Retrying greedily (temperature 0): the answer that decoding gives, the same each time."
CHAT_KEYS = ("stop", "interrupt", "copy_last", "new_chat", "history", "help", "toggle_stats")


class SwiftSpecApp(App[int]):
    """``engine_factory(progress)`` starts the engine (blocking); the app calls it in a thread worker,
    again after a failure when the user asks for a restart. ``defaults`` are the session's settings: a
    new conversation starts from them."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so subclasses elsewhere find it too
    TITLE = "SwiftSpec"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (72, "-normal"), (120, "-wide"), (180, "-widest")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+c", "interrupt", "Stop", show=False, priority=True),
        Binding("ctrl+o", "copy_last", "Copy"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("f2", "history", "History"),
        Binding("f3", "toggle_stats", "Stats"),
        Binding("f1", "help", "Help"),
    ]

    def __init__(self, engine_factory: EngineFactory, defaults: Settings, store: HistoryStore | None = None,
                 conversation: Conversation | None = None, model_line: str = "") -> None:
        super().__init__()
        self.engine_factory = engine_factory
        self.defaults = defaults
        self.store = store or HistoryStore()
        self.conversation = conversation or Conversation(self.store, defaults.copy())
        self.model_line = model_line
        self.closing: threading.Thread | None = None  # the engine's close, once the app is gone
        self.engine: EngineAPI | None = None
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

    async def on_mount(self) -> None:
        self._flush_timer: Timer | None = None
        self._pace = DrawPace()
        self.theme = preferences.load().get("theme", self.theme)
        if self.store.notice:
            self.notify(self.store.notice, title="History", severity="warning", markup=False, timeout=15)
        self._check_store()
        await self.show_conversation()
        self._start_engine(None)

    def watch_theme(self, theme: str) -> None:
        if self.is_mounted:  # chosen by the user (palette): kept for the next start
            preferences.save(theme=theme)

    def on_unmount(self) -> None:
        if self._turn is not None:  # quitting mid-answer keeps what was written, marked cancelled
            self.conversation.finish(self._turn.reply, "cancelled")
        with self._engine_lock:
            self._leaving = True
            engine, self.engine = self.engine, None
        if engine is not None:  # off the event loop: ending the workers takes seconds, the screen is gone at once
            engine.cancel()
            self.closing = threading.Thread(target=engine.close, name="engine-close")  # the interpreter waits for it
            self.closing.start()

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
        self.title = info.target  # what runs: the model and its precision (weights, activations, kernels)
        self.query_one(StatsPanel).set_info(info)
        self.fit_mode()
        self.query_one(PromptInput).focus()

    def available_modes(self) -> tuple[str, ...]:
        """What this engine can run: ar alone when it was started without a draft (--mode ar)."""
        return ("ar",) if self.engine is not None and not self.engine.info.speculative else MODES

    def fit_mode(self) -> None:
        """A conversation (resumed, or set while loading) in a mode this engine cannot run answers in ar."""
        params = self.conversation.params
        if params.mode not in self.available_modes():
            self.conversation.set_params(dataclasses.replace(params, mode="ar"))
            self.notify(f"This engine runs ar only (started with --mode ar, no draft): answering in ar, not "
                        f"{params.mode}.", severity="warning", timeout=10)
        self.update_title()

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
            if await commands.run(self, text):
                event.prompt_input.clear()
            else:  # kept to be corrected, selected so that typing another command replaces it
                event.prompt_input.select_all()
            return
        if await self.answer("edit" if event.edit else "ask", text):
            event.prompt_input.clear()

    async def answer(self, kind: Kind, text: str | None = None) -> bool:
        """Starts an answer; False (the input keeps its text) when it cannot start. Its boxes are only
        proposed until the engine accepts the request (AnswerAccepted)."""
        if not self.can_answer(kind):
            return False
        try:  # in a thread: tokenizing a long conversation takes a moment, the screen keeps drawing
            plan = await asyncio.to_thread(self.conversation.plan, kind, window.Context.of(self.engine), text)
        except window.ContextError as e:
            self.notify(str(e), title="Does not fit", severity="error", markup=False, timeout=10)
            return False
        except CannotAnswer as e:
            self.notify(str(e), severity="warning", markup=False)
            return False
        chat = self.query_one(ChatView)
        question = await chat.add("user", text) if plan.question is not None else None
        if kind == "continue":
            box = chat.box(self.conversation.messages[-1].key)
            box.resume()
        else:
            box = await chat.add("assistant", streaming=True)
        if kind == "retry":
            replaced = self.conversation.messages[-1]  # still there: the engine has not accepted the retry yet
            self.notify(_retry_notice(plan.params, (replaced.stats or {}).get("temperature")), timeout=8)
        edited = self.conversation.editable if kind == "edit" else None
        self._turn = Turn(Reply(plan), box, question, AnswerBuffer(), edited)
        self.query_one(PromptInput).editable = None
        self.query_one(StatsPanel).start_turn(plan.params.mode)
        self._pace = DrawPace()
        self._schedule_flush(DrawPace.SHORTEST)
        self.refresh_bindings()
        self._generate(self.engine, self._turn)
        return True

    @work(thread=True, group="generate")
    def _generate(self, engine: EngineAPI, turn: Turn) -> None:
        def accepted(_reply) -> None:
            if turn.stop:  # Esc came before the engine had the request, and its cancel found none
                engine.cancel()
            self.post_message(AnswerAccepted(turn))

        self.conversation.run(turn.reply, engine, on_accept=accepted, on_event=turn.buffer.push)
        self.post_message(AnswerDone(turn))

    def _schedule_flush(self, delay: float) -> None:
        self._flush_timer = self.set_timer(delay, self._flush_streaming)

    async def _flush_streaming(self) -> None:
        """The streaming answer's refresh, then the next one's, as the pace says."""
        if self._turn is None:
            return
        await self._flush_answer()
        self._schedule_flush(self._pace.next_delay())

    async def _flush_answer(self) -> None:
        if self._turn is None:
            return
        text, steps = self._turn.buffer.drain()
        if text:
            await self._turn.box.append(text)
        if steps:
            self.query_one(StatsPanel).add_steps(steps)

    async def on_answer_accepted(self, message: AnswerAccepted) -> None:
        """The conversation now holds the answer: the boxes of what it replaced go, the new ones are its."""
        turn, plan, chat = message.turn, message.turn.reply.plan, self.query_one(ChatView)
        messages = self.conversation.messages
        turn.box.key = turn.reply.answer.key
        if turn.question is not None:
            turn.question.key = messages[-2].key
        await chat.keep_only({m.key for m in messages})
        if plan.left_out:
            turn.notice = await chat.add_context_notice(plan.left_out, plan.kept, before=turn.question or turn.box)
        if plan.question is not None:
            prompt = self.query_one(PromptInput)
            if turn.edited is not None:  # the edited message replaces the last one in the recall list too
                prompt.forget(turn.edited)
            prompt.remember(plan.question)

    async def on_answer_done(self, message: AnswerDone) -> None:
        await self._flush_answer()
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        turn, reply, plan = message.turn, message.turn.reply, message.turn.reply.plan
        self._turn = None
        self.refresh_bindings()
        self._notify_warnings()
        self._check_store()
        if reply.accepted or plan.kind == "continue":
            await turn.box.finish(AnswerSummary.from_dict(self.conversation.messages[-1].stats or {}).line(short=True))
        else:  # nothing changed: the proposed boxes go, the question back into the input
            await turn.box.remove()
            if turn.question is not None:
                await turn.question.remove()
                self.query_one(PromptInput).give_back(plan.question, editing=plan.kind == "edit")
        self._update_editable()
        finish = self.conversation.last_finish
        if reply.error is not None:
            self._report_failure(reply.error, reply.fatal)
        elif finish == "repetition":
            self.notify("The answer was stopped: it kept repeating itself (the loop guard) — /continue goes on.",
                        timeout=6)
        elif finish in AT_LIMIT:
            self.notify(f"The answer was cut by the {'context' if finish == 'context' else 'token limit'}"
                        " — /continue goes on.", timeout=6)

    def _report_failure(self, cause: str, fatal: bool) -> None:
        if fatal:
            self.on_engine_failed(EngineFailed(cause))
        else:
            self.notify(cause, title="No answer", severity="error", markup=False, timeout=10)

    # --- the conversation on screen ---------------------------------------------------------------

    async def show_conversation(self, conversation: Conversation | None = None) -> None:
        """Shows ``conversation`` (now the app's), or the app's own afresh: messages, settings, recall list."""
        self.conversation = conversation or self.conversation
        await self.query_one(ChatView).show(self.conversation.messages)
        self.query_one(PromptInput).recall = [m.content for m in self.conversation.messages if m.role == "user"]
        self._update_editable()
        self._notify_warnings()
        if self.engine is not None:
            self.fit_mode()
        self.update_title()

    def _update_editable(self) -> None:
        editable = self.conversation.editable
        self.query_one(PromptInput).editable = editable if self._turn is None else None

    def _notify_warnings(self) -> None:
        for warning in self.conversation.take_warnings():
            self.notify(warning, severity="warning", markup=False, timeout=10)

    def _check_store(self) -> None:
        """Says once, plainly, that the conversation is not being saved, and why."""
        if self.store.problem and not self._store_problem_shown:
            self._store_problem_shown = True
            self.notify(f"{self.store.problem}. The chat goes on, but nothing is saved.",
                        title="Not saved", severity="error", markup=False, timeout=20)
            self.update_title()

    def update_title(self) -> None:
        self.sub_title = title_line(self.conversation.params) + (" · not saved" if self.store.problem else "")

    # --- actions ----------------------------------------------------------------------------------

    def idle(self, what: str) -> bool:
        if self._turn is not None:
            self.notify(f"Stop the answer first (Esc), then {what}.", severity="warning")
            return False
        return True

    def can_answer(self, what: str) -> bool:
        if self.engine is None:
            self.notify("The engine is not ready yet.", severity="warning")
            return False
        return self.idle(what)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat keys are hidden while the loading or error screen is up, Stop unless answering."""
        if action in CHAT_KEYS and isinstance(self.screen, (LoadingScreen, ErrorScreen)):
            return False
        if action == "stop":
            return self._turn is not None
        return True

    def action_stop(self) -> None:
        if self._turn is not None and self.engine is not None:
            self._turn.stop = True
            self.engine.cancel()

    def action_interrupt(self) -> None:
        """Ctrl+C stops the answer, as in a shell; otherwise it copies the input's selection, or says how
        to quit."""
        prompt = self.query_one(PromptInput)
        if self._turn is not None:
            self.action_stop()
        elif self.focused is prompt and prompt.selected_text:
            prompt.action_copy()
        else:
            self.action_help_quit()

    def action_copy_last(self) -> None:
        text = self.query_one(ChatView).last_answer
        if text is None:
            self.notify("No answer to copy yet.", severity="warning")
            return
        clipboard.copy(self, text, "the last answer")

    def on_message_box_copy_code(self, message: MessageBox.CopyCode) -> None:
        clipboard.copy(self, message.code, "the code block")
        self.query_one(PromptInput).focus()  # typing goes on where it was

    def on_copy_done(self, message: CopyDone) -> None:
        clipboard.report(self, message)

    def action_toggle_stats(self) -> None:
        """Shows or hides the stats panel at any width (by default it hides below 72 columns)."""
        body, panel = self.query_one("#body"), self.query_one(StatsPanel)
        shown = panel.display
        body.set_class(shown, "-stats-off")
        body.set_class(not shown, "-stats-on")

    async def action_new_chat(self) -> None:
        await commands.run(self, "/new")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_history(self) -> None:
        if not self.idle("open the history"):
            return
        if self.store.problem:
            self.notify(self.store.problem, title="History", severity="error", markup=False)
            return
        self.push_screen(HistoryScreen(self.store, self.conversation.id), self._after_history)

    async def _after_history(self, result: HistoryResult | None) -> None:
        if result is None:
            return
        if self.conversation.id in result.deleted:
            await self.show_conversation(Conversation(self.store, self.defaults.copy()))
            self.notify("The open conversation was deleted; this is a new one.")
        if result.open is not None:
            await self.resume_conversation(result.open)

    async def resume_conversation(self, conversation_id: int) -> None:
        if self.idle("resume"):
            conversation = Conversation.resume(self.store, conversation_id, self.defaults)
            await self.show_conversation(conversation)
            self.notify(f"Resumed #{conversation.id}: {conversation.title}", markup=False)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from commands.palette(self)
