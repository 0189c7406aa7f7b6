"""The CPU kernels' linears by ISA path: what a verified row costs against one decode row, on this machine.

For every path this CPU runs (portable, AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI, AVX-512 BF16, AMX), times the packed
linears a small model's decode step, verification and prefill are made of (the embedded SmolLM2's shapes:
Q4 gate/up and down, a Q8 weight of the same width) at 1, 2, 4, 8 and 32 rows, for each thread count asked,
and prints the time, the cost of 8 rows as a multiple of one row, and the multiply-adds per second
at 8 and 32 rows. The paths the engine picks (the fastest for one row, several and many, measured at
load) are marked. With ``--check`` it first confirms that every path gives the portable path's bits on
these shapes.

With ``--activations int16,int8`` it does all this for each width the integer formats' activations are
quantised to (the int8 tiles: vpmaddubsw, vpdpbusd, one AMX dot product a block). ``bf16`` times the same
shapes as BF16 weights, on fp32 activations and then on bf16 ones (vdpbf16ps where the CPU has it, which
only the AVX-512 BF16 path runs; two fp32 fmas a pair on the others).

With ``--attention`` it also times tree attention the way a step of the embedded model runs it: 30 layers'
caches in turn (so the keys and values stream from L3 or memory, as in the model), 9 query heads over 3 kv
heads of 64, at each of ``--contexts`` tokens and 1, 4 and 8 rows, with a float32 and a float16 KV cache.

    python benchmarks/cpu_kernels.py [--threads 1,2] [--reps 200] [--json out.json] [--check]
        [--activations int16,int8,bf16]
        [--attention [--contexts 300,1000,2000]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from swiftspec.engine.config import ACTIVATIONS, Activations
from swiftspec.engine.model import cpu_backends
from swiftspec.kernels import cpu_linear
from swiftspec.kernels.cpu_linear import Format

SHAPES = ((Format.Q4, 3072, 576), (Format.Q4, 576, 1536), (Format.Q8, 4096, 576))
ROWS = (1, 2, 4, 8, 32)


def cpu_name() -> str:
    """The CPU's model name, family/model and the vector flags that pick a path."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = [f for f in fields.get("flags", "").split()
             if f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")]
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; "
            f"{os.cpu_count()} CPUs; {' '.join(flags)})")


def runs_here(dll) -> list[str]:
    """The paths that run on this CPU with the library's activations, widest first."""
    return [kp.name for kp in cpu_linear.paths(dll) if kp.runs]


def shapes(width: Activations) -> tuple[tuple[Format, int, int], ...]:
    """The linears timed at ``width``: BF16 weights of SHAPES' sizes for bf16 activations."""
    return tuple((Format.BF16, n, k) for _, n, k in SHAPES) if width is Activations.BF16 else SHAPES


def weights(g: torch.Generator, fmt: Format, n: int, k: int) -> tuple[torch.Tensor, ...]:
    if fmt == Format.BF16:
        return (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16), None, None
    nb = k // 32
    w = torch.randint(-128, 128, (n, nb * (16 if fmt == Format.Q4 else 32)), generator=g, dtype=torch.int8)
    return w, torch.rand(n, nb, generator=g), torch.rand(n, nb, generator=g)


def median_us(fn, most: int) -> float:
    """The median of five batches' mean, in µs; a batch is ``most`` calls, or fewer where that would
    take over 50 ms (the portable path is two orders slower than the vector ones)."""
    t0 = time.perf_counter()
    fn()
    reps = max(2, min(most, int(0.05 / max(time.perf_counter() - t0, 1e-7))))
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        batches.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(batches)


def check(dll, paths: list[str], width: Activations) -> list[str]:
    """The paths whose outputs differ from the portable path's on ``width``'s shapes (an empty list: all
    agree)."""
    g = torch.Generator().manual_seed(1)
    portable = cpu_linear.paths(dll)[-1].name  # the table ends with the portable path
    wrong = []
    for fmt, n, k in shapes(width):
        w, d, m = weights(g, fmt, n, k)
        x = torch.randn(8, k, generator=g)
        cpu_linear.use_path(dll, portable)
        want = cpu_linear.linear(dll, fmt, x, n, w, d, m)
        for name in paths:
            cpu_linear.use_path(dll, name)
            if not torch.equal(cpu_linear.linear(dll, fmt, x, n, w, d, m), want):
                wrong.append(f"{name} {fmt.name} {n}x{k}")
    return wrong


