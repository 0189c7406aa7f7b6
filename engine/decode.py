"""Target and draft state for one rank, and the in-process decoding loops (``ar`` and ``sync``).

The asynchronous mode drives the very same TargetState / DraftState from two processes: the draft loop
expands d times, receives the verdict, re-roots, expands while the tree is smaller than bs and sends the
next subtree; the target loop receives a subtree, verifies it and sends the verdict.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swiftspec.config import ConfigError, SamplingParams, TreeParams
from swiftspec.engine.drafters import Expansion, Features
from swiftspec.engine.sampling import Sampler
from swiftspec.engine.tree import TokenTree, target_inputs
from swiftspec.engine.tree_cache import ContextFull, TreeKVCache, prefill_forward
from swiftspec.engine.verify import verify_tree

MAX_TREE_NODES = 4096  # the draft tree's node budget (bookkeeping only; the KV budget is the cache's)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Verdict:
    path: list[int]  # accepted draft tokens followed by the bonus token (root not included); len >= 1
    accepted: int  # number of accepted draft tokens (len(path) - 1)
    tree_size: int  # nodes verified
    target_ms: float  # this verification's forward + verify time
    features: torch.Tensor | None = None  # with want_features: final hidden states of the root and accepted nodes


@dataclass
class Step:
    tokens: list[int]  # tokens emitted by this step
    accepted: int  # draft tokens accepted (the bonus token not counted)
    tree_size: int  # nodes verified (0 for the prefill's token, 1 per ar step)
    draft_ms: float  # mean draft forward time this step
    target_ms: float  # target time this step (prefill, decode step or verification)
    finish_reason: str | None = None  # on the last step: "eos" | "length" (max tokens or a full cache)


class TargetState:
    """Target side for one rank: the model, its KV cache, committed token ids (for multi-turn KV reuse)."""

    def __init__(self, model, max_slots: int):
        if model.max_slots != max_slots:
            model.setup_cache(max_slots)
        self.model = model
        self.cache = TreeKVCache(model)
        self._committed: list[int] = []
        self.prefill_tokens = 0
        self.device = model.k_cache.device
        self.want_features = False  # a draft head reads the target's final hidden states
        self.features: Features | None = None  # the last prefill's, with want_features

    @property
    def committed(self) -> list[int]:
        """Token ids whose KV is in the prefix."""
        return self._committed

    @property
    def room(self) -> int:
        """Free KV slots behind the prefix."""
        return self.cache.capacity - self.cache.prefix_len

    def prefill(self, prompt_ids: list[int], sampler: Sampler) -> int:
        """Prefills what is new since the committed prefix; returns the first new token (the first root,
        whose KV is computed as the root of the next verification or decode step)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        # The last prompt token is always recomputed: its logits give the first new token.
        reuse = min(common_prefix(self._committed, prompt_ids), len(prompt_ids) - 1)
        self._committed = self._committed[:reuse]
        self.cache.prefix_len = reuse
        hidden = [] if self.want_features else None
        logits = prefill_forward(self.model, prompt_ids[reuse:], reuse, hidden=hidden)
        self.features = Features(reuse, torch.cat(hidden)) if hidden else None
        self._committed = list(prompt_ids)
        self.cache.prefix_len = len(prompt_ids)
        self.prefill_tokens = len(prompt_ids) - reuse
        return sampler.sample(logits)

    def decode_step(self, token: int, sampler: Sampler) -> int:
        """``ar`` mode: computes the KV of ``token``, commits it and returns the next token."""
        return self.verify([token], [-1], sampler).path[0]

    def verify(self, tokens: list[int], parents: list[int], sampler: Sampler) -> Verdict:
        """One target forward over the tree (tokens[0] = the current root) with the prefix; then the root
        and the accepted nodes move into the prefix contiguously."""
        t0 = time.perf_counter()
        n, p0 = len(tokens), self.cache.prefix_len
        if n > self.room:
            raise ContextFull(f"the KV cache ({self.cache.capacity} slots) is full")
        positions, slots, mask = target_inputs(parents, p0)
        dev = self.device
        out = self.model(torch.tensor(tokens, device=dev), positions.to(dev), slots.to(dev), mask.to(dev),
                         return_hidden=self.want_features)
        logits, hidden = out if self.want_features else (out, None)
        path, bonus = verify_tree(logits, tokens, parents, sampler)
        self.cache.commit([p0] + [p0 + i for i in path], 1 + len(path))
        self._committed += [tokens[0]] + [tokens[i] for i in path]
        feats = None if hidden is None else hidden[[0, *path]]
        return Verdict([tokens[i] for i in path] + [bonus], len(path), n, (time.perf_counter() - t0) * 1e3, feats)


