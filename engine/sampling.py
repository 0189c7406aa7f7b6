"""The target's token distribution (temperature, top-k, top-p, in Hugging Face's order) and a seeded
generator, shared by plain decoding and tree verification so both sample from the same distribution."""

from __future__ import annotations

import torch
from torch import Tensor

from swiftspec.config import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        self.params = params.validate()
        self.greedy = params.temperature == 0
        self.generator = torch.Generator(device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> the fp32 distribution to sample from (temperature, then top-k, then top-p)."""
        p = self.params
        x = logits.float() / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            kth = x.topk(p.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
            sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def draw(self, probs: Tensor) -> int:
        """One token from an (unnormalised, non-negative) distribution [V]."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, device=self.generator.device))

    def sample(self, logits: Tensor) -> int:
        """The next token from logits [V]: argmax when greedy."""
        if self.greedy:
            return int(logits.argmax())
        return self.draw(self.probs(logits))
