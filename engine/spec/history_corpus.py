"""The history store as the suffix drafter's growing corpus (SuffixDecoding-style): the answers this target
gave in earlier conversations, newest first, up to ``TOKEN_CAP`` tokens.

Users repeat themselves (the same kinds of questions, code they iterate on), and a model repeats its own
phrasing, so what it answered before is the best corpus there is for what it will answer next.

The contract with the store (``swiftspec/history.py`` keeps it): a table ``answer_tokens`` in the history
database, one row per finished answer: ``message_id``, ``vocab`` (``tokenizer_fingerprint`` of the target
that wrote it), ``n`` (its token count) and ``tokens`` (``encode_tokens``). A row goes with its message
(ON DELETE CASCADE), so a deleted conversation, or a retried or edited turn, leaves the corpus before the
draft's next answer; rows of another tokenizer are ignored (the Engine says how many at start).

The draft worker opens the database read-only and looks for changes before every answer (``PRAGMA
data_version``: one query when nothing changed). The index is exact: n-gram counts of the answers that
are in, nothing else. It is a numpy table built once over the answers found at start (``CorpusIndex``
with every continuation kept), cached between starts beside the database (it holds the user's answers, as
n-grams, and must not outlive them or serve another database) while the answers it was built from are all
there, unchanged, plus a small overlay of counts added and removed since. The drafter still only
proposes: the target verifies every token, so the history makes drafting faster or slower, never wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swiftspec.engine.spec.corpus import CorpusIndex

TABLE = "answer_tokens"
# Newest answers first, up to this many tokens: a table of that size builds in seconds (after a change of
# the answer set, in the draft process, while the target loads) and takes ~100 MB; benchmarks/
# history_startup.py measures it, docs/ARCHITECTURE.md gives figures.
TOKEN_CAP = 1_000_000
MAX_ORDER = 8  # context tokens of the longest n-gram; a copy of a longer span goes on at this order
INDEX_FORMAT = 1  # of the cached tables


def tokenizer_fingerprint(model_dir: Path) -> str:
    """sha256 of the tokenizer's token -> id map, read from its files (the workers load no tokenizer):
    equal for targets that share a vocabulary, so that they share the history's answers."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data.get("model", {}).get("vocab") or {}
        ids = dict(vocab) if isinstance(vocab, dict) else {piece[0]: i for i, piece in enumerate(vocab)}
        ids.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        by_id = sorted((i, t) for t, i in ids.items())  # ints first: cheap to sort
        return hashlib.sha256("\0".join(f"{i}\1{t}" for i, t in by_id).encode()).hexdigest()
    digest = hashlib.sha256()
    for name in ("vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json"):
        if (model_dir / name).is_file():
            digest.update(name.encode() + (model_dir / name).read_bytes())
    return digest.hexdigest()


