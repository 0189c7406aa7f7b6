"""Tiny random Hugging Face checkpoints for tests, with a real (small, fast) tokenizer.

``make_tiny_model(dir, ...)`` writes a LlamaForCausalLM or Qwen2ForCausalLM with random weights
(safetensors, config.json) and a byte-level BPE tokenizer of exactly ``vocab`` tokens with a ChatML chat
template, so the directory loads through ``swiftspec.engine.model.loader`` like a real model.

Greedy robustness: batched forwards (a verified tree, a prefill chunk) differ from one-token forwards by
~1e-6 relative in fp32, so a greedy choice whose top-2 logit gap is that small can flip between ``ar`` and
tree decoding. Random models at the default init have flat logits (gaps often that small), so weights
are drawn with a large ``init_range`` and the lm_head is scaled by ``logit_scale``: top-1 gaps are then
typically whole units and the greedy output is the same on every path. Random weights also make the
models peaked and repetitive, which is what speculative decoding tests want.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; <|im_end|> is EOS
EOS_ID = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """\
Speculative decoding lets a small draft model propose several tokens which the large target model then
checks in a single forward pass. Every token the target would have produced itself is kept, so the output
is exactly the target's, while the target reads its weights once for many tokens. The draft keeps a tree of
candidate continuations rooted at the last verified token; each node stores the log probability of its
token and the sum of those values from the root. The target verifies the most probable connected subtree.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
Question: what is 17 times 23? Answer: 17 times 23 is 391. The quick brown fox jumps over the lazy dog.
Summaries should be short, factual and written in plain language; the reader wants the main points first.
{"name": "SwiftSpec", "tokens": [1, 2, 3], "ok": true} -- 0123456789 !? () [] {} <> = + - * / % & | ^ ~
"""


@cache
def _tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    # Small corpora yield fewer merges than asked: fill up with plain tokens so len(tokenizer) == vocab.
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab - tok.get_vocab_size())])
    return tok.to_str()


def make_tokenizer(vocab: int = 512):
    """A PreTrainedTokenizerFast of exactly ``vocab`` tokens (vocab >= 300) with a ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab)),
                                  bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == vocab
    return tok


def make_tiny_model(dir: str | Path, arch: str = "llama", vocab: int = 512, layers: int = 2,
                    hidden: int = 64, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                    init_range: float = 0.2, logit_scale: float = 4.0, tie: bool = False,
                    positions: int = 4096) -> Path:
    """Writes a random ``arch`` ("llama" | "qwen2") model and its tokenizer to dir; returns the path.

    Same ``vocab`` means the same tokenizer, so any two tiny models of one vocab form a valid
    target/draft pair. Qwen2 gets random (non-zero) q/k/v biases so that the bias path is exercised.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=positions, initializer_range=init_range, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        if not tie:
            model.lm_head.weight.mul_(logit_scale)
        if arch == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=init_range)
    path = Path(dir)
    model.save_pretrained(path)
    make_tokenizer(vocab).save_pretrained(path)
    return path


@cache
def tiny_model_dir(**kwargs) -> Path:
    """``make_tiny_model(**kwargs)`` written once per test process into a temporary directory (removed
    at exit), so several test modules can share one checkpoint."""
    path = tempfile.mkdtemp(prefix="swiftspec-tiny-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return make_tiny_model(path, **kwargs)


@contextlib.contextmanager
def single_thread():
    """Tiny models run far faster on one thread: OpenMP fork/join costs more than their math, and a
    shared, oversubscribed machine makes a second thread worse still."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def q4_k_blocks(rng, rows: int, cols: int):
    """Random GGUF Q4_K super-blocks for a [rows, cols] weight (cols a multiple of 256), as uint8
    [rows, cols / 256 * 144]: weights of about +-0.5."""
    import numpy as np

    n = rows * cols // 256
    scales = np.abs(rng.normal(0, 0.5 / (63 * 15), (n, 2))).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (n, 140), dtype=np.uint8)
    return np.concatenate([scales, rest], 1).reshape(rows, -1)


def make_tiny_gguf(path: str | Path, vocab: int = 320, layers: int = 2, hidden: int = 64, heads: int = 4,
                   kv_heads: int = 2, seed: int = 0) -> Path:
    """Writes a random llama GGUF with this module's tokenizer; returns the path. Its tensors come in every
    kind a conversion meets: blocks the loader dequantises (Q4_0, Q4_1, Q4_K from layer 2 when the MLP is 256
    wide, Q8_0; q and k among them, which
    transformers permutes), blocks it does not (Q5_0, stored dequantised), F16 and F32 (norms); layer 0
    mixes types inside q/k/v and gate/up, layer 1 has one type in each (their blocks are fused)."""
    import json

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    rng = np.random.default_rng(seed)
    tok = json.loads(_tokenizer_json(vocab))
    tokens = sorted({**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}.items(),
                    key=lambda item: item[1])
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in tokens])
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], kind: Q) -> None:
        w = rng.normal(0, 0.2, shape).astype(np.float32)
        if kind == Q.Q4_K:  # gguf-py cannot quantise to it: random super-blocks of weights about that size
            writer.add_tensor(name, q4_k_blocks(rng, *shape), raw_dtype=kind)
        elif kind == Q.F32:
            writer.add_tensor(name, w)
        elif kind == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(w, kind), raw_dtype=kind)

    head_dim = hidden // heads
    add("token_embd.weight", (vocab, hidden), Q.Q8_0)
    add("output.weight", (vocab, hidden), Q.Q4_0)
    add("output_norm.weight", (hidden,), Q.F32)
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", (hidden, hidden), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), Q.Q8_0 if i == 0 else Q.Q4_1)
        add(f"blk.{i}.attn_output.weight", (hidden, hidden), Q.Q4_0)
        add(f"blk.{i}.ffn_gate.weight", (2 * hidden, hidden), Q.Q5_0 if i == 0 else Q.Q8_0)
        add(f"blk.{i}.ffn_up.weight", (2 * hidden, hidden), Q.F16 if i == 0 else Q.Q8_0)
        add(f"blk.{i}.ffn_down.weight", (hidden, 2 * hidden), Q.Q4_K if i >= 2 and 2 * hidden % 256 == 0 else Q.Q4_1)
        add(f"blk.{i}.attn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
