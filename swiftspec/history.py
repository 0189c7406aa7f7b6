"""Conversations kept in SQLite, so a chat can be resumed (``--resume``) and exported to Markdown.

The database lives in the user data dir; ``SWIFTSPEC_DATA_DIR`` moves it (tests, portable setups).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from swiftspec.engine.host.answer import AnswerSummary

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    settings TEXT
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
CREATE TABLE IF NOT EXISTS answer_tokens (
    message_id INTEGER PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
    vocab TEXT NOT NULL,
    n INTEGER NOT NULL,
    tokens BLOB NOT NULL
);
"""  # answer_tokens: the suffix drafter's corpus (engine/spec/history_corpus.py), gone with its message


def data_dir() -> Path:
    return Path(os.environ.get("SWIFTSPEC_DATA_DIR") or platformdirs.user_data_dir("swiftspec"))


def default_path() -> Path:
    return data_dir() / "history.sqlite3"


def exports_dir() -> Path:
    """Where ``/export`` writes when given no file name."""
    return data_dir() / "exports"


LOCK_WAIT_S = 2.0  # how long a write waits for another program's lock before the chat goes on unsaved
CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


class DamagedDatabase(sqlite3.DatabaseError):
    """The file opened but fails SQLite's integrity check."""


def _damaged(e: Exception) -> bool:
    return isinstance(e, DamagedDatabase) or getattr(e, "sqlite_errorcode", None) in CORRUPT_CODES


class HistoryError(LookupError):
    """A conversation that the user named does not exist, or the history cannot be read at all."""


@dataclass
class Conversation:
    id: int
    title: str
    system: str | None
    created: float
    updated: float
    turns: int = 0  # questions asked
    tokens: int = 0  # tokens generated in its answers
    settings: dict[str, Any] | None = None  # the SamplingParams it was last answered with


@dataclass
class Message:
    """A saved message. Role "system" marks where the system prompt changed (content: the new one, "" for
    none); the conversation's own ``system`` is the one it started with."""

    role: str
    content: str
    stats: dict[str, Any] | None = None
    id: int | None = None


