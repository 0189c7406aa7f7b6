"""How often the suffix drafter's best proposal is the target's next token, with and without a corpus of
the target's own answers: teacher-forced over the target's greedy answers to a prompt set (at each
position the drafter sees the prompt and the true answer so far, as a tree root does), no session history.
It measures the drafter, not the engine: `swiftspec bench` measures what the hit rate buys.

    .venv/bin/python benchmarks/corpus_hit_rate.py [--set fresh] [--prompts FILE] [--tokens 160]
        [--corpus FILE] [--target PATH]

Without --corpus, the embedded default's shipped corpus (engine/spec/corpus.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swiftspec.bench.prompts import select_prompts
from swiftspec.engine.config import Dtype, SamplingParams
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import eos_token_ids, load_tokenizer, resolve_model_dir
from swiftspec.engine.spec.corpus import builtin_corpus, check_corpus, load_corpus
from swiftspec.engine.spec.decode import TargetState
from swiftspec.engine.spec.drafters import SuffixDrafter
from swiftspec.engine.spec.loop import generate


def hit_rates(drafter: SuffixDrafter, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(top-1 hits, hits within the proposals) over the answer's tokens."""
    drafter.prefill(prompt, 0)
    top1 = any_k = 0
    for token in answer:
        counts, _ = drafter.lookup(drafter.context.tokens[-drafter.max_order:])
        if counts:
            top1 += max(counts.items(), key=lambda kv: kv[1])[0] == token
            any_k += token in counts
        drafter.extend([token])
    return top1, any_k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="fresh", help="built-in prompt sets, comma-separated")
    ap.add_argument("--prompts", type=Path, help="a JSONL prompt file instead")
    ap.add_argument("--tokens", type=int, default=160, help="greedy answer length at most")
    ap.add_argument("--corpus", type=Path, help="a corpus file (default: the shipped one)")
    ap.add_argument("--target", help="target model (default: the embedded SmolLM2)")
    args = ap.parse_args()
    target_dir = resolve_model_dir(args.target)
    tok = load_tokenizer(target_dir)
    corpus_path = args.corpus or builtin_corpus()
    check_corpus(corpus_path, tok)
    model = load_model(target_dir, "cpu", Dtype.FLOAT32, max_slots=4096, batch_invariant=False)
    corpus = load_corpus(corpus_path, model.args.vocab_size)
    target = TargetState(model, 4096)
    eos = set(eos_token_ids(target_dir))
    params = SamplingParams(mode="ar", max_new_tokens=args.tokens)
    totals = {"without": [0, 0], "with": [0, 0]}
    n = 0
    for p in select_prompts(args.prompts, None if args.prompts else args.set, None):
        prompt = encode_chat(tok, p.messages)
        answer = [t for step in generate(target, None, prompt, params, eos=eos) for t in step.tokens]
        answer = answer[:next((i for i, t in enumerate(answer) if t in eos), len(answer))]
        n += len(answer)
        for name, c in (("without", None), ("with", corpus)):
            top1, any_k = hit_rates(SuffixDrafter(history_tokens=0, corpus=c), prompt, answer)
            totals[name][0] += top1
            totals[name][1] += any_k
    print(f"{n} answer tokens; {corpus_path.name}")
    for name, (top1, any_k) in totals.items():
        print(f"{name:>7} corpus: top-1 {top1 / n:.1%}, within the proposals {any_k / n:.1%}")


if __name__ == "__main__":
    main()
