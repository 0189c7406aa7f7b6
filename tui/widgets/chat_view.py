"""The scrolling conversation."""

from __future__ import annotations

from textual.containers import VerticalScroll

from swiftspec.conversation import Message
from swiftspec.engine.host.answer import AnswerSummary
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.notice import Notice


class ChatView(VerticalScroll):
    """Holds MessageBoxes and stays pinned to the bottom while an answer grows, unless the user scrolls up."""

    def on_mount(self) -> None:
        self.anchor()

    async def add(self, role: str, text: str = "", footer: str = "", streaming: bool = False,
                  key: int | None = None) -> MessageBox:
        box = MessageBox(role, text, footer, streaming=streaming, key=key)
        await self.mount(box)
        self.anchor()
        return box

    async def show(self, messages: list[Message]) -> None:
        """A conversation afresh: one box per message, named by its key, with an answer's figures."""
        await self.clear()
        for m in messages:
            await self.add(m.role, m.content, footer=AnswerSummary.from_dict(m.stats).line(short=True) if m.stats else "", key=m.key)

    async def add_context_notice(self, left_out: int, kept: int, before: MessageBox) -> Notice:
        """Above the message it made room for: how many turns the model no longer sees."""
        what = "the oldest turn" if left_out == 1 else f"the {left_out} oldest turns"
        notice = Notice(f"Context full: left out {what} (still shown here and saved); the model sees the last "
                        f"{turns(kept)}.")
        await self.mount(notice, before=before)
        self.anchor()
        return notice

    @property
    def messages(self) -> list[MessageBox]:
        """The message boxes, oldest first."""
        return list(self.query(MessageBox))

    def box(self, key: int) -> MessageBox:
        return next(b for b in self.query(MessageBox) if b.key == key)

    async def keep_only(self, keys: set[int]) -> None:
        """Removes the boxes of messages that are no longer in the conversation."""
        for box in self.query(MessageBox):
            if box.key is not None and box.key not in keys:
                await box.remove()

    async def clear(self) -> None:
        await self.remove_children()

    @property
    def last_answer(self) -> str | None:
        answers = [box.text for box in self.query(MessageBox) if box.role == "assistant" and box.text]
        return answers[-1] if answers else None


def turns(n: int) -> str:
    return f"{n} turn{'s' if n != 1 else ''}"
