"""swiftspec cache list / clear on a scratch cache: sizes, the stored dtype, one entry or all, and a name
that is not there."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from swiftspec import cli


def _fake_conversion(root, name: str, dtype: str, size: int) -> None:
    d = root / "converted" / name
    d.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": dtype, "shape": [size // 2], "data_offsets": [0, size]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * size)
    (d / "config.json").write_text("{}")


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path))
    _fake_conversion(tmp_path, "Big.Q4_K_M-0123456789abcdef", "BF16", 3_000_000)
    _fake_conversion(tmp_path, "Small.Q8_0-fedcba9876543210", "F32", 20_000)
    (tmp_path / "converted" / ".tmp-half-done").mkdir()  # another process converting: not listed
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "0123.json").write_text("y" * 100)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "workers-1.log").write_text("x" * 500)
    return tmp_path


def run(*args):
    return CliRunner().invoke(cli.app, ["cache", *args])


def test_list_names_sizes_and_dtypes(scratch):
    result = run("list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(scratch))
    assert "3.0 MB  Big.Q4_K_M-0123456789abcdef  converted GGUF, bfloat16 weights" in lines[1]
    assert "20.1 KB  Small.Q8_0-fedcba9876543210  converted GGUF, float32 weights" in lines[2]
    assert "profiles" in lines[3] and "1 step-time profile(s)" in lines[3] and "100 B" in lines[3]
    assert "logs" in lines[4] and "1 worker log(s)" in lines[4]
    assert lines[5].split() == ["3.0", "MB", "in", "all"]
    assert ".tmp" not in result.stdout


def test_clear_one_then_all(scratch):
    result = run("clear", "Big.Q4_K_M-0123456789abcdef")
    assert result.exit_code == 0 and "removed Big.Q4_K_M-0123456789abcdef (3.0 MB)" in result.stdout
    assert not (scratch / "converted" / "Big.Q4_K_M-0123456789abcdef").exists()
    assert (scratch / "converted" / "Small.Q8_0-fedcba9876543210").is_dir()

    missing = run("clear", "Big.Q4_K_M-0123456789abcdef")
    assert missing.exit_code == 2
    assert "no entry called 'Big.Q4_K_M-0123456789abcdef'; it holds Small.Q8_0-fedcba9876543210, profiles, logs" in missing.stderr

    result = run("clear", "profiles")
    assert result.exit_code == 0 and not (scratch / "profiles").exists()

    result = run("clear")
    assert result.exit_code == 0 and "freed 20.6 KB" in result.stdout
    assert not list((scratch / "converted").glob("[!.]*")) and not (scratch / "logs").exists()
    assert (scratch / "converted" / ".tmp-half-done").is_dir()  # another process's work is left alone
    assert run("list").stdout.splitlines()[-1].split() == ["0", "B", "in", "all"]


def test_the_suite_writes_nothing_into_the_users_directories():
    """conftest moves the cache, the data dir, the config file and the libraries' own caches (matplotlib's,
    Triton's) into one temporary directory per session."""
    import os
    import tempfile
    from pathlib import Path

    from swiftspec.engine.paths import cache_dir
    from swiftspec.history import data_dir
    from swiftspec.settings import config_path

    scratch = Path(tempfile.gettempdir()).resolve()
    libraries = [Path(os.environ[name]) for name in ("MPLCONFIGDIR", "TRITON_CACHE_DIR", "TRITON_HOME")]
    for path in (cache_dir(), data_dir(), config_path(), *libraries):
        assert path.resolve().is_relative_to(scratch) and not path.resolve().is_relative_to(Path.home()), path
