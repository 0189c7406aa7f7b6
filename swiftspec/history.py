"""Conversations kept in SQLite, so a chat can be resumed (``--resume``) and exported to Markdown.

The database lives in the user data dir; ``SWIFTSPEC_DATA_DIR`` moves it (tests, portable setups).
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from swiftspec.config import StepEvent, StepStats

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def data_dir() -> Path:
    return Path(os.environ.get("SWIFTSPEC_DATA_DIR") or platformdirs.user_data_dir("swiftspec"))


def default_path() -> Path:
    return data_dir() / "history.sqlite3"


class HistoryError(LookupError):
    """A conversation that the user named does not exist."""


@dataclass
class Conversation:
    id: int
    title: str
    system: str | None
    created: float
    updated: float


@dataclass
class Message:
    role: str
    content: str
    stats: dict[str, Any] | None = None


def title_from(prompt: str, width: int = 60) -> str:
    """The first line of the first prompt, shortened: what a user recognises in a list."""
    line = next((ln.strip() for ln in prompt.splitlines() if ln.strip()), "untitled")
    return line if len(line) <= width else line[: width - 1] + "…"


class HistoryStore:
    """One SQLite file; each call is its own short transaction, so a crash loses at most one message."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Conversations are private: the file (and the journals SQLite gives its mode) only for the user.
        os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        # Autocommit: every write is durable at once; add() groups its two statements explicitly.
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def create(self, title: str, system: str | None = None) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system, created, updated) VALUES (?, ?, ?, ?)",
            (title, system, now, now),
        )
        return int(cur.lastrowid)

    def add(self, conversation_id: int, role: str, content: str, stats: dict[str, Any] | None = None) -> None:
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, created) VALUES (?, ?, ?, ?, ?)",
                (conversation_id, role, content, json.dumps(stats) if stats else None, now),
            )
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))

    def get(self, conversation_id: int) -> Conversation:
        row = self._db.execute(
            "SELECT id, title, system, created, updated FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise HistoryError(f"no conversation with id {conversation_id} in {self.path}")
        return Conversation(*row)

    def latest(self) -> Conversation:
        row = self._db.execute(
            "SELECT id, title, system, created, updated FROM conversations ORDER BY updated DESC, id DESC LIMIT 1"
        ).fetchone()
        if row is None:
            raise HistoryError(f"no saved conversation yet in {self.path}")
        return Conversation(*row)

    def list(self, limit: int = 50) -> list[Conversation]:
        rows = self._db.execute(
            "SELECT id, title, system, created, updated FROM conversations ORDER BY updated DESC, id DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [Conversation(*row) for row in rows]

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT role, content, stats FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [Message(role, content, json.loads(stats) if stats else None) for role, content, stats in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system(self, conversation_id: int, system: str | None) -> None:
        self._db.execute("UPDATE conversations SET system = ? WHERE id = ?", (system, conversation_id))

    def clear(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        return to_markdown(conv.title, conv.system, self.messages(conversation_id))


def to_markdown(title: str, system: str | None, messages: list[Message]) -> str:
    """A readable transcript: headings per turn, answers verbatim (they are Markdown already)."""
    parts = [f"# {title}\n"]
    if system:
        parts.append(f"**System:** {system}\n")
    for m in messages:
        heading = {"user": "## You", "assistant": "## Assistant"}.get(m.role, f"## {m.role.title()}")
        parts.append(f"{heading}\n\n{m.content.rstrip()}\n")
        if m.role == "assistant" and m.stats:
            parts.append(f"<sub>{stats_line(m.stats)}</sub>\n")
    return "\n".join(parts)


class TurnRecorder:
    """Folds one answer's StepEvents into the figures kept with it (and printed after it)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.latencies: list[float] = []  # one entry per token, so the median is per token
        self.last: StepStats | None = None
        self.finish_reason: str | None = None

    def add(self, ev: StepEvent) -> None:
        self.last = ev.stats
        self.latencies.extend([ev.stats.token_latency_ms] * len(ev.token_ids))
        if ev.finished:
            self.finish_reason = ev.finish_reason

    def summary(self) -> dict[str, Any]:
        out = self.last.to_dict() if self.last else StepStats().to_dict()
        out.update(mode=self.mode, finish_reason=self.finish_reason,
                   ms_per_token_p50=statistics.median(self.latencies) if self.latencies else 0.0)
        return out


def stats_line(stats: dict[str, Any], short: bool = False) -> str:
    """An answer's figures on one line: scripted mode's stderr and exports (full), a chat footer (short)."""
    speculative = stats.get("mode") != "ar"
    bits = [str(stats.get("mode", "?")), f"{stats.get('generated', 0)} tok",
            f"{stats.get('tokens_per_s', 0.0):.1f} tok/s"]
    if speculative:
        bits.append(f"acc {100 * stats.get('acceptance_rate', 0.0):.0f}%")
    if not short:
        if speculative:
            bits.append(f"{stats.get('mean_accepted', 0.0):.2f} tok/verify")
        bits.append(f"p50 {stats.get('ms_per_token_p50', 0.0):.1f} ms/tok")
    reason = stats.get("finish_reason")
    if reason and (not short or reason not in ("eos", "stop")):
        bits.append(reason)
    return " · ".join(bits)
