"""The decoding loops of every mode, written once: the target leader's loop (``ar``: one token per step;
``sync`` / ``async``: verify each subtree the draft sends), the draft leader's loop, and the one
finisher that decides where an answer ends.

The loops talk over a Link: ``worker/wire.py``'s between the two worker groups (torch.distributed), or
``InProcessLink`` between two threads of one process (``generate``: tests and benchmarks run the shipped
loops this way). Only token ids and numbers leave the target loop (``emit``); the Engine turns them
into text, stop strings and stats.

One round, leader to leader (``engine/spec/messages.py``): the draft sends a ``Subtree``; the target verifies
it and answers with a ``Verdict`` (accepted tokens + bonus; ``last`` ends the answer; the verification's time,
which the draft's costs follow). In ``async`` the draft expands its tree d times while the target verifies;
in ``sync`` it expands d times, sends, and waits. A draft that sits rounds out sends a ``Plain`` instead: the
target takes that many ``ar`` steps on its own and answers with one verdict of their tokens. A drafter that
reads the target's hidden states gets them right after ``Start`` (the prefill's) and after each verdict.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from swiftspec.engine.config import ConfigError, SamplingParams
from swiftspec.engine.events import Step
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.draft_io import Features
from swiftspec.engine.spec.draft_policy import DraftPolicy
from swiftspec.engine.spec.messages import (
    Follow,
    FollowerStep,
    LeaderMessage,
    Plain,
    Start,
    Subtree,
    Verdict,
    WireError,
)
from swiftspec.engine.spec.sampling import Sampler


class Link(Protocol):
    """One leader's end of the channel to the other group's leader. ``due``: the ``time.perf_counter()``
    at which the message is expected, so that a link whose receiver would otherwise sleep can poll for
    it from shortly before (a sleeping receiver's wake-up sits on the round's critical path)."""

    def send(self, msg: LeaderMessage) -> None: ...

    def recv(self, due: float | None = None) -> LeaderMessage: ...

    def post_recv(self, due: float | None = None) -> Callable[[], LeaderMessage]:
        """Starts receiving the next message; the returned call waits for it."""

    def send_features(self, hidden: Tensor) -> None: ...

    def recv_features(self, rows: int, dim: int) -> Tensor: ...


def grammar_figures(sampler: Sampler, v, tokens: list[int], reason: str | None) -> dict:
    """A step's grammar figures (Step.forced, mask_ms, complete) for the tokens the finisher kept."""
    if sampler.constraint is None:
        return {}
    whole = len(tokens) == len(v.path) or reason == "eos"  # a cut path leaves the matcher beyond the cut
    return {"forced": sum(v.forced[:len(tokens)]), "mask_ms": v.mask_ms,
            "complete": (sampler.constraint.complete and whole) if reason is not None else None}


def nobody(step: FollowerStep) -> None:
    """``tell`` for a group without TP followers."""


def unexpected(msg, wanted: str) -> WireError:
    return WireError(f"expected {wanted}, got {msg!r}")


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams


