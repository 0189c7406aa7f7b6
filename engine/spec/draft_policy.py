"""When the draft leader expands again: the cost policy of ``loop.lead_draft``, from what the draft
knows of the target's costs (DraftState.verify_cost, step_ms).

A sync round pays for its draft's time: it stops at the first expansion that lowered its expected tokens
per unit of time, the drafting counted (``PayingExpansions``), and a draft that does not earn its time
back sits rounds out (``PaybackGate``). An async draft expands while the target verifies: it stops where
its next expansion would outlast the verification of the subtree it sent. On the cores that verification
fills (``DraftState.shares_cores``: a small CPU machine) an expansion during it delays it, by more than the
expansion's own time where it preempts one of the kernels' threads, and is drafted for a verdict not yet
known: there an async draft drafts between verifications, as a sync round does. Without the costs (no
profile), a round expands d times and tops the tree up to bs nodes.
"""

from __future__ import annotations

import time

from swiftspec.engine.spec.decode import DraftState


class DraftPolicy:
    """The draft leader's answers, for one answer: whether it drafts while the target verifies, whether a
    round drafts, what judges its expansions, and whether one more fits in the verification it overlaps."""

    def __init__(self, ds: DraftState, asynchronous: bool):
        self.ds = ds
        costed = ds.verify_cost is not None and bool(ds.step_ms)
        self.overlaps = asynchronous and not (costed and ds.shares_cores)  # expands while the target verifies
        self.paying = costed and not self.overlaps  # pays for every expansion, as sync does
        self.payback = PaybackGate()

    def drafts(self) -> bool:
        """Whether this round drafts before it sends its subtree (a sync draft that does not pay sits
        rounds out)."""
        return not self.paying or self.payback.open()

    def judge_before_send(self) -> PayingExpansions | None:
        """What judges the expansions before the send (None: expand on)."""
        return PayingExpansions(self.ds) if self.paying else None

    def verdict_due(self, window_ms: float | None) -> float | None:
        """When the verdict of a verification expected to take ``window_ms`` is due (``time.perf_counter``),
        for the link to poll for it from shortly before: a draft asleep through the verification would
        wake up late. None, to wait for it asleep, where the draft shares the target's cores: there the
        polling took a core from the verification it waited for (fresh bench on a 2-core Zen 4, 8 runs
        each way in turn: sync gained 4.4 points over ar asleep, async 3.3)."""
        if window_ms is None or self.ds.shares_cores:
            return None
        return time.perf_counter() + window_ms / 1e3

    @staticmethod
    def fits(window_ms: float | None, spent_ms: float, last_ms: float) -> bool:
        """Whether one more expansion (as long as the last) ends within the verification's window: past
        it, the target would wait for the draft."""
        return window_ms is None or spent_ms + last_ms <= window_ms

    def draft_share(self, drafting_ms: float) -> float:
        """A round's drafting in one-node steps (0 where the draft's time is not paid for)."""
        return drafting_ms / self.ds.step_ms if self.paying else 0.0

    def judge(self, tokens: int, verified: int, draft_share: float) -> None:
        """A round's outcome: ``tokens`` from a verification of ``verified`` nodes."""
        if draft_share > 0:  # a sync round that drafted
            self.payback.judge(tokens / (self.ds.verify_cost[verified - 1] + draft_share), draft_share)


class PayingExpansions:
    """A round that pays for its draft's time stops at the first expansion that did not raise its expected
    tokens per one-node step (``DraftState.round_rate``, the drafting so far counted)."""

    def __init__(self, ds: DraftState):
        self.ds = ds
        self.rate = ds.round_rate(0.0)

    def paid(self, drafting_ms: float) -> bool:
        """After an expansion, ``drafting_ms`` into the round: whether it raised the rate (go on)."""
        rate = self.ds.round_rate(drafting_ms)
        if rate <= self.rate:
            return False
        self.rate = rate
        return True


class PaybackGate:
    """``sync`` with a draft whose own time is a real share of a step (a head, a draft model; rarely the
    suffix drafter, whose expansions are table lookups): drafting must earn that time back. Every drafting
    round's realised rate (tokens per one-node step, its drafting and verification counted; a plain step
    makes 1) and its drafting's share of a step feed running means; while the mean rate is below 1 and the
    mean share at least ``MIN_DRAFT_SHARE``, the draft sits out 1, 2, 4 ... 32 rounds, which are then plain
    steps, and tries again. So a draft that does not pay costs about what ar does instead of slowing every
    round.

    Every drafting round is judged, not only the dear ones: the rounds whose drafting took long are mostly
    those where nothing paid (the loop expanded on, looking), so means over those alone read below 1 for a
    draft that pays on average, and would sit out a drafter that copies long runs of an earlier turn
    (``benchmarks/draft_replay.py`` replays it; docs/ARCHITECTURE.md gives figures)."""

    MIN_DRAFT_SHARE = 0.05  # of a step: a draft that costs less on average is never sat out
    MAX_WAIT = 32

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.mean_rate = 1.0
        self.mean_share = 0.0
        self.wait = 0  # rounds left without drafting
        self.misses = 0  # judgements in a row that found the mean below 1

    def open(self) -> bool:
        """Whether this round drafts (a closed round counts down the wait)."""
        if self.wait:
            self.wait -= 1
            return False
        return True

    def judge(self, rate: float, draft_share: float) -> None:
        """A drafting round's realised rate and its drafting's share of a step."""
        self.mean_rate += self.weight * (rate - self.mean_rate)
        self.mean_share += self.weight * (draft_share - self.mean_share)
        if self.mean_rate >= 1.0:
            self.misses = 0
        elif self.mean_share >= self.MIN_DRAFT_SHARE:
            self.wait = min(2 ** self.misses, self.MAX_WAIT)
            self.misses += 1
