"""The messages between ranks, one named dataclass per kind, and their packing into the fixed-size int64
tensors that torch.distributed carries (gloo needs the size known to the receiver).

Two channels, each with its own kinds:

* leader <-> leader (``Link``): the target sends ``Start`` after the prefill, then a ``Verdict`` for
  every ``Subtree`` (or ``Plain``) the draft sends; the verdict with ``last`` ends the answer (also right
  after the prefill, when the answer is over at its first token).
* leader -> its TP followers (``Wire.pack_step`` over the group's broadcast): a ``FollowerStep`` naming
  the model call to mirror.

Every pack and unpack checks its lengths against ``bs``: a message that does not fit is an error on the
side that would have sent it, and a tensor with an unknown kind or a count beyond ``bs`` is an error on
the side that receives it, never a silently wrong step.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor


class WireError(RuntimeError):
    """A message between ranks that breaks the protocol (unknown kind, wrong lengths)."""


class Kind(IntEnum):
    """Leader <-> leader message kinds, as they travel."""

    START = 1
    VERDICT = 2
    SUBTREE = 4
    PLAIN = 8


class Follow(IntEnum):
    """What a TP follower mirrors next (``FollowerStep.op``)."""

    END = 10  # the answer is over
    VERIFY = 11  # target: verify (tokens, parents)
    DECODE = 12  # target: one ``ar`` step from tokens[0]
    START = 13  # draft: a new tree at tokens[0]
    EXPAND = 14  # draft: one expansion
    REROOT = 15  # draft: re-root along the verdict's path (tokens)
    ADVANCE = 16  # draft: the target's plain steps (tokens), past the tree


@dataclass(frozen=True)
class Start:
    """target -> draft, after the prefill: the first root. ``reuse``: where the prefill began (the
    features that follow cover the prompt from there); ``hidden_size``: their width (0: none follow)."""

    root: int
    reuse: int = 0
    hidden_size: int = 0


@dataclass(frozen=True)
class Subtree:
    """draft -> target: the nodes to verify (parents[0] == -1, parents[i] < i), and the draft's work since
    the previous subtree (for the stats: expansions and their total µs)."""

    tokens: list[int]
    parents: list[int]
    expansions: int = 0
    expand_us: int = 0


@dataclass(frozen=True)
class Plain:
    """draft -> target, in place of a subtree while the draft sits rounds out: take ``steps`` plain decode
    steps from the root (``ar``'s), then answer with one Verdict of their tokens, so that the rounds sat
    out cost no hand-offs."""

    steps: int


@dataclass(frozen=True)
class Verdict:
    """target -> draft: the accepted tokens followed by the bonus token (after a Plain: each step's token);
    ``last``: the answer is over; ``verify_us``: the target's time for the verification (after a Plain: a
    step's, on average), which the draft's costs follow."""

    path: list[int]
    last: bool = False
    verify_us: int = 0


LeaderMessage = Start | Subtree | Plain | Verdict


@dataclass(frozen=True)
class FollowerStep:
    op: Follow
    tokens: list[int] = ()
    parents: list[int] = ()


class Wire:
    """Each message as int64[4 + 2 bs]: kind, n, a, b, tokens[bs], parents[bs] (n tokens and n parents
    used); as a tensor for torch.distributed (``pack``), as bytes for a socket (``encode``: struct
    packing, no torch op on the round's critical path)."""

    def __init__(self, bs: int):
        self.bs = bs
        self.size = 4 + 2 * bs
        self.layout = struct.Struct(f"<{self.size}q")

    def buffer(self) -> Tensor:
        return torch.zeros(self.size, dtype=torch.int64)

    def _words(self, kind: int, tokens, parents, a: int = 0, b: int = 0) -> list[int]:
        n = len(tokens)
        if n > self.bs:
            raise WireError(f"{n} tokens do not fit a message of {self.bs} (bs)")
        if len(parents) not in (0, n):
            raise WireError(f"{n} tokens with {len(parents)} parents")
        pad = [0] * (self.bs - n)
        parents = list(parents) or [0] * n
        return [kind, n, a, b, *tokens, *pad, *parents, *pad]

    def _fields(self, v: Sequence[int]) -> tuple[int, list[int], list[int], int, int]:
        kind, n, a, b = v[:4]
        if not 0 <= n <= self.bs:
            raise WireError(f"a message of kind {kind} claims {n} tokens, more than bs = {self.bs}")
        return kind, list(v[4:4 + n]), list(v[4 + self.bs:4 + self.bs + n]), a, b

    def words(self, msg: LeaderMessage) -> list[int]:
        match msg:
            case Start(root, reuse, hidden_size):
                return self._words(Kind.START, [root], (), reuse, hidden_size)
            case Subtree(tokens, parents, expansions, expand_us):
                if len(parents) != len(tokens):
                    raise WireError(f"a subtree of {len(tokens)} tokens with {len(parents)} parents")
                return self._words(Kind.SUBTREE, tokens, parents, expansions, expand_us)
            case Plain(steps):
                if not 1 <= steps <= self.bs:
                    raise WireError(f"{steps} plain steps: a verdict holds 1 to {self.bs} (bs) tokens")
                return self._words(Kind.PLAIN, [], (), steps)
            case Verdict(path, last, verify_us):
                return self._words(Kind.VERDICT, path, (), int(last), verify_us)
        raise WireError(f"not a leader message: {msg!r}")

    def message(self, v: Sequence[int]) -> LeaderMessage:
        kind, tokens, parents, a, b = self._fields(v)
        match kind:
            case Kind.START if len(tokens) == 1:
                return Start(tokens[0], a, b)
            case Kind.SUBTREE if tokens:
                return Subtree(tokens, parents, a, b)
            case Kind.PLAIN if not tokens and 1 <= a <= self.bs:
                return Plain(a)
            case Kind.VERDICT if tokens:
                return Verdict(tokens, bool(a), b)
        raise WireError(f"unknown leader message: kind {kind} with {len(tokens)} tokens")

    def pack(self, msg: LeaderMessage) -> Tensor:
        return torch.tensor(self.words(msg), dtype=torch.int64)

    def unpack(self, t: Tensor) -> LeaderMessage:
        return self.message(t.tolist())

    def encode(self, msg: LeaderMessage) -> bytes:
        return self.layout.pack(*self.words(msg))

    def decode(self, data: bytes | bytearray | memoryview) -> LeaderMessage:
        return self.message(self.layout.unpack(data))

    def pack_step(self, step: FollowerStep) -> Tensor:
        return torch.tensor(self._words(step.op, step.tokens, step.parents), dtype=torch.int64)

    def unpack_step(self, t: Tensor) -> FollowerStep:
        op, tokens, parents, _, _ = self._fields(t.tolist())
        try:
            return FollowerStep(Follow(op), tokens, parents)
        except ValueError:
            raise WireError(f"unknown follower step: op {op}") from None
