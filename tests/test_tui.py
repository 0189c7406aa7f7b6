"""Pilot tests of the chat app against the scripted FakeEngine (fast); the real engine is in test_tui_real."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import ANSWER, FakeEngine
from helpers.pilot import boxes, figures, idle, make_app, ready, resumed_app, text_of, type_and_send, wait_for
from textual import events

from swiftspec.history import HistoryStore
from swiftspec.tui import stream
from swiftspec.tui.app import SwiftSpecApp
from swiftspec.tui.dialogs import ConfirmScreen
from swiftspec.tui.screens import ErrorScreen, HelpScreen, LoadingScreen
from swiftspec.tui.stream import DrawPace
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel


@pytest.fixture
def store(tmp_path):
    s = HistoryStore(tmp_path / "history.sqlite3")
    yield s
    s.close()


async def test_type_send_stream_stats_and_history(store, monkeypatch):
    fragments = []  # what each UI flush appended to the answer
    append = MessageBox.append

    async def spy(self, fragment):
        fragments.append(fragment)
        await append(self, fragment)

    monkeypatch.setattr(MessageBox, "append", spy)
    factory = FakeEngine.factory(step_delay=0.05)
    app = make_app(store, factory)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press(*"hello")
        await pilot.press("enter")
        assert app.query_one(PromptInput).text == ""
        await idle(pilot)
        assert boxes(app) == [("user", "hello"), ("assistant", ANSWER)]
        # streamed in several flushes, each batching several decoding steps (11 here)
        assert "".join(fragments) == ANSWER and 2 <= len(fragments) < 11
        engine = factory.started[0]
        assert engine.calls[0][0] == [{"role": "user", "content": "hello"}]
        panel = app.query_one(StatsPanel)
        assert "async" in figures(app) and "50.0" in figures(app)
        assert panel.query_one("Sparkline").data  # latency of recent steps
        assert "fake-target" in text_of(panel.query_one("#layout"))
        assert "async" in app.query_one(ChatView).query(MessageBox).last().border_subtitle
    saved = store.messages(app.conversation.id)
    assert [(m.role, m.content) for m in saved] == [("user", "hello"), ("assistant", ANSWER)]
    assert saved[1].stats["finish_reason"] == "eos"
    app.closing.join(5)
    assert engine.closed  # leaving the app closes the engine (in a thread of its own)


@pytest.mark.parametrize("ui_ms, later", [(2, DrawPace.SHORTEST), (20, 0.02 / DrawPace.SHARE), (100, DrawPace.LONGEST)])
async def test_a_streaming_answer_refreshes_less_often_the_more_its_refreshes_cost(store, monkeypatch, ui_ms, later):
    """The UI's rendering competes with decoding for the cores: after the first refresh, the next comes once
    the UI's thread has spent at most DrawPace.SHARE of the time since (between SHORTEST and LONGEST).
    Each reading of the thread's CPU clock here is ``ui_ms`` later than the one before."""
    cpu = [0.0]

    def thread_time() -> float:
        cpu[0] += ui_ms / 1e3
        return cpu[0]

    delays = []
    schedule = SwiftSpecApp._schedule_flush
    monkeypatch.setattr(stream.time, "thread_time", thread_time)
    monkeypatch.setattr(SwiftSpecApp, "_schedule_flush", lambda self, delay: (delays.append(delay), schedule(self, delay)))
    app = make_app(store, FakeEngine.factory(step_delay=0.05))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        assert boxes(app)[-1] == ("assistant", ANSWER)
    assert delays[0] == DrawPace.SHORTEST and len(delays) >= 2
    assert delays[1:] == [pytest.approx(later)] * (len(delays) - 1)


async def test_newline_keys_and_prompt_recall(store):
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("a", "ctrl+j", "b")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "a\nb"
        await pilot.press("enter")
        await idle(pilot)
        await type_and_send(pilot, "second")
        await idle(pilot)
        await pilot.press(*"draft")
        await pilot.press("up")
        assert prompt.text == "second"
        await pilot.press("up")
        assert prompt.text == "a\nb"
        await pilot.press("down", "down")
        assert prompt.text == "draft"


