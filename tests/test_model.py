"""Our model against transformers' own implementation, loaded through our loader from saved checkpoints."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from swiftspec.engine.config import Dtype
from swiftspec.engine.model.cpu_backends import PackedLinear
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import LoadError, resolve_model_dir
from swiftspec.kernels.cpu_linear import Format

TOL = 1e-4

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CONFIGS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama-tied-mha": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
}


def save_hf(name: str, path):
    cfg_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra})).eval()
    if name == "qwen2-bias":  # random non-zero biases so that the test sees them
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, theirs) for one config, with random weights saved and re-read through our loader."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf(request.param, path)
    return load_model(path, max_slots=128), hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def causal(n_new: int, start: int) -> torch.Tensor:
    """Mask for n_new tokens at slots start.. over slots [0, start + n_new)."""
    return torch.ones(n_new, start + n_new, dtype=torch.bool).tril(diagonal=start)


def forward(model, tokens, positions, slots, mask):
    as_t = lambda x: torch.tensor(x, dtype=torch.long)
    return model(as_t(tokens), as_t(positions), as_t(slots), mask)


@pytest.mark.parametrize("name", ["llama", "qwen2-bias"])
def test_bf16_logits_close_to_transformers(name, tmp_path):
    """bf16 through the batch-invariant path (the bf16 default) against transformers' bf16 forward:
    both round every op to bf16 (8 mantissa bits), in different places, so they agree to ~1e-2 of the
    logits' range."""
    hf = save_hf(name, tmp_path).to(torch.bfloat16)
    ours = load_model(tmp_path, dtype=Dtype.BFLOAT16, max_slots=64)
    assert ours.batch_invariant
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    want = hf_logits(hf, ids)
    got = forward(ours, ids, range(24), range(24), causal(24, 0))
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("name", ["llama", "qwen2-bias"])
def test_fp16_weights_on_the_cpu_compute_in_fp32(name, tmp_path):
    """float16 on the CPU: every linear holds fp16 weights multiplied in fp32 (the row-invariant kernels),
    so the model is transformers' fp32 forward of the fp16-rounded weights; the KV cache and the embedding
    stay fp32."""
    hf = save_hf(name, tmp_path)
    ours = load_model(tmp_path, dtype=Dtype.FLOAT16, max_slots=64)
    assert not any(isinstance(m, torch.nn.Linear) for m in ours.modules())
    packed = [m for m in ours.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 * 4 + 1 and all(m.fmt == Format.F16 for m in packed)  # 4 a layer, lm_head
    assert ours.k_cache.dtype == ours.tok_embeddings.weight.dtype == torch.float32 and ours.batch_invariant
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    got = forward(ours, ids, range(24), range(24), causal(24, 0))
    assert (got - hf_logits(hf, ids)).abs().max() > 1e-5  # the fp16 rounding is real (~2e-4)...
    with torch.no_grad():
        for lin in (m for m in hf.modules() if isinstance(m, torch.nn.Linear)):
            lin.weight.copy_(lin.weight.half())  # ...and is all there is (the embedding stays fp32)
    assert (got - hf_logits(hf, ids)).abs().max() <= 1e-5  # (fp32 math, in another summation order)


def test_prefill_matches(pair):
    ours, hf = pair
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = forward(ours, ids, range(40), range(40), causal(40, 0))
    assert (got - hf_logits(hf, ids)).abs().max() <= TOL


def test_decode_steps_with_cache_match(pair):
    ours, hf = pair
    ids = torch.randint(0, 97, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, ids)
    forward(ours, ids[:44], range(44), range(44), causal(44, 0))  # positions past 32 exercise llama3 scaling
    for i in range(44, 50):
        got = forward(ours, [ids[i]], [i], [i], causal(1, i))
        assert (got[0] - ref[i]).abs().max() <= TOL


def random_tree(n: int, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = torch.randint(0, 97, (n,), generator=g).tolist()
    return tokens, parents


def test_tree_masked_forward_matches_paths(pair):
    """Every node's logits equal a separate transformers forward over prefix + its root-to-node path."""
    ours, hf = pair
    prefix = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    forward(ours, prefix, range(20), range(20), causal(20, 0))
    tokens, parents = random_tree(12, seed=4)
    depth, paths = [], []
    mask = torch.zeros(12, 20 + 12, dtype=torch.bool)
    mask[:, :20] = True
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        paths.append([i] if p < 0 else paths[p] + [i])
        mask[i, [20 + j for j in paths[i]]] = True
    got = forward(ours, tokens, [20 + d for d in depth], range(20, 32), mask)
    for i in range(12):
        want = hf_logits(hf, prefix + [tokens[j] for j in paths[i]])[-1]
        assert (got[i] - want).abs().max() <= TOL, f"node {i}"


def test_nonexistent_path_is_a_clear_error(tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(LoadError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(LoadError, match="unsupported architecture 'GPT2LMHeadModel'.*supported: Llama"):
        load_model(resolve_model_dir(str(tmp_path)))


def test_missing_weights_is_a_clear_error(tmp_path):
    LlamaConfig(**COMMON).save_pretrained(tmp_path)
    with pytest.raises(LoadError, match="no model.safetensors"):
        load_model(tmp_path)


def test_corrupt_weights_is_a_clear_error(tmp_path):
    LlamaConfig(**COMMON).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(LoadError, match="cannot read weights"):
        load_model(tmp_path)


@pytest.mark.parametrize("form", ["string", "added-token dict", "special_tokens_map only"])
def test_the_tokenizer_eos_is_read_from_the_files_as_transformers_reads_it(form, tmp_path):
    from tiny_models import make_tokenizer
    from transformers import AutoTokenizer

    from swiftspec.engine.model.model_dir import tokenizer_eos_id

    tok = make_tokenizer(320)
    tok.eos_token = "<|im_start|>" if form == "special_tokens_map only" else "<|im_end|>"  # not the default
    tok.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if form == "added-token dict":
        cfg["eos_token"] = {"__type": "AddedToken", "content": cfg["eos_token"], "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
    elif form == "special_tokens_map only":
        (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": cfg.pop("eos_token")}))
    cfg_path.write_text(json.dumps(cfg))
    expected = AutoTokenizer.from_pretrained(tmp_path).eos_token_id
    assert expected is not None and tokenizer_eos_id(tmp_path) == expected
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(LookupError):  # the files cannot tell: eos_token_ids asks transformers
        tokenizer_eos_id(tmp_path)