class DraftState:
    """Draft side for one rank: the drafter, its token tree and its tree KV cache.

    Committed tokens whose draft KV is missing (``pending``: a verified token that was never expanded) are
    computed by the next draft forward, in the same batch as the new root.

    ``verify_cost[n - 1]``: the target's time to verify n nodes relative to one, for n = 1..bs (see
    profile_verify_cost).
    When given, subtree() sends only as many of the bs best nodes as maximise the expected tokens per unit
    of target time, taking exp(weight) as a node's chance to be accepted: where a row costs a good part of
    a step (a CPU), a node the draft gives 2 % is not worth verifying. None: always bs (the paper).
    """

    def __init__(self, drafter, tree_params: TreeParams, verify_cost: list[float] | None = None):
        self.drafter = drafter
        self.params = tree_params.validate()
        self.verify_cost = verify_cost
        self.cache: TreeKVCache = drafter.cache
        self.k = self.params.bs - 1  # children per expanded leaf: more could never enter a subtree
        self.committed: list[int] = []  # verified tokens; the first cache.prefix_len have draft KV
        self.pending: list[int] = []
        self.tree: TokenTree | None = None
        self.next_slot = 0

    def prefill(self, prompt_ids: list[int], features: Features | None = None) -> None:
        reuse = common_prefix(self.committed[:self.cache.prefix_len], prompt_ids)
        self.drafter.prefill(prompt_ids, reuse, features)
        self.committed = list(prompt_ids)
        self.cache.prefix_len = len(prompt_ids)
        self.pending = []
        self.tree = None

    def start(self, root: int) -> None:
        """A new tree rooted at root (its draft KV is computed when it is first expanded)."""
        self.tree = TokenTree(root)
        self.next_slot = self.cache.prefix_len + len(self.pending)

    @property
    def size(self) -> int:
        return self.tree.size

    def can_expand(self) -> bool:
        """False when the tree/cache budget is full or nothing is left to expand."""
        return (self.k > 0 and bool(self.tree.leaves) and self.tree.size < MAX_TREE_NODES
                and self.next_slot + self.params.w <= self.cache.capacity)

    def expand(self) -> float:
        """One expansion: the w most probable leaves in ONE batched draft forward. Returns its ms."""
        t0 = time.perf_counter()
        tree = self.tree
        leaves = tree.best_leaves(self.params.w)
        for j, leaf in enumerate(leaves):
            tree.slot[leaf] = self.next_slot + j
        proposals = self.drafter.propose(Expansion(tree, leaves, self.cache.prefix_len, self.pending), self.k)
        tree.expand(leaves, proposals)
        self.next_slot += len(leaves)
        self.cache.prefix_len += len(self.pending)
        self.pending = []
        return (time.perf_counter() - t0) * 1e3

    def reroot(self, path: list[int], features: torch.Tensor | None = None) -> None:
        """Walks the tree along a verdict's path (the old root plus path[:-1] are now verified) and
        re-roots at path[-1], keeping its subtree and moving all surviving KV into place. ``features``:
        the verdict's, for a drafter that wants them."""
        tree = self.tree
        nodes = tree.walk(path)
        verified = nodes[:len(path)]  # the old root and the accepted tokens: all in the tree
        assert len(verified) == len(path), "a verdict accepted a token the draft never proposed"
        with_kv = [tree.slot[i] for i in verified if tree.slot[i] >= 0]
        new_tokens = [tree.token[i] for i in verified]
        if len(nodes) > len(path):  # the bonus token is in the tree: keep its subtree
            new_tree, _ = tree.reroot(nodes[-1])
            survivors = sorted(s for s in new_tree.slot if s >= 0)
        else:
            new_tree, survivors = TokenTree(path[-1]), []
        # A node without draft KV has no children, so only the last verified ones can lack it.
        self.pending += new_tokens[len(with_kv):]
        self.cache.commit(with_kv + survivors, len(with_kv))
        self.drafter.extend(new_tokens, features)
        self.committed += new_tokens
        new_slot = {s: self.cache.prefix_len + j for j, s in enumerate(survivors)}
        new_tree.slot = [new_slot.get(s, -1) for s in new_tree.slot]
        self.tree = new_tree
        self.next_slot = self.cache.prefix_len + len(self.pending) + len(survivors)

    def subtree(self) -> tuple[list[int], list[int]]:
        """The most probable connected subtree of bs nodes containing the root: (tokens, parents), with
        parents[0] == -1 and parents[i] < i."""
        nodes = self.tree.subtree(self.params.bs)
        if self.verify_cost is not None:
            expected = [1.0]  # tokens a verification of the first n nodes yields, on average
            for node in nodes[1:]:
                expected.append(expected[-1] + math.exp(self.tree.weight[node]))
            nodes = nodes[:1 + max(range(len(nodes)), key=lambda i: expected[i] / self.verify_cost[i])]
        index = {node: i for i, node in enumerate(nodes)}
        return [self.tree.token[i] for i in nodes], [index.get(self.tree.parent[i], -1) for i in nodes]


