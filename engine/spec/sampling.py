"""The target's token distribution and a seeded generator, shared by plain decoding and tree verification so
both sample from the same distribution.

Order, as in transformers: the penalties on the logits (repetition, then presence and frequency), the
grammar's mask (engine/spec/grammar.py), then temperature, top-k, top-p and min-p. A penalty makes a position's distribution depend on the tokens
before it, so in a token tree each node is penalised with the counts of its own path (the context's tail
plus the node's ancestors and itself): ``Sampler.logits`` does it for all nodes at once.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from swiftspec.engine.config import ConfigError, Device, SamplingParams
from swiftspec.engine.model import cpu_backends
from swiftspec.engine.spec.grammar import Constraint, Vocabulary
from swiftspec.engine.spec.tree import ancestors
from swiftspec.kernels import cpu_linear


def window_counts(history: list[int], tokens: list[int], ancestors: np.ndarray, last_n: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens occurring in the last ``last_n`` tokens of any node's context, ``history`` followed by the
    node's path (``ancestors`` [n, n] bool: node i's ancestors and itself), and how often in each node's:
    (ids [u], counts [n, u] int64), on the host. Only these u <= last_n + n columns of the logits change."""
    tail = history[-last_n:]
    ids, column = np.unique(np.asarray(tail + tokens, dtype=np.int64), return_inverse=True)
    length = ancestors.sum(1)  # path length, root included
    # A path longer than the window keeps its last last_n nodes; the history fills what the path leaves.
    in_path = ancestors & (length[None, :] > length[:, None] - last_n)
    first_hist = length[:, None] - last_n + len(tail)  # the history positions >= this are in the window
    in_hist = np.arange(len(tail))[None, :] >= first_hist
    members = np.concatenate([in_hist, in_path], axis=1).astype(np.int64)
    return ids, members @ (column.reshape(-1)[:, None] == np.arange(len(ids))[None, :])


@functools.cache
def _kernels():
    """The CPU kernels, for their sampler (kernels/cpu/sample.c); None where they cannot be built."""
    try:
        return cpu_backends.library()
    except cpu_linear.KernelsUnavailable:
        return None


def _below(u: Tensor, total: Tensor) -> Tensor:
    """u (>= 0), kept below ``total`` (> 0): where rounding took it to the total, the largest value below,
    so that a search of u in a cumulative sum ending at ``total`` lands on a token of mass > 0."""
    return torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))


