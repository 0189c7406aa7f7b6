"""Lossless verification of a token tree from the target's logits at every node.

Greedy (the paper's): follow, from the root, the child whose token is the target's argmax at its parent;
the argmax where no child matches is the bonus token.

Sampling: our tree's children are chosen deterministically from the draft (its top tokens), so the exact
scheme for deterministic candidates applies (SpecInfer's multi-candidate rejection sampling with a
point-mass draft per candidate): at node u with target distribution p, try the children x_1, x_2, ... in
order; accept x_i with probability p(x_i) / sum(p); on rejection set p(x_i) = 0 and go on; when all are
rejected, draw the bonus from what is left of p. This is exactly a draw from p, decomposed as "x_1? else
x_2? else ...", so every emitted token has the target's distribution whatever the draft proposed; the
draft only decides how often the draw lands on a child (is accepted).

That decomposition is carried out as what it equals: at every node one draw y from p, then the first
child whose token is y is accepted, and y is the bonus where none is. Greedy is the same walk with y the
argmax. So both modes are one computation on the device (``accept``: every node's choice, then the walk
as a mask over the tree, without reading a value), and a round reads back one packed verdict. Drawing at
nodes the walk never reaches changes nothing: each node's draw is independent of the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swiftspec.engine.sampling import Sampler
from swiftspec.engine.tree import tree_mask


def accept(choice: Tensor, tokens: Tensor, parents: Tensor, tree: Tensor) -> Tensor:
    """The walk from the root as a packed verdict, on the device: [accepted count, bonus token, the
    accepted nodes in order (root first), then the others]. ``choice`` [n]: the target's token at each
    node; ``tokens``, ``parents`` [n] (parents[0] == -1); ``tree`` [n, n] bool: each node's ancestors and
    itself. A node is taken when its token is its parent's choice and no earlier sibling's is; it is on
    the path when it and all its ancestors are taken."""
    n = tokens.shape[0]
    index = torch.arange(n, device=tokens.device)
    match = tokens == choice[parents.clamp(min=0)]
    match[0] = True  # the root is always on the path
    earlier = (parents[None, :] == parents[:, None]) & (index[None, :] < index[:, None]) & match[None, :]
    taken = match & ~earlier.any(1)
    on_path = ~(tree & ~taken[None, :]).any(1)
    last = torch.where(on_path, index, 0).amax()  # the deepest node on the path
    order = torch.where(on_path, index, n + index).argsort()
    return torch.cat([(on_path.sum() - 1)[None], choice.gather(0, last[None]), order])


@dataclass
class Walk:
    """A read verdict: the accepted node indices (root excluded) and the bonus token."""

    path: list[int]
    bonus: int

    @classmethod
    def read(cls, packed: list[int]) -> Walk:
        accepted, bonus, order = packed[0], packed[1], packed[2:]
        return cls(order[1:1 + accepted], bonus)


def verify_tree(logits: Tensor, tokens: list[int], parents: list[int], sampler: Sampler) -> Walk:
    """logits [n, V] at the n nodes -> the accepted nodes and the bonus token, moving the tree to the
    logits' device and reading the verdict at once (tests; a round stages the tree with its inputs)."""
    dev = logits.device
    tokens_t, parents_t = (torch.tensor(x, dtype=torch.long, device=dev) for x in (tokens, parents))
    packed = accept(sampler.choose(logits), tokens_t, parents_t, tree_mask(parents).to(dev))
    return Walk.read(packed.tolist())
