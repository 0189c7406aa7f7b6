"""Driving the chat app in Textual's Pilot: the app on a FakeEngine, waits for its states, what it shows."""

from __future__ import annotations

import io
import time

from fake_engine import FakeEngine
from rich.console import Console

from swiftspec.conversation import Conversation, Settings
from swiftspec.engine.config import SamplingParams
from swiftspec.tui.app import SwiftSpecApp
from swiftspec.tui.screens import LoadingScreen
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel


def make_app(store, factory=None, **params) -> SwiftSpecApp:
    return SwiftSpecApp(factory or FakeEngine.factory(), Settings(params=SamplingParams(**params)), store=store,
                        model_line="fake")


def resumed_app(store, conversation_id: int, factory=None) -> SwiftSpecApp:
    conversation = Conversation.resume(store, conversation_id, Settings())
    return SwiftSpecApp(factory or FakeEngine.factory(), Settings(), store=store, conversation=conversation)


async def wait_for(pilot, condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


async def ready(pilot, timeout: float = 10.0) -> None:
    await wait_for(pilot, lambda: pilot.app.engine is not None and not isinstance(pilot.app.screen, LoadingScreen),
                   timeout)


async def idle(pilot, timeout: float = 10.0) -> None:
    await wait_for(pilot, lambda: pilot.app._turn is None, timeout)
    await pilot.pause()


async def type_and_send(pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).load_text(text)
    await pilot.press("enter")


async def send_each(pilot, *texts: str) -> None:
    """Sends each text (a prompt or a command) once the app is idle again."""
    for text in texts:
        await type_and_send(pilot, text)
        await idle(pilot)


def notes(app) -> list[str]:
    """The notifications' messages, oldest first."""
    return [str(n.message) for n in app._notifications]


def boxes(app) -> list[tuple[str, str]]:
    return [(b.role, b.text) for b in app.query_one(ChatView).query(MessageBox)]


def text_of(static) -> str:
    """What a Static shows, as plain text (Rich renderables included)."""
    console = Console(width=60, file=io.StringIO(), record=True)
    console.print(static.content)
    return console.export_text()


def figures(app) -> str:
    return text_of(app.query_one(StatsPanel).query_one("#figures"))