def encode_tokens(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def decode_tokens(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i4").astype(np.int64)


def newest_within(listing: list[tuple[int, int]], cap: int) -> list[int]:
    """The ids of (id, tokens) answers, newest first, while their tokens together stay within cap."""
    ids, total = [], 0
    for answer_id, n in sorted(listing, reverse=True):
        total += n
        if total > cap:
            break
        ids.append(answer_id)
    return ids


class AnswerReader:
    """The store's answers of one tokenizer, read-only. A missing database or table reads as empty (the
    chat creates both before the engine starts; a history that cannot be read leaves the drafter as is)."""

    def __init__(self, db: Path, vocab: str):
        self.db, self.vocab = Path(db), vocab
        self._conn: sqlite3.Connection | None = None
        self._version: int | None = None

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        if self._conn is None:
            self._conn = sqlite3.connect(f"{self.db.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
        return self._conn.execute(sql, args).fetchall()

    def changed(self) -> bool:
        """Whether another connection committed anything since the last call (True the first time)."""
        try:
            version = self._query("PRAGMA data_version")[0][0]
        except sqlite3.Error:
            self._conn = None
            return False
        changed, self._version = version != self._version, version
        return changed

    def listing(self) -> list[tuple[int, int]]:
        """(message id, tokens) of every answer of this tokenizer; [] when the history cannot be read."""
        try:
            return self._query(f"SELECT message_id, n FROM {TABLE} WHERE vocab = ?", (self.vocab,))
        except sqlite3.Error:
            return []

    def tokens(self, ids: list[int]) -> dict[int, np.ndarray]:
        """The token arrays of those answers (one deleted meanwhile is missing)."""
        out: dict[int, np.ndarray] = {}
        for start in range(0, len(ids), 500):  # SQLite's limit on bound parameters
            chunk = ids[start:start + 500]
            try:
                rows = self._query(f"SELECT message_id, tokens FROM {TABLE} WHERE message_id IN "
                                   f"({','.join('?' * len(chunk))})", tuple(chunk))
            except sqlite3.Error:
                continue
            out.update((answer_id, decode_tokens(blob)) for answer_id, blob in rows)
        return out

    def foreign(self) -> int:
        """Answers written with another tokenizer (ignored)."""
        try:
            return self._query(f"SELECT COUNT(*) FROM {TABLE} WHERE vocab != ?", (self.vocab,))[0][0]
        except sqlite3.Error:
            return 0


@dataclass
class HistorySummary:
    """What the Engine says at start about the history it drafts from."""

    answers: int
    tokens: int
    foreign: int  # answers of another tokenizer, ignored

    def line(self) -> str:
        line = f"drafting also from {self.answers} earlier answers ({self.tokens:,} tokens) in the history"
        if self.foreign:
            line += f"; {self.foreign} answers by another tokenizer are ignored"
        return line


def summarise(db: Path, vocab: str, cap: int = TOKEN_CAP) -> HistorySummary:
    reader = AnswerReader(db, vocab)
    listing = reader.listing()
    ids = set(newest_within(listing, cap))
    return HistorySummary(len(ids), sum(n for i, n in listing if i in ids), reader.foreign())


class HistoryIndex:
    """Exact n-gram counts over a changing set of answers: for every context of 1..max_order tokens within
    an answer, how often each token followed it. A ``CorpusIndex`` over the answers it was built with,
    plus an overlay of the counts of answers added or removed since (Python dicts: a session's worth)."""

    def __init__(self, answers: dict[int, np.ndarray], max_order: int = MAX_ORDER, base: CorpusIndex | None = None):
        """base: the table of exactly these answers, cached; None builds it."""
        self.max_order = max_order
        self.answers = dict(answers)
        self.base = base or CorpusIndex(_joined(answers), max_order, top_k=None)
        self.overlay: dict[tuple[int, ...], dict[int, int]] = {}
        self.changed_tokens = 0  # tokens added or removed through the overlay

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.answers.values())

    def add(self, answer_id: int, tokens: np.ndarray) -> None:
        if answer_id not in self.answers:
            self.answers[answer_id] = tokens
            self._count(tokens.tolist(), 1)
            self.changed_tokens += len(tokens)

    def remove(self, answer_id: int) -> None:
        tokens = self.answers.pop(answer_id, None)
        if tokens is not None:
            self._count(tokens.tolist(), -1)
            self.changed_tokens += len(tokens)

    def _count(self, tokens: list[int], sign: int) -> None:
        for i in range(1, len(tokens)):
            for order in range(1, min(self.max_order, i) + 1):
                key = tuple(tokens[i - order:i])
                counts = self.overlay.setdefault(key, {})
                c = counts.get(tokens[i], 0) + sign
                if c:
                    counts[tokens[i]] = c
                else:
                    del counts[tokens[i]]
                    if not counts:
                        del self.overlay[key]

    def lookup(self, context: list[int]) -> tuple[dict[int, int], int]:
        """The continuation counts of the longest suffix of context found in the answers, and its length."""
        hashes = self.base.hashes(context)
        for order in range(len(hashes), 0, -1):
            counts = self.base.counts(hashes, order)
            delta = self.overlay.get(tuple(context[-order:]))
            if delta:
                for t, c in delta.items():
                    n = counts.get(t, 0) + c
                    if n:
                        counts[t] = n
                    else:
                        del counts[t]
            if counts:
                return counts, order
        return {}, 0


def _joined(answers: dict[int, np.ndarray]) -> np.ndarray:
    """The answers as one array, -1 between them (no n-gram spans two), oldest first."""
    parts = []
    for answer_id in sorted(answers):
        parts += [answers[answer_id], np.array([-1], dtype=np.int64)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class StoredHistory:
    """The suffix drafter's history in the store: read at start and followed before every answer
    (``update``). At start the cached table serves while the answers it was built from are all still in
    the store and the changes since are small (under a tenth of its tokens, e.g. the last session's
    answers); otherwise (a deletion among them, many changes) the table is built anew and cached."""

    REBUILD_SHARE = 0.1

    def __init__(self, db: Path, vocab: str, cap: int = TOKEN_CAP, max_order: int = MAX_ORDER,
                 cache: Path | None = None):
        """cache: the directory of the cached table (None: the database's own)."""
        self.reader, self.cap = AnswerReader(db, vocab), cap
        self.reader.changed()
        listing = self.reader.listing()
        path = (cache or Path(db).parent) / f"{Path(db).name}.index-{vocab[:16]}-o{max_order}.npz"
        cached = _load_table(path, max_order)
        if cached is not None and cached[0] <= {i for i, _ in listing}:
            base = self.reader.tokens(sorted(cached[0]))
            if set(base) == cached[0] and _digest(base) == cached[2]:  # the same answers (a new database
                # file reuses ids; none deleted since the listing)
                self.index = HistoryIndex(base, max_order, cached[1])
                self._follow(listing)
                if self.index.changed_tokens <= self.REBUILD_SHARE * max(self.index.tokens, 1):
                    return
        self.index = HistoryIndex(self.reader.tokens(newest_within(listing, cap)), max_order)
        if self.index.answers:
            _save_table(path, self.index)

    def update(self) -> None:
        """Follows the store: new answers in, deleted ones (and those past the cap) out."""
        if self.reader.changed():
            self._follow(self.reader.listing())

    def _follow(self, listing: list[tuple[int, int]]) -> None:
        wanted = newest_within(listing, self.cap)
        keep = set(wanted)
        for answer_id in [i for i in self.index.answers if i not in keep]:
            self.index.remove(answer_id)
        for answer_id, tokens in self.reader.tokens([i for i in wanted if i not in self.index.answers]).items():
            self.index.add(answer_id, tokens)

    def lookup(self, context: list[int]) -> tuple[dict[int, int], int]:
        return self.index.lookup(context)


def _digest(answers: dict[int, np.ndarray]) -> bytes:
    """What identifies a table's answers: their ids and tokens."""
    digest = hashlib.sha256()
    for answer_id in sorted(answers):
        digest.update(np.int64(answer_id).tobytes() + answers[answer_id].astype("<i4").tobytes())
    return digest.digest()


def _load_table(path: Path, max_order: int) -> tuple[set[int], CorpusIndex, bytes] | None:
    """The cached table, the ids of the answers it was built from and their digest."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if int(f["format"]) != INDEX_FORMAT:
                return None
            tables = [tuple(f[f"{name}{order}"] for name in ("keys", "offsets", "nexts", "counts"))
                      for order in range(1, max_order + 1)]
            return set(f["ids"].tolist()), CorpusIndex.from_tables(max_order, tables), f["digest"].tobytes()
    except (OSError, KeyError, ValueError):
        return None


def _save_table(path: Path, index: HistoryIndex) -> None:
    """Written privately (it holds the user's conversations, as n-grams) and atomically."""
    arrays = {"format": np.array(INDEX_FORMAT), "ids": np.array(sorted(index.answers), dtype=np.int64),
              "digest": np.frombuffer(_digest(index.answers), dtype=np.uint8)}
    for order, table in enumerate(index.base.tables, 1):
        arrays.update({f"{name}{order}": a for name, a in zip(("keys", "offsets", "nexts", "counts"), table,
                                                               strict=True)})
    try:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "wb") as f:
            np.savez(f, **arrays)
        tmp.replace(path)
    except OSError:
        pass  # no cache: the next start builds the table again