class Sampler:
    """The target's distribution at tree nodes and the draws from it, on the logits' device: nothing here
    reads a device value, so a round's choices reach the host with its verdict."""

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu", vocab: Vocabulary | None = None):
        self.params = params.validate()
        self.greedy = params.temperature == 0
        self.constraint: Constraint | None = None
        if params.grammar is not None:
            if vocab is None:
                raise ConfigError("this model takes no grammar: its tokenizer is unknown to the sampler")
            self.constraint = Constraint(vocab, params.grammar)
        self.device = torch.device(device)
        self.generator = torch.Generator(device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def penalty_counts(self, history: list[int], tokens: list[int], parents: list[int]
                       ) -> tuple[np.ndarray, np.ndarray] | None:
        """The host half of ``logits`` for a tree (``parents``): window_counts of its nodes (None without
        a penalty), staged with the round's inputs."""
        if not self.params.penalised:
            return None
        return window_counts(history, tokens, ancestors(parents), self.params.repeat_last_n)

    def penalise(self, logits: Tensor, ids: Tensor, counts: Tensor) -> Tensor:
        """[n, V] logits penalised by each node's window counts (``ids`` [u], ``counts`` [n, u] on the
        logits' device) -> fp32."""
        p = self.params
        out = logits.float().clone()
        x, seen = out[:, ids], counts > 0
        if p.repeat_penalty != 1:
            x = torch.where(seen, torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty), x)
        out[:, ids] = x - p.frequency_penalty * counts.float() - p.presence_penalty * seen.float()
        return out

    def logits(self, logits: Tensor, history: list[int], tokens: list[int], ancestors: np.ndarray | Tensor
               ) -> Tensor:
        """[n, V] logits at the n tree nodes -> the same, penalised by each node's own path (fp32); as they
        are without a penalty. ``history``: the tokens before the root (tokens[0]). Moves the counts on
        their own: for a prefill and tests; a round stages them with its inputs."""
        if not self.params.penalised:
            return logits
        found = window_counts(history, tokens, np.asarray(ancestors), self.params.repeat_last_n)
        ids, counts = (torch.from_numpy(a).to(logits.device) for a in found)
        return self.penalise(logits, ids, counts)

    def grammar_masks(self, tokens: list[int], parents: list[int]) -> np.ndarray | None:
        """The host half of ``constrain`` for a tree: each node's bitmask (None without a grammar),
        staged with the round's inputs."""
        return None if self.constraint is None else self.constraint.masks(tokens, parents)

    def advance(self, tokens: list[int]) -> None:
        """The answer's next tokens, chosen: the grammar's state moves past them."""
        if self.constraint is not None:
            self.constraint.advance(tokens)

    @staticmethod
    def constrain(logits: Tensor, masks: Tensor) -> Tensor:
        """[n, V] logits with what each node's grammar refuses at -inf (fp32); ``masks`` [n, words] of
        32 bits each (bit t = token t) on the logits' device, unpacked there."""
        bits = (masks[:, :, None] >> torch.arange(32, device=masks.device)) & 1
        allowed = bits.view(len(masks), -1)[:, :logits.shape[-1]].bool()
        return logits.float().masked_fill(~allowed, float("-inf"))

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

    def draw(self, probs: Tensor) -> Tensor:
        """One token per row from (unnormalised, non-negative) distributions [..., V], as a tensor: an exact
        draw from p. On the CPU, the inverse of the cumulative distribution (float64) at one uniform a row (a
        V-wide random draw cost 0.8 ms a row there, more than the rest of a decode step; choose() draws in the
        kernels where it can); elsewhere the exponential race argmax(p / E), E ~ Exp(1) i.i.d., which reads
        nothing of p back from the device."""
        if Device.of(probs.device) is not Device.CPU:
            race = torch.empty_like(probs).exponential_(generator=self.generator)
            return (probs / race).argmax(-1)
        cdf = probs.double().cumsum(-1)
        u = _below(torch.rand((*cdf.shape[:-1], 1), generator=self.generator, dtype=torch.float64) * cdf[..., -1:],
                   cdf[..., -1:])
        return torch.searchsorted(cdf, u, right=True).squeeze(-1)  # the first whose mass exceeds u: mass > 0

    @functools.cached_property
    def _in_kernels(self) -> bool:
        """Whether the choice runs in the kernels' one pass (kernels/cpu/sample.c): on the CPU where they are
        built, greedy or without top-k and top-p."""
        p = self.params
        return (Device.of(self.device) is Device.CPU and (self.greedy or (p.top_k == 0 and p.top_p >= 1.0))
                and _kernels() is not None)

    @property
    def chooses_tree_in_kernels(self) -> bool:
        """Whether ``choose_tree`` penalises and chooses in the kernels: as ``choose`` does, and without a
        grammar (its mask comes between the penalties and the choice)."""
        return self._in_kernels and self.constraint is None

    def _uniforms(self, n: int) -> Tensor | None:
        return None if self.greedy else torch.rand(n, generator=self.generator, dtype=torch.float64)

    def choose(self, logits: Tensor) -> Tensor:
        """The target's token at each of n nodes from (penalised) logits [n, V]: the argmax when greedy (the
        first of equal maxima), else a draw from its distribution; [n] int64 on the logits' device. On the
        CPU the kernels' pass (in torch's ops, the argmax of a row of 49k logits took 70 µs and the draw
        0.2 ms)."""
        p = self.params
        if self._in_kernels:
            return cpu_linear.choose(_kernels(), logits.float().contiguous(), p.temperature, p.min_p,
                                     self._uniforms(len(logits)))
        if self.greedy:
            return logits.argmax(-1)
        return self.draw(self.probs(logits))

    def choose_tree(self, logits: Tensor, history: list[int], tokens: list[int], parents: list[int]) -> Tensor:
        """``choose`` at each node of a tree from its raw logits [n, V] (fp32 on the CPU, changed in place),
        each node penalised by its own path first (as ``logits`` does), in one call into the kernels: only
        where ``chooses_tree_in_kernels`` (elsewhere TargetState.verify penalises, masks and chooses in
        torch)."""
        p = self.params
        penalties = cpu_linear.Penalties(history, tokens, parents, p.repeat_last_n, p.repeat_penalty,
                                         p.frequency_penalty, p.presence_penalty) if p.penalised else None
        return cpu_linear.choose(_kernels(), logits.float().contiguous(), p.temperature, p.min_p,
                                 self._uniforms(len(logits)), penalties)

    def sample(self, logits: Tensor) -> int:
        """The next token from (penalised) logits [V] (a prefill's first token: read at once)."""
        return int(self.choose(logits[None])[0])