async def test_fast_burst_keeps_key_order(store):
    """A terminal delivers pasted or fast-typed text and Enter in one read: all of it must be sent."""
    factory = FakeEngine.factory()
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        for key in ["a", "b", "ctrl+j", "c", "d", "enter"]:
            app._driver.send_message(events.Key(key, key if len(key) == 1 else None))
        await idle(pilot)
        await wait_for(pilot, lambda: factory.started[0].calls)
        assert factory.started[0].calls[0][0][-1]["content"] == "ab\ncd"


async def test_escape_stops_and_engine_stays_usable(store):
    factory = FakeEngine.factory(step_delay=0.05, answer="word " * 200)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "long please")
        await wait_for(pilot, lambda: boxes(app)[-1][1])
        await pilot.press("escape")
        await idle(pilot)
        answer = app.query_one(ChatView).query(MessageBox).last()
        assert "cancelled" in answer.border_subtitle
        assert 0 < len(answer.text) < len("word " * 200)
        engine = factory.started[0]
        engine.step_delay = 0
        await type_and_send(pilot, "again")
        await idle(pilot)
        assert boxes(app)[-1][1] == "word " * 200
        # the stopped answer stays in the context of the next turn
        assert [m["role"] for m in engine.calls[1][0]] == ["user", "assistant", "user"]


async def test_escape_before_the_engine_has_the_request_stops_it(store):
    """Esc between Enter and the engine taking the request: the cancel then finds no answer, so the app
    tells the engine again once it has one."""
    gate = threading.Event()
    factory = FakeEngine.factory(step_delay=0.05, answer="word " * 200, accept_gate=gate)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "long please")
        await wait_for(pilot, lambda: app._turn is not None)
        await pilot.press("escape")
        gate.set()
        await idle(pilot)
        answer = app.query_one(ChatView).query(MessageBox).last()
        assert "cancelled" in answer.border_subtitle
        assert len(answer.text) < len("word " * 200)


async def test_slash_commands(store, tmp_path):
    factory = FakeEngine.factory()
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        for command in ("/mode sync", "/temp 0.7", "/max 3", "/system Be brief."):
            await type_and_send(pilot, command)
            assert prompt.text == ""
        assert (app.conversation.params.mode, app.conversation.params.temperature, app.conversation.params.max_new_tokens) == ("sync", 0.7, 3)
        assert "sync" in app.sub_title and "T0.7" in app.sub_title
        await type_and_send(pilot, "/mode turbo")
        assert prompt.text == "/mode turbo"  # a failed command keeps what was typed
        await type_and_send(pilot, "/nonsense")
        assert prompt.text == "/nonsense"
        prompt.clear()

        await type_and_send(pilot, "hi")
        await idle(pilot)
        messages, params = factory.started[0].calls[0]
        assert messages[0] == {"role": "system", "content": "Be brief."}
        assert (params.mode, params.temperature, params.max_new_tokens) == ("sync", 0.7, 3)

        await type_and_send(pilot, "/save My title")
        assert store.get(app.conversation.id).title == "My title"
        out = tmp_path / "chat.md"
        await type_and_send(pilot, f"/export {out}")
        exported = out.read_text()
        assert exported.startswith("# My title") and "**System:** Be brief." in exported and "## You\n\nhi" in exported

        first = app.conversation.id
        await type_and_send(pilot, "/new")
        assert boxes(app) == [] and app.conversation.messages == [] and app.conversation.id is None
        assert len(store.messages(first)) == 2  # the old conversation stays saved

        await type_and_send(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        await type_and_send(pilot, "again")
        await idle(pilot)
        second = app.conversation.id
        await type_and_send(pilot, "/clear")  # asks first: Esc keeps everything
        assert isinstance(app.screen, ConfirmScreen) and "from the history" in str(app.screen.question)
        await pilot.press("escape")
        assert len(boxes(app)) == 2 and len(store.messages(second)) == 2
        await type_and_send(pilot, "/clear")
        await pilot.click("#confirm")
        await pilot.pause()
        assert boxes(app) == [] and store.messages(second) == [] and app.conversation.messages == []

        await type_and_send(pilot, "/quit")
        await pilot.pause()
    assert app.return_code == 0


async def test_copy_last_answer(store):
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        await pilot.press("ctrl+o")
        assert app.clipboard == ANSWER


async def test_history_resume(store):
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "remember 42")
        await idle(pilot)
    conversation = app.conversation.id

    factory = FakeEngine.factory()
    resumed = resumed_app(store, conversation, factory)
    async with resumed.run_test() as pilot:
        await ready(pilot)
        assert boxes(resumed) == [("user", "remember 42"), ("assistant", ANSWER)]
        prompt = resumed.query_one(PromptInput)
        await pilot.press("up")  # on an empty input: edit the last message
        assert prompt.text == "remember 42" and prompt.editing
        await pilot.press("escape")
        assert prompt.text == "" and not prompt.editing and len(boxes(resumed)) == 2
        await type_and_send(pilot, "what number?")
        await idle(pilot)
        assert [m["content"] for m in factory.started[0].calls[0][0]] == ["remember 42", ANSWER, "what number?"]
    assert len(store.messages(conversation)) == 4


