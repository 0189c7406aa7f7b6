"""A draft head's expansion on the CPU, by what runs its linears: FBGEMM's fp16-weight linears (fp32 math)
and the row-invariant kernels' Q8 blocks at each activation width. An expansion is what
``HeadDrafter.propose`` computes for w leaves: the head's layer over the rows, attention over a context of
``--context`` tokens, the lm_head rows of the draft vocabulary, log-softmax and the top k.

The head is ``--head DIR`` (a trained one) or a random one of the target's shapes with an 8192-token draft
vocabulary, as ``train-draft`` makes by default (an expansion's cost does not depend on the weights' values).
One kernel thread, as a head's draft rank has.

    python benchmarks/head_expansion.py [--head DIR] [--model PATH] [--leaves 1,4,8] [--context 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swiftspec.engine.config import Activations
from swiftspec.engine.model import cpu_backends
from swiftspec.engine.model.embedded import embedded_gguf_path
from swiftspec.engine.model.fp16_linear import fbgemm_available
from swiftspec.engine.model.gguf_io import ensure_converted
from swiftspec.engine.model.loader import load_target_io
from swiftspec.engine.model.model_dir import read_args
from swiftspec.engine.spec.draft_head import DraftHead, HeadArgs, load_head
from swiftspec.engine.spec.draft_io import read_top
from swiftspec.kernels import cpu_linear

DRAFT_VOCAB = 8192
TOP_K = 8


def build_head(target_dir: Path, head_dir: Path | None) -> DraftHead:
    """The head to time, attached to the target's embedding and lm_head, fp32."""
    args = read_args(target_dir)
    if head_dir is not None:
        head = load_head(head_dir, args)
    else:
        g = torch.Generator().manual_seed(0)
        head = DraftHead(HeadArgs.for_target(args), torch.arange(min(DRAFT_VOCAB, args.vocab_size)))
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    head.attach_target(*load_target_io(target_dir, "cpu", torch.float32))
    return head.eval()


def time_expansions(head: DraftHead, leaves: list[int], context: int, reps: int) -> dict[int, float]:
    """Median milliseconds of an expansion of each number of leaves."""
    head.setup_cache(context + max(leaves))
    out = {}
    for w in leaves:
        g = torch.Generator().manual_seed(w)
        tokens = torch.randint(0, head.lm_head_weight.shape[0], (w,), generator=g)
        feats = torch.randn(w, head.args.dim, generator=g)
        pos = torch.arange(context, context + w)
        mask = torch.ones(w, context + w, dtype=torch.bool)
        times = []
        for i in range(reps + 5):
            t0 = time.perf_counter()
            logp = head.logits(head(tokens, feats, pos, pos, mask)).log_softmax(-1)
            read_top(logp, TOP_K, head.d2t)
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e3)
        out[w] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", type=Path, help="a trained head's directory (default: random weights)")
    p.add_argument("--model", type=Path, help="the target: a Hugging Face directory or .gguf (default: the embedded one)")
    p.add_argument("--leaves", default="1,4,8", help="comma-separated leaves per expansion (w)")
    p.add_argument("--context", type=int, default=300, help="tokens of context the rows attend to")
    p.add_argument("--reps", type=int, default=100, help="timed expansions per size")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    leaves = [int(x) for x in a.leaves.split(",")]
    model = a.model or embedded_gguf_path()
    target_dir = ensure_converted(model) if model.suffix == ".gguf" else model
    torch.set_num_threads(1)
    results = {}
    if fbgemm_available():
        head = build_head(target_dir, a.head)
        head.pack_fp16_cpu_weights()
        results["FBGEMM fp16 weights"] = time_expansions(head, leaves, a.context, a.reps)
    why = cpu_backends.kernels_available(read_args(target_dir))
    for activations in (Activations.INT16, Activations.INT8):
        if why is not None:
            break
        dll = cpu_backends.library(activations)  # the library's width from now on, for this process
        cpu_linear.set_threads(dll, 1)
        head = build_head(target_dir, a.head)
        head.pack_cpu_kernels(dll)
        results[f"kernels Q8 · {activations} activations · {cpu_linear.isa(dll)}"] = \
            time_expansions(head, leaves, a.context, a.reps)
    print(f"expansion of w leaves over {a.context} tokens of context, ms (median of {a.reps}), one thread")
    print(f"{'linears':<52}" + "".join(f"{'w=' + str(w):>9}" for w in leaves))
    for name, ms in results.items():
        print(f"{name:<52}" + "".join(f"{ms[w]:>9.3f}" for w in leaves))
    if why is not None:
        print(f"(no kernels row: {why})")
    if a.json:
        a.json.write_text(json.dumps({"context": a.context, "leaves": leaves, "ms": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