def profile_verify_cost(target: TargetState, bs: int, reps: int = 3) -> list[float]:
    """Target forward time for chains of 1..bs nodes behind the prefix, relative to one node (medians of
    interleaved runs; not forced monotone, as a GEMM kernel may favour one row count). Nothing is
    committed: the slots are tree slots."""
    p0, dev = target.cache.prefix_len, target.device
    if target.room < bs:
        raise ContextFull("no room in the KV cache to profile the verification")
    times: dict[int, list[float]] = {n: [] for n in range(1, bs + 1)}
    for _ in range(reps + 1):  # the first round warms up
        for n in times:
            positions, slots, mask = target_inputs(list(range(-1, n - 1)), p0)
            t0 = time.perf_counter()
            target.model(torch.zeros(n, dtype=torch.long, device=dev), positions.to(dev), slots.to(dev),
                         mask.to(dev))
            times[n].append(time.perf_counter() - t0)
    med = [statistics.median(times[n][1:]) for n in times]
    return [m / med[0] for m in med]


def _finish(tokens: list[int], produced: int, params: SamplingParams, eos: set[int]
            ) -> tuple[list[int], str | None]:
    """Cuts a step's tokens at EOS or max_new_tokens (``produced`` = tokens emitted before them)."""
    for j, t in enumerate(tokens):
        if t in eos and not params.ignore_eos:
            return tokens[:j + 1], "eos"
        if produced + j + 1 >= params.max_new_tokens:
            return tokens[:j + 1], "length"
    return tokens, None


def _first_step(target: TargetState, prompt_ids: list[int], params: SamplingParams, sampler: Sampler
                ) -> tuple[int, Step]:
    t0 = time.perf_counter()
    root = target.prefill(prompt_ids, sampler)
    ms = (time.perf_counter() - t0) * 1e3
    tokens, reason = _finish([root], 0, params, set(target.model.args.eos_token_ids))
    return root, Step(tokens, 0, 0, 0.0, ms, reason)


def generate_ar(target: TargetState, prompt_ids: list[int], params: SamplingParams) -> Iterator[Step]:
    """Target-only decoding, one token per step."""
    sampler = Sampler(params, target.device)
    eos = set(target.model.args.eos_token_ids)
    token, step = _first_step(target, prompt_ids, params, sampler)
    yield step
    produced = 1
    while step.finish_reason is None:
        if target.room < 1:
            step = Step([], 0, 0, 0.0, 0.0, "length")
        else:
            v = target.verify([token], [-1], sampler)
            tokens, reason = _finish(v.path, produced, params, eos)
            step = Step(tokens, 0, 1, 0.0, v.target_ms, reason)
            token = v.path[-1]
            produced += len(tokens)
        yield step


def generate_sync(target: TargetState, draft: DraftState, prompt_ids: list[int], params: SamplingParams,
                  d: int) -> Iterator[Step]:
    """Serial tree speculation: grow the tree (d expansions, then on while it has fewer than bs nodes),
    verify its best bs-node subtree, re-root, repeat."""
    if d < 1:
        raise ConfigError("d (draft expansions per round) must be >= 1")
    sampler = Sampler(params, target.device)
    eos = set(target.model.args.eos_token_ids)
    bs = draft.params.bs
    target.want_features = draft.drafter.wants_features
    root, step = _first_step(target, prompt_ids, params, sampler)
    draft.prefill(prompt_ids, target.features)
    draft.start(root)
    yield step
    produced = 1
    while step.finish_reason is None:
        if target.room < 1:
            yield Step([], 0, 0, 0.0, 0.0, "length")
            return
        times = []
        for _ in range(d):
            if not draft.can_expand():
                break
            times.append(draft.expand())
        while draft.size < bs and draft.can_expand():
            times.append(draft.expand())
        tokens, parents = draft.subtree()
        keep = min(len(tokens), target.room)
        v = target.verify(tokens[:keep], parents[:keep], sampler)
        draft.reroot(v.path, v.features)
        out, reason = _finish(v.path, produced, params, eos)
        produced += len(out)
        step = Step(out, v.accepted, v.tree_size, sum(times) / max(len(times), 1), v.target_ms, reason)
        yield step
