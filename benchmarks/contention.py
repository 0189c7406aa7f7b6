"""Issue 16 figures: decoding speed with one busy process beside the workers, against quiet, on the
embedded model. Each OpenMP wait policy gets its own engine; quiet and busy runs alternate inside one
engine so that both see the same machine, and the ratio busy / quiet is the figure to read (the goal is
>= 45 %). The busy process is one Python spin loop, i.e. one core taken.

    .venv/bin/python benchmarks/contention.py [--policies ACTIVE,PASSIVE] [--tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.host.client import Engine

PROMPT = [{"role": "user", "content": "Explain how a hash map works, step by step."}]


def tokens_per_s(engine: Engine, mode: str, tokens: int) -> float:
    t0 = time.perf_counter()
    n = sum(len(e.token_ids) for e in engine.generate(
        PROMPT, SamplingParams(mode=mode, max_new_tokens=tokens, ignore_eos=True)))
    return n / (time.perf_counter() - t0)


def busy_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="ACTIVE,PASSIVE", help="OMP_WAIT_POLICY values to compare")
    ap.add_argument("--modes", default="ar,async")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    for policy in args.policies.split(","):
        os.environ["OMP_WAIT_POLICY"] = policy
        with Engine.start(EngineConfig(threads=args.threads)) as engine:
            threads = engine.info.ranks[0].torch_threads
            for mode in args.modes.split(","):
                tokens_per_s(engine, mode, 8)  # warm-up
                quiet, busy = [], []
                for _ in range(args.rounds):
                    quiet.append(tokens_per_s(engine, mode, args.tokens))
                    spinner = busy_process()
                    try:
                        time.sleep(0.2)
                        busy.append(tokens_per_s(engine, mode, args.tokens))
                    finally:
                        spinner.kill()
                        spinner.wait()
                q, b = statistics.median(quiet), statistics.median(busy)
                print(f"OMP_WAIT_POLICY={policy:8s} target threads {threads}  {mode:5s}  quiet {q:6.1f} tok/s  "
                      f"busy {b:6.1f} tok/s  busy/quiet {b / q:5.0%}", flush=True)


if __name__ == "__main__":
    main()
