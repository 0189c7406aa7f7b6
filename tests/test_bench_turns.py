"""bench over conversations (--turns all: each later turn after the mode's own earlier answers, figures
per turn) and with a warmed-up drafter history (--warm N: answers of other sets, and only those)."""

from __future__ import annotations

import json

import pytest
from helpers.replay import ReplayEngine, started
from rich.console import Console

from swiftspec.bench.command import bench_command
from swiftspec.bench.prompts import (
    BenchError,
    Prompt,
    builtin_prompts,
    parse_jsonl,
    select_prompts,
    turn_rows,
    warm_prompts,
)
from swiftspec.bench.report import render_turns, summarise
from swiftspec.bench.runners import Sample, run_interleaved
from swiftspec.engine.config import EngineConfig, SamplingParams


def test_the_multiturn_set_is_conversations_of_our_own():
    records = builtin_prompts("multiturn")
    assert len(records) >= 10 and all(len(r.later) == 1 and r.later[0].strip() for r in records)
    assert len({r.later[0] for r in records}) == len(records)
    assert parse_jsonl(json.dumps({"turns": ["a", "b", "c"]}), "x")[0].later == ("b", "c")
    with pytest.raises(BenchError, match="line 1"):
        parse_jsonl(json.dumps({"turns": ["a", ""]}), "x")


def test_later_turns_follow_the_modes_own_answers():
    calls = []

    def runner(mode):
        def run(messages, params):
            calls.append((mode, messages))
            return Sample([len(calls)], 0.1, [(0.1, 1)])
        return run

    prompts = [Prompt("s", "a", "first", later=("second",)), Prompt("s", "b", "alone")]
    out: dict = {}
    run_interleaved({m: runner(m) for m in ("ar", "async")}, prompts, SamplingParams(), out, turns="all",
                          decode=lambda ids: f"answer {ids[0]}")
    assert [(m, [x["content"] for x in msgs]) for m, msgs in calls] == [
        ("ar", ["first"]), ("ar", ["first", "answer 1", "second"]),
        ("async", ["first"]), ("async", ["first", "answer 3", "second"]),
        ("async", ["alone"]), ("ar", ["alone"])]
    assert [r.turn for r in turn_rows(prompts, "all")] == [1, 2, 1]
    assert [r.text for r in turn_rows(prompts, "first")] == ["first", "alone"]


def test_figures_per_turn():
    rows = [Prompt("s", "a", "q", turn=1), Prompt("s", "a", "q2", turn=2)]
    samples = {"async": [Sample([1, 2, 3, 4], 1.0, [(0.5, 2), (1.0, 2)], verifications=2, accepted=2, proposed=4),
                         Sample([5, 6, 7, 8, 9, 10], 1.0, [(0.5, 3), (1.0, 3)], verifications=2, accepted=4,
                                proposed=4)]}
    (result,), _ = summarise(samples, rows)
    assert result["by_turn"]["1"]["mean_accepted"] == 2.0 and result["by_turn"]["2"]["mean_accepted"] == 3.0
    assert result["by_turn"]["2"]["acceptance_rate"] == 1.0 and result["by_turn"]["2"]["tokens_per_s"] == 6.0
    assert [p["turn"] for p in result["per_prompt"]] == [1, 2]
    console = Console(record=True, width=120)
    console.print(render_turns({"results": [result]}))
    text = console.export_text()
    assert "by turn" in text and "3.00" in text
    one, _ = summarise({"async": samples["async"][:1]}, rows[:1])
    assert render_turns({"results": one}) is None


def test_warm_prompts_come_from_the_sets_not_measured():
    measured = select_prompts(None, "multiturn", None)
    warm = warm_prompts(measured, 50)
    assert len(warm) == 50 and "multiturn" not in {p.source for p in warm}
    with pytest.raises(BenchError, match="outside the measured ones"):
        warm_prompts(select_prompts(None, "all", None), 1)
    with pytest.raises(BenchError, match="turns must be"):
        bench_command(EngineConfig(), modes="ar", turns="some")
    with pytest.raises(BenchError, match="engine mode"):
        bench_command(EngineConfig(), modes="hf", warm=2)


def test_a_warmed_multi_turn_run(tiny, tmp_path, monkeypatch):
    """The warm-up answers go into the bench's own history, which the engine's drafter reads; the timed
    answers never do; every turn is reported."""
    import swiftspec

    monkeypatch.setattr(swiftspec, "Engine", ReplayEngine, raising=False)
    started.clear()
    console = Console(record=True, width=200)
    report = bench_command(EngineConfig(target=str(tiny)), modes="ar,async", prompt_set="multiturn", limit=2,
                                 sampling=SamplingParams(max_new_tokens=6), console=console, turns="all", warm=3)
    (engine,) = started
    assert engine.config.draft_history and engine.config.history_db.endswith("history.sqlite3")
    warm = [m for m, mode, n in engine.calls if n == 6 and mode == "ar"][:3]
    assert [m[-1]["content"] for m in warm] == [p.text for p in warm_prompts(builtin_prompts("multiturn"), 3)]
    second = [m for m, _, n in engine.calls if n == 6 and len(m) == 3]
    assert len(second) == 2 * 2 and all(m[1]["role"] == "assistant" and m[1]["content"] for m in second)
    cfg = report["config"]
    assert cfg["turns"] == "all" and cfg["warm"] == {"prompts": 3, "sets": ["chat", "code", "math"]}
    assert "3 warm-up answers only" in cfg["engine_sessions"] and cfg["prompts"] == 4
    for r in report["results"]:
        assert set(r["by_turn"]) == {"1", "2"} and r["identical_to_target"]
    assert "by turn" in console.export_text()


@pytest.mark.slow
def test_real_engine_every_mode_equals_the_target_over_turns_with_a_warm_history(tiny):
    report = bench_command(EngineConfig(target=str(tiny)), modes="ar,sync,async", prompt_set="multiturn",
                                 limit=2, sampling=SamplingParams(max_new_tokens=16), turns="all", warm=2,
                                 console=Console(record=True, width=200))
    assert all(r["identical_to_target"] for r in report["results"])
    assert all(r["by_turn"]["2"]["answers"] == 2 for r in report["results"])