def time_linears(dll, paths: list[str], threads: list[int], reps: int, chosen: cpu_linear.PathChoice,
                 linears: tuple[tuple[Format, int, int], ...] = SHAPES, activations: str = "") -> list[dict]:
    """Each path's ``linears`` at each of ROWS on each thread count, printed as a table and returned (each
    entry's format named with ``activations`` where given)."""
    g = torch.Generator().manual_seed(0)
    print(f"\n{'path':<16}{'thr':>4}  {'linear':<14}" + "".join(f"{f'{r} row':>10}" for r in ROWS)
          + f"{'8 ÷ 1':>8}{'GMAC/s@8':>10}{'@32':>7}")
    found = []
    for n_threads in threads:
        cpu_linear.set_threads(dll, n_threads)
        for name in paths:
            cpu_linear.use_path(dll, name)
            for fmt, n, k in linears:
                w, d, m = weights(g, fmt, n, k)
                us = {}
                for rows in ROWS:
                    x = torch.randn(rows, k, generator=g)
                    us[rows] = median_us(partial(cpu_linear.linear, dll, fmt, x, n, w, d, m), reps)
                mark = "".join(sign if name == path else " " for sign, path in
                               (("*", chosen.rows), ("1", chosen.one_row), ("+", chosen.many_rows)))
                print(f"{name + mark:<16}{n_threads:>4}  {f'{fmt.name}{activations} {n}x{k}':<14}"
                      + "".join(f"{us[r]:>8.1f}µs" for r in ROWS) + f"{us[8] / us[1]:>8.2f}"
                      + f"{8 * n * k / us[8] / 1e3:>10.1f}{32 * n * k / us[32] / 1e3:>7.1f}")
                found.append({"path": name, "threads": n_threads, "format": fmt.name + activations, "n": n, "k": k,
                              "us": {str(r): round(us[r], 2) for r in ROWS}})
    print("\n* the path the engine picks for several rows on this CPU, 1 for one row, + for many; '8 ÷ 1' is "
          "what a verification of 8 rows costs in one-row linears")
    return found


ATTENTION_ROWS = (1, 4, 8)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # the embedded SmolLM2-135M's


