"""The target's token distribution and a seeded generator, shared by plain decoding and tree verification so
both sample from the same distribution.

Order, as in transformers: the penalties on the logits (repetition, then presence and frequency), then
temperature, top-k, top-p and min-p. A penalty makes a position's distribution depend on the tokens
before it, so in a token tree each node is penalised with the counts of its own path (the context's tail
plus the node's ancestors and itself): ``Sampler.logits`` does it for all nodes at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from swiftspec.config import SamplingParams


def window_counts(history: list[int], tokens: list[int], ancestors: Tensor, last_n: int) -> tuple[Tensor, Tensor]:
    """The tokens occurring in the last ``last_n`` tokens of any node's context, ``history`` followed by the
    node's path (``ancestors`` [n, n] bool: node i's ancestors and itself), and how often in each node's:
    (ids [u], counts [n, u] fp32). Only these u <= last_n + n columns of the logits change."""
    tail = history[-last_n:]
    ids, column = torch.tensor(tail + tokens, dtype=torch.long).unique(return_inverse=True)
    length = ancestors.sum(1)  # path length, root included
    # A path longer than the window keeps its last last_n nodes; the history fills what the path leaves.
    in_path = ancestors & (length[None, :] > length[:, None] - last_n)
    first_hist = length[:, None] - last_n + len(tail)  # the history positions >= this are in the window
    in_hist = torch.arange(len(tail))[None, :] >= first_hist
    members = torch.cat([in_hist, in_path], dim=1).float()
    return ids, torch.zeros(len(tokens), len(ids)).scatter_add_(1, column.expand(len(tokens), -1), members)


class Sampler:
    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        self.params = params.validate()
        self.greedy = params.temperature == 0
        self.generator = torch.Generator(device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def logits(self, logits: Tensor, history: list[int], tokens: list[int], ancestors: Tensor) -> Tensor:
        """[n, V] logits at the n tree nodes -> the same, penalised by each node's own path (fp32); as they
        are without a penalty. ``history``: the tokens before the root (tokens[0])."""
        p = self.params
        if not p.penalised:
            return logits
        ids, counts = window_counts(history, tokens, ancestors.cpu(), p.repeat_last_n)
        ids, counts = ids.to(logits.device), counts.to(logits.device)
        out = logits.float().clone()
        x, seen = out[:, ids], counts > 0
        if p.repeat_penalty != 1:
            x = torch.where(seen, torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty), x)
        out[:, ids] = x - p.frequency_penalty * counts - p.presence_penalty * seen.float()
        return out

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] (penalised) logits -> the fp32 distribution to sample from (temperature, then top-k,
        top-p and min-p)."""
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
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def draw(self, probs: Tensor) -> int:
        """One token from an (unnormalised, non-negative) distribution [V]."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, device=self.generator.device))

    def sample(self, logits: Tensor) -> int:
        """The next token from (penalised) logits [V]: argmax when greedy."""
        if self.greedy:
            return int(logits.argmax())
        return self.draw(self.probs(logits))
