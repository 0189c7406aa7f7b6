"""Statistics for the losslessness tests."""

from __future__ import annotations

import torch


def chi_square_p(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test. Cells of zero expected mass must be empty; cells expecting
    fewer than 5 counts are pooled into one, as the test's approximation requires."""
    n = observed.sum()
    live = expected_p > 0
    assert observed[~live].sum() == 0, "a token of zero target probability was emitted"
    exp, obs = expected_p[live] * n, observed[live]
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum(0, keepdim=True)])
    obs = torch.cat([obs[~small], obs[small].sum(0, keepdim=True)])
    stat = ((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum()
    df = len(exp) - 1 - int(not small.any())
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))
