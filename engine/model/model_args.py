"""A checkpoint's config.json, read into what our model needs. No torch here: the Engine checks a
model's config before it starts any worker, and importing torch would slow its start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelConfigError(ValueError):
    """The checkpoint's config describes a model this code does not implement."""


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"

    @property
    def context_limit(self) -> int:
        """Longest sequence this code computes exactly (no sliding-window attention is implemented)."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Reads a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                       "qwen2": "Qwen2ForCausalLM"}.get(cfg.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5)"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported activation {cfg['hidden_act']!r} (only silu)")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None:
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise ModelConfigError(f"unsupported RoPE scaling {rope_type!r} (default, linear, llama3)")
            rope = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        n_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            architecture=arch,
        )
