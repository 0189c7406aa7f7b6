"""The SQLite conversation store: where it lives, what it keeps, and the Markdown export."""

from __future__ import annotations

import pytest

from swiftspec.config import StepEvent, StepStats
from swiftspec.history import HistoryError, HistoryStore, TurnRecorder, default_path, title_from


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
    assert store.messages(first) == [] and store.get(first)
    with pytest.raises(HistoryError):
        store.get(999)
    store.close()
    reopened = HistoryStore(tmp_path / "h.sqlite3")
    assert [c.title for c in reopened.list()] == ["How do I sort a list?", "second"]


def test_title_is_shortened():
    assert title_from("x" * 100).endswith("…") and len(title_from("x" * 100)) == 60
    assert title_from("   \n") == "untitled"


def test_turn_recorder_median_is_per_token():
    rec = TurnRecorder("async")
    rec.add(StepEvent([1, 2, 3], "abc", StepStats(token_latency_ms=10.0, generated=3)))
    rec.add(StepEvent([4], "d", StepStats(token_latency_ms=40.0, generated=4), True, "eos"))
    summary = rec.summary()
    assert summary["ms_per_token_p50"] == 10.0 and summary["finish_reason"] == "eos"
    assert summary["generated"] == 4 and summary["mode"] == "async"
