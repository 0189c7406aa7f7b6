"""The target's time to verify n tree nodes as the draft expects it, learnt from the answers' own
verifications.

The profile measures the costs once, at a first start, in a few forwards behind a fixed context; on a
small virtual machine its ratio of an 8-node verification to a one-node step read anywhere from 1.9 to 3.0
between starts, and the answers' own verifications moved as much from minute to minute (a verification
is compute-bound where a step is bound by memory, and the cores a hypervisor lends are not always as
fast). Trees sized by a stale figure verify too many nodes, or too few. So every verdict carries the
target's time for it, and the draft fits t(n) = a + b (n - 1) to those times, the recent ones weighing
most: ``a`` the one-node step, ``b`` what each further row adds, the two held near the profile's only
while the verifications seen cannot tell them (all of one size, or none yet). A line, not the profile's
own shape: the answers verify few node counts, mostly small ones, and the profile's shape is its noise as
much as the kernels'; what sizes a tree is what the next row adds.
"""

from __future__ import annotations

from collections.abc import Sequence

FORGET = 1 / 48  # each verification's weight fades by this much per later one: ~50 verifications, under a second
NOISE = 0.1  # a verification's timing noise, of a step: the unit the profile's weights below are given in
STEP_SD = 0.3  # how far off the profile's step may be, of itself
ROW_SD = 1.0  # how far off the profile's cost of a row may be, of itself ...
ROW_SD_FLOOR = 0.2  # ... and at least this much of a step (a profile that found rows free)
CLIP = 4.0  # a verification timed beyond this factor of the expected (a preempted one) counts at that factor


class VerifyCostFit:
    """A weighted least-squares fit of the target's verification times (ms) to t(n) = a + b (n - 1),
    with the profile's step and mean cost a row as a prior of little weight (in verifications)."""

    def __init__(self, profile: Sequence[float], step_ms: float):
        self.bs = len(profile)
        a0 = step_ms
        b0 = max(a0 * (profile[-1] - 1.0) / max(self.bs - 1, 1), 0.0)
        self.prior_a = (NOISE / STEP_SD) ** 2, a0
        self.prior_b = (NOISE * a0 / (ROW_SD * b0 + ROW_SD_FLOOR * a0)) ** 2, b0
        self.sums = [0.0] * 5  # the faded sums of the verifications' weight, x, x^2, t, x t (x = n - 1)
        self.a, self.b = a0, b0

    def ms(self, n: int) -> float:
        """The expected time (ms) to verify n nodes."""
        return self.a + self.b * (n - 1)

    def relative(self) -> list[float]:
        """The expected cost of verifying 1..bs nodes relative to one."""
        return [self.ms(n) / self.a for n in range(1, self.bs + 1)]

    def observe(self, n: int, ms: float) -> None:
        """One verification of n nodes that took ``ms``."""
        expected = self.ms(n)
        t = min(max(ms, expected / CLIP), expected * CLIP)
        x = n - 1.0
        keep = 1.0 - FORGET
        self.sums = [s * keep + v for s, v in zip(self.sums, (1.0, x, x * x, t, x * t), strict=True)]
        w, sx, sxx, st, sxt = self.sums
        (pa, a0), (pb, b0) = self.prior_a, self.prior_b
        # minimise sum w (t - a - b x)^2 + pa (a - a0)^2 + pb (b - b0)^2: the 2 x 2 normal equations
        m11, m12, m22 = w + pa, sx, sxx + pb
        r1, r2 = st + pa * a0, sxt + pb * b0
        det = m11 * m22 - m12 * m12
        a, b = (m22 * r1 - m12 * r2) / det, (m11 * r2 - m12 * r1) / det
        self.a, self.b = max(a, 0.05 * a0), max(b, 0.0)  # a few odd times never make a cost of nothing
