"""The bench's structured answers: the built-in set of extraction prompts with JSON Schemas, a prompts
file's schemas, the modes that apply a schema (and the -noforce and -free ones that measure against them),
the validity of each answer, and llama.cpp's schema path (through a stand-in for llama-cpp-python)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import INFO
from helpers.replay import ReplayEngine, started

from swiftspec.bench.command import bench_command
from swiftspec.bench.llamacpp import LlamaCppRunner
from swiftspec.bench.prompts import (
    STRUCTURED,
    BenchError,
    Prompt,
    builtin_prompts,
    parse_jsonl,
    select_prompts,
)
from swiftspec.bench.report import render_table, report_config, summarise, validates
from swiftspec.bench.runners import STRUCTURED_MODES, EngineRunner, Sample
from swiftspec.engine.config import EngineConfig, Grammar, GrammarKind, SamplingParams
from swiftspec.engine.spec.grammar import check

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"], "additionalProperties": False}


def test_the_structured_set_is_a_dozen_fresh_prompts_each_with_a_schema_the_library_compiles():
    import jsonschema

    prompts = builtin_prompts(STRUCTURED)
    assert len(prompts) == 12 and len({p.id for p in prompts}) == 12 and len({p.text for p in prompts}) == 12
    tuned = (Path(__file__).parents[1] / "benchmarks" / "structured.py").read_text()
    for p in prompts:
        assert p.text.split(": ", 1)[1] not in tuned  # none of the prompts the grammar work was tuned on
        jsonschema.Draft202012Validator.check_schema(p.schema)
        check(Grammar(GrammarKind.JSON_SCHEMA, json.dumps(p.schema)))
    kinds = json.dumps([p.schema for p in prompts])
    assert all(k in kinds for k in ('"enum"', '"array"', '"number"', '"integer"', '"boolean"'))
    assert not any(p.schema for p in select_prompts(None, "all", None))  # named only: "all" stays free text


def test_a_prompts_file_may_carry_a_schema_and_it_becomes_the_answers_grammar():
    text = json.dumps({"id": "p", "prompt": "Who?", "schema": PERSON}) + "\n" + json.dumps({"prompt": "Free"})
    with_schema, free = parse_jsonl(text, "mine")
    assert with_schema.schema == PERSON and free.schema is None
    params = SamplingParams(max_new_tokens=9)
    assert with_schema.params(params).grammar == Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PERSON))
    assert free.params(params) is params
    with pytest.raises(BenchError, match="line 1: 'schema' must be a JSON Schema object"):
        parse_jsonl(json.dumps({"prompt": "x", "schema": "PERSON"}), "mine")


def test_schema_modes_are_checked_before_any_model_loads(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("swiftspec.engine.model.model_dir.resolve_model_dir", no_load)
    with pytest.raises(BenchError, match="--modes hf: transformers cannot hold an answer to a schema"):
        bench_command(EngineConfig(), modes="hf,ar", prompt_set=STRUCTURED)
    with pytest.raises(BenchError, match="--modes async-free,sync-noforce: these modes differ .* only on prompts"):
        bench_command(EngineConfig(), modes="ar,async-free,sync-noforce", prompt_set="qa")


def test_validity_is_counted_for_the_modes_that_apply_the_schema_and_shown_in_the_table():
    from rich.console import Console

    prompts = [Prompt("structured", "a", "x", schema=PERSON), Prompt("structured", "b", "y", schema=PERSON)]
    assert validates('{"name": "Ana", "age": 3}', PERSON) and validates('{\n "age": 3, "name": "Ana"}', PERSON)
    assert not validates('{"name": "Ana", "age": "3"}', PERSON) and not validates('{"name": "Ana"', PERSON)
    one = [Sample([1, 2], 1.0, [(0.5, 1), (1.0, 1)], verifications=1), Sample([3], 1.0, [(1.0, 1)])]
    samples = {m: one for m in ("ar", "async", "async-free", "llama.cpp")}
    texts = {"ar": ['{"name": "A"}', '{"name": "B", "age": 1}'], "async": ['{"name": "A"}', '{"name": "B"}'],
             "async-free": ["Sure! Here", "it is"], "llama.cpp": ['{"name": "A"}', '{"age": 1}']}
    results, speedup = summarise(samples, prompts, texts=texts)
    by = {r["mode"]: r for r in results}
    assert (by["ar"]["valid"], by["async"]["valid"], by["llama.cpp"]["valid"]) == (2, 2, 1)
    assert by["async-free"]["valid"] is None and by["ar"]["checked"] == 2
    assert by["async-free"]["identical_to_target"] is None  # no ar-free to be compared with; never with ar
    assert "async/async-free" in speedup
    config = report_config(EngineConfig(), INFO, list(samples), prompts, SamplingParams(), None)
    assert config["schemas"] == 2 and "jsonschema" in config["valid"]
    console = Console(record=True, width=250)
    console.print(render_table({"config": config, "results": results, "speedup": speedup}))
    text = console.export_text()
    assert "× async-free" in text and "valid" in text and "1/2" in text and "2/2" in text


class SchemaRecorder(ReplayEngine):
    """The replay engine, keeping the settings each timed answer was asked with."""

    def generate(self, messages, params):
        if params.max_new_tokens > 1:
            self.asked.append((params.mode, params.grammar, params.draft_forced))
        yield from super().generate(messages, params)


def test_a_structured_run_asks_each_mode_with_its_schema_settings(tiny, tmp_path, monkeypatch):
    import swiftspec

    monkeypatch.setattr(swiftspec, "Engine", SchemaRecorder, raising=False)
    monkeypatch.setattr(SchemaRecorder, "asked", [], raising=False)
    started.clear()
    report = bench_command(EngineConfig(target=str(tiny)), prompt_set=STRUCTURED, limit=2,
                           sampling=SamplingParams(max_new_tokens=5), json_path=tmp_path / "r.json")
    assert [r["mode"] for r in report["results"]] == list(STRUCTURED_MODES)  # the default with schemas
    schemas = {Grammar(GrammarKind.JSON_SCHEMA, json.dumps(p.schema)) for p in builtin_prompts(STRUCTURED)[:2]}
    asked = SchemaRecorder.asked
    timed = asked[len(STRUCTURED_MODES):]  # after each mode's warm-up, which has no schema
    assert all(g is None for _, g, _ in asked[:len(STRUCTURED_MODES)])
    assert len(timed) == 2 * len(STRUCTURED_MODES)
    assert {(m, f) for m, g, f in timed if g in schemas} == {("ar", True), ("sync", True), ("async", True),
                                                              ("sync", False), ("async", False)}
    assert [(m, f) for m, g, f in timed if g is None] == [("async", True)] * 2  # async-free
    saved = json.loads((tmp_path / "r.json").read_text())
    by = {r["mode"]: r for r in saved["results"]}
    assert by["async-free"]["valid"] is None and by["sync-noforce"]["checked"] == 2
    assert saved["config"]["schemas"] == 2 and "async/async-free" in saved["speedup"]
    assert by["sync-noforce"]["identical_to_target"] is True  # the replay answers alike; the real engine too


FAKE_LLAMA_CPP = '''
class LlamaGrammar:
    def __init__(self, schema):
        self.schema = schema

    @classmethod
    def from_json_schema(cls, json_schema, verbose=True):
        return cls(json_schema)


class Llama:
    def __init__(self, **kwargs):
        pass

    def token_eos(self):
        return 2

    def generate(self, ids, grammar=None, **kwargs):
        yield 1000 + len(grammar.schema) if grammar is not None else 7
        yield 2
'''


def test_llama_cpp_holds_its_answer_to_the_prompts_schema(tmp_path, monkeypatch, tokenizer):
    """The peer's own process, on a stand-in for llama-cpp-python: the schema's text reaches
    LlamaGrammar.from_json_schema and the grammar reaches generate; a free prompt sends none."""
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    runner = LlamaCppRunner(tmp_path / "model.gguf", tokenizer, [2], 1, 256)
    try:
        prompt = Prompt("structured", "a", "Who?", schema=PERSON)
        params = prompt.params(SamplingParams(max_new_tokens=4))
        assert runner(prompt.messages, params).token_ids == [1000 + len(params.grammar.source)]
        assert runner(prompt.messages, SamplingParams(max_new_tokens=4)).token_ids == [7]
    finally:
        runner.close()


def test_the_engine_runner_drops_the_schema_only_in_free_modes():
    class Asked:
        def __init__(self):
            self.params = []

        def generate(self, messages, params):
            self.params.append(params)
            return iter(())

    engine = Asked()
    params = Prompt("s", "a", "x", schema=PERSON).params(SamplingParams())
    for mode in ("async", "async-noforce", "async-free"):
        EngineRunner(engine, mode, [2])([{"role": "user", "content": "x"}], params)
    timed = [p for p in engine.params if p.max_new_tokens > 1]
    assert [(p.mode, p.grammar is not None, p.draft_forced) for p in timed] == [
        ("async", True, True), ("async", True, False), ("async", False, True)]
