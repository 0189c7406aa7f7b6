"""A one-line note in the conversation from SwiftSpec itself (e.g. turns left out of the context)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class Notice(Static):
    """Not a message: it is neither sent to the model nor saved."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text))
        self.text = text
