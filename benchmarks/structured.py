"""Structured answers on the embedded model, in process: extraction prompts each with a JSON Schema,
answered constrained in ``ar``, ``sync`` and ``async`` (the suffix drafter, its loop in a thread of this
process), ``sync`` without forced-token drafting (the grammar's forced tokens not proposed), and free
``ar`` / ``sync`` / ``async`` on the same prompts. Reports
tokens/s against constrained ar (interleaved runs, median ratio), tokens per verification, whether every
constrained answer validates and whether sync's and async's tokens equal ar's.

    .venv/bin/python benchmarks/structured.py [--threads 1] [--tokens 160]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from swiftspec.engine.config import Dtype, Grammar, GrammarKind, SamplingParams, TreeParams
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import eos_token_ids, load_tokenizer, read_args, resolve_model_dir
from swiftspec.engine.spec import grammar
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.drafters import SuffixDrafter
from swiftspec.engine.spec.loop import generate

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "job": {"type": "string"}}, "required": ["name", "age", "city", "job"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"],
        "additionalProperties": False}},
    "total": {"type": "number"}, "currency": {"enum": ["EUR", "USD", "GBP"]}},
    "required": ["items", "total", "currency"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string"}, "attendees": {"type": "array", "items": {"type": "string"}},
    "online": {"type": "boolean"}}, "required": ["title", "date", "attendees", "online"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"type": "string"}}, "rating": {"type": "number"}},
    "required": ["title", "author", "year", "genres"], "additionalProperties": False}
STRUCTURED = [
    ("Extract the person as JSON: Maria Lopez, 34, is a nurse who lives in Valencia.", PERSON),
    ("Extract the order as JSON: two notebooks and three pens, 14.50 euros in all.", ORDER),
    ("Extract the event as JSON: the team retro on 12 March with Ana, Ben and Chloe, held on a video call.", EVENT),
    ("Extract the book as JSON: Frank Herbert's Dune (1965), science fiction and adventure, rated 4.6.", BOOK),
    ("Extract the person as JSON: Tom Becker is a 51-year-old baker from Hamburg.", PERSON),
    ("Extract the order as JSON: one laptop stand at 39 dollars.", ORDER),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--d", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    eos = eos_token_ids(model_dir)
    vocab = grammar.Vocabulary(model_dir / "tokenizer.json", tuple(sorted(eos)), read_args(model_dir).vocab_size)
    target = TargetState(load_model(model_dir, "cpu", Dtype.FLOAT32, max_slots=2048), 2048, vocab)
    tokenizer = load_tokenizer(model_dir)
    runs = {"ar": ("ar", True, True), "sync": ("sync", True, True), "sync, no forced drafts": ("sync", True, False),
            "async": ("async", True, True), "free ar": ("ar", False, True), "free sync": ("sync", False, True),
            "free async": ("async", False, True)}
    speed: dict[str, list[float]] = {name: [] for name in runs}
    per_verify: dict[str, list[float]] = {name: [] for name in runs}
    valid = same = 0
    for i, (question, schema) in enumerate(STRUCTURED):
        ids = encode_chat(tokenizer, [{"role": "user", "content": question}])
        g = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        out = {}
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            mode, constrained, drafts_forced = runs[name]
            params = SamplingParams(mode=mode, max_new_tokens=args.tokens, grammar=g if constrained else None,
                                    draft_forced=drafts_forced)
            draft = None if mode == "ar" else DraftState(SuffixDrafter(), TreeParams(bs=args.bs, w=8), vocab=vocab)
            t0 = time.perf_counter()
            steps = generate(target, draft, ids, params, args.d, eos=set(eos))
            seconds = time.perf_counter() - t0 - steps[0].target_ms / 1e3  # the prefill left out
            tokens = [t for s in steps for t in s.tokens]
            out[name] = (tokens, len(tokens) / seconds, steps)
            if mode != "ar":
                per_verify[name].append(len(tokens[1:]) / max(len(steps) - 1, 1))
        for name in runs:
            speed[name].append(out[name][1] / out["ar"][1])
        text = tokenizer.decode(out["ar"][0], skip_special_tokens=True)
        try:
            json.loads(text)
            valid += 1
        except ValueError:
            pass
        same += out["ar"][0] == out["sync"][0] == out["sync, no forced drafts"][0] == out["async"][0]
        print(f"prompt {i}: ar {out['ar'][1]:.1f} tok/s, {len(out['ar'][0])} tokens: {text[:90]}", flush=True)
    for name in runs:
        tpv = f", {statistics.mean(per_verify[name]):.2f} tokens per verification" if per_verify[name] else ""
        print(f"{name:24s} {statistics.median(speed[name]):.2f}x constrained ar{tpv}")
    print(f"constrained answers that parse: {valid}/{len(STRUCTURED)}; sync == async == ar token for token: "
          f"{same}/{len(STRUCTURED)}")


if __name__ == "__main__":
    main()
