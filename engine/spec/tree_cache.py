"""The evolving tree KV cache, over a model's static cache tensors.

Invariant, for the draft and the target alike: slots ``[0, prefix_len)`` hold the KV of verified tokens in
order (slot = position), and the KV of the still-useful tree nodes sits right behind them. A commit moves
the KV of the newly verified tokens and of the surviving tree nodes, in that order, to ``prefix_len..``
with one gather and one index_copy per cache tensor across all layers; nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

PREFILL_CHUNK = 256


class ContextFull(RuntimeError):
    """The conversation no longer fits the KV cache."""


@dataclass
class Move:
    """KV to move: the slots ``src`` go to ``first, first + 1, ...`` (empty: nothing to move)."""

    src: list[int] = field(default_factory=list)
    first: int = 0


class TreeKVCache:
    """``deferred``: a commit only records its move (``pending``), which the next forward's caller applies
    with the slots it staged with its own inputs (``apply``), so that a round copies to the device once;
    whoever else reads the cache calls ``apply()`` first."""

    def __init__(self, model=None, move_slots: Callable[[Tensor, Tensor], None] | None = None,
                 deferred: bool = False):
        """``model`` None: slot bookkeeping only (model-free drafters). ``move_slots(src, dst)``: moves
        the caller's own per-slot state along with the KV (a draft head's predicted features)."""
        self.model = model
        self.move_slots = move_slots
        self.deferred = deferred
        self.prefix_len = 0
        self.pending = Move()

    @property
    def capacity(self) -> int:
        return self.model.max_slots if self.model is not None else 1 << 30

    def commit(self, src: list[int], n_verified: int) -> None:
        """Moves the KV at slots ``src`` (ascending: verified tokens, then surviving nodes) to
        ``prefix_len, prefix_len + 1, ...``; the first ``n_verified`` join the prefix."""
        first = self.prefix_len
        skip = 0  # entries already in place (the common case: the accepted path is the leftmost one)
        while skip < len(src) and src[skip] == first + skip:
            skip += 1
        if skip < len(src) and self.model is not None:
            self.pending = Move(src[skip:], first + skip)
            if not self.deferred:
                self.apply()
        self.prefix_len += n_verified

    def apply(self, src: Tensor | None = None) -> None:
        """Carries out the pending move; ``src``: its slots, already on the device."""
        move, self.pending = self.pending, Move()
        if not move.src:
            return
        if src is None:
            src = torch.tensor(move.src, dtype=torch.long, device=self.model.k_cache.device)
        dst = torch.arange(move.first, move.first + len(move.src), device=src.device)
        for cache in (self.model.k_cache, self.model.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))
        if self.move_slots is not None:
            self.move_slots(src, dst)


def causal_mask(start: int, n: int) -> Tensor:
    """[n, start + n]: token start + i sees slots 0..start + i."""
    return torch.ones(n, start + n, dtype=torch.bool).tril(start)


def prefill_forward(model, tokens: list[int], start: int, logits: bool = True, hidden: bool = False
                    ) -> tuple[Tensor | None, Tensor | None]:
    """Computes the KV of ``tokens`` at positions and slots ``start..`` in chunks (bounded activation
    memory); returns the last token's logits [vocab] and the final hidden states of all the tokens
    [len(tokens), dim], each when asked (else None)."""
    if start + len(tokens) > model.max_slots:
        raise ContextFull(f"the prompt needs {start + len(tokens)} KV slots but the cache has "
                          f"{model.max_slots}; raise max-seq-len or shorten the conversation")
    device = model.k_cache.device
    out, states = None, []
    for s in range(0, len(tokens), PREFILL_CHUNK):
        chunk = tokens[s:s + PREFILL_CHUNK]
        last = s + PREFILL_CHUNK >= len(tokens)
        pos = torch.arange(start + s, start + s + len(chunk), device=device)
        rows = slice(-1, None) if logits and last else slice(0, 0)
        out = model(torch.tensor(chunk, device=device), pos, pos,
                    causal_mask(start + s, len(chunk)).to(device), logits_rows=rows, return_hidden=hidden)
        if hidden:
            out, h = out
            states.append(h)
    return (out[-1] if logits and out is not None else None), (torch.cat(states) if hidden else None)
