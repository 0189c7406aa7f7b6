"""The bench's peers: llama.cpp in a process of its own (a crash is reported as the peer's, the run goes
on), threads per mode, the profiled verification cost and the load-average warning in the report."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

import pytest
from fake_engine import INFO

from swiftspec.bench import llamacpp
from swiftspec.bench.command import bench_command, llamacpp_gguf
from swiftspec.bench.llamacpp import LlamaCppRunner
from swiftspec.bench.prompts import BenchError, Prompt
from swiftspec.bench.report import render_table, report_config, summarise
from swiftspec.bench.runners import PeerCrashed, Sample, run_interleaved
from swiftspec.engine.config import EngineConfig, SamplingParams


def dying_peer(code: str) -> LlamaCppRunner:
    """A runner whose process is ``code`` instead of llama.cpp."""
    runner = LlamaCppRunner.__new__(LlamaCppRunner)
    runner.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
    runner.tokenizer, runner.eos, runner.threads = None, [], 1
    return runner


def test_a_peer_killed_by_sigill_says_so_and_how_to_rebuild():
    runner = dying_peer(f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})")
    with pytest.raises(PeerCrashed, match="killed by SIGILL.*GGML_NATIVE=OFF"):
        runner._read("ready")
    runner.close()


def test_a_peer_that_fails_to_load_reports_its_error():
    runner = dying_peer('print(\'{"type": "error", "message": "ValueError: no such model"}\', flush=True)')
    with pytest.raises(PeerCrashed, match="no such model"):
        runner._read("ready")
    runner.close()


def test_a_crashed_peer_leaves_the_run_and_the_report_names_it():
    from rich.console import Console

    def ok(messages, params):
        return Sample([1, 2], 0.2, [(0.1, 1), (0.2, 1)], verifications=1)

    def crash(messages, params):
        raise PeerCrashed("llama.cpp killed by SIGILL")

    prompts = [Prompt("s", str(i), f"p{i}") for i in range(3)]
    samples: dict = {}
    crashed: dict = {}
    run_interleaved({"llama.cpp": crash, "ar": ok}, prompts, SamplingParams(), samples, crashed=crashed)
    assert crashed == {"llama.cpp": "llama.cpp killed by SIGILL"} and list(samples) == ["ar"]
    assert len(samples["ar"]) == 3
    results, speedup = summarise(samples, prompts)
    config = report_config(EngineConfig(), INFO, ["llama.cpp", "ar"], prompts, SamplingParams(), None,
                                 {"llama.cpp": "2", "ar": "target 1 × 1"}, ["load average 3.10 above 2 cores"])
    report = {"config": config, "results": results, "speedup": speedup, "crashed": crashed}
    console = Console(record=True, width=250)
    console.print(render_table(report))
    text = console.export_text()
    assert "crashed" in text and "killed by SIGILL" in text
    assert "threads: llama.cpp 2, ar target 1 × 1" in text and "WARNING: load average 3.10" in text


def test_peers_show_how_many_prompts_agree_instead_of_failing_identity():
    from rich.console import Console

    prompts = [Prompt("qa", "q1", "x"), Prompt("qa", "q2", "y")]
    samples = {"ar": [Sample([1, 2, 3, 4], 2.0, [(0.5, 1)] * 4), Sample([5, 6], 1.0, [(0.5, 1), (1.0, 1)])],
               "llama.cpp": [Sample([1, 2, 3, 9], 1.0, [(0.5, 2), (1.0, 2)]), Sample([5, 6], 0.5, [(0.5, 2)])]}
    results, speedup = summarise(samples, prompts)
    config = report_config(EngineConfig(), INFO, list(samples), prompts, SamplingParams(), None)
    console = Console(record=True, width=250)
    console.print(render_table({"config": config, "results": results, "speedup": speedup}))
    row = next(line for line in console.export_text().splitlines() if line.strip().startswith("│ llama.cpp")
               or line.strip().startswith("llama.cpp"))
    assert "1/2" in row and "NO" not in row
    assert "llama.cpp/ar" in speedup and "ar/llama.cpp" in speedup


def test_the_report_gives_the_profiled_cost_of_each_verification_size():
    """What a verified row costs, in one-node forwards, read off the engine's profile: the figure the CPU
    kernels are judged by (8 nodes in at most 1.8 steps); none where it was not measured."""
    from rich.console import Console

    prompts = [Prompt("qa", "q1", "x")]
    samples = {"ar": [Sample([1, 2], 1.0, [(0.5, 1), (1.0, 1)])]}
    results, speedup = summarise(samples, prompts)
    for info, want in ((dataclasses.replace(INFO, verify_cost=[1.0, 1.12, 1.3, 2.19]),
                        "2 nodes 1.12, 3 nodes 1.30, 4 nodes 2.19."), (INFO, None)):
        config = report_config(EngineConfig(), info, list(samples), prompts, SamplingParams(), None)
        assert config["engine"]["verify_cost"] == info.verify_cost
        console = Console(record=True, width=250)
        console.print(render_table({"config": config, "results": results, "speedup": speedup}))
        text = console.export_text()
        assert (want in text) if want else "verification cost" not in text


def test_the_llama_cpp_mode_needs_the_package_and_a_gguf(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert "pip install llama-cpp-python" in llamacpp.available()
    with pytest.raises(BenchError, match="llama-cpp-python"):
        bench_command(EngineConfig(), modes="llama.cpp,ar")
    with pytest.raises(BenchError, match="reads a GGUF file"):
        llamacpp_gguf(EngineConfig(target=str(tmp_path)))
    assert llamacpp_gguf(EngineConfig()).suffix == ".gguf"  # the embedded default's file
