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
"""

from __future__ import annotations

from torch import Tensor

from swiftspec.engine.sampling import Sampler


def children_lists(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return kids


def verify_greedy(logits: Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """logits [n, V] at the n nodes -> (accepted node indices, root excluded; bonus token)."""
    best = logits.argmax(-1).tolist()
    kids = children_lists(parents)
    path, u = [], 0
    while True:
        nxt = next((c for c in kids[u] if tokens[c] == best[u]), None)
        if nxt is None:
            return path, best[u]
        path.append(nxt)
        u = nxt


def verify_sampling(logits: Tensor, tokens: list[int], parents: list[int], sampler: Sampler
                    ) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling over the siblings at each node of the accepted path (see the
    module docstring); the target's distribution is computed only at the nodes the path visits."""
    kids = children_lists(parents)
    path, u = [], 0
    while True:
        p = sampler.probs(logits[u])
        for c in kids[u]:
            x = tokens[c]
            px = float(p[x])
            if px > 0 and sampler.uniform() * float(p.sum()) < px:
                path.append(c)
                u = c
                break
            p[x] = 0.0
        else:
            return path, sampler.draw(p)


def verify_tree(logits: Tensor, tokens: list[int], parents: list[int], sampler: Sampler
                ) -> tuple[list[int], int]:
    if sampler.greedy:
        return verify_greedy(logits, tokens, parents)
    return verify_sampling(logits, tokens, parents, sampler)
