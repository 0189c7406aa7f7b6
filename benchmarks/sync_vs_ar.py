"""In-process figures on the embedded model: t_verify(n) / t_step(1), and ``sync`` (the suffix drafter or
a draft head) against ``ar`` — tokens/s per prompt from interleaved runs (median ratio), mean accepted
tokens per verification and acceptance rate. Every sync output is checked against ar's, token for token.

Times are given twice: wall clock, and this process's CPU time (with one torch thread all the math runs on
one core at a time), which is what to read when other processes share the cores.

    .venv/bin/python benchmarks/sync_vs_ar.py [--threads 1] [--prompts 12] [--tokens 128] [--cost]
        [--draft suffix|HEAD_DIR] [--set fresh] [--w 8] [--dtype float32|float16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from swiftspec.engine.config import Dtype, SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import load_tokenizer, resolve_model_dir
from swiftspec.engine.spec.decode import DraftState, TargetState, profile_verify_cost
from swiftspec.engine.spec.draft_spec import DraftSpec
from swiftspec.engine.spec.drafters import make_drafter
from swiftspec.engine.spec.loop import generate
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.spec.tree import target_inputs

CATEGORIES = ["chat", "code", "math", "qa", "summarisation", "extraction"]


def prompts(tokenizer, n: int, sets: list[str] = CATEGORIES) -> list[list[int]]:
    root = Path(__file__).resolve().parents[1] / "swiftspec" / "prompts"
    lines = {c: (root / f"{c}.jsonl").read_text().splitlines() for c in sets}
    texts = [json.loads(lines[c][i])["prompt"] for i in range(max(map(len, lines.values())))
             for c in sets if i < len(lines[c])][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for t in texts]


def verify_ratios(model, context: int, sizes: list[int], reps: int) -> dict[int, float]:
    """Median forward time of a tree of n nodes (a chain plus siblings) behind a context, over one node."""
    tokens = torch.randint(0, model.args.vocab_size, (context,))
    pos = torch.arange(context)
    model(tokens, pos, pos, torch.ones(context, context, dtype=torch.bool).tril())
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps + 1):
        for n in sizes:
            parents = [-1] + [max(0, i - 2) for i in range(1, n)]
            positions, slots, mask = target_inputs(parents, context)
            t0, c0 = time.perf_counter(), time.thread_time()
            model(torch.randint(0, model.args.vocab_size, (n,)), positions, slots, mask)
            times.setdefault(("wall", n), []).append(time.perf_counter() - t0)
            times.setdefault(("cpu", n), []).append(time.thread_time() - c0)
    med = {k: statistics.median(t[1:]) for k, t in times.items()}
    return {(c, n): med[c, n] / med[c, 1] for c, n in med} | {(c, 0): med[c, 1] * 1e3 for c in ("wall", "cpu")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d", type=int, default=4)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--cost", action="store_true", help="cost-aware subtree size (profile_verify_cost)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--w", type=int, default=8)
    ap.add_argument("--draft", default="suffix", help="suffix or a draft head directory")
    ap.add_argument("--set", default=",".join(CATEGORIES), help="built-in prompt sets, e.g. fresh")
    ap.add_argument("--dtype", type=Dtype, default=Dtype.FLOAT32, help="float32, or float16 (fp16 weights, fp32 math)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    model = load_model(model_dir, "cpu", args.dtype, max_slots=2048)
    tokenizer = load_tokenizer(model_dir)

    def drafter():
        return make_drafter(DraftSpec.of(args.draft), model_dir, False, False, None, max_slots=4096)

    ratios = verify_ratios(model, 300, [1, 2, 4, 8, 16], args.reps)
    for clock in ("wall", "cpu"):
        print(f"[{clock}] t_step(1) = {ratios[clock, 0]:.1f} ms; t_verify(n)/t_step(1): "
              + ", ".join(f"{n}: {ratios[clock, n]:.2f}" for n in (2, 4, 8, 16)), flush=True)

    target = TargetState(model, 2048)
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    cost = step_ms = None
    if args.cost:
        target.prefill(prompts(tokenizer, 1)[0], Sampler(params))
        cost, step_ms = profile_verify_cost(target, args.bs), ratios["wall", 0]
        print("verify cost profile:", [round(c, 2) for c in cost], flush=True)
    speed, cpu_speed, accepted, verified, verifications, same = [], [], 0, 0, 0, 0
    for i, prompt in enumerate(prompts(tokenizer, args.prompts, args.set.split(","))):
        runs = {}
        for mode in (("ar", "sync") if i % 2 == 0 else ("sync", "ar")):
            draft = DraftState(drafter(), TreeParams(bs=args.bs, w=args.w), verify_cost=cost, step_ms=step_ms)
            t0, c0 = time.perf_counter(), time.process_time()
            steps = generate(target, None if mode == "ar" else draft, prompt, replace(params, mode=mode), args.d)
            prefill = steps[0].target_ms / 1e3  # the same work in both modes: left out of the timing
            runs[mode] = ([t for s in steps for t in s.tokens], time.perf_counter() - t0 - prefill,
                          time.process_time() - c0 - prefill, steps)
        ar, sync = runs["ar"], runs["sync"]
        same += ar[0] == sync[0]
        speed.append(ar[1] / sync[1])  # same token count: the tokens/s ratio is the time ratio
        cpu_speed.append(ar[2] / sync[2])
        steps = sync[3][1:]
        accepted += sum(s.accepted for s in steps)
        verified += sum(s.tree_size - 1 for s in steps)
        verifications += len(steps)
        print(f"prompt {i}: ar {len(ar[0]) / ar[1]:.1f} tok/s, sync {len(sync[0]) / sync[1]:.1f} tok/s, "
              f"ratio {speed[-1]:.2f} (cpu time {cpu_speed[-1]:.2f}), same={ar[0] == sync[0]}", flush=True)
    for clock, r in (("wall", speed), ("cpu", cpu_speed)):
        print(f"[{clock}] sync/ar tokens/s: median {statistics.median(r):.2f} (min {min(r):.2f}, "
              f"max {max(r):.2f}) over {len(r)} prompts")
    print(f"outputs identical {same}/{len(speed)}")
    print(f"mean accepted per verification {accepted / verifications:.2f} "
          f"(tokens per verification {1 + accepted / verifications:.2f}); "
          f"acceptance rate {accepted / max(verified, 1):.2%} of {verified} verified draft nodes; "
          f"mean tree size {1 + verified / verifications:.2f}")


if __name__ == "__main__":
    main()
