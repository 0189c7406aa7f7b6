"""Inputs shared by the kernel tests (tests/test_kernels.py, tests/kernels_interpret_cases.py)."""

import torch


def rope_tables(pos: torch.Tensor, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-layout cos/sin [T, dim]: the per-pair angles repeated over both halves."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def tree_case(g: torch.Generator, T: int, S: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A [T, S] mask with >= 1 True per row, and the RoPE positions of the T query tokens.

    "tree": prefix of S - T fully visible, then a random draft tree (each token sees its ancestors and
    itself) in the last T slots. "sparse": ~2% random keys per row, so most key blocks are fully masked
    for most rows and whole splits contribute nothing.
    """
    P = S - T
    if kind == "tree":
        mask = torch.zeros(T, S, dtype=torch.bool)
        mask[:, :P] = True
        depth = torch.zeros(T, dtype=torch.long)
        for i in range(T):
            parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            if parent >= 0:
                mask[i, P : P + i] = mask[parent, P : P + i]
                depth[i] = depth[parent] + 1
            mask[i, P + i] = True
        return mask, P + depth
    mask = torch.rand(T, S, generator=g) < 0.02
    mask[torch.arange(T), torch.randint(0, S, (T,), generator=g)] = True
    return mask, torch.randint(0, S, (T,), generator=g)
