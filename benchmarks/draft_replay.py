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

from swiftspec.bench.prompts import builtin_prompts, turns_of
from swiftspec.engine.config import EngineConfig, SamplingParams, TreeParams
from swiftspec.engine.host.client import Engine
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.model.embedded import embedded_gguf_path
from swiftspec.engine.model.gguf_io import ensure_converted
from swiftspec.engine.model.model_dir import read_args
from swiftspec.engine.spec.corpus import builtin_corpus, load_corpus
from swiftspec.engine.spec.decode import DraftState
from swiftspec.engine.spec.drafters import SuffixDrafter
from swiftspec.engine.spec.history_corpus import HistoryIndex
from swiftspec.engine.spec.loop import Request, lead_draft
from swiftspec.engine.spec.messages import Plain, Start, Subtree, Verdict
from swiftspec.engine.spec.verify import walk


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


class AnswerTarget:
    """A Link standing in for the target leader of one known greedy answer: the shipped draft loop
    (``lead_draft``) sends it subtrees, and it answers each with the verdict the target would give, the
    walk of the subtree along the answer (``engine/spec/verify.py``'s own). It counts each round's tokens and
    verify cost into ``cell``."""

    def __init__(self, answer: list[int], cost: list[float], cell: list):
        self.answer, self.cost, self.cell = answer, cost, cell
        self.pos = 1  # answer[0] is the prefill's token
        self.inbox = [Start(answer[0]) if len(answer) > 1 else Verdict(answer[:1], last=True)]

    def send(self, msg: Subtree | Plain) -> None:
        if isinstance(msg, Plain):  # steps the draft sits out: the answer's next tokens, a step each
            got = self.answer[self.pos:self.pos + msg.steps]
            self.cell[0], self.cell[1] = self.cell[0] + len(got), self.cell[1] + len(got)
            self.cell[2] += self.cost[0] * len(got)
            self.pos += len(got)
            self.inbox.append(Verdict(got, last=self.pos >= len(self.answer)))
            return
        depth = [0] * len(msg.parents)
        for i in range(1, len(msg.parents)):
            depth[i] = depth[msg.parents[i]] + 1
        choice = [self.answer[self.pos + k] if self.pos + k < len(self.answer) else -1 for k in depth]
        v = walk(choice, msg.tokens, msg.parents)
        got = [msg.tokens[i] for i in v.path] + ([v.bonus] if v.bonus >= 0 else [])
        self.cell[0], self.cell[1] = self.cell[0] + len(got), self.cell[1] + 1
        self.cell[2] += self.cost[len(msg.tokens) - 1]
        self.pos += len(got)
        self.inbox.append(Verdict(got, last=self.pos >= len(self.answer)))

    def recv(self, due: float | None = None):
        return self.inbox.pop(0)

    def post_recv(self, due: float | None = None):
        return self.recv


def replay(records: list[dict], make_drafter, cost: list[float], step_ms: float, d: int = 16, w: int = 8) -> dict:
    """(set, turn) -> [tokens, verifications, summed verify cost] of the shipped sync rounds."""
    out: dict = defaultdict(lambda: [0, 0, 0.0])
    params = SamplingParams(mode="sync")
    for rec in records:
        ds = DraftState(make_drafter(), TreeParams(bs=len(cost), w=w), verify_cost=cost, step_ms=step_ms)
        target = AnswerTarget(rec["answer"], cost, out[(rec["set"], rec["turn"])])
        lead_draft(ds, target, Request(0, rec["prompt"], params), d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verify-cost", required=True, help="comma-separated costs of verifying 1..bs nodes")
    ap.add_argument("--set", default="multiturn", help="built-in prompt sets, comma-separated")
    ap.add_argument("--answers", type=Path, help="the answers file: read if it exists, else written")
    ap.add_argument("--history", type=Path, help="an answers file whose answers are the drafter's history")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=15.0,
                    help="the target's one-node step (a sync round counts its drafting against it)")
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
    cells = replay(records, lambda: SuffixDrafter(corpus=corpus, history_tokens=0, stored=stored), cost, args.step_ms)
    print(f"{'set':14} {'turn':>4} {'rounds':>7} {'tok/verify':>10} {'tok/cost':>9}")
    for (name, turn), (tokens, rounds, spent) in sorted(cells.items()):
        print(f"{name:14} {turn:4d} {rounds:7d} {tokens / rounds:10.3f} {tokens / spent:9.3f}")


if __name__ == "__main__":
    main()
