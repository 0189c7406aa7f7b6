"""Where the start-up of ``swiftspec chat -p hi --max-new-tokens 1`` goes, on the converted embedded model:
each stage is the time between the engine's progress lines on stderr, taken as they arrive.

    .venv/bin/python benchmarks/startup.py [--runs 3] [-- extra chat flags, e.g. --mode ar]

Stages: "cli + imports" (the interpreter, the CLI, torch and transformers, up to the first progress line),
"models + tokenizer" (resolving the model paths, loading the tokenizer), "torchrun + worker imports" (up
to the workers' first word), "load weights", "profile d" (the step times d is chosen from), and
"answer + shutdown" (one token, then every process ends). Medians over the runs; the machine's load
average is printed alongside, since a shared machine stretches every stage.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

STAGES = [  # (the progress line that ends the stage, its name)
    ("resolving the models", "cli + imports"),
    ("starting ", "models + tokenizer"),
    ("loading target", "torchrun + worker imports"),
    ("profil", "load weights"),  # "profiling ...", or "... from the profile cache"
    ("ready", "profile d"),
]


def one_run(extra: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "swiftspec", "chat", "-p", "hi", "--max-new-tokens", "1", *extra],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    for line in proc.stderr:
        for marker, name in STAGES:
            if marker in line and name not in seen:
                seen[name] = time.perf_counter() - t0
    if proc.wait() != 0:
        raise SystemExit(f"swiftspec exited with {proc.returncode}")
    total = time.perf_counter() - t0
    out, last = {}, 0.0
    for _, name in STAGES:
        if name in seen:
            out[name] = seen[name] - last
            last = seen[name]
    out["answer + shutdown"] = total - last
    out["total"] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more chat flags (after --)")
    args = parser.parse_args()
    one_run(args.extra)  # warm the page cache; not counted
    runs = [one_run(args.extra) for _ in range(args.runs)]
    print(f"swiftspec chat -p hi --max-new-tokens 1 {' '.join(args.extra)}: median of {args.runs} runs, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name in [n for _, n in STAGES] + ["answer + shutdown", "total"]:
        values = [r[name] for r in runs if name in r]
        if values:
            print(f"  {name:<28} {statistics.median(values):6.2f} s   (runs: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
