"""The row-invariance check the exactness tests share: a verified tree against the one-token steps that
would have produced each of its rows."""

from __future__ import annotations

import torch

from swiftspec.engine.spec.tree import target_inputs
from swiftspec.engine.spec.tree_cache import prefill_forward


def tree_and_steps(model, prompt: list[int], parents: list[int], vocab: int,
                   device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one verification of the tree ``parents`` behind ``prompt`` (random tokens below
    ``vocab``), and of the one-token steps along each node's path that would have produced the same rows."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (len(parents),), generator=g)
    prefill_forward(model, prompt, 0, logits=False)
    positions, slots, mask = target_inputs(parents, len(prompt))
    tree = model(tokens.to(device), positions.to(device), slots.to(device), mask.to(device))
    steps = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        for depth, i in enumerate(reversed(path)):  # slots behind the prefix are overwritten step by step
            at = torch.tensor([len(prompt) + depth], device=device)
            mask = torch.ones(1, len(prompt) + depth + 1, dtype=torch.bool, device=device)
            logits = model(tokens[i:i + 1].to(device), at, at, mask)
        steps.append(logits[0])
    return tree, torch.stack(steps)