async def test_resume_from_command_palette(store):
    conversation = store.create("an old chat")
    store.add(conversation, "user", "old question")
    store.add(conversation, "assistant", "old answer")
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p", *"resume #", "enter")
        await wait_for(pilot, lambda: boxes(app))
        assert boxes(app) == [("user", "old question"), ("assistant", "old answer")]
        assert app.conversation.id == conversation


async def test_engine_death_keeps_the_turn_and_restarts(store):
    """The question was accepted and saved: a death mid-answer keeps it and what was answered (marked
    "error", so /continue or /retry go on after the restart), and keeps what the user typed meanwhile."""
    starts = []

    def factory(progress):
        engine = FakeEngine(die_after=1 if not starts else None, step_delay=0.2 if not starts else 0)
        starts.append(engine)
        return engine

    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "this prompt must survive")
        app.query_one(PromptInput).insert("typed meanwhile")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        await pilot.pause()
        assert "exited with signal 9" in text_of(app.screen.query_one("#error-cause Static"))
        assert app.query_one(PromptInput).text == "typed meanwhile"
        partial = ANSWER[:16]  # the one step before the death
        assert boxes(app) == [("user", "this prompt must survive"), ("assistant", partial)]
        saved = store.messages(app.conversation.id)
        assert [m.content for m in saved] == ["this prompt must survive", partial]
        assert saved[1].stats["finish_reason"] == "error"
        await pilot.press("r")
        await ready(pilot)
        assert starts[0].closed and len(starts) == 2
        app.query_one(PromptInput).clear()
        await type_and_send(pilot, "/continue")
        await idle(pilot)
        assert boxes(app) == [("user", "this prompt must survive"), ("assistant", ANSWER)]
    assert [m.content for m in store.messages(app.conversation.id)] == ["this prompt must survive", ANSWER]


async def test_start_failure_shows_cause_then_restart(store):
    attempts = []

    def factory(progress):
        progress("spawning workers")
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("torchrun: rendezvous timed out")
        return FakeEngine()

    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen))
        assert "rendezvous timed out" in text_of(app.screen.query_one("#error-cause Static"))
        await pilot.click("#restart")
        await ready(pilot)
        assert len(attempts) == 2


async def test_narrow_terminal_hides_stats(store):
    app = make_app(store)
    async with app.run_test(size=(60, 20)) as pilot:
        await ready(pilot)
        assert not app.query_one(StatsPanel).display
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert app.query_one(StatsPanel).display


async def test_refused_answer_keeps_engine_and_prompt(store):
    factory = FakeEngine.factory(refuse="the conversation is 5000 tokens, but the context length is 4096")
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "too long")
        await wait_for(pilot, lambda: app.query_one(PromptInput).text == "too long")
        assert not isinstance(app.screen, ErrorScreen) and app.engine is factory.started[0]
        assert boxes(app) == [] and app.conversation.messages == []


