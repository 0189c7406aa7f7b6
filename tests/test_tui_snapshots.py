"""Snapshots of the main screens (pytest-textual-snapshot). Update after an intended change with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the SVGs before committing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from helpers.pilot import idle, ready, type_and_send, wait_for

from swiftspec.conversation import Settings
from swiftspec.history import HistoryStore
from swiftspec.tui.app import SwiftSpecApp
from swiftspec.tui.screens import ErrorScreen, LoadingScreen
from swiftspec.tui.widgets.prompt_input import PromptInput


@pytest.fixture
def store(tmp_path):
    s = HistoryStore(tmp_path / "history.sqlite3")
    yield s
    s.close()


class StillApp(SwiftSpecApp):
    """No blinking cursor, no animation: the same pixels every run."""

    def __init__(self, *args, on_unmount=None, **kwargs) -> None:
        super().__init__(*args, model_line="target fake-target · draft suffix", **kwargs)
        self.animation_level = "none"
        self._release = on_unmount

    def on_mount(self) -> None:
        self.query_one(PromptInput).cursor_blink = False

    def on_unmount(self) -> None:
        if self._release:
            self._release()


async def chat_after_one_answer(pilot) -> None:
    await ready(pilot)
    await type_and_send(pilot, "Write a Python function that adds two numbers.")
    await idle(pilot)
    pilot.app.query_one(PromptInput).load_text("and now subtract them")


def test_chat_80x24(snap_compare, store):
    app = StillApp(FakeEngine.factory(), Settings(), store=store)
    assert snap_compare(app, terminal_size=(80, 24), run_before=chat_after_one_answer)


def test_chat_wide(snap_compare, store):
    app = StillApp(FakeEngine.factory(), Settings(), store=store)
    assert snap_compare(app, terminal_size=(140, 40), run_before=chat_after_one_answer)


def test_chat_narrow_hides_stats(snap_compare, store):
    app = StillApp(FakeEngine.factory(), Settings(), store=store)
    assert snap_compare(app, terminal_size=(64, 24), run_before=chat_after_one_answer)


def test_loading_screen(snap_compare, store):
    gate = threading.Event()  # holds the start until the app leaves
    app = StillApp(FakeEngine.factory(start_gate=gate), Settings(), store=store, on_unmount=gate.set)

    async def loading(pilot):
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, LoadingScreen)
                       and pilot.app.screen.query_one("#loading-log").line_count == 2)

    assert snap_compare(app, terminal_size=(80, 24), run_before=loading)


def test_error_screen(snap_compare, store):
    cause = ("a worker failed: CUDA out of memory\n--- last lines of the workers' output ---\n"
             "[rank1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    app = StillApp(FakeEngine.factory(start_error=cause), Settings(), store=store)

    async def failed(pilot):
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ErrorScreen))

    assert snap_compare(app, terminal_size=(80, 24), run_before=failed)


async def help_open(pilot) -> None:
    await ready(pilot)
    await pilot.press("f1")


def test_help_screen(snap_compare, store):
    app = StillApp(FakeEngine.factory(), Settings(), store=store)
    assert snap_compare(app, terminal_size=(80, 24), run_before=help_open)


def test_overflow_notice(snap_compare, store):
    app = StillApp(FakeEngine.factory(answer="Sure: " + "word " * 30, context_length=160), Settings(),
                   store=store)

    async def overflowed(pilot):
        await ready(pilot)
        for question in ("first question", "second question", "third question"):
            await type_and_send(pilot, question)
            await idle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=overflowed)


def test_history_screen(snap_compare, store, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    for i, (title, turns) in enumerate([("How do I sort a list?", 3), ("Explain RoPE scaling", 1),
                                        ("Write a haiku about the sea", 2)]):
        conv = store.create(title)
        for _ in range(turns):
            store.add(conv, "user", "q")
            store.add(conv, "assistant", "a", {"generated": 40 + i})
        store._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (1.7e9 + 3600 * i, conv))
    store.path = Path("/home/user/.local/share/swiftspec/history.sqlite3")  # shown in the hint line
    app = StillApp(FakeEngine.factory(), Settings(), store=store)

    async def history_open(pilot):
        await ready(pilot)
        await pilot.press("f2")
        await pilot.pause()

    try:
        assert snap_compare(app, terminal_size=(80, 24), run_before=history_open)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_clear_asks_first(snap_compare, store):
    app = StillApp(FakeEngine.factory(), Settings(), store=store)

    async def asking(pilot):
        await chat_after_one_answer(pilot)
        await type_and_send(pilot, "/clear")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=asking)


def test_editing_the_last_message(snap_compare, store):
    app = StillApp(FakeEngine.factory(), Settings(), store=store)

    async def editing(pilot):
        await ready(pilot)
        await type_and_send(pilot, "Write a Python function that adds two numbers.")
        await idle(pilot)
        await pilot.press("up")

    assert snap_compare(app, terminal_size=(80, 24), run_before=editing)


async def notified(pilot) -> None:
    await chat_after_one_answer(pilot)
    pilot.app.notify("Retrying greedily (temperature 0): the answer that decoding gives, the same each time.",
                     timeout=600)
    pilot.app.notify("Unknown command /bogus — /help lists them.", severity="error", timeout=600)


@pytest.mark.parametrize("width", [100, 230])
@pytest.mark.parametrize("scene, rows", [(chat_after_one_answer, 36), (help_open, 45), (notified, 30)],
                         ids=["chat", "help", "notifications"])
def test_at_100_and_230_columns(snap_compare, store, scene, rows, width):
    """chat: the title names the model and its precision, the Layout box wraps it whole (and widens at
    230); help: titled, with how to close it, in 45 rows; notifications: over the chat, above the input."""
    app = StillApp(FakeEngine.factory(), Settings(), store=store)
    assert snap_compare(app, terminal_size=(width, rows), run_before=scene)
