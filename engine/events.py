"""What an answer reports as it streams: the target leader's ``Step`` (token ids and figures, no text),
the Engine's ``StepEvent`` (the text those tokens complete, with running ``StepStats``), and why an answer
ended (``FinishReason``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

# eos | stop (a stop string, matched by the Engine) | length (max_new_tokens) | context | repetition (the
# loop guard) | cancelled | partial (a saved answer still streaming, or cut off when its program ended) |
# error (broken off by the engine)
FinishReason = Literal["eos", "stop", "length", "context", "repetition", "cancelled", "partial", "error"]
# The reasons after which an answer can go on (/continue): every one but a natural end.
CUT_SHORT: frozenset[FinishReason] = frozenset({"length", "context", "repetition", "cancelled", "partial", "error"})
# The reasons that are a limit reached: max_new_tokens or the context's end.
AT_LIMIT: frozenset[FinishReason] = frozenset({"length", "context"})


@dataclass
class Step:
    """One decoding step as the target leader reports it: token ids and figures, no text."""

    tokens: list[int]  # new tokens, already cut by the finisher
    finish: FinishReason | None = None  # on the last step (never "stop": the Engine matches stop strings)
    accepted: int = 0  # draft tokens accepted (the bonus token not counted)
    tree_size: int = 0  # nodes verified (0 for the prefill's token and in ar)
    draft_ms: float = 0.0  # mean draft expansion time since the previous subtree
    target_ms: float = 0.0  # the prefill, decode step or verification
    prefill_tokens: int = 0  # on the first step: tokens prefilled after KV reuse
    forced: int = 0  # of its tokens, those the grammar forced (the only one it allowed)
    mask_ms: float = 0.0  # the grammar's masks of this step, on the host
    complete: bool | None = None  # on the last step of an answer with a grammar: whether it is complete
    interval_ms: float = 0.0  # the leader's wall time since its previous step of the answer (0 on the first)

    def to_dict(self) -> dict[str, Any]:
        """Its fields as they are (flat, so no deep copy: asdict's would cost far more, once a step)."""
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        return cls(**data)


@dataclass
class StepStats:
    """Live figures after one decoding step (one verification, or one token in ``ar`` mode)."""

    accepted: int = 0  # draft tokens the target accepted this step (the bonus token not counted)
    tree_size: int = 0  # nodes verified this step
    draft_ms: float = 0.0  # mean draft forward time (ms)
    target_ms: float = 0.0  # this step's target forward time (ms)
    token_latency_ms: float = 0.0  # wall time of this step / tokens it produced
    acceptance_rate: float = 0.0  # running: accepted draft tokens / verified draft tokens
    mean_accepted: float = 0.0  # running: tokens produced per verification (accepted + bonus)
    tokens_per_s: float = 0.0  # running, since the first new token
    d: int = 0  # draft expansions per round in use
    prefill_tokens: int = 0  # tokens prefilled for this turn (after KV reuse)
    generated: int = 0  # tokens generated so far this turn
    ms_per_token_p50: float = 0.0  # running: the median of every token's latency this turn
    ms_per_token_p95: float = 0.0  # running: the 95th percentile of the same
    forced_share: float = 0.0  # running: generated tokens the grammar forced / generated tokens
    mask_ms_per_node: float = 0.0  # running: the grammar's mask time per verified node (a step's root included)
    grammar_complete: bool | None = None  # at the end of an answer with a grammar: whether it is complete

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepEvent:
    """One streamed update of an answer: new token ids, the text they complete, and live stats."""

    token_ids: list[int]
    text: str
    stats: StepStats
    finished: bool = False
    finish_reason: FinishReason | None = None
