"""The per-round overhead of the disaggregated loops (gloo between the groups, Python, the leader's
socket) on a tiny random target with the suffix drafter, through the Engine: for ``sync`` and ``async``
the wall time per round (between two streamed steps), the target's own time in it (verification), and
their difference, medians of interleaved runs; and the async / sync round-time ratio. Beside them, the
CPU time per round of each leader process (all its threads, from /proc: what a loaded machine does not
stretch the way it stretches wall time) and the target's CPU beyond its verification.

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

from swiftspec.engine.config import EngineConfig, SamplingParams, TreeParams  # noqa: E402
from swiftspec.engine.host.client import Engine  # noqa: E402

MODES = ("sync", "async")


def cpu_ms(pid: int) -> float:
    """The CPU time a process's threads have run, in ms (Linux schedstat: nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            pass
    return total / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    config = EngineConfig(target=str(tiny_model_dir(seed=0, layers=2)), draft="suffix", max_seq_len=512,
                          threads=args.threads, tree=TreeParams(bs=4, w=4, d=1), draft_history=False)
    messages = [{"role": "user", "content": "What is 17 times 23?"}]
    runs: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in MODES}
    with Engine.start(config) as engine:
        leaders = [r.pid for r in engine.info.ranks if r.tp_rank == 0]  # the target's, then the draft's
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                arrivals, target_ms, cpu = [], [], []
                for ev in engine.generate(messages, SamplingParams(mode=mode, max_new_tokens=args.tokens,
                                                                   ignore_eos=True)):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 1:  # after the prefill
                        cpu = [cpu_ms(pid) for pid in leaders]
                    if ev.stats.tree_size:
                        target_ms.append(ev.stats.target_ms)
                rounds = len(arrivals) - 1  # the first step is the prefill
                target_cpu, draft_cpu = ((cpu_ms(pid) - c) / rounds for pid, c in zip(leaders, cpu, strict=True))
                runs[mode].append(((arrivals[-1] - arrivals[0]) * 1e3 / rounds, statistics.mean(target_ms),
                                   target_cpu, draft_cpu))
    for mode, r in runs.items():
        wall, target, target_cpu, draft_cpu = (statistics.median(column) for column in zip(*r, strict=True))
        print(f"{mode}: round {wall:.3f} ms, target {target:.3f} ms, overhead "
              f"{statistics.median(x[0] - x[1] for x in r):.3f} ms; CPU per round: target leader {target_cpu:.3f} ms "
              f"(less the verification's time: {statistics.median(x[2] - x[1] for x in r):.3f}), "
              f"draft leader {draft_cpu:.3f} ms")
    ratio = statistics.median(a[0] / s[0] for a, s in zip(runs["async"], runs["sync"], strict=True))
    print(f"async / sync round time: {ratio:.3f}")


if __name__ == "__main__":
    main()