def time_attention(dll, paths: list[str], threads: list[int], contexts: list[int]) -> list[dict]:
    """Each path's attention over LAYERS layers' caches at each context and row count, float32 and float16
    caches, as a table (ms for the layers together) and returned."""
    g = torch.Generator().manual_seed(2)
    slots = max(contexts) + max(ATTENTION_ROWS)
    caches = {dtype: tuple(torch.randn(LAYERS, KV_HEADS, slots, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
              for dtype in (torch.float32, torch.float16)}
    print(f"\n{'path':<16}{'thr':>4}  {'context':>8}" + "".join(f"{f'{r} row fp32':>13}{'fp16':>9}" for r in ATTENTION_ROWS))
    found = []
    for n_threads in threads:
        cpu_linear.set_threads(dll, n_threads)
        for name in paths:
            cpu_linear.use_path(dll, name)
            for context in contexts:
                ms = {}
                for rows in ATTENTION_ROWS:
                    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
                    mask = torch.ones(rows, context, dtype=torch.bool)
                    for dtype, (k, v) in caches.items():
                        def layers(k=k, v=v, q=q, mask=mask):
                            for layer in range(LAYERS):
                                cpu_linear.attention(dll, q, k[layer], v[layer], mask, HEAD_DIM ** -0.5)
                        ms[rows, dtype] = median_us(layers, 20) / 1e3
                print(f"{name:<16}{n_threads:>4}  {context:>8}" + "".join(
                    f"{ms[r, torch.float32]:>11.2f}ms{ms[r, torch.float16]:>7.2f}ms" for r in ATTENTION_ROWS))
                found.append({"path": name, "threads": n_threads, "context": context,
                              "ms": {f"{r}/{str(d).removeprefix('torch.')}": round(ms[r, d], 3) for r, d in ms}})
    print(f"\nattention of {LAYERS} layers ({HEADS} heads over {KV_HEADS}, {HEAD_DIM} wide), ms, "
          "with a float32 and a float16 KV cache")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1", help="comma-separated kernel thread counts (default 1)")
    p.add_argument("--reps", type=int, default=200, help="most calls per timed batch")
    p.add_argument("--paths", default="", help="comma-separated path names as listed, e.g. 'AVX2' (default: every path that runs)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--check", action="store_true", help="first check every path against the portable bits")
    p.add_argument("--activations", default="int16",
                   help="comma-separated activations, each timed in turn: int16 (default), int8, bf16 or int16,int8,bf16")
    p.add_argument("--attention", action="store_true", help="also time attention, float32 and float16 KV caches")
    p.add_argument("--contexts", default="300,1000,2000", help="with --attention: comma-separated context lengths")
    args = p.parse_args()
    try:
        widths = [Activations(w) for w in args.activations.split(",") if w]
    except ValueError:
        print(f"cpu_kernels: --activations takes {' or '.join(ACTIVATIONS)}, not {args.activations!r}", file=sys.stderr)
        return 2

    dll = cpu_backends.library()  # the engine's own build
    running = runs_here(dll)
    if Activations.BF16 in widths:  # and the path that runs with bf16 activations alone
        chosen = cpu_linear.paths_in_use(dll)
        cpu_linear.set_bf16_activations(dll, True)
        with_bf16 = runs_here(dll)
        cpu_linear.set_bf16_activations(dll, False)
        cpu_linear.use_paths(dll, chosen)
        running = [name for name in with_bf16 if name not in running] + running
    paths = [s for s in args.paths.split(",") if s] or running
    unknown = [s for s in paths if s not in running]
    if unknown:
        print(f"cpu_kernels: no path {', '.join(unknown)} runs here (these do: {', '.join(running)})", file=sys.stderr)
        return 2
    result: dict = {"cpu": cpu_name(), "paths": running, "activations": {}}
    print(f"CPU: {result['cpu']}\npaths that run: {', '.join(running)}")
    threads = [int(t) for t in args.threads.split(",")]
    for width in widths:
        dll = cpu_backends.library(width)  # and the paths the engine picks for this width
        chosen = cpu_linear.paths_in_use(dll)
        found: dict = {"chosen": asdict(chosen)}
        print(f"\n{width} activations: the engine picks {cpu_linear.isa(dll)}")
        runs = runs_here(dll)  # the AVX-512 BF16 path runs with bf16 activations alone
        timed = [name for name in paths if name in runs]
        if args.check:
            found["differ"] = check(dll, runs, width)
            print("bits: every path equals portable" if not found["differ"]
                  else f"bits DIFFER: {', '.join(found['differ'])}")
        if width is Activations.BF16:  # the same weights on fp32 activations, for comparison
            cpu_linear.set_bf16_activations(dll, False)
            fp32_timed = [name for name in timed if name in runs_here(dll)]
            found["fp32_linears"] = time_linears(dll, fp32_timed, threads, args.reps, cpu_linear.paths_in_use(dll),
                                                 shapes(width), " fp32")
            cpu_linear.set_bf16_activations(dll, True)
            cpu_linear.use_paths(dll, chosen)
        found["linears"] = time_linears(dll, timed, threads, args.reps, chosen, shapes(width))
        cpu_linear.use_paths(dll, chosen)
        result["activations"][str(width)] = found
    cpu_backends.library(Activations.INT16)
    if args.attention:
        chosen = cpu_linear.paths_in_use(dll)
        result["attention"] = time_attention(dll, paths, [int(t) for t in args.threads.split(",")],
                                             [int(c) for c in args.contexts.split(",")])
        cpu_linear.use_paths(dll, chosen)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
