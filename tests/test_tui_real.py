"""Pilot tests of the chat app wired to the real Engine (torchrun workers) on a tiny random model.

One engine serves the module (a start costs tens of seconds here); each app gets it through a wrapper
whose close() is a no-op, and the module closes it at the end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.pilot import boxes, figures, idle, ready, text_of, type_and_send, wait_for

from swiftspec.conversation import Conversation, Settings
from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.history import HistoryStore
from swiftspec.tui.app import SwiftSpecApp
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel

pytestmark = pytest.mark.slow
STARTUP_S, ANSWER_S = 300, 120  # generous: the CI machine has 2 shared cores
# An answer long enough that Esc or a kill lands mid-answer: the tiny model makes 1500+ tokens a second,
# and on 2 cores its workers can keep the app from drawing the first text for a second or more.
LONG_ANSWER, LONG_CONTEXT = 28000, 32768


class Shared:
    """The module's engine, lent to one app: everything passes through except close()."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine():
    from tiny_models import tiny_model_dir

    from swiftspec import Engine

    target = tiny_model_dir(seed=0, layers=2, positions=LONG_CONTEXT)
    eng = Engine.start(EngineConfig(target=str(target), draft="suffix", max_seq_len=LONG_CONTEXT))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def small_engine():
    """Workers with a 512-token context, for the overflow test (the Esc test needs long answers)."""
    from tiny_models import tiny_model_dir

    from swiftspec import Engine

    eng = Engine.start(EngineConfig(target=str(tiny_model_dir(seed=0, layers=2)), draft="suffix", max_seq_len=512))
    yield eng
    eng.close()


@pytest.fixture
def store(tmp_path):
    s = HistoryStore(tmp_path / "history.sqlite3")
    yield s
    s.close()


def app_on(engine, store, resume: int | None = None) -> SwiftSpecApp:
    def start(progress):
        progress("lent by the test module")
        return Shared(engine)

    conversation = Conversation.resume(store, resume, Settings()) if resume is not None else None
    return SwiftSpecApp(start, Settings(params=SamplingParams(max_new_tokens=24)), store=store,
                        conversation=conversation)


def last_answer(app) -> MessageBox:
    return app.query_one(ChatView).query(MessageBox).last()


def streaming(app) -> bool:
    """The answer being generated has text on screen (not an earlier box, which the last may still be)."""
    return app._turn is not None and bool(app._turn.box.text)


async def test_chat_stream_stats_stop_slash_and_history(engine, store):
    app = app_on(engine, store)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, STARTUP_S)
        assert "target" in text_of(app.query_one(StatsPanel).query_one("#layout"))

        await pilot.press(*"hello")
        await pilot.press("enter")
        await idle(pilot, ANSWER_S)
        async_answer = last_answer(app).text
        assert async_answer and boxes(app)[0] == ("user", "hello")
        stats = figures(app)
        assert "async" in stats and "tokens/s" in stats
        assert "async" in last_answer(app).border_subtitle

        # lossless: target-only decoding gives the same greedy answer
        await type_and_send(pilot, "/new")  # a new conversation starts from the session's settings
        await type_and_send(pilot, "/mode ar")
        await type_and_send(pilot, "hello")
        await idle(pilot, ANSWER_S)
        assert last_answer(app).text == async_answer
        assert "ar" in last_answer(app).border_subtitle

        # Esc stops a long answer; the engine answers again afterwards
        await type_and_send(pilot, "/mode async")
        await type_and_send(pilot, f"/max {LONG_ANSWER}")
        await type_and_send(pilot, "/set ignore-eos on")
        await type_and_send(pilot, "tell me everything")
        await wait_for(pilot, lambda: streaming(app), timeout=60)
        await pilot.press("escape")
        await idle(pilot, ANSWER_S)
        assert "cancelled" in last_answer(app).border_subtitle
        await type_and_send(pilot, "/set ignore-eos off")
        await type_and_send(pilot, "/max 8")
        await type_and_send(pilot, "and again")
        await idle(pilot, ANSWER_S)
        assert "cancelled" not in last_answer(app).border_subtitle and last_answer(app).text
        conversation = app.conversation.id
        saved = store.messages(conversation)
        assert [m.role for m in saved] == ["user", "assistant"] * 3
        assert saved[3].stats["finish_reason"] == "cancelled"

    resumed = app_on(engine, store, resume=conversation)
    async with resumed.run_test(size=(100, 30)) as pilot:
        await ready(pilot, STARTUP_S)
        assert boxes(resumed) == [(m.role, m.content) for m in saved]
        await pilot.press("up")
        assert resumed.query_one(PromptInput).text == "and again"
        await type_and_send(pilot, "one more")
        await idle(pilot, ANSWER_S)
    assert len(store.messages(conversation)) == 8


