"""The per-round overhead of the disaggregated loops (gloo between the groups, Python, the leader's
socket) on a tiny random target with the suffix drafter, through the Engine: for ``sync`` and ``async``
the wall time per round (between two streamed steps), the target's own time in it (verification), and
their difference, medians of interleaved runs; and the async / sync round-time ratio.

    .venv/bin/python benchmarks/round_overhead.py [--reps 8] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models

from tiny_models import tiny_model_dir  # noqa: E402

from swiftspec.config import EngineConfig, SamplingParams, TreeParams  # noqa: E402
from swiftspec.engine.client import Engine  # noqa: E402

MODES = ("sync", "async")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    config = EngineConfig(target=str(tiny_model_dir(seed=0, layers=2)), draft="suffix", max_seq_len=512,
                          threads=args.threads, tree=TreeParams(bs=4, w=4, d=1), draft_history=False)
    messages = [{"role": "user", "content": "What is 17 times 23?"}]
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with Engine.start(config) as engine:
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                arrivals, target_ms = [], []
                for ev in engine.generate(messages, SamplingParams(mode=mode, max_new_tokens=args.tokens,
                                                                   ignore_eos=True)):
                    arrivals.append(time.perf_counter())
                    if ev.stats.tree_size:
                        target_ms.append(ev.stats.target_ms)
                rounds = len(arrivals) - 1  # the first step is the prefill
                runs[mode].append(((arrivals[-1] - arrivals[0]) * 1e3 / rounds, statistics.mean(target_ms)))
    for mode, r in runs.items():
        print(f"{mode}: round {statistics.median(w for w, _ in r):.3f} ms, target {statistics.median(t for _, t in r):.3f} ms, "
              f"overhead {statistics.median(w - t for w, t in r):.3f} ms")
    ratio = statistics.median(a[0] / s[0] for a, s in zip(runs["async"], runs["sync"], strict=True))
    print(f"async / sync round time: {ratio:.3f}")


if __name__ == "__main__":
    main()
