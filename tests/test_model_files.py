"""Broken model files (a truncated or foreign GGUF, a truncated or foreign safetensors file, a config.json
that is not JSON): one line naming the file and what is wrong, exit 2, no traceback, before any worker
starts, in scripted mode and before the TUI."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from swiftspec import cli
from swiftspec.cli import chat as cli_chat


@pytest.fixture(scope="module")
def tiny_dir():
    from tiny_models import tiny_model_dir

    return tiny_model_dir(seed=0, layers=1)


@pytest.fixture
def scratch_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "cache"


def _broken_copy(tiny_dir, tmp_path, name: str, damage) -> str:
    model = tmp_path / name
    shutil.copytree(tiny_dir, model)
    damage(model)
    return str(model)


def _truncate(path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _embedded_gguf():
    from swiftspec.engine.model.embedded import embedded_gguf_path

    return embedded_gguf_path()


def _cases(tiny_dir, tmp_path):
    cut_header, cut_data = tmp_path / "cut.gguf", tmp_path / "half.gguf"
    with _embedded_gguf().open("rb") as f:
        cut_header.write_bytes(f.read(4000))  # the reader fails in the metadata ("unpack_from requires...")
        f.seek(0)
        cut_data.write_bytes(f.read(3_000_000))  # the metadata is whole, the first tensors are not
    foreign_gguf = tmp_path / "notes.gguf"
    foreign_gguf.write_text("these are not weights\n")
    return [
        (str(cut_header), "cut.gguf: the file is truncated or corrupt"),
        (str(cut_data), "half.gguf: the file is truncated or corrupt"),
        (str(foreign_gguf), "notes.gguf: not a GGUF file"),
        (_broken_copy(tiny_dir, tmp_path, "cut-weights", lambda m: _truncate(m / "model.safetensors", 0.6)),
         "model.safetensors is truncated"),
        (_broken_copy(tiny_dir, tmp_path, "foreign-weights",
                      lambda m: (m / "model.safetensors").write_bytes(b"\x00" * 64)), "is not a safetensors file"),
        (_broken_copy(tiny_dir, tmp_path, "bad-config", lambda m: (m / "config.json").write_text("{\"vocab")),
         "cannot read"),
    ]


def test_broken_files_are_one_line_exit_2_in_scripted_mode(tiny_dir, tmp_path, scratch_cache):
    for path, message in _cases(tiny_dir, tmp_path):
        result = CliRunner().invoke(cli.app, ["chat", "-m", path, "-p", "hi"])
        assert result.exit_code == 2, (path, result.output)
        errors = [line for line in result.stderr.splitlines()  # the stage lines before the failure aside
                  if line != "swiftspec: resolving the models" and not line.startswith("swiftspec: converting ")]
        assert len(errors) == 1 and message in errors[0], (path, result.stderr)
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not list((scratch_cache / "converted").iterdir())  # nothing half-converted is kept


def test_broken_files_are_found_before_the_tui(tiny_dir, tmp_path, scratch_cache, monkeypatch):
    from swiftspec.tui.app import SwiftSpecApp

    monkeypatch.setattr(cli_chat, "_interactive", lambda: True)
    monkeypatch.setattr(SwiftSpecApp, "run", lambda self: pytest.fail("the TUI started on a broken model"))
    for path, message in _cases(tiny_dir, tmp_path):
        result = CliRunner().invoke(cli.app, ["chat", "--model", path])
        assert result.exit_code == 2 and message in result.stderr, (path, result.output)
        assert "Traceback" not in result.output


def test_a_symlink_loop_is_named_as_such(tmp_path):
    from swiftspec.engine.model.model_dir import LoadError, resolve_model_dir

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(LoadError, match="symbolic link that cannot be followed"):
        resolve_model_dir(str(tmp_path / "a"))


def test_a_generic_tokenizer_loads_as_autotokenizer_would_without_importing_torch(embedded_dir, target_dir):
    """The chat's process loads the tokenizer while torchrun imports torch beside it: the generic fast
    tokenizer is loaded as its class, without AutoTokenizer's import of torch, and is the same tokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from swiftspec.engine.model.model_dir import load_tokenizer

    probe = ("import sys; from swiftspec.engine.model.model_dir import load_tokenizer; "
             f"load_tokenizer({str(embedded_dir)!r}); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode, code: `x = 1`\n\tok?"}]
    for model_dir in (embedded_dir, target_dir):
        ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
        assert type(ours) is type(auto)
        for continuing in (False, True):
            chat = messages + [{"role": "assistant", "content": "Sure"}] * continuing
            kw = dict(tokenize=False, add_generation_prompt=not continuing, continue_final_message=continuing)
            assert ours.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)
        text = "Hello <|im_end|> wörld\n\n  spaces"
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.eos_token_id == auto.eos_token_id and ours.all_special_ids == auto.all_special_ids