class LoopGuard:
    """Notices an answer caught in a loop: its last ``window`` tokens are one span repeated ``repeats``
    times or more (the span at most window / repeats tokens long). ``run[L]`` counts how many tokens in a
    row have equalled the one L before, so each new token costs window / repeats comparisons."""

    def __init__(self, window: int, repeats: int):
        self.window = window
        self.periods = range(1, window // repeats + 1)
        self.run = [0] * (window // repeats + 1)
        self.answer: list[int] = []

    def add(self, token: int) -> bool:
        """Takes the answer's next token; True once the answer loops."""
        a = self.answer
        a.append(token)
        looping = False
        for span in self.periods:
            self.run[span] = self.run[span] + 1 if len(a) > span and a[-1 - span] == token else 0
            looping |= self.run[span] >= self.window - span
        return looping


class Finisher:
    """Where an answer ends: after an EOS token (kept), at max_new_tokens ("length") or at the context's
    end ("context"), after the token that shows the answer looping ("repetition", with a loop guard), or
    at the first step after a cancel. The Engine matches stop strings and cancels."""

    def __init__(self, req: Request, max_seq_len: int, eos: set[int], cancelled: Callable[[], bool]):
        p = req.params
        self.eos = set() if p.ignore_eos else eos
        self.budget = min(p.max_new_tokens, max_seq_len - len(req.prompt))
        self.cut_reason = "context" if self.budget < p.max_new_tokens else "length"
        self.cancelled = cancelled
        self.generated = 0
        # a window longer than the answer may be never fills: no guard (a request's loop_guard of 10**12 would
        # otherwise be a list of 10**12 / repeats counters, a MemoryError that ended the workers)
        self.guard = LoopGuard(p.loop_guard, p.loop_repeats) if 0 < p.loop_guard <= self.budget else None

    def cut(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """A step's tokens trimmed after EOS, a loop and at the budget, and the finish reason if any."""
        reason = None
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens, reason = tokens[:i + 1], "eos"
                break
            if self.guard and self.guard.add(t):
                tokens, reason = tokens[:i + 1], "repetition"
                break
        room = self.budget - self.generated
        if len(tokens) >= room:
            tokens = tokens[:room]
            reason = "eos" if tokens and tokens[-1] in self.eos else self.cut_reason
        if reason is None and self.cancelled():
            reason = "cancelled"
        self.generated += len(tokens)
        return tokens, reason


HOLD_BELOW_US = 1000  # lead_target's hold_steps: the drafting a round may take for its step to be held


def lead_target(target: TargetState, link: Link | None, req: Request, fin: Finisher,
                emit: Callable[[Step], None], tell=nobody, features: bool = False,
                hold_steps: bool = False) -> None:
    """The target leader's loop for one answer; ``link`` None in ``ar``. ``features``: the drafter reads
    the target's hidden states. ``hold_steps`` (speculative modes): emit each round's step once the next
    subtree has arrived (the last at once), so that the user's side (the Engine and its UI) handles it
    while the target verifies rather than while the draft answers the verdict; on a machine whose cores
    the workers fill, that work would otherwise compete with the draft's critical path. Only behind a
    draft whose round took under HOLD_BELOW_US of drafting: a slower one (a draft model in sync) would
    show the user each step that much later."""
    sampler = Sampler(req.params, target.device, target.vocab)
    t0 = time.perf_counter()
    root = target.prefill(req.prompt, sampler, hidden=features)
    tokens, reason = fin.cut([root])
    first = Step(tokens, reason, target_ms=(time.perf_counter() - t0) * 1e3, prefill_tokens=target.prefill_tokens)
    if req.params.mode == "ar":
        emit(first)
        while reason is None:
            tell(FollowerStep(Follow.DECODE, [root]))
            v = target.verify([root], [-1], sampler)
            root = v.path[0]
            tokens, reason = fin.cut(v.path)
            emit(Step(tokens, reason, target_ms=v.target_ms, **grammar_figures(sampler, v, tokens, reason)))
    else:
        if reason is not None:
            link.send(Verdict([root], last=True))
        elif features:
            f = target.features
            link.send(Start(root, f.start, f.hidden.shape[-1]))
            link.send_features(f.hidden)
        else:
            link.send(Start(root))
        emit(first)
        held: Step | None = None
        while reason is None:
            try:
                sub = link.recv(due=time.perf_counter())  # the draft answers as soon as it can
            finally:
                if held is not None:
                    emit(held)
                    held = None
            if isinstance(sub, Plain):
                root, reason = plain_steps(target, link, sub.steps, root, sampler, fin, emit, tell, features)
                continue
            if not isinstance(sub, Subtree):
                raise unexpected(sub, "a subtree")
            tell(FollowerStep(Follow.VERIFY, sub.tokens, sub.parents))
            v = target.verify(sub.tokens, sub.parents, sampler, hidden=features)
            root = v.path[-1]
            tokens, reason = fin.cut(v.path)
            link.send(Verdict(v.path, last=reason is not None, verify_us=round(v.target_ms * 1e3)))
            if features:
                link.send_features(v.hidden)
            draft_ms = sub.expand_us / 1e3 / sub.expansions if sub.expansions else 0.0
            step = Step(tokens, reason, v.accepted, v.tree_size, draft_ms, v.target_ms,
                        **grammar_figures(sampler, v, tokens, reason))
            if hold_steps and reason is None and sub.expand_us < HOLD_BELOW_US:
                held = step
            else:
                emit(step)
    tell(FollowerStep(Follow.END))


def plain_steps(target: TargetState, link: Link, steps: int, root: int, sampler: Sampler, fin: Finisher,
                emit: Callable[[Step], None], tell, features: bool) -> tuple[int, str | None]:
    """A Plain's steps: up to ``steps`` ``ar`` steps from ``root``, each emitted, then one Verdict of their
    tokens (and their features). Returns the new root and the finish reason, if the answer ended."""
    path, rows, spent, reason = [], [], 0.0, None
    while len(path) < steps and reason is None:
        tell(FollowerStep(Follow.DECODE, [root]))
        v = target.verify([root], [-1], sampler, hidden=features)
        root = v.path[0]
        path.append(root)
        rows.append(v.hidden)
        spent += v.target_ms
        tokens, reason = fin.cut(v.path)
        emit(Step(tokens, reason, 0, 1, 0.0, v.target_ms, **grammar_figures(sampler, v, tokens, reason)))
    link.send(Verdict(path, last=reason is not None, verify_us=round(spent / len(path) * 1e3)))
    if features:
        link.send_features(torch.cat(rows))
    return root, reason


def lead_draft(ds: DraftState, link: Link, req: Request, d: int, tell=nobody) -> None:
    """The draft leader's loop for one answer. async: send the subtree, expand d times while the target
    verifies it, then take the verdict (d is sized to fill a verification, as in the paper); sync, and
    async on the cores the verification fills: take the verdict, expand d times, send. Either way the tree
    is topped up to bs nodes.

    A draft that knows the target's costs spends its time where it pays: ``DraftPolicy`` says how many
    steps it sits out (a ``Plain``) and when a round's expansions stop (engine/spec/draft_policy.py). A
    drafter that reads the target's features prefills once it has them; others prefill while the target
    does."""
    wants = ds.drafter.wants_features
    grammar, draft_forced = req.params.grammar, req.params.draft_forced
    if not wants:
        ds.prefill(req.prompt, grammar=grammar, draft_forced=draft_forced)
    match link.recv():
        case Verdict(last=True):  # the answer was over at its first token
            tell(FollowerStep(Follow.END))
            return
        case Start(root, reuse, dim) if dim or not wants:
            pass
        case msg:
            raise unexpected(msg, "the start of an answer" + (" with features" if wants else ""))
    if wants:
        ds.prefill(req.prompt, Features(reuse, link.recv_features(len(req.prompt) - reuse, dim)), grammar,
                   draft_forced)
    tell(FollowerStep(Follow.START, [root]))
    ds.start(root)
    bs = ds.params.bs
    policy = DraftPolicy(ds, req.params.mode == "async")
    n_exp, exp_ms = 0, 0.0
    cycle = time.perf_counter()  # when the last verdict arrived: a round's whole time runs from there
    while True:
        plain = policy.sits_out()
        while plain > 0:  # the target takes them on its own, a verdict's worth (bs) at a time
            steps = min(plain, bs)
            plain -= steps
            link.send(Plain(steps))
            msg = link.recv()
            cycle = time.perf_counter()
            if not isinstance(msg, Verdict):
                raise unexpected(msg, "a verdict")
            ds.observe_verification(1, msg.verify_us / 1e3)
            tell(FollowerStep(Follow.ADVANCE, msg.path))
            ds.advance(msg.path, link.recv_features(len(msg.path), dim) if wants else None)
            if msg.last:
                tell(FollowerStep(Follow.END))
                return
        todo = 0 if policy.overlaps else d
        payoff = policy.judge_before_send()
        while (todo > 0 or ds.size < bs) and ds.can_expand():
            tell(FollowerStep(Follow.EXPAND))
            exp_ms += ds.expand()
            n_exp, todo = n_exp + 1, todo - 1
            if payoff is not None and not payoff.paid(exp_ms):
                break
        draft_share = policy.draft_share(exp_ms)
        toks, parents = ds.subtree(draft_share)
        link.send(Subtree(toks, parents, n_exp, round(exp_ms * 1e3)))
        n_exp, exp_ms = 0, 0.0
        window = ds.verify_ms(len(toks))  # the verification's expected time
        verdict = link.post_recv(policy.verdict_due(window))
        if policy.overlaps:  # grow the tree for the next round while the target verifies this one
            last = 0.0
            for _ in range(d):
                if not ds.can_expand() or not policy.fits(window, exp_ms, last):
                    break
                tell(FollowerStep(Follow.EXPAND))
                last = ds.expand()
                exp_ms += last
                n_exp += 1
        msg = verdict()
        arrived = time.perf_counter()
        if not isinstance(msg, Verdict):
            raise unexpected(msg, "a verdict")
        ds.observe_verification(len(toks), msg.verify_us / 1e3)
        policy.judge(len(msg.path), (arrived - cycle) * 1e3, msg.verify_us / 1e3)
        cycle = arrived
        tell(FollowerStep(Follow.REROOT, msg.path))  # after the last too: the draft then holds what the target committed
        ds.reroot(msg.path, link.recv_features(len(msg.path), dim) if wants else None)
        if msg.last:
            tell(FollowerStep(Follow.END))
            return


class InProcessLink:
    """Both ends of a leader-to-leader channel inside one process (queues); features pass as they are.
    A failure on one end reaches the other as the exception itself."""

    def __init__(self):
        self.queues = (queue.Queue(), queue.Queue())  # to the draft, to the target

    def end(self, side: int) -> _End:
        return _End(self.queues[side], self.queues[1 - side])


class _End:
    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox = inbox, outbox

    def send(self, msg) -> None:
        self.outbox.put(msg)

    def recv(self, due: float | None = None):
        msg = self.inbox.get()
        if isinstance(msg, BaseException):
            raise RuntimeError("the other end of the link failed") from msg
        return msg

    def post_recv(self, due: float | None = None) -> Callable[[], LeaderMessage]:
        return self.recv

    send_features = send

    def recv_features(self, rows: int, dim: int) -> Tensor:
        hidden = self.recv()
        if tuple(hidden.shape) != (rows, dim):
            raise WireError(f"features of shape {tuple(hidden.shape)} where ({rows}, {dim}) were due")
        return hidden


def generate(target: TargetState, draft: DraftState | None, prompt: list[int], params: SamplingParams,
             d: int = 1, max_seq_len: int | None = None, eos: set[int] = frozenset(),
             cancelled: Callable[[], bool] = lambda: False) -> list[Step]:
    """One answer through the shipped loops in this process, the draft leader's in a thread (``ar``:
    no draft). max_seq_len defaults to what the target's cache holds besides one tree of bs nodes."""
    if d < 1:
        raise ConfigError("d (draft expansions per round) must be >= 1")
    req = Request(0, prompt, params.validate())
    if max_seq_len is None:
        max_seq_len = target.cache.capacity - (draft.params.bs + 1 if draft else 1)
    steps: list[Step] = []
    fin = Finisher(req, max_seq_len, eos, cancelled)
    if params.mode == "ar":
        lead_target(target, None, req, fin, steps.append)
        return steps
    link = InProcessLink()
    draft_end = link.end(0)

    def run_draft() -> None:
        try:
            lead_draft(draft, draft_end, req, d)
        except BaseException as e:  # noqa: BLE001 - handed to the target's end
            draft_end.send(e)

    thread = threading.Thread(target=run_draft, daemon=True, name="draft-leader")
    thread.start()
    try:
        lead_target(target, link.end(1), req, fin, steps.append, features=draft.drafter.wants_features)
    finally:
        if thread.is_alive():  # the target failed: end the draft's loop too
            link.end(1).send(RuntimeError("the target's loop failed"))
        thread.join()
    return steps
