"""How often chat answers loop under a few sampling settings, and how fast they come, on the embedded model
in this process: the figures behind swiftspec.settings.CHAT_DEFAULTS.

An answer *loops* when it hits the token limit with an 8-gram repeated three or more times in it, or when
the loop guard stopped it (finish reason "repetition"). Every setting answers the same prompts, each with
the model's real EOS, one seed per prompt, in ``ar`` (``--mode``: sync and async give the same answers in
greedy and the same distribution when sampling). ``--speed`` adds, for each setting, ar / sync / async
tokens/s from interleaved runs on every prompt, the suffix drafter with its shipped corpus and the verify
cost profiled at start, as in the chat.

    .venv/bin/python benchmarks/loop_rate.py [--set fresh,dev] [--settings greedy,chat,...] [--tokens 512]
        [--dtype float32] [--threads 1] [--mode sync] [--speed] [--short]

--short: 6 prompts, 256 tokens, the greedy and chat settings (a couple of minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from swiftspec.engine.config import DraftKind, Dtype, SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import eos_token_ids, load_tokenizer, resolve_model_dir
from swiftspec.engine.spec.corpus import builtin_corpus
from swiftspec.engine.spec.decode import DraftState, TargetState, profile_verify_cost
from swiftspec.engine.spec.draft_spec import DraftSpec
from swiftspec.engine.spec.drafters import make_drafter
from swiftspec.engine.spec.loop import generate
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.settings import CHAT_DEFAULTS

SETTINGS = {
    "greedy": SamplingParams(),
    "greedy+repeat1.1": SamplingParams(repeat_penalty=1.1),
    "greedy+repeat1.3": SamplingParams(repeat_penalty=1.3),
    "ollama": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1),
    "t0.7+minp0.05+repeat1.1": SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.1),
    "t0.7+minp0.05+repeat1.2": SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.2),
    "chat": CHAT_DEFAULTS,
}
# Dev questions, besides the fresh set: the two that looped when tried as a new user would, and others of
# the kinds a 135M model tends to repeat itself on (lists, templates, echoing).
DEV = [
    "Give me a simple recipe for pancakes.",
    "Line one\nLine two\n\nReply with OK.",
    "List ten fruits.",
    "Write a short poem about the sea.",
    "What are the days of the week?",
    "Explain how to change a bicycle tyre, step by step.",
    "Write a shopping list for a week of vegetarian dinners.",
    "Tell me about the history of the bicycle.",
]


def questions(sets: list[str]) -> list[str]:
    root = Path(__file__).resolve().parents[1] / "swiftspec" / "prompts"
    out = []
    for name in sets:
        if name == "dev":
            out += DEV
        else:
            out += [json.loads(line)["prompt"] for line in (root / f"{name}.jsonl").read_text().splitlines()]
    return out


def loops(tokens: list[int], finish: str | None) -> bool:
    grams = Counter(tuple(tokens[i:i + 8]) for i in range(len(tokens) - 7))
    return finish == "repetition" or (finish == "length" and max(grams.values(), default=0) >= 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="fresh,dev", help="built-in prompt sets and/or dev")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=None, help="at most this many prompts")
    ap.add_argument("--dtype", type=Dtype, default=Dtype.FLOAT32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", default="ar", choices=("ar", "sync", "async"))
    ap.add_argument("--d", type=int, default=4)
    ap.add_argument("--speed", action="store_true", help="also time ar, sync and async, interleaved")
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.short:
        args.prompts, args.tokens = args.prompts or 6, min(args.tokens, 256)
        args.settings = "greedy,chat" if args.settings == ",".join(SETTINGS) else args.settings
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model_dir = resolve_model_dir(None)
    model = load_model(model_dir, "cpu", args.dtype, max_slots=4096)
    tokenizer = load_tokenizer(model_dir)
    eos = set(eos_token_ids(model_dir))
    texts = questions(args.set.split(","))[:args.prompts]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"] for t in texts]
    target = TargetState(model, 4096)
    sampler = Sampler(SamplingParams())
    root = target.prefill(ids[0], sampler)
    cost = profile_verify_cost(target, TreeParams().bs)
    t0 = time.perf_counter()
    for _ in range(5):
        root = target.decode_step(root, sampler)
    step_ms = (time.perf_counter() - t0) / 5 * 1e3

    def answer(prompt: list[int], params: SamplingParams, mode: str) -> tuple[list[int], str | None, float]:
        draft = None if mode == "ar" else DraftState(make_drafter(
            DraftSpec(DraftKind.SUFFIX), model_dir, False, False, None, corpus=builtin_corpus()), TreeParams(), cost, step_ms)
        t0 = time.perf_counter()
        steps = generate(target, draft, prompt, replace(params, mode=mode), args.d, eos=eos)
        elapsed = time.perf_counter() - t0 - steps[0].target_ms / 1e3  # the prefill left out
        return [t for s in steps for t in s.tokens], steps[-1].finish, elapsed

    report = {}
    for name in args.settings.split(","):
        base = replace(SETTINGS[name], max_new_tokens=args.tokens)
        looped, lengths, times, speeds, looping = 0, [], [], {m: [0, 0.0] for m in ("ar", "sync", "async")}, []
        for i, prompt in enumerate(ids):
            params = replace(base, seed=i)
            tokens, finish, elapsed = answer(prompt, params, args.mode)
            looped += loops(tokens, finish)
            if loops(tokens, finish):
                looping.append(i)
            lengths.append(len(tokens))
            times.append(elapsed)
            if args.speed:
                modes = ["ar", "sync", "async"]
                for mode in modes[i % 3:] + modes[:i % 3]:
                    t, _, e = answer(prompt, params, mode)
                    speeds[mode][0] += len(t)
                    speeds[mode][1] += e
        row = {"loop_rate": looped / len(ids), "looping_prompts": looping, "mean_tokens": sum(lengths) / len(ids),
               "tokens_per_s": sum(lengths) / sum(times), "settings": base.summary()}
        if args.speed:
            row["speed"] = {m: n / t for m, (n, t) in speeds.items()}
        report[name] = row
        line = (f"{name:26} loops {looped}/{len(ids)} ({row['loop_rate']:.0%}) {looping}, mean {row['mean_tokens']:.0f} "
                f"tokens, {args.mode} {row['tokens_per_s']:.1f} tok/s")
        if args.speed:
            line += " | " + ", ".join(f"{m} {v:.1f}" for m, v in row["speed"].items()) + " tok/s"
        print(line, flush=True)
    print(f"{len(ids)} prompts ({args.set}), {args.tokens} tokens at most, dtype {args.dtype}, "
          f"{args.threads} thread(s); {time.perf_counter() - t_start:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
