"""The prompt box: Enter sends, ctrl+j / shift+enter break the line, up/down recall earlier prompts; Up on
an empty box edits the last message sent."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A multi-line TextArea whose Enter submits; the text stays until the app accepts it."""

    # Shown in the footer; the keys themselves are handled in _on_key.
    BINDINGS = [
        Binding("enter", "submit", "Send"),
        Binding("ctrl+j,shift+enter", "newline", "Newline", key_display="^j"),
    ]
    NEWLINE_KEYS = ("ctrl+j", "shift+enter")

    EDIT_TITLE = "editing your last message · esc cancels"

    @dataclass
    class Submitted(Message):
        prompt_input: PromptInput
        text: str
        edit: bool = False  # the text replaces the last message sent (and its answer)

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", compact=True,
                         placeholder="Message · /help for commands", **kwargs)
        self.recall: list[str] = []  # earlier prompts, oldest first
        self._recall_index: int | None = None  # position in `recall` while browsing it
        self._draft = ""  # what was typed before browsing started
        self.editable: str | None = None  # the last message sent, when the app allows editing it now
        self.editing = False

    async def _on_key(self, event: events.Key) -> None:
        """Enter and the newline keys are taken here, in order with the typed text: a pasted or fast burst
        ("text⏎") must submit all of it. (A priority binding would run ahead of keys still queued here.)
        Other keys fall through to TextArea's own handler."""
        if event.key == "escape" and self.editing:
            event.stop()
            event.prevent_default()
            self.clear()
            return
        if event.key == "enter" or event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            if event.key == "enter":
                self.action_submit()
            else:
                self.action_newline()

    def action_submit(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text, self.editing))

    def start_edit(self, text: str) -> None:
        """Loads the last message sent for editing; sending it then replaces that turn."""
        self._recall_index = len(self.recall) - 1 if self.recall and self.recall[-1] == text else len(self.recall)
        self._draft = ""
        self._show(text)
        self._set_editing(True)

    def give_back(self, text: str, editing: bool) -> None:
        """A message the engine did not take comes back, before anything typed since, the cursor at its end."""
        typed = self.text
        if editing:
            self.start_edit(text)
        else:
            self.load_text(text + ("\n" + typed if typed else ""))
        self.move_cursor((text.count("\n"), len(text.split("\n")[-1])))

    def clear(self) -> TextArea:
        self._set_editing(False)
        self._recall_index = None
        return super().clear()

    def load_text(self, text: str) -> None:
        """Text put here by the program is a new message, not an edit (start_edit marks it after)."""
        self._set_editing(False)
        super().load_text(text)

    def _set_editing(self, on: bool) -> None:
        self.editing = on
        self.border_title = self.EDIT_TITLE if on else None
        self.set_class(on, "-editing")

    def action_newline(self) -> None:
        start, end = self.selection
        self.replace("\n", start, end, maintain_selection_offset=False)

    def remember(self, text: str) -> None:
        """Adds a sent prompt to the recall list and ends any browsing."""
        if not self.recall or self.recall[-1] != text:
            self.recall.append(text)
        self._recall_index = None

    def forget(self, text: str) -> None:
        """Takes the latest occurrence of a prompt out of the recall list (it was edited)."""
        if text in self.recall:
            del self.recall[len(self.recall) - 1 - self.recall[::-1].index(text)]

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and not self.text and self._recall_index is None and self.editable is not None:
            self.start_edit(self.editable)
            return
        if select or not self.cursor_at_first_line or not self.recall:
            super().action_cursor_up(select)
            return
        if self._recall_index is None:
            self._draft = self.text
            self._recall_index = len(self.recall)
        if self._recall_index > 0:
            self._recall_index -= 1
            self._show(self.recall[self._recall_index])

    def action_cursor_down(self, select: bool = False) -> None:
        if select or not self.cursor_at_last_line or self._recall_index is None:
            super().action_cursor_down(select)
            return
        self._recall_index += 1
        if self._recall_index >= len(self.recall):
            self._recall_index = None
            self._show(self._draft)
        else:
            self._show(self.recall[self._recall_index])

    def _show(self, text: str) -> None:
        self.load_text(text)  # browsing away from the edited message makes the text a new one
        self.move_cursor(self.document.end)
