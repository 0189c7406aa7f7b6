"""A GGUF's conversion keeps its quantised blocks, and the model loaded from it is transformers' fp32
dequantisation bit for bit: on a tiny synthetic GGUF with every kind of tensor a conversion meets."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quants
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import make_tiny_gguf, q4_k_blocks

from swiftspec import cache
from swiftspec.engine.config import Dtype
from swiftspec.engine.model import gguf_io
from swiftspec.engine.model.gguf_io import GGUF_BLOCKS
from swiftspec.engine.model.gguf_io import dequantize as our_dequantize
from swiftspec.engine.model.loader import (
    convert_hf_state_dict,
    load_hf_model,
    load_model,
    read_hf_state_dict,
    read_weights,
)
from swiftspec.engine.model.model_dir import read_args


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the GGUF, its converted directory, transformers' fp32 state dict of the GGUF)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("conversion")
    gguf = make_tiny_gguf(root / "tiny.Q4_1.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWIFTSPEC_CACHE", str(root / "cache"))
        out = gguf_io.ensure_converted(gguf)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return gguf, out, reference.state_dict()


@pytest.mark.parametrize("kind", sorted(GGUF_BLOCKS))
def test_dequantize_is_gguf_py_bit_for_bit(kind):
    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 256)) * rng.choice([1e-4, 1.0, 300.0], size=(48, 1))).astype(np.float32)
    blocks = q4_k_blocks(rng, 48, 256) if kind == "Q4_K" else quants.quantize(w, qtype)  # gguf-py: no Q4_K quantiser
    assert torch.equal(our_dequantize(torch.from_numpy(blocks), kind), torch.from_numpy(dequantize(blocks, qtype)))


def test_weights_load_as_transformers_dequantises_them(converted):
    _, out, reference = converted
    ours = read_hf_state_dict(out)
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype != torch.float32 or tensor.dtype == torch.float32
        assert torch.equal(ours[name].float(), tensor), name
    hf, kinds = read_weights(out)
    assert {kinds[f"model.layers.1.{n}.weight"] for n in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")} == {
        "Q4_1", "Q8_0"}  # layer 1's q/k/v and gate/up are fused as blocks
    fused, _ = convert_hf_state_dict(hf, read_args(out), kinds)
    for name, tensor in convert_hf_state_dict(reference, read_args(out))[0].items():  # blocks fused, then dequantised
        assert torch.equal(fused[name], tensor), name
    model = load_model(out, dtype=Dtype.FLOAT32, max_slots=64)
    assert torch.equal(model.tok_embeddings.weight, reference["model.embed_tokens.weight"])
    hf = load_hf_model(out).state_dict()  # what the tests and the bench compare with
    assert all(torch.equal(hf[name], tensor) for name, tensor in reference.items())


def test_blocks_are_kept_and_the_rest_is_stored_exactly(converted):
    """Q4_0/Q4_1/Q8_0 as blocks (q and k permuted as rows of blocks), F16 as F16, Q5_0 (which the loader
    does not dequantise) and the F32 norms as F32: nothing stored wider than it needs, nothing rounded."""
    gguf, out, _ = converted
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    blocks = json.loads(meta[gguf_io.GGUF_METADATA])
    layer = "model.layers.0."
    assert {k: blocks.get(layer + k) for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                                "mlp.down_proj.weight")} == {
        "self_attn.q_proj.weight": "Q4_1", "self_attn.k_proj.weight": "Q4_1", "self_attn.v_proj.weight": "Q8_0",
        "self_attn.o_proj.weight": "Q4_0", "mlp.down_proj.weight": "Q4_1"}
    assert blocks["model.embed_tokens.weight"] == "Q8_0" and blocks["lm_head.weight"] == "Q4_0"
    assert all(stored[k] == "U8" for k in blocks)
    assert stored[layer + "mlp.up_proj.weight"] == "F16"
    assert stored[layer + "mlp.gate_proj.weight"] == stored[layer + "input_layernorm.weight"] == "F32"
    assert meta[gguf_io.FORMAT_METADATA] == str(gguf_io.CONVERSION_FORMAT)
    weights = (out / "model.safetensors").stat().st_size
    assert weights < 1.6 * gguf.stat().st_size  # the Q5_0 tensors, dequantised, are the excess


def test_title_names_the_precision_and_the_source(converted, tmp_path):
    _, out, _ = converted
    assert gguf_io.precision_label(out, Dtype.FLOAT32) == "fp32 (from Q8_0 GGUF)"  # most of the tiny GGUF's values
    assert gguf_io.precision_label(out, Dtype.BFLOAT16) == "bf16 (from Q8_0 GGUF)"
    assert gguf_io.precision_label(tmp_path, Dtype.FLOAT16) == "fp16"  # a plain model directory


def test_cache_list_shows_true_sizes(converted):
    _, out, _ = converted
    (entry,) = [e for e in cache.entries(out.parent.parent) if e.path == out]
    assert entry.size == sum(f.stat().st_size for f in out.iterdir()) > (out / "model.safetensors").stat().st_size
    assert entry.what == "converted GGUF, Q8_0 + float32 + Q4_1 + float16 + Q4_0 weights"


def test_older_formats_are_converted_again_and_removed(tmp_path, monkeypatch):
    """A conversion by an older version (fp32 in format 1, bf16 in format 2) has another key, so it is not
    used; the new conversion removes it, and `cache list` marks any that are left as unused."""
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(4092))
    old = [gguf_io.converted_dir(gguf, f) for f in range(1, gguf_io.CONVERSION_FORMAT)]
    for d in old:
        d.mkdir(parents=True)
        save_file({"w": torch.ones(8)}, str(d / "model.safetensors"))  # no swiftspec metadata, as then
    assert [e.what for e in cache.entries() if e.path in old] == [
        "converted GGUF, float32 weights (an older format, no longer used: clear it)"] * len(old)
    calls = []

    def fake(gguf, out, console):
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")

    monkeypatch.setattr(gguf_io, "_convert", fake)
    out = gguf_io.ensure_converted(gguf)
    assert len(calls) == 1 and out not in old and out.is_dir()
    assert not any(d.exists() for d in old)


def test_a_cold_conversion_draws_no_progress_bar(tmp_path, monkeypatch, capfd):
    """The stages go to ``progress`` (the CLI's stderr lines); the GGUF reader's own tqdm bar would leak
    onto stderr around them."""
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "cache"))
    lines = []
    gguf_io.ensure_converted(make_tiny_gguf(tmp_path / "tiny.Q4_1.gguf"), lines.append)
    assert capfd.readouterr().err == "" and len(lines) >= 4


def _fake_convert(gguf, out, say) -> None:
    """Stands in for the 25 s dequantisation: a small but well-formed converted directory."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1000)}, str(out / "model.safetensors"))
    (out / "config.json").write_text("{}")


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):

    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(4096))
    return gguf


