"""A stand-in Engine for the bench's fast tests: the tiny target's greedy answers through transformers."""

from __future__ import annotations

from pathlib import Path

from swiftspec.engine.config import EngineConfig


class ReplayEngine:
    """Stands in for the Engine in the fast tests: the tiny target's greedy answer (through transformers),
    streamed as the Engine streams it: a prefill event, then steps of 1 (ar) or up to 3 tokens with stats,
    a final EOS included."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM

        from swiftspec.engine.host.protocol import EngineInfo, RankInfo
        from swiftspec.engine.model.model_dir import load_tokenizer

        self.tokenizer = load_tokenizer(Path(config.target))
        self.model = AutoModelForCausalLM.from_pretrained(config.target).eval()
        self.info = EngineInfo(target="tiny", draft=config.draft, context_length=config.max_seq_len,
                               ranks=[RankInfo(rank=0, role="target", device="cpu", tp_rank=0, tp_world=1,
                                               torch_threads=1, host="h", pid=1)],
                               backend="gloo", bs=config.tree.bs, w=config.tree.w, d=2, d_auto=True,
                               t_verify_ms=9.0, t_expand_ms=1.0)
        self.config = config
        self.calls: list[tuple[list[dict], str, int]] = []
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, progress=None) -> ReplayEngine:
        progress("workers ready")
        started.append(cls(config))
        return started[-1]

    def generate(self, messages, params):
        import torch

        from swiftspec.engine.events import StepEvent, StepStats
        from swiftspec.engine.host.encode import encode_chat

        self.calls.append((messages, params.mode, params.max_new_tokens))
        ids = encode_chat(self.tokenizer, messages)
        new = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=params.max_new_tokens,
                                  eos_token_id=2, pad_token_id=0)[0, len(ids):].tolist()  # EOS kept, as the Engine does
        yield StepEvent(new[:1], "", StepStats(prefill_tokens=len(ids), target_ms=9.0), len(new) <= 1)
        step = 1 if params.mode == "ar" else 3
        for i in range(1, len(new), step):
            chunk = new[i:i + step]
            stats = StepStats(accepted=len(chunk) - 1, tree_size=0 if params.mode == "ar" else 8, target_ms=2.0,
                              draft_ms=0.0 if params.mode == "ar" else 0.5)
            yield StepEvent(chunk, "", stats, i + step >= len(new))

    def close(self) -> None:
        self.closed = True


started: list[ReplayEngine] = []
