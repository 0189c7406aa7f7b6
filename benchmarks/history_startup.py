"""What a large history costs the suffix drafter's start: a history database of ``--tokens`` answer tokens
(the shipped corpus's answers of the embedded model, repeated with their token ids permuted so that no
n-gram repeats between copies), then the drafter's history read four ways: with no cached table (built
and cached), from the cache, from the cache with a session's worth of new answers (overlaid), and after a
deletion among the cached answers (built again). Medians of ``--runs``; the load average alongside.

    .venv/bin/python benchmarks/history_startup.py [--tokens 1000000] [--runs 3] [--keep DIR]

``--keep DIR`` leaves the database in DIR/history.sqlite3 (SWIFTSPEC_DATA_DIR=DIR for
``benchmarks/startup.py -- --save`` times a whole start with it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from swiftspec.engine.model.model_dir import resolve_model_dir
from swiftspec.engine.spec.corpus import builtin_corpus
from swiftspec.engine.spec.history_corpus import AnswerReader, StoredHistory, tokenizer_fingerprint
from swiftspec.history import HistoryStore


def fill(store: HistoryStore, vocab: str, tokens: int) -> list[int]:
    """Conversations of one answer each until the history holds ``tokens`` answer tokens; their ids."""
    corpus = load_file(str(builtin_corpus()))["tokens"].astype(np.int64)
    answers = [a[3:] for a in np.split(corpus, np.flatnonzero(corpus < 0) + 1) if len(a) > 4]
    rng, ids, total, copy = np.random.default_rng(0), [], 0, 0
    while total < tokens:
        perm = rng.permutation(int(corpus.max()) + 1) if copy else np.arange(int(corpus.max()) + 1)
        for a in answers:
            if total >= tokens:
                break
            cid = store.create("q")
            store.add(cid, "user", "q")
            store.append_tokens(store.add(cid, "assistant", "a"), vocab, perm[a].tolist())
            ids.append(cid)
            total += len(a)
        copy += 1
    return ids


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="write the database here and keep it")
    args = ap.parse_args()
    vocab = tokenizer_fingerprint(resolve_model_dir(None))
    work = Path(tempfile.mkdtemp())
    root = args.keep or work
    root.mkdir(parents=True, exist_ok=True)
    store = HistoryStore(root / "history.sqlite3")
    ids: list[int] = []
    t = timed(lambda: ids.extend(fill(store, vocab, args.tokens)))
    cache = work / "cache"
    cache.mkdir()
    times: dict[str, list[float]] = {k: [] for k in ("built", "cached", "cached + 300 new answers", "after a deletion")}
    for _ in range(args.runs):
        for table in cache.glob("*.npz"):
            table.unlink()
        times["built"].append(timed(lambda: StoredHistory(store.path, vocab, cache=cache)))
        times["cached"].append(timed(lambda: StoredHistory(store.path, vocab, cache=cache)))
    scratch = HistoryStore(work / "scratch.sqlite3")
    new = fill(scratch, vocab, 45_000)  # a session's worth: ~300 answers
    extra = [scratch.messages(cid)[1].id for cid in new]
    for _ in range(args.runs):
        StoredHistory(store.path, vocab, cache=cache)  # the cache of the history as it is
        added = []
        tokens = AnswerReader(scratch.path, vocab).tokens(extra)
        for toks in tokens.values():
            cid = store.create("q")
            store.add(cid, "user", "q")
            store.append_tokens(store.add(cid, "assistant", "a"), vocab, toks.tolist())
            added.append(cid)
        times["cached + 300 new answers"].append(timed(lambda: StoredHistory(store.path, vocab, cache=cache)))
        for cid in added:
            store.delete(cid)
        StoredHistory(store.path, vocab, cache=cache)
        store.delete(ids.pop())
        times["after a deletion"].append(timed(lambda: StoredHistory(store.path, vocab, cache=cache)))
    held = StoredHistory(store.path, vocab, cache=cache)
    print(f"history: {len(held.index.answers)} answers, {held.index.tokens:,} tokens; "
          f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); fill took {t:.0f} s")
    for name, ts in times.items():
        print(f"{name:28} {statistics.median(ts):6.2f} s")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