def local_time(timestamp: float) -> str:
    """A saved time as lists show it: 2026-11-30 17:44, in the local time zone."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def title_from(prompt: str, width: int = 60) -> str:
    """The first line of the first prompt, shortened: what a user recognises in a list."""
    line = next((ln.strip() for ln in prompt.splitlines() if ln.strip()), "untitled")
    return line if len(line) <= width else line[: width - 1] + "…"


_CONVERSATION_COLUMNS = """c.id, c.title, c.system, c.created, c.updated,
    (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id AND m.role = 'user'),
    (SELECT COALESCE(SUM(json_extract(m.stats, '$.generated')), 0) FROM messages m
     WHERE m.conversation_id = c.id AND m.role = 'assistant'),
    c.settings"""


class HistoryStore:
    """One SQLite file; each call is its own short transaction, so a crash loses at most the answer in flight.

    The chat must never depend on it: a damaged file is moved aside and a new one started (``notice`` says
    so); a database that is locked by another program, read-only or unreadable leaves the store
    *unavailable*: ``problem`` says why, writes do nothing and reads find nothing, and the chat goes on
    unsaved. ``HistoryError`` is raised only for what a user asked for by id.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        self.problem: str | None = None  # why nothing is being saved; None while the store works
        self.notice: str | None = None  # something that happened when opening it, to tell the user once
        self._db: sqlite3.Connection | None = None
        self._lock = threading.RLock()  # the chat saves an answer from its generate thread
        try:
            self._db = self._open()
        except (sqlite3.Error, OSError) as e:
            if not _damaged(e):
                self._fail(e)
                return
            moved = self._move_aside()
            self.notice = f"The history database was damaged ({e}); moved it to {moved} and started a new one."
            try:
                self._db = self._open()
            except (sqlite3.Error, OSError) as again:
                self._fail(again)

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.path.exists():  # conversations are private: the file is the user's alone
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        # Autocommit: every write is durable at once; multi-statement writes group themselves explicitly.
        db = sqlite3.connect(self.path, isolation_level=None, timeout=LOCK_WAIT_S, check_same_thread=False)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            db.executescript(SCHEMA)
            if "settings" not in {row[1] for row in db.execute("PRAGMA table_info(conversations)")}:
                db.execute("ALTER TABLE conversations ADD COLUMN settings TEXT")  # a file from before 0.1
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise DamagedDatabase(f"integrity check: {check}")
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = self.path.with_name(f"{self.path.name}.damaged-{stamp}")
        self.path.rename(moved)
        for suffix in ("-wal", "-shm", "-journal"):  # they belong to the damaged file, not to the new one
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                side.rename(moved.with_name(moved.name + suffix))
        return moved

    def _fail(self, e: Exception) -> None:
        """The store stops saving, for good: half a conversation saved would be worse than a clear 'unsaved'."""
        code = getattr(e, "sqlite_errorcode", None)
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            why = f"it is locked by another program (waited {LOCK_WAIT_S:g} s)"
        elif code == sqlite3.SQLITE_READONLY or isinstance(e, PermissionError):
            why = f"it is read-only ({e})"
        elif _damaged(e):
            why = f"it is damaged ({e})"
        else:
            why = str(e)
        self.problem = f"the history database {self.path} cannot be used: {why}"
        if self._db is not None:
            self._db.close()
            self._db = None

    def _run(self, sql: str, args: tuple = ()) -> sqlite3.Cursor | None:
        """One statement; None once the store is unavailable."""
        with self._lock:
            if self._db is None:
                return None
            try:
                return self._db.execute(sql, args)
            except sqlite3.Error as e:
                self._fail(e)
                return None

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            cur = self._run(sql, args)
            if cur is None:
                return []
            try:
                return cur.fetchall()
            except sqlite3.Error as e:
                self._fail(e)
                return []

    def _transaction(self, statements: list[tuple[str, tuple]]) -> sqlite3.Cursor | None:
        """Several statements, all or nothing; returns the first one's cursor."""
        with self._lock:
            if self._db is None:
                return None
            try:
                with self._db:
                    self._db.execute("BEGIN")
                    first = self._db.execute(*statements[0])
                    for sql, args in statements[1:]:
                        self._db.execute(sql, args)
                return first
            except sqlite3.Error as e:
                self._fail(e)
                return None

    @property
    def available(self) -> bool:
        return self._db is not None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def create(self, title: str, system: str | None = None, settings: dict[str, Any] | None = None) -> int | None:
        now = time.time()
        cur = self._run("INSERT INTO conversations (title, system, created, updated, settings) VALUES (?, ?, ?, ?, ?)",
                        (title, system, now, now, json.dumps(settings) if settings else None))
        return None if cur is None else int(cur.lastrowid)

    def add(self, conversation_id: int, role: str, content: str, stats: dict[str, Any] | None = None) -> int | None:
        """Appends a message; returns its id (None when the store is unavailable). HistoryError when the
        conversation is gone (deleted from another window, or with ``swiftspec history delete``)."""
        now = time.time()
        exists = self._rows("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,))
        if self._db is not None and not exists:
            raise HistoryError(f"conversation #{conversation_id} was deleted")
        cur = self._transaction([
            ("INSERT INTO messages (conversation_id, role, content, stats, created) VALUES (?, ?, ?, ?, ?)",
             (conversation_id, role, content, json.dumps(stats) if stats else None, now)),
            ("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id)),
        ])
        return None if cur is None else int(cur.lastrowid)

    def update(self, message_id: int, content: str, stats: dict[str, Any] | None = None) -> None:
        """Replaces a message's text and figures (a continued answer)."""
        self._run("UPDATE messages SET content = ?, stats = ? WHERE id = ?",
                  (content, json.dumps(stats) if stats else None, message_id))

    def append_tokens(self, message_id: int, vocab: str, tokens: list[int]) -> None:
        """Adds a finished answer's token ids to what the suffix drafter learns from (after those it
        already has, for a continued answer, when the same tokenizer wrote them)."""
        # numpy and the tokenizers' tables: only for a store whose answers feed the suffix drafter
        from swiftspec.engine.spec.history_corpus import TABLE, decode_tokens, encode_tokens

        with self._lock:
            rows = self._rows(f"SELECT vocab, tokens FROM {TABLE} WHERE message_id = ?", (message_id,))
            earlier = decode_tokens(rows[0][1]).tolist() if rows and rows[0][0] == vocab else []
            self._run(f"INSERT OR REPLACE INTO {TABLE} (message_id, vocab, n, tokens) SELECT ?, ?, ?, ? "
                      "WHERE EXISTS (SELECT 1 FROM messages WHERE id = ?)",  # not deleted meanwhile
                      (message_id, vocab, len(earlier) + len(tokens), encode_tokens(earlier + tokens), message_id))

    def truncate(self, conversation_id: int, from_message_id: int) -> None:
        """Deletes that message and every later one (a retried or edited turn)."""
        self._run("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, from_message_id))

    def get(self, conversation_id: int) -> Conversation:
        rows = self._rows(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations c WHERE c.id = ?", (conversation_id,))
        if not rows:
            raise HistoryError(self.problem or f"no conversation with id {conversation_id} in {self.path}")
        return _conversation(rows[0])

    def latest(self) -> Conversation:
        rows = self._rows(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations c "
                          "ORDER BY c.updated DESC, c.id DESC LIMIT 1")
        if not rows:
            raise HistoryError(self.problem or f"no saved conversation yet in {self.path}")
        return _conversation(rows[0])

    def list(self, limit: int = 50) -> list[Conversation]:
        rows = self._rows(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations c "
                          "ORDER BY c.updated DESC, c.id DESC LIMIT ?", (limit,))
        return [_conversation(row) for row in rows]

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._rows("SELECT role, content, stats, id FROM messages WHERE conversation_id = ? ORDER BY id",
                          (conversation_id,))
        return [Message(role, content, json.loads(stats) if stats else None, mid) for role, content, stats, mid in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self._run("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system(self, conversation_id: int, system: str | None) -> None:
        self._run("UPDATE conversations SET system = ? WHERE id = ?", (system, conversation_id))

    def set_settings(self, conversation_id: int, settings: dict[str, Any]) -> None:
        self._run("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(settings), conversation_id))

    def clear(self, conversation_id: int) -> None:
        self._run("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))

    def delete(self, conversation_id: int) -> None:
        """The conversation and its messages (ON DELETE CASCADE)."""
        self._run("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        return to_markdown(conv.title, conv.system, self.messages(conversation_id))

    def export_json(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        return json.dumps({
            "id": conv.id, "title": conv.title, "system": conv.system, "created": conv.created,
            "updated": conv.updated,
            "messages": [{"role": m.role, "content": m.content, "stats": m.stats}
                         for m in self.messages(conversation_id)],
        }, ensure_ascii=False, indent=2) + "\n"


def _conversation(row: tuple) -> Conversation:
    *columns, settings = row
    return Conversation(*columns, settings=json.loads(settings) if settings else None)


def to_markdown(title: str, system: str | None, messages: list[Message]) -> str:
    """A readable transcript: headings per turn, answers verbatim (they are Markdown already), a change of
    system prompt where it happened (it applies to the answers after it)."""
    parts = [f"# {title}\n"]
    if system:
        parts.append(f"**System:** {system}\n")
    for m in messages:
        if m.role == "system":
            parts.append(f"**System, from here on:** {m.content}\n" if m.content else "**System prompt removed.**\n")
            continue
        heading = {"user": "## You", "assistant": "## Assistant"}.get(m.role, f"## {m.role.title()}")
        parts.append(f"{heading}\n\n{m.content.rstrip()}\n")
        if m.role == "assistant" and m.stats:
            parts.append(f"<sub>{AnswerSummary.from_dict(m.stats).line()}</sub>\n")
    return "\n".join(parts)