async def test_worker_killed_shows_error_and_restart(store):
    """kill -9 a worker mid-answer: the error screen names the cause, the turn stays (its answer marked
    "error"), and Restart brings up a fresh engine that goes on with it."""
    import os
    import signal

    from tiny_models import tiny_model_dir

    from swiftspec import Engine
    from swiftspec.tui.screens import ErrorScreen

    started = []
    target = tiny_model_dir(seed=0, layers=2, positions=LONG_CONTEXT)

    def start(progress):
        # room for the cut answer again: a random model's text tokenises back into up to ~1.5x its tokens
        eng = Engine.start(EngineConfig(target=str(target), max_seq_len=LONG_CONTEXT), progress=progress)
        started.append(eng)
        return eng

    app = SwiftSpecApp(start, Settings(params=SamplingParams(max_new_tokens=LONG_ANSWER, ignore_eos=True)),
                       store=store)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, STARTUP_S)
        await type_and_send(pilot, "a long answer please")
        await wait_for(pilot, lambda: streaming(app), timeout=60)
        victim = next(r.pid for r in started[0].info.ranks if r.role == "draft")
        os.kill(victim, signal.SIGKILL)
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), timeout=30)
        await pilot.pause()
        cause = text_of(app.screen.query_one("#error-cause Static"))
        assert "the draft worker (rank 1) was killed by signal 9 (SIGKILL)" in cause, cause  # in words
        log = Path(re.search(r"output:(/\S+?\.log)", "".join(cause.split()))[1])  # the path wraps at 60 columns
        assert "exitcode" in log.read_text() and "exitcode" not in cause  # torchrun's lines are in the log
        log.unlink()
        saved = store.messages(app.conversation.id)
        assert [m.content for m in saved] == ["a long answer please", last_answer(app).text]
        assert saved[1].stats["finish_reason"] == "error" and saved[1].content
        await pilot.press("r")
        await ready(pilot, STARTUP_S)
        assert len(started) == 2 and started[1].alive and not started[0].alive
        cut = last_answer(app).text
        await type_and_send(pilot, "/max 8")
        await type_and_send(pilot, "/continue")
        await idle(pilot, ANSWER_S)
        assert boxes(app)[0] == ("user", "a long answer please") and last_answer(app).text.startswith(cut)
        assert len(last_answer(app).text) > len(cut)
    assert not started[1].alive  # leaving the app closed the engine


async def test_small_context_overflow_context_reason_and_continue(small_engine, store):
    """The real workers in a 512-token context: an answer longer than the context ends with "context",
    the next turn leaves it out (a notice, no error), and /continue extends a cut answer in place,
    prefilling only what is new."""
    from swiftspec.tui.widgets.notice import Notice

    app = app_on(small_engine, store)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, STARTUP_S)
        await type_and_send(pilot, "/max 2000")  # more than the context holds
        await type_and_send(pilot, "/set ignore-eos on")
        await type_and_send(pilot, "a very long one")
        await idle(pilot, ANSWER_S)
        assert "context" in last_answer(app).border_subtitle and app.conversation.last_finish == "context"

        await type_and_send(pilot, "/max 6")
        await type_and_send(pilot, "next")
        await idle(pilot, ANSWER_S)
        [notice] = app.query_one(ChatView).query(Notice)
        assert notice.text.startswith("Context full: left out the oldest turn")
        assert app.conversation.window_start == 2 and len(boxes(app)) == 4 and "length" in last_answer(app).border_subtitle

        first = last_answer(app).text
        await type_and_send(pilot, "/continue")
        await idle(pilot, ANSWER_S)
        assert last_answer(app).text.startswith(first) and len(last_answer(app).text) > len(first)
        assert len(boxes(app)) == 4
        # the question at least was cached (how much of the first part re-tokenizes to the same ids
        # depends on the model: this random one's text does not)
        conversation = app.conversation
        window = conversation.engine_messages([{"role": m.role, "content": m.content}
                                               for m in conversation.messages], conversation.window_start)
        window[-1]["content"] = first
        assert app.query_one(StatsPanel)._stats.prefill_tokens < small_engine.count_tokens(window) - 3
