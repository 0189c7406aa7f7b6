"""What passes between the decoding loop and any drafter: the ``Drafter`` interface, the ``Expansion`` it
is asked to extend, the target's ``Features`` it may read, and ``read_top``, how a model's log-probs become
proposals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from swiftspec.engine.spec.tree import TokenTree
from swiftspec.engine.spec.tree_cache import TreeKVCache


@dataclass
class Features:
    """The target's final hidden states at positions start..start + len(hidden) - 1 of a prompt: the
    positions its prefill recomputed (start = its own reuse point)."""

    start: int
    hidden: Tensor  # [n, target dim]


@dataclass
class Expansion:
    """One draft forward: the pending tokens (verified, draft KV not computed yet) then the leaves."""

    tree: TokenTree
    leaves: list[int]
    n_prefix: int  # committed tokens whose draft KV exists (slots 0..n_prefix)
    pending: list[int]

    def paths(self) -> list[list[int]]:
        """Per leaf, the tokens from the root to the leaf."""
        return [[self.tree.token[a] for a in self.tree.path_to(leaf)] for leaf in self.leaves]


class Drafter(Protocol):
    """A drafter has a ``cache`` (a TreeKVCache; model-free drafters keep bookkeeping only) and says
    whether it reads the target's hidden states (``wants_features``: then the target computes them and
    sends them along; otherwise the ``features`` arguments are None)."""

    cache: TreeKVCache
    wants_features: bool

    def prefill(self, tokens: list[int], reuse: int, features: Features | None) -> None:
        """The committed context is now ``tokens``; its first ``reuse`` tokens were already committed
        before, so their KV is kept (a model-free drafter compares the context itself)."""

    def extend(self, tokens: list[int], features: Tensor | None) -> None:
        """These verified tokens were appended to the committed context; ``features`` [len(tokens), dim]
        are the target's hidden states of exactly these tokens."""

    def propose(self, exp: Expansion, k: int) -> list[list[tuple[int, float]]]:
        """For each leaf of the expansion, up to k (token, log-prob) children, most probable first. A
        model drafter computes the KV of the expansion's rows as a side effect."""


def read_top(logp: Tensor, k: int, ids_map: Tensor | None = None) -> list[list[tuple[int, float]]]:
    """Each row's k most probable (token, log-prob) pairs from log-probs [rows, V], read in one go: ids
    and values packed as float64 (exact for both). ``ids_map``: the token id of each column."""
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    ids = top.indices if ids_map is None else ids_map[top.indices]
    ids, values = torch.stack([ids.double(), top.values.double()]).tolist()
    return [[(int(i), v) for i, v in zip(row_ids, row_values, strict=True)]
            for row_ids, row_values in zip(ids, values, strict=True)]
