"""`swiftspec history` on a scratch data dir (SWIFTSPEC_DATA_DIR), and what scripted runs save."""

from __future__ import annotations

import json

import pytest
from fake_engine import ANSWER
from helpers.cli import invoke

from swiftspec import history
from swiftspec.history import HistoryStore


@pytest.fixture
def saved(data_dir):  # noqa: F811
    store = HistoryStore()
    first = store.create("How do I sort a list?", system="Be brief.")
    store.add(first, "user", "How do I sort a list?")
    store.add(first, "assistant", "Use `sorted(xs)`.", {"mode": "async", "generated": 5, "tokens_per_s": 9.5})
    second = store.create("second chat")
    store.add(second, "user", "hi")
    store.close()
    return first, second


def test_list_show_export_delete(saved, data_dir, tmp_path):  # noqa: F811
    first, second = saved
    listed = invoke(["history", "list"])
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ID", "UPDATED", "TURNS", "TOKENS", "TITLE"]
    assert lines[1].split()[0] == str(second) and lines[2].split()[0] == str(first)  # newest first
    assert lines[2].split()[3:5] == ["1", "5"] and lines[2].endswith("How do I sort a list?")
    assert str(data_dir / "history.sqlite3") in listed.stderr

    shown = invoke(["history", "show", str(first)])
    assert shown.exit_code == 0 and shown.stdout.startswith("# How do I sort a list?\n")
    assert "## Assistant\n\nUse `sorted(xs)`." in shown.stdout

    as_json = json.loads(invoke(["history", "export", str(first), "--format", "json"]).stdout)
    assert as_json["system"] == "Be brief." and as_json["messages"][1]["stats"]["generated"] == 5
    exported = invoke(["history", "export", str(first), "-o", str(tmp_path / "." / "chat.md")])
    assert exported.exit_code == 0 and f"to {tmp_path / 'chat.md'}" in exported.stderr  # the absolute path
    assert (tmp_path / "chat.md").read_text() == shown.stdout

    refused = invoke(["history", "delete", str(first)], stdin=b"n\n")
    assert refused.exit_code == 0 and len(HistoryStore().list()) == 2  # asked, and kept: no error
    assert refused.stderr.endswith(f"Kept #{first}: How do I sort a list?\n") and "Aborted" not in refused.output
    deleted = invoke(["history", "delete", str(first)], stdin=b"y\n")
    assert deleted.exit_code == 0 and [c.id for c in HistoryStore().list()] == [second]
    assert invoke(["history", "delete", "-y", str(second)]).exit_code == 0
    assert "No saved conversations" in invoke(["history", "list"]).stdout


@pytest.mark.parametrize("args", [["show", "42"], ["export", "42"], ["delete", "-y", "42"]])
def test_unknown_id_is_a_usage_error(saved, args):
    result = invoke(["history", *args])
    assert result.exit_code == 2 and "no conversation with id 42" in result.stderr


def test_damaged_database_is_moved_aside_and_said(data_dir):  # noqa: F811
    data_dir.mkdir(parents=True)
    (data_dir / "history.sqlite3").write_bytes(b"garbage" * 1000)
    result = invoke(["history", "list"])
    assert result.exit_code == 0 and "damaged" in result.stderr and "No saved conversations" in result.stdout
    assert len(list(data_dir.glob("history.sqlite3.damaged-*"))) == 1


def test_unreadable_history_exits_1(data_dir, monkeypatch):  # noqa: F811
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    data_dir.write_text("a file where the data dir should be")
    result = invoke(["history", "list"])
    assert result.exit_code == 1 and "cannot be used" in result.stderr


def test_prompt_runs_are_saved_only_with_save(fake, data_dir):  # noqa: F811
    assert invoke(["chat", "-p", "not kept"]).exit_code == 0
    assert HistoryStore().list() == []
    result = invoke(["chat", "--each-line", "--save"], stdin=b"first\nsecond\n")
    assert result.exit_code == 0
    [conv] = HistoryStore().list()
    assert conv.title == "first" and conv.turns == 2
    assert [m.content for m in HistoryStore().messages(conv.id)] == ["first", ANSWER, "second", ANSWER]


def test_resume_on_a_read_only_history_answers_and_says_not_saved(fake, data_dir, monkeypatch):  # noqa: F811
    store = HistoryStore()
    old = store.create("old")
    store.add(old, "user", "my name is Ada")
    store.close()
    opened = HistoryStore._open

    def read_only(self):
        db = opened(self)
        db.execute("PRAGMA query_only = ON")  # what a read-only file or medium gives (root ignores chmod)
        return db

    with monkeypatch.context() as patch:
        patch.setattr(HistoryStore, "_open", read_only)
        result = invoke(["chat", "-p", "what is my name?", "--resume"])
    assert result.exit_code == 0 and result.stdout == ANSWER + "\n"
    assert result.stderr.count("not saved") == 1 and "read-only" in result.stderr
    assert len(HistoryStore().messages(old)) == 1


def test_resume_on_a_locked_history_is_a_clear_usage_error(fake, data_dir, monkeypatch):  # noqa: F811
    import sqlite3

    monkeypatch.setattr(history, "LOCK_WAIT_S", 0.1)
    HistoryStore().close()
    other = sqlite3.connect(data_dir / "history.sqlite3", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        result = invoke(["chat", "-p", "hi", "--resume"])
        assert result.exit_code == 2 and "locked by another program" in result.stderr
        saving = invoke(["chat", "-p", "hi", "--save"])  # answered, not saved, and said so
        assert saving.exit_code == 0 and saving.stdout == ANSWER + "\n"
        assert saving.stderr.count("not saved") == 1 and "locked" in saving.stderr
    finally:
        other.rollback()
        other.close()


@pytest.mark.parametrize("command", ["show", "export", "delete"])
def test_an_id_that_is_not_a_number_is_one_line(saved, command):  # noqa: F811
    result = invoke(["history", command, "abc"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "ID: 'abc' is not a whole number" in result.stderr
    assert "╭" not in result.output  # was: a Typer box


def test_end_of_input_at_the_confirmation_is_a_no(saved):  # noqa: F811
    """`swiftspec history delete ID </dev/null`: kept, exit 0, as a typed "n" (was: "Aborted.", exit 1)."""
    first, _ = saved
    result = invoke(["history", "delete", str(first)], stdin=b"")
    assert result.exit_code == 0, result.output
    assert result.stderr.endswith(f"[y/N]: \nKept #{first}: How do I sort a list?\n"), result.stderr
    assert "Aborted" not in result.output and first in [c.id for c in HistoryStore().list()]
