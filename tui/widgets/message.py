"""One turn of the conversation: the user's text verbatim, or an answer rendered as Markdown."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownFence, MarkdownStream

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "note": "SwiftSpec", "error": "Error"}


class MessageBox(Vertical):
    """A bordered block per message, named after its message's key in the Conversation (None while the
    engine has not yet accepted the answer it belongs to). Answers stream through a MarkdownStream, which
    coalesces fragments when they arrive faster than Markdown can re-render; a click on one of their code
    blocks copies that block."""

    @dataclass
    class CopyCode(Message):
        code: str

    def __init__(self, role: str, text: str = "", footer: str = "", streaming: bool = False,
                 key: int | None = None) -> None:
        super().__init__(classes=f"-{role} -streaming" if streaming else f"-{role}")
        self.role = role
        self.text = text
        self.key = key
        self.border_title = ROLE_TITLES.get(role, role)
        self.border_subtitle = footer
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        if self.role == "user":
            yield Static(Text(self.text), classes="body")
        else:
            yield Markdown(self.text, classes="body")

    def on_click(self, event: events.Click) -> None:
        widget = event.widget
        while widget is not None and widget is not self and not isinstance(widget, MarkdownFence):
            widget = widget.parent
        if isinstance(widget, MarkdownFence):
            event.stop()
            self.post_message(self.CopyCode(widget.code))

    async def append(self, fragment: str) -> None:
        """Streams more answer text in; called from the app's flush timer, never per token."""
        self.text += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(fragment)

    def resume(self) -> None:
        """Streams again into a finished answer (``/continue``); finish() ends it as before."""
        self.add_class("-streaming")
        self.border_subtitle = ""

    async def finish(self, footer: str) -> None:
        """Ends the stream (flushing what it still holds) and shows the answer's figures under it."""
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                await stream.stop()
            except asyncio.CancelledError:  # its task was cancelled before it first ran (a race in Textual's
                if asyncio.current_task().cancelling():  # MarkdownStream.stop) and dropped what it held
                    raise
                await self.query_one(Markdown).update(self.text)
        self.border_subtitle = footer
        self.remove_class("-streaming")
