"""How right the suffix drafter's proposals are, by where the match came from (the conversation or the
history), its length n and its support (how often the context was seen): teacher-forced over the
target's own answers, without a model. The answers are the shipped corpus's (the embedded model's greedy
answers to 2,400 prompts): the last ``--held-out`` are answered, the others are the history. It prints, per
cell, the share of lookups whose top continuation was the next token and the probability the drafter
gave it, which is what the cost-aware trees size a round by (``DraftState._best``).

    .venv/bin/python benchmarks/history_calibration.py [--held-out 300] [--history 2000]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
from safetensors.numpy import load_file

from swiftspec.engine.spec.corpus import builtin_corpus
from swiftspec.engine.spec.drafters import SuffixDrafter
from swiftspec.engine.spec.history_corpus import HistoryIndex


def answers() -> list[list[int]]:
    tokens = load_file(str(builtin_corpus()))["tokens"].astype(np.int64)
    return [a.tolist() for a in np.split(tokens, np.flatnonzero(tokens < 0) + 1) if len(a) > 1]


class Fixed:
    """A history that is only looked up (the drafter's ``stored`` interface)."""

    def __init__(self, index: HistoryIndex):
        self.index = index

    def update(self) -> None:
        pass

    def lookup(self, context):
        return self.index.lookup(context)


def bucket(x: int, edges=(1, 2, 3, 5, 8, 16)) -> str:
    for lo, hi in zip(edges, edges[1:] + (10**9,), strict=True):
        if lo <= x < hi:
            return f"{lo}-{hi - 1}" if hi - 1 > lo else str(lo)
    return "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--held-out", type=int, default=300)
    ap.add_argument("--history", type=int, default=2000, help="answers in the history")
    args = ap.parse_args()
    every = answers()
    held, known = every[-args.held_out:], every[:-args.held_out][-args.history:]
    drafter = SuffixDrafter(history_tokens=0,
                            stored=Fixed(HistoryIndex({i: np.array(a) for i, a in enumerate(known)})))
    cells: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])  # lookups, top-1 hits, summed probability
    for a in held:
        drafter.prefill(a[:3], 0)  # the lead-in (the assistant header)
        for token in a[3:]:
            context = drafter.context.tokens[-drafter.max_order:]
            counts, order = drafter.context.lookup(context)
            source = "conversation"
            if order < 2:
                older, longer = drafter.stored.lookup(context)
                if longer > order:
                    counts, order, source = older, longer, "history"
            if counts:
                total = sum(counts.values())
                top, c = max(counts.items(), key=lambda kv: kv[1])
                cell = cells[(source, bucket(order), bucket(total))]
                cell[0] += 1
                cell[1] += top == token
                cell[2] += c / total * drafter.lookup(context)[1]  # the probability its proposal gets
            drafter.extend([token])
    print(f"{len(held)} answers answered, {len(known)} in the history")
    print(f"{'source':13} {'n':>5} {'support':>8} {'lookups':>8} {'right':>6} {'given':>6}")
    for key in sorted(cells):
        n, hits, given = cells[key]
        if n >= 30:
            print(f"{key[0]:13} {key[1]:>5} {key[2]:>8} {n:8d} {hits / n:6.2f} {given / n:6.2f}")


if __name__ == "__main__":
    main()
