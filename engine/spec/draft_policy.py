"""When the draft leader expands again: the cost policy of ``loop.lead_draft``, from what the draft
knows of the target's costs (DraftState.verify_cost, step_ms).

A sync round pays for its draft's time: it stops at the first expansion that lowered its expected tokens
per unit of time, the drafting counted (``PayingExpansions``), and a draft whose rounds yield less than
plain steps would, hand-offs included, sits rounds out (``PaybackGate``): the target takes them as plain
steps on its own (a ``Plain``), without a round trip each. An async draft expands while the target
verifies: it stops where its next expansion would outlast the verification of the subtree it sent. On the
cores that verification fills (``DraftState.shares_cores``: a small CPU machine) an expansion during it
delays it, by more than the expansion's own time where it preempts one of the kernels' threads, and is
drafted for a verdict not yet known: there an async draft drafts between verifications, as a sync round
does. Without the costs (no profile), a round expands d times and tops the tree up to bs nodes.
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

    def sits_out(self) -> int:
        """The plain steps the target takes before the next round drafts (0: this one drafts): a draft
        whose rounds do not pay sits rounds out."""
        return self.payback.sit_out() if self.paying else 0

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

    def judge(self, tokens: int, cycle_ms: float, verify_ms: float) -> None:
        """A drafting round's outcome: ``tokens`` in ``cycle_ms`` (from the last verdict to this one, as the
        draft sees it: its drafting, the hand-offs and the verification of ``verify_ms``)."""
        if self.paying and cycle_ms > 0:
            step = self.ds.step_ms
            self.payback.judge(tokens * step / cycle_ms, max(cycle_ms - verify_ms, 0.0) / step)


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
    """``sync`` (and ``async`` on the target's cores) where a round costs a real share of a step besides its
    verification (a head's or a draft model's drafting; the hand-offs between the two processes, ~0.35 ms
    of a 4 ms round on a 2-core CPU): drafting must earn that time back. Every drafting round's realised
    rate (tokens per one-node step over its whole cycle; a plain step makes 1) and the share of a step
    its cycle adds to the verification feed running means; while the mean rate is below 1 and the mean
    share at least ``MIN_DRAFT_SHARE``, the draft sits out 1, 2, 4 ... steps, which the target takes as
    plain steps on its own, and tries again: at most 32, and at most as many as keep the round that tries
    again within ``PROBE_SHARE`` of the steps it waited (10 for a round that adds a tenth of a step: a
    cheap draft sat out long would miss the copies a turn begins). So a draft that does not pay (a sampled
    answer, where little is accepted) costs about what ar does instead of slowing every round.

    Every drafting round is judged, not only the dear ones: the rounds whose drafting took long are mostly
    those where nothing paid (the loop expanded on, looking), so means over those alone read below 1 for a
    draft that pays on average, and would sit out a drafter that copies long runs of an earlier turn
    (``benchmarks/draft_replay.py`` replays it; docs/ARCHITECTURE.md gives figures)."""

    MIN_DRAFT_SHARE = 0.05  # of a step: a round that adds less on average is never sat out
    MAX_WAIT = 32
    PROBE_SHARE = 0.01  # the longest wait makes the round that tries again cost at most this of its steps

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.mean_rate = 1.0
        self.mean_share = 0.0
        self.wait = 0  # steps to sit out before the next drafting round
        self.misses = 0  # judgements in a row that found the mean below 1

    def sit_out(self) -> int:
        """The steps to sit out now (0: draft), all at once."""
        wait, self.wait = self.wait, 0
        return wait

    def judge(self, rate: float, share: float) -> None:
        """A drafting round's realised rate and the share of a step it added to its verification."""
        self.mean_rate += self.weight * (rate - self.mean_rate)
        self.mean_share += self.weight * (share - self.mean_share)
        if self.mean_rate >= 1.0:
            self.misses = 0
        elif self.mean_share >= self.MIN_DRAFT_SHARE:
            longest = max(1, min(self.MAX_WAIT, round(self.mean_share / self.PROBE_SHARE)))
            self.wait = min(2 ** self.misses, longest)
            self.misses += 1
