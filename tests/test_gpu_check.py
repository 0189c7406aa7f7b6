"""scripts/gpu_check.sh, the GPU acceptance run, checked where CI runs: its syntax, and a dry run on the
CPU that builds the scaled-down random-weight models and runs every step that needs no CUDA."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_the_tests_step_collects_the_modules_with_gpu_tests_alone():
    """Collecting the whole suite on a GPU image without the openai client ended the step in 2 errors."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    files = gpu_check.gpu_test_files()
    assert {"tests/test_kernels.py", "tests/test_cuda_graphs.py", "tests/test_batch_invariant.py"} <= set(files)
    assert "tests/test_server.py" not in files
    assert all("mark.gpu" in (ROOT / f).read_text() for f in files)


@pytest.mark.slow
def test_dry_run_runs_every_cpu_step(tmp_path):
    report = tmp_path / "gpu_check.json"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--report", str(report), "--budget", "600"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = json.loads(report.read_text())["steps"]
    assert steps["tests"]["status"].startswith("skipped: dry run")
    assert [steps[s]["status"] for s in ("engine", "decode", "attention", "rounds")] == ["ok"] * 4
    engine = steps["engine"]
    assert engine["identical"] and engine["model-draft"]["tok_s"]["async"] > 0
    assert set(steps["decode"]["batch-invariant"]["verify_cost"]) == {"1", "2", "4", "8", "16", "32", "64"}
    rounds = steps["rounds"]  # on the CPU a round's inputs are numpy's, nothing to copy; its one read: the choice
    assert {k: (v["up"], v["down"]) for k, v in rounds["transfers_per_round"].items()} == {
        "greedy": (0, 1), "penalised": (0, 1), "sampled": (0, 1)}
    assert rounds["launches_per_layer"] > 0 and 0 < rounds["engine_ar_share_of_step"]
    assert "gpu_check on cpu" in proc.stdout
