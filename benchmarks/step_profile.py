"""Where a forward of the CPU target goes: the layers' linears (wqkv, wo, w13, w2), their attention, the
rest of the layers (norms, RoPE, the cache writes, SwiGLU), the lm_head, and what is left outside them
(embedding, final norm, the Python around the call), for a decode step (1 row) and verifications (4, 8 rows)
over a context of ``--context`` tokens.

It builds the kernels once more with ``-DSS_STEP_PROFILE`` (the blocks then time their parts; the engine's
library has no timers) and runs the model on that build, with the paths the engine picks here.

    python benchmarks/step_profile.py [--model PATH] [--dtype auto] [--activations int16] [--threads 1,2]
        [--rows 1,4,8] [--context 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import torch

from swiftspec.engine.config import Activations, Dtype
from swiftspec.engine.model import cpu_backends
from swiftspec.engine.model.embedded import embedded_gguf_path
from swiftspec.engine.model.gguf_io import ensure_converted
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.paths import cache_dir
from swiftspec.kernels import cpu_linear

PARTS = ("wqkv", "wo", "w13", "w2", "attention", "layers", "lm_head")  # as blocks.c numbers them


def profile(model, dll, rows: int, context: int, reps: int) -> dict[str, float]:
    """Milliseconds a forward of ``rows`` rows after ``context`` tokens, and of its parts (means over
    ``reps`` forwards)."""
    g = torch.Generator().manual_seed(rows)
    tokens = torch.randint(0, model.args.vocab_size, (context + rows,), generator=g)
    pos = torch.arange(context)
    model(tokens[:context], pos, pos, torch.tril(torch.ones(context, context, dtype=torch.bool)))
    step_pos = torch.arange(context, context + rows)
    mask = torch.ones(rows, context + rows, dtype=torch.bool)
    parts = (ctypes.c_double * len(PARTS))()
    for _ in range(5):
        model(tokens[context:], step_pos, step_pos, mask)
    dll.ss_step_profile(parts)
    t0 = time.perf_counter()
    for _ in range(reps):
        model(tokens[context:], step_pos, step_pos, mask)
    total = time.perf_counter() - t0
    dll.ss_step_profile(parts)
    ms = {name: parts[i] / reps * 1e3 for i, name in enumerate(PARTS)}
    linears = sum(ms[n] for n in ("wqkv", "wo", "w13", "w2"))
    ms["glue"] = ms.pop("layers") - linears - ms["attention"]
    ms["forward"] = total / reps * 1e3
    ms["outside"] = ms["forward"] - linears - ms["attention"] - ms["glue"] - ms["lm_head"]
    ms["linears_share"] = (linears + ms["lm_head"]) / ms["forward"]
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="the target: a Hugging Face directory or .gguf (default: the embedded one)")
    p.add_argument("--threads", default="1,2", help="comma-separated kernel thread counts")
    p.add_argument("--rows", default="1,4,8", help="comma-separated rows a forward")
    p.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    p.add_argument("--reps", type=int, default=60, help="timed forwards a case")
    p.add_argument("--dtype", default="auto", choices=[str(d) for d in Dtype], help="the CPU backend (--dtype)")
    p.add_argument("--activations", default="int16", choices=[str(a) for a in Activations])
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    activations = Activations(a.activations)
    dll = cpu_linear.load(cache_dir() / "kernels", activations.bits, ("-DSS_STEP_PROFILE",),
                          activations is Activations.BF16)
    cpu_backends.library = lambda activations=None: dll  # the model below runs the profiled build
    model = a.model or embedded_gguf_path()
    torch.set_num_threads(1)
    target = load_model(ensure_converted(model) if model.suffix == ".gguf" else model,
                        dtype=Dtype(a.dtype), max_slots=a.context + 64, activations=activations)
    print(f"{target.precision}; {a.context} tokens of context; ms a forward and its parts (means)")
    cols = ("forward", "wqkv", "wo", "w13", "w2", "attention", "glue", "lm_head", "outside")
    print(f"{'threads':>7} {'rows':>4} " + "".join(f"{c:>10}" for c in cols) + f"{'linears':>9}")
    results = []
    for threads in (int(t) for t in a.threads.split(",")):
        cpu_linear.set_threads(dll, threads)
        for rows in (int(r) for r in a.rows.split(",")):
            ms = profile(target, dll, rows, a.context, a.reps)
            share = ms.pop("linears_share")
            print(f"{threads:>7} {rows:>4} " + "".join(f"{ms[c]:>10.3f}" for c in cols) + f"{share:>8.0%}")
            results.append({"threads": threads, "rows": rows, "ms": ms, "linears_share": share})
    print("linears: the share of the forward in the linears, the lm_head included; glue: the layers' norms, RoPE, "
          "cache writes and SwiGLU; outside: embedding, final norm and the Python around the call")
    if a.json:
        a.json.write_text(json.dumps({"precision": target.precision, "context": a.context, "results": results},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
