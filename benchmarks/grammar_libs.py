"""llguidance against xgrammar on the embedded tokenizer: compile, mask per token, fork, rollback, memory.

Run: python benchmarks/grammar_libs.py. Each library builds its tokenizer view, compiles one nested
extraction schema, then walks a valid answer token by token computing the 49,152-token mask at every
step (the cost a constrained step pays), and times a fork (a matcher state copied for a tree branch)
and a rollback of 8 tokens. Memory is the process's resident growth while a library is set up.
xgrammar is not a dependency: `pip install --no-deps xgrammar apache-tvm-ffi` to compare.

2-core AMD EPYC (Zen 5, KVM), llguidance 1.9.1 against xgrammar 0.2.9, a 61-token answer:

| | llguidance | xgrammar |
|---|---|---|
| tokenizer view (once a start) | 470 ms | 160 ms |
| schema compile | 4 ms | 19-28 ms |
| mask, median / p95 / max | 0.02 / 0.1-0.13 / 1.9-2.0 ms | 0.002 / 0.01 / 0.12 ms |
| fork (deep_copy / fork) | 6-9 us | 2 us |
| rollback of 8 tokens | 5 us | 7 us |
| resident memory | +35 MB | +31 MB |
| import | 0.12 s, no torch | 2.3 s, imports torch and transformers |
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
     "address": {"city": "London", "zip": "W1"}, "score": 9.5}
)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def bench_llguidance(tok, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    before = rss_mb()
    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tok)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    compile_s = time.perf_counter() - t0
    mask = llguidance.numpy.allocate_token_bitmask(1, ll_tok.vocab_size)
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        steps.append(time.perf_counter() - t0)
        if not matcher.consume_token(t):
            raise RuntimeError(f"llguidance refused {t}: {matcher.get_error()}")
    forks = []
    for _ in range(50):
        t0 = time.perf_counter()
        matcher.deep_copy()
        forks.append(time.perf_counter() - t0)
    probe = llguidance.LLMatcher(ll_tok, grammar)
    probe.consume_tokens(ids[:16])
    t0 = time.perf_counter()
    probe.rollback(8)
    rollback_s = time.perf_counter() - t0
    return {"tokenizer": tok_s, "compile": compile_s, "mask": steps, "fork": forks,
            "rollback8": rollback_s, "rss_mb": rss_mb() - before}


def bench_xgrammar(tok, ids: list[int]) -> dict:
    import xgrammar as xgr

    before = rss_mb()
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        steps.append(time.perf_counter() - t0)
        if not matcher.accept_token(t):
            raise RuntimeError(f"xgrammar refused {t}")
    forks = []
    for _ in range(50):
        t0 = time.perf_counter()
        matcher.fork()
        forks.append(time.perf_counter() - t0)
    probe = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    for t in ids[:16]:
        probe.accept_token(t)
    t0 = time.perf_counter()
    probe.rollback(8)
    rollback_s = time.perf_counter() - t0
    return {"tokenizer": tok_s, "compile": compile_s, "mask": steps, "fork": forks,
            "rollback8": rollback_s, "rss_mb": rss_mb() - before}


def main() -> None:
    from swiftspec.engine.model.model_dir import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"vocabulary {len(tok)}, answer {len(ids)} tokens")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            r = bench(tok, ids)
        except ImportError as e:
            print(f"{name:10s} not installed ({e})")
            continue
        mask = sorted(r["mask"])
        print(
            f"{name:10s} tokenizer {ms(r['tokenizer'])}, compile {ms(r['compile'])}, "
            f"mask median {ms(statistics.median(mask))} p95 {ms(mask[int(len(mask) * 0.95)])} "
            f"max {ms(mask[-1])}, fork median {ms(statistics.median(r['fork']))}, "
            f"rollback(8) {ms(r['rollback8'])}, RSS +{r['rss_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