async def test_quitting_while_loading_abandons_the_start(store):
    abandoned = threading.Event()

    def factory(progress):
        try:
            for i in range(600):  # a slow start that reports progress, as Engine.start does per stage
                progress(f"stage {i}")
                time.sleep(0.02)
        except RuntimeError:
            abandoned.set()
            raise
        return FakeEngine()

    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen))
        await pilot.press("ctrl+q")
    assert abandoned.wait(5) and app.engine is None


async def test_ctrl_c_stops_the_answer_and_does_not_quit(store):
    factory = FakeEngine.factory(step_delay=0.05, answer="word " * 200)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "long please")
        await wait_for(pilot, lambda: boxes(app)[-1][1])
        await pilot.press("ctrl+c")  # was: asked about quitting while the answer went on
        await idle(pilot)
        assert "cancelled" in app.query_one(ChatView).query(MessageBox).last().border_subtitle
        assert not any("quit" in str(n.title).lower() for n in app._notifications)
        await pilot.press("ctrl+c")  # idle: says how to quit, and stays
        await pilot.pause()
        assert app.is_running and any("to quit" in str(n.message) for n in app._notifications)


async def test_a_refused_prompt_comes_back_with_the_cursor_at_its_end(store):
    app = make_app(store, FakeEngine.factory(refuse="no"))
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "first line\nsecond")
        prompt = app.query_one(PromptInput)
        await wait_for(pilot, lambda: prompt.text == "first line\nsecond")
        assert prompt.cursor_location == (1, 6)  # was: (0, 0)
        await pilot.press("!")
        assert prompt.text == "first line\nsecond!"


async def test_keys_typed_a_few_ms_apart_keep_their_order(store):
    factory = FakeEngine.factory()
    app = make_app(store, factory)
    text = "the quick brown fox jumps over the lazy dog"
    async with app.run_test() as pilot:
        await ready(pilot)
        for gap in (0.0, 0.002, 0.008):
            app.query_one(PromptInput).clear()
            for ch in text:
                app._driver.send_message(events.Key("space" if ch == " " else ch, ch))
                await asyncio.sleep(gap)
            await pilot.pause(0.2)
            assert app.query_one(PromptInput).text == text, gap


async def test_the_title_bar_keeps_the_settings_readable_at_80_columns(store):
    app = make_app(store)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        for command in ("/temp 0.7", "/set top-p 0.9", "/set top-k 40", "/max 256"):
            await type_and_send(pilot, command)
        await pilot.pause()
        header = app.query_one("HeaderTitle").render()
        shown = str(header) if not hasattr(header, "plain") else header.plain
        assert "T0.7 p0.9 k40" in shown and "max 256" in shown and "async" in shown, shown


async def test_f3_shows_and_hides_the_stats_at_any_width(store):
    app = make_app(store)
    async with app.run_test(size=(60, 20)) as pilot:
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        assert not panel.display
        await pilot.press("f3")
        assert panel.display  # was: impossible below 72 columns
        await pilot.press("f3")
        assert not panel.display
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert not panel.display  # hidden by the user: it stays so
        await pilot.press("f3")
        assert panel.display


async def test_a_click_on_a_code_block_copies_that_block(store):
    from textual.widgets.markdown import MarkdownFence

    app = make_app(store)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "code please")
        await idle(pilot)
        await pilot.click(MarkdownFence)
        assert app.clipboard == "def add(a, b):\n    return a + b"
        await type_and_send(pilot, "/copy 1")
        assert app.clipboard == "def add(a, b):\n    return a + b"
        await type_and_send(pilot, "/copy 2")
        await pilot.pause()
        assert any("1 code block" in str(n.message) for n in app._notifications)


async def test_the_panel_names_figures_as_everything_else_does(store):
    app = make_app(store)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        assert "tok/verify" in figures(app) and "mean accepted" not in figures(app)


async def test_the_chosen_theme_is_kept(store, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path))  # the other tests keep the default theme
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        app.theme = "nord"
    again = make_app(store)
    async with again.run_test() as pilot:
        await ready(pilot)
        assert again.theme == "nord"
