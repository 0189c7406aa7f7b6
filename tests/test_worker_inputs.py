"""What a worker reads is checked alike on every rank, and without ``assert``: a measured-backend cache
made for other candidates, and a hand run's requests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import tiny_model_dir

from swiftspec.engine.worker.setup import parse_args


def test_a_backend_cache_of_other_candidates_is_measured_again_even_under_python_O(tmp_path):
    """The check is no ``assert``: with ``python -O`` a cache of other candidates still reads as none."""
    cache = tmp_path / "backends.json"
    cache.write_text(json.dumps({"costs": {"float32": [1.0, 2.0]}}))
    code = ("import sys; from pathlib import Path; from swiftspec.engine.worker.profiling import read_backend_costs; "
            "p = Path(sys.argv[1]); "
            "print(read_backend_costs(p, ['gguf', 'float32']), read_backend_costs(p, ['float32']))")
    out = subprocess.run([sys.executable, "-O", "-c", code, str(cache)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "{'float32':", "[1.0,", "2.0]}"]


@pytest.mark.parametrize("text", ["not json", '{"costs": [1, 2]}', '{"costs": {"float32": "fast"}}', "[]"])
def test_an_unreadable_backend_cache_reads_as_none(tmp_path, text):
    from swiftspec.engine.worker.profiling import read_backend_costs

    (tmp_path / "c.json").write_text(text)
    assert read_backend_costs(tmp_path / "c.json", ["float32"]) is None


@pytest.mark.parametrize("flags, why", [
    (["--modes", "ar,turbo"], "mode must be one of ar, sync, async, not 'turbo'"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
])
def test_a_hand_run_with_a_bad_request_stops_at_its_flags(flags, why, capsys):
    """Every rank parses the same flags, so a bad request stops them all there, before any collective
    (the leader alone refusing it would leave the others waiting in one)."""
    with pytest.raises(SystemExit) as stop:
        parse_args(["--target", str(tiny_model_dir()), "--prompt", "Hi", *flags])
    assert stop.value.code == 2 and why in capsys.readouterr().err


def test_a_hand_run_carries_validated_requests():
    _, hand = parse_args(["--target", str(tiny_model_dir()), "--prompt", "Hi", "--modes", "ar,sync",
                          "--max-new-tokens", "7"])
    assert [(p.mode, p.max_new_tokens) for p in hand.requests] == [("ar", 7), ("sync", 7)]
