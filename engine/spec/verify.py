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

That decomposition is carried out as what it equals: at every node one draw y from p (``Sampler.choose``,
on the device), then the first child whose token is y is accepted, and y is the bonus where none is.
Greedy is the same walk with y the argmax. So both modes read back one thing, every node's choice, in one
transfer, and walk the tree on the host (``walk``). Drawing at nodes the walk never reaches changes
nothing: each node's draw is independent of the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from swiftspec.engine.spec.sampling import Sampler


@dataclass
class Walk:
    """A verification's outcome: the accepted node indices (root excluded) and the bonus token."""

    path: list[int]
    bonus: int


def walk(choice: list[int], tokens: list[int], parents: list[int]) -> Walk:
    """From the root, the first child whose token is the target's choice at its parent, as long as there
    is one; the choice where there is none is the bonus token."""
    kids: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    path, u = [], 0
    while True:
        nxt = next((c for c in kids[u] if tokens[c] == choice[u]), None)
        if nxt is None:
            return Walk(path, choice[u])
        path.append(nxt)
        u = nxt


def verify_tree(logits: Tensor, tokens: list[int], parents: list[int], sampler: Sampler) -> Walk:
    """logits [n, V] at the n nodes (penalised) -> the accepted nodes and the bonus token."""
    return walk(sampler.choose(logits).tolist(), tokens, parents)
