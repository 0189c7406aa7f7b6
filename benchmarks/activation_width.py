"""How many of the reference model's greedy answers survive the CPU kernels' quantisation of the linears'
inputs at a given width: the transformers model (the bench's `hf`, fp32) answers each prompt once as it is
and once per width with every linear's input quantised as the kernels quantise it (blocks of 32, one fp32
scale amax / L each, round to nearest even), and the table counts the answers that stay token for token
the same. It isolates the activations' width from everything else the kernels do (their fp32 order).

    .venv/bin/python benchmarks/activation_width.py [--widths 32767,2047,511,127,127+2] [--set fresh]
        [--prompts FILE] [--tokens 128] [--target PATH] [--json FILE]

A width is L, the levels a side (32767: int16, 127: int8), or L+K: the K largest values of each block kept
exact and the rest quantised to L levels (an outlier split, what an int8 path would need to keep a block's
large activation from crushing the others).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from swiftspec.bench.prompts import select_prompts
from swiftspec.bench.runners import HFRunner
from swiftspec.engine.config import SamplingParams
from swiftspec.engine.model.loader import load_hf_model
from swiftspec.engine.model.model_dir import eos_token_ids, load_tokenizer, resolve_model_dir

BLOCK = 32


@dataclass(frozen=True)
class Width:
    levels: int
    exact: int = 0  # the largest values a block keeps unquantised

    @classmethod
    def parse(cls, text: str) -> Width:
        levels, _, exact = text.partition("+")
        try:
            width = cls(int(levels), int(exact or 0))
        except ValueError:
            raise ValueError(f"a width is L or L+K (levels a side, values kept exact), not {text!r}") from None
        if width.levels < 1 or not 0 <= width.exact < BLOCK:
            raise ValueError(f"a width needs L >= 1 and 0 <= K < {BLOCK}: {text!r}")
        return width

    def __str__(self) -> str:
        bits = f"{math.log2(2 * self.levels + 2):.0f}-bit"
        return f"{self.levels} ({bits})" + (f", {self.exact} a block exact" if self.exact else "")


def quantise(x: Tensor, width: Width) -> Tensor:
    """x [..., K] (K a multiple of 32) as the kernels' integer blocks stand for it: q * scale, q =
    rint(v * (1 / scale)), scale = amax / L (kernels/cpu/kernels.h), the block's ``exact`` largest values
    passed through."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    keep = torch.zeros_like(blocks, dtype=torch.bool)
    if width.exact:
        keep.scatter_(-1, blocks.abs().topk(width.exact, dim=-1).indices, True)
    rest = blocks.masked_fill(keep, 0.0)
    scale = rest.abs().amax(-1, keepdim=True) / width.levels
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)
    return torch.where(keep, blocks, torch.round(rest * inv) * scale).reshape(x.shape).to(x.dtype)


class Quantised:
    """While set, every nn.Linear of the model sees its input quantised to ``width`` (None: as it is)."""

    def __init__(self, model: torch.nn.Module):
        self.width: Width | None = None
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(self._hook)

    def _hook(self, _module, args):
        return None if self.width is None else (quantise(args[0], self.width), *args[1:])


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ; None if they are the same."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="32767,2047,511,127,127+2", help="comma-separated widths: L or L+K")
    ap.add_argument("--set", default="fresh", help="built-in prompt sets, comma-separated")
    ap.add_argument("--prompts", type=Path, help="a JSONL prompt file instead")
    ap.add_argument("--tokens", type=int, default=128, help="greedy answer length at most")
    ap.add_argument("--target", help="target model (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    try:
        widths = [Width.parse(w) for w in args.widths.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = resolve_model_dir(args.target)
    tok = load_tokenizer(target_dir)
    eos = eos_token_ids(target_dir)
    model = load_hf_model(target_dir).eval()
    quantised = Quantised(model)
    hf = HFRunner(model, tok, eos)
    params = SamplingParams(mode="ar", max_new_tokens=args.tokens)
    prompts = select_prompts(args.prompts, None if args.prompts else args.set, None)

    def answers(width: Width | None) -> list[list[int]]:
        """The bench's hf mode's greedy answers (EOS stripped), the linears' inputs at ``width``."""
        quantised.width = width
        return [hf(p.messages, params).token_ids for p in prompts]

    reference = answers(None)
    rows = []
    print(f"{len(prompts)} prompts, {args.tokens} tokens, greedy; reference: the fp32 model's own answers")
    print(f"{'levels a side':<32} {'same answers':>12} {'median first difference':>24}")
    for width in widths:
        diffs = [first_difference(a, b) for a, b in zip(answers(width), reference, strict=True)]
        moved = [d for d in diffs if d is not None]
        rows.append({**asdict(width), "same": len(diffs) - len(moved), "first_differences": moved})
        median = f"{statistics.median(moved):.0f}" if moved else "-"
        print(f"{str(width):<32} {len(diffs) - len(moved):>7} / {len(diffs):<4} {median:>24}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"prompts": len(prompts), "tokens": args.tokens, "widths": rows}, indent=1))


if __name__ == "__main__":
    main()
