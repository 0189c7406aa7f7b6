"""The SQLite conversation store: where it lives, what it keeps, and the Markdown export."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import pytest

from swiftspec import history
from swiftspec.history import HistoryError, HistoryStore, default_path, title_from


def test_data_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path))
    assert default_path() == tmp_path / "history.sqlite3"
    HistoryStore().close()
    assert (tmp_path / "history.sqlite3").is_file()


def test_conversations_round_trip(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    with pytest.raises(HistoryError):
        store.latest()
    first = store.create(title_from("\n  How do I sort a list?\nmore"), system="Be brief.")
    store.add(first, "user", "How do I sort a list?")
    store.add(first, "assistant", "Use `sorted(xs)`.", {"mode": "async", "generated": 5, "tokens_per_s": 9.5})
    second = store.create("second")
    assert store.latest().id == second
    store.add(first, "user", "thanks")  # activity moves a conversation to the top
    assert [c.id for c in store.list()] == [first, second]
    assert store.get(first).title == "How do I sort a list?" and store.get(first).system == "Be brief."
    md = store.export_markdown(first)
    assert md.startswith("# How do I sort a list?\n") and "**System:** Be brief." in md
    assert "## Assistant\n\nUse `sorted(xs)`." in md and "9.5 tok/s" in md
    store.clear(first)
    assert store.messages(first) == [] and store.get(first).title == "How do I sort a list?"
    with pytest.raises(HistoryError):
        store.get(999)
    store.close()
    reopened = HistoryStore(tmp_path / "h.sqlite3")
    assert [c.title for c in reopened.list()] == ["How do I sort a list?", "second"]


def test_title_is_shortened():
    assert title_from("x" * 100).endswith("…") and len(title_from("x" * 100)) == 60
    assert title_from("   \n") == "untitled"


def test_messages_edit_delete_and_figures(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    conv = store.create("c")
    q = store.add(conv, "user", "q")
    a = store.add(conv, "assistant", "a", {"generated": 7, "finish_reason": "length"})
    store.update(a, "a, continued", {"generated": 5, "finish_reason": "eos"})
    store.add(conv, "user", "q2")
    store.add(conv, "assistant", "a2", {"generated": 3})
    listed = store.list()[0]
    assert (listed.turns, listed.tokens) == (2, 8)
    assert [m.content for m in store.messages(conv)] == ["q", "a, continued", "q2", "a2"]
    assert store.messages(conv)[0].id == q
    store.truncate(conv, a)  # a retried answer goes, and everything after it
    assert [m.content for m in store.messages(conv)] == ["q"]
    exported = json.loads(store.export_json(conv))
    assert exported["title"] == "c" and exported["messages"] == [{"role": "user", "content": "q", "stats": None}]
    store.delete(conv)
    assert store.list() == [] and store._rows("SELECT * FROM messages") == []  # cascaded
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600  # conversations are private


def _filled(path):
    store = HistoryStore(path)
    conv = store.create("kept")
    rows = [(conv, "user", f"question {i} " + "x" * 200, 0.0) for i in range(200)]  # several pages
    with store._db:
        store._db.execute("BEGIN")
        store._db.executemany("INSERT INTO messages (conversation_id, role, content, created) VALUES (?, ?, ?, ?)",
                              rows)
    store.close()


@pytest.mark.parametrize("where", ["header", "body"])
def test_damaged_database_is_moved_aside(tmp_path, where):
    path = tmp_path / "history.sqlite3"
    _filled(path)
    data = bytearray(path.read_bytes())
    if where == "header":
        data[:16] = b"not a database!!"
    else:
        page = 4096
        data[3 * page:5 * page] = b"\xff" * (2 * page)
    path.write_bytes(bytes(data))
    store = HistoryStore(path)
    assert store.problem is None and store.available
    assert "damaged" in store.notice and "started a new one" in store.notice
    aside = list(tmp_path.glob("history.sqlite3.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data)  # kept for the user to rescue
    conv = store.create("new")
    assert store.add(conv, "user", "hello") is not None and [c.title for c in store.list()] == ["new"]


def test_locked_database_runs_unsaved(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "LOCK_WAIT_S", 0.1)
    path = tmp_path / "history.sqlite3"
    _filled(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another program holds the database
    try:
        store = HistoryStore(path)
        assert not store.available and "locked by another program" in store.problem
        assert store.create("x") is None and store.add(1, "user", "x") is None and store.list() == []
        with pytest.raises(HistoryError, match="locked"):
            store.latest()
    finally:
        other.rollback()
        other.close()
    assert [c.title for c in HistoryStore(path).list()] == ["kept"]  # nothing was lost


def test_lock_taken_later_stops_saving(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "LOCK_WAIT_S", 0.1)
    path = tmp_path / "history.sqlite3"
    store = HistoryStore(path)
    conv = store.create("c")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        assert store.add(conv, "user", "x") is None
        assert "locked" in store.problem and not store.available
    finally:
        other.rollback()
        other.close()


def test_read_only_database_runs_unsaved(tmp_path):
    path = tmp_path / "history.sqlite3"
    _filled(path)
    store = HistoryStore(path)
    store._db.execute("PRAGMA query_only = ON")  # what a read-only file or medium gives (root ignores chmod)
    assert [c.title for c in store.list()] == ["kept"]
    assert store.create("new") is None
    assert "read-only" in store.problem and store.list() == []


def test_unopenable_location_runs_unsaved(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = HistoryStore(blocker / "history.sqlite3")  # its directory cannot exist
    assert not store.available and str(blocker) in store.problem and store.notice is None


def test_the_history_database_is_private(tmp_path):
    from swiftspec.history import HistoryStore

    store = HistoryStore(tmp_path / "data" / "history.sqlite3")
    store.add(store.create("t"), "user", "a secret")
    store.close()
    assert (tmp_path / "data" / "history.sqlite3").stat().st_mode & 0o077 == 0
    assert (tmp_path / "data").stat().st_mode & 0o077 == 0
