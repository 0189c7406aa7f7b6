"""The saved conversations: date, title, turns and tokens; open, rename or delete (after confirming)."""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label

from swiftspec.history import HistoryStore, local_time
from swiftspec.tui.dialogs import ConfirmScreen, TextPromptScreen

LIMIT = 500  # conversations listed, newest first


@dataclass
class HistoryResult:
    open: int | None = None  # the conversation to open
    deleted: set[int] = field(default_factory=set)  # what was deleted (the open one may be among them)


class HistoryScreen(ModalScreen[HistoryResult]):
    """Works on the store directly; tells the app on closing what to open and what is gone."""

    BINDINGS = [
        Binding("enter", "open", "Open", show=True, priority=True),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("escape,f2", "close", "Close"),
    ]

    def __init__(self, store: HistoryStore, current: int | None = None) -> None:
        super().__init__()
        self.store = store
        self.current = current
        self.result = HistoryResult()

    def compose(self) -> ComposeResult:
        with Vertical(id="history-box"):
            yield Label("Saved conversations", id="history-title")
            yield DataTable(id="history-table", cursor_type="row", zebra_stripes=True)
            yield Label(f"Kept in {self.store.path}", id="history-hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("#", key="id")
        table.add_column("Date", key="date")
        table.add_column("Title", key="title")
        table.add_column("Turns", key="turns")
        table.add_column("Tokens", key="tokens")
        for conv in self.store.list(LIMIT):
            mark = " ●" if conv.id == self.current else ""
            table.add_row(str(conv.id), local_time(conv.updated), conv.title + mark, str(conv.turns),
                          str(conv.tokens), key=str(conv.id))
        self._show_empty()
        table.focus()

    def _show_empty(self) -> None:
        if not self.query_one(DataTable).row_count:
            self.query_one("#history-title", Label).update("No saved conversations yet")

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        return int(key.value)

    def action_open(self) -> None:
        conversation_id = self._selected()
        if conversation_id is not None:
            self.result.open = conversation_id
            self.dismiss(self.result)

    def action_close(self) -> None:
        self.dismiss(self.result)

    def action_rename(self) -> None:
        conversation_id = self._selected()
        if conversation_id is None:
            return

        def renamed(title: str | None) -> None:
            if title is None:
                return
            self.store.rename(conversation_id, title)
            mark = " ●" if conversation_id == self.current else ""
            self.query_one(DataTable).update_cell(str(conversation_id), "title", title + mark)
            self._say_if_failed()

        title = self.store.get(conversation_id).title
        self.app.push_screen(TextPromptScreen(f"New title for #{conversation_id}:", title), renamed)

    def action_delete(self) -> None:
        conversation_id = self._selected()
        if conversation_id is None:
            return

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            self.store.delete(conversation_id)
            if self._say_if_failed():
                return
            self.result.deleted.add(conversation_id)
            self.query_one(DataTable).remove_row(str(conversation_id))
            self._show_empty()
            self.notify(f"Deleted #{conversation_id}.")

        title = self.store.get(conversation_id).title
        self.app.push_screen(ConfirmScreen(f"Delete #{conversation_id} “{title}” and all its messages? "
                                           "This cannot be undone.", "Delete"), answered)

    def _say_if_failed(self) -> bool:
        if self.store.problem:
            self.notify(self.store.problem, title="History", severity="error", markup=False)
            return True
        return False
