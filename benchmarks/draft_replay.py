"""Tokens per verification of ``sync`` rounds with the suffix drafter, replayed without the model: the
target's greedy answers to a prompt set are collected once through the Engine (``ar``) into a JSON file,
and a round's verdict is then the walk of the draft's subtree along the known answer. A change to the
drafter or to the verify cost is judged in seconds instead of a bench's minutes; with the profiled verify
cost of the machine it reproduces ``swiftspec bench --modes sync``'s tokens per verification (greedy) to
about 0.01. Beside it, tokens per unit of verify cost: what the cost-aware cut maximises.

    .venv/bin/python benchmarks/draft_replay.py --verify-cost 1,1.46,1.83,2.13,2.69,3.17,3.54,3.84 \
        [--set multiturn] [--answers answers.json] [--history warm.json]

``--verify-cost``: the target's ``verify_cost`` from ``<cache>/profiles/*.json`` (the one written at the
first start of the setup). ``--history``: another answers file whose answers the drafter keeps as its
history (as ``bench --warm`` does with its warm-up answers).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from history_calibration import Fixed  # this folder: a history that is only looked up

from swiftspec.bench import builtin_prompts, turns_of
from swiftspec.config import EngineConfig, SamplingParams, TreeParams
from swiftspec.engine.client import Engine, encode_chat
from swiftspec.engine.corpus import builtin_corpus, load_corpus
from swiftspec.engine.decode import DraftState
from swiftspec.engine.drafters import SuffixDrafter
from swiftspec.engine.embedded import embedded_gguf_path, ensure_converted
from swiftspec.engine.history_corpus import HistoryIndex
from swiftspec.engine.model_dir import read_args

EXPAND_MS = 0.15  # a suffix expansion, as the bench measures it: a sync round counts its drafting


def collect(sets: list[str], max_new_tokens: int) -> list[dict]:
    """Every turn's prompt ids and greedy answer, each later turn after the target's own earlier answer."""
    out = []
    with Engine.start(EngineConfig(draft="none", draft_history=False)) as engine:
        for name in sets:
            for p in builtin_prompts(name):
                messages, earlier = p.messages, ""
                for turn, text in enumerate(turns_of(p, "all"), 1):
                    if turn > 1:
                        messages = messages + [{"role": "assistant", "content": earlier},
                                               {"role": "user", "content": text}]
                    ids, answer = encode_chat(engine.tokenizer, messages), []
                    for ev in engine.generate(messages, SamplingParams(mode="ar", max_new_tokens=max_new_tokens)):
                        answer += ev.token_ids
                    earlier = engine.tokenizer.decode(answer, skip_special_tokens=True)
                    out.append({"set": name, "id": p.id, "turn": turn, "prompt": ids, "answer": answer})
    return out


def replay(records: list[dict], make_drafter, cost: list[float], d: int = 16, bs: int = 8, w: int = 8) -> dict:
    """(set, turn) -> [tokens, verifications, summed verify cost] of lead_draft's sync rounds."""
    step_ms = 100.0  # only EXPAND_MS / step_ms matters: a suffix expansion is a sliver of a step
    out: dict = defaultdict(lambda: [0, 0, 0.0])
    for rec in records:
        answer = rec["answer"]
        ds = DraftState(make_drafter(), TreeParams(bs=bs, w=w), verify_cost=cost, step_ms=step_ms)
        ds.prefill(rec["prompt"])
        ds.start(answer[0])  # the prefill's token
        pos = 1
        while pos < len(answer):
            todo, exp_ms, rate = d, 0.0, ds.round_rate(0.0)
            while (todo > 0 or ds.size < bs) and ds.can_expand():  # lead_draft's sync round
                ds.expand()
                exp_ms, todo = exp_ms + EXPAND_MS, todo - 1
                if (new := ds.round_rate(exp_ms)) <= rate:
                    break
                rate = new
            tokens, parents = ds.subtree(exp_ms / step_ms)
            kids = defaultdict(list)
            for i in range(1, len(parents)):
                kids[parents[i]].append(i)
            path, node = [], 0
            while pos + len(path) < len(answer):  # the target's choice below a node is the answer's next token
                nxt = next((c for c in kids[node] if tokens[c] == answer[pos + len(path)]), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            got = [tokens[i] for i in path] + answer[pos + len(path):pos + len(path) + 1]  # and the bonus
            cell = out[(rec["set"], rec["turn"])]
            cell[0], cell[1], cell[2] = cell[0] + len(got), cell[1] + 1, cell[2] + cost[len(tokens) - 1]
            pos += len(got)
            if pos < len(answer):
                ds.reroot(got)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verify-cost", required=True, help="comma-separated costs of verifying 1..bs nodes")
    ap.add_argument("--set", default="multiturn", help="built-in prompt sets, comma-separated")
    ap.add_argument("--answers", type=Path, help="the answers file: read if it exists, else written")
    ap.add_argument("--history", type=Path, help="an answers file whose answers are the drafter's history")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    cost = [float(c) for c in args.verify_cost.split(",")]
    if args.answers and args.answers.is_file():
        records = json.loads(args.answers.read_text())
    else:
        records = collect(args.set.split(","), args.max_new_tokens)
        if args.answers:
            args.answers.write_text(json.dumps(records))
    corpus = load_corpus(builtin_corpus(), read_args(ensure_converted(embedded_gguf_path())).vocab_size)
    stored = None
    if args.history:
        answers = {i: np.array(r["answer"]) for i, r in enumerate(json.loads(args.history.read_text()))}
        stored = Fixed(HistoryIndex(answers))
    cells = replay(records, lambda: SuffixDrafter(corpus=corpus, history_tokens=0, stored=stored), cost, bs=len(cost))
    print(f"{'set':14} {'turn':>4} {'rounds':>7} {'tok/verify':>10} {'tok/cost':>9}")
    for (name, turn), (tokens, rounds, spent) in sorted(cells.items()):
        print(f"{name:14} {turn:4d} {rounds:7d} {tokens / rounds:10.3f} {tokens / spent:9.3f}")


if __name__ == "__main__":
    main()
