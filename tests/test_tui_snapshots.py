"""Snapshots of the main screens (pytest-textual-snapshot). Update after an intended change with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the SVGs before committing."""

from __future__ import annotations

import threading

import pytest
from fake_engine import FakeEngine
from test_tui import idle, ready, type_and_send, wait_for

from swiftspec.config import SamplingParams
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
    app = StillApp(FakeEngine.factory(), SamplingParams(), store=store)
    assert snap_compare(app, terminal_size=(80, 24), run_before=chat_after_one_answer)


def test_chat_wide(snap_compare, store):
    app = StillApp(FakeEngine.factory(), SamplingParams(), store=store)
    assert snap_compare(app, terminal_size=(140, 40), run_before=chat_after_one_answer)


def test_chat_narrow_hides_stats(snap_compare, store):
    app = StillApp(FakeEngine.factory(), SamplingParams(), store=store)
    assert snap_compare(app, terminal_size=(64, 24), run_before=chat_after_one_answer)


def test_loading_screen(snap_compare, store):
    gate = threading.Event()  # holds the start until the app leaves
    app = StillApp(FakeEngine.factory(start_gate=gate), SamplingParams(), store=store, on_unmount=gate.set)

    async def loading(pilot):
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, LoadingScreen)
                       and pilot.app.screen.query_one("#loading-log").line_count == 2)

    assert snap_compare(app, terminal_size=(80, 24), run_before=loading)


def test_error_screen(snap_compare, store):
    cause = ("a worker failed: CUDA out of memory\n--- last lines of the workers' output ---\n"
             "[rank1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    app = StillApp(FakeEngine.factory(start_error=cause), SamplingParams(), store=store)

    async def failed(pilot):
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ErrorScreen))

    assert snap_compare(app, terminal_size=(80, 24), run_before=failed)


def test_help_screen(snap_compare, store):
    app = StillApp(FakeEngine.factory(), SamplingParams(), store=store)

    async def help_open(pilot):
        await ready(pilot)
        await pilot.press("f1")

    assert snap_compare(app, terminal_size=(80, 24), run_before=help_open)
