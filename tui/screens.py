"""Screens over the chat: engine start-up, engine failure, help."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Label, Log, Markdown, ProgressBar, Static

from swiftspec.tui.commands import help_markdown


class LoadingScreen(Screen):
    """Shown while the workers spawn and load weights; the engine's progress messages scroll by."""

    def __init__(self, model_line: str) -> None:
        super().__init__()
        self.model_line = model_line

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Label("Starting SwiftSpec", id="loading-title")
            yield Label(self.model_line, id="loading-model")
            yield ProgressBar(total=None, show_eta=False, show_percentage=False)
            yield Log(id="loading-log", auto_scroll=True)
            yield Label("ctrl+q quits", id="loading-hint")

    def add_line(self, text: str) -> None:
        self.query_one(Log).write_line(text)


class ErrorScreen(Screen[bool]):
    """The engine died or would not start: the cause, and a restart. Dismisses True to restart."""

    BINDINGS = [
        Binding("r", "restart", "Restart engine"),
        Binding("q", "quit_app", "Quit"),
    ]

    def __init__(self, cause: str) -> None:
        super().__init__()
        self.cause = cause

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box"):
            yield Label("The engine stopped", id="error-title")
            with VerticalScroll(id="error-cause"):
                yield Static(Text(self.cause))
            yield Label("The conversation and anything you typed are kept.", id="error-hint")
            with Horizontal(id="error-buttons"):
                yield Button("Restart engine", id="restart", variant="primary")
                yield Button("Quit", id="quit", variant="error")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#restart", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "restart":
            self.action_restart()
        else:
            self.action_quit_app()

    def action_restart(self) -> None:
        self.dismiss(True)

    def action_quit_app(self) -> None:
        self.app.exit(1)  # leaving with the engine down is an engine error


class HelpScreen(ModalScreen):
    """Slash commands and keys, titled, with how to close it."""

    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "SwiftSpec help"
            box.border_subtitle = "Esc, F1 or q closes"
            yield Markdown(help_markdown())