def test_conversion_killed_half_way_is_cleaned_up_by_the_next_start(fake_gguf, monkeypatch):
    import subprocess
    import sys

    converted = gguf_io.converted_dir(fake_gguf).parent
    hang = ("import sys, time\nfrom swiftspec.engine.model import gguf_io\n"
            "def hang(gguf, out, console):\n    (out / 'model.safetensors').write_bytes(b'x' * 4096)\n"
            "    time.sleep(60)\n"
            "gguf_io._convert = hang\ngguf_io.ensure_converted(gguf_io.Path(sys.argv[1]))\n")
    proc = subprocess.Popen([sys.executable, "-c", hang, str(fake_gguf)])
    try:
        deadline = time.monotonic() + 30
        while not list(converted.glob(".tmp-*/model.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = list(converted.glob(".tmp-*"))
        assert len(running) == 1
        gguf_io._remove_stale_temp_dirs(converted)  # a conversion still running is left alone
        assert running[0].is_dir()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert running[0].is_dir()  # what a SIGKILL leaves behind
    monkeypatch.setattr(gguf_io, "_convert", _fake_convert)
    out = gguf_io.ensure_converted(fake_gguf)
    assert gguf_io.damage(out) is None
    assert sorted(p.name for p in converted.iterdir()) == [out.name]


@pytest.mark.parametrize("harm, why", [
    (lambda out: os.truncate(out / "model.safetensors", 2000), "bytes, its header says"),
    (lambda out: (out / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda out: (out / "model.safetensors").write_bytes(b"\xff" * 16), "no readable header"),
])
def test_damaged_conversion_is_detected_and_converted_again(harm, why, fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_io, "_convert", lambda *a: (calls.append(1), _fake_convert(*a)))
    out = gguf_io.ensure_converted(fake_gguf)
    assert gguf_io.ensure_converted(fake_gguf) == out and len(calls) == 1  # intact: used as it is
    harm(out)
    assert why in gguf_io.damage(out)
    said = []
    assert gguf_io.ensure_converted(fake_gguf, said.append) == out and len(calls) == 2
    assert gguf_io.damage(out) is None
    assert any("damaged" in line for line in said)  # through the caller's progress callback
