"""Target and draft state for one rank: the model calls of every mode, without the loops (engine/spec/loop.py
drives them, in one process or across the two worker groups)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from swiftspec.engine.config import ConfigError, Device, Grammar, TreeParams
from swiftspec.engine.spec.draft_io import Drafter, Expansion, Features
from swiftspec.engine.spec.grammar import Constraint, Vocabulary, single_token
from swiftspec.engine.spec.messages import WireError
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.spec.transfers import Staging
from swiftspec.engine.spec.tree import TokenTree, target_inputs, target_rows
from swiftspec.engine.spec.tree_cache import ContextFull, TreeKVCache, prefill_forward
from swiftspec.engine.spec.verify import walk
from swiftspec.engine.spec.verify_costs import VerifyCostFit
from swiftspec.engine.timing import CleanTimer

MAX_TREE_NODES = 4096  # the draft tree's node budget (bookkeeping only; the KV budget is the cache's)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Verification:
    """What one target forward over a tree decided, on the target's side (the draft hears a Verdict)."""

    path: list[int]  # accepted draft tokens followed by the bonus token (root not included); len >= 1
    accepted: int  # number of accepted draft tokens (len(path) - 1)
    tree_size: int  # nodes verified
    target_ms: float  # this verification's forward + verify time
    hidden: Tensor | None = None  # asked for: final hidden states of the old root and the accepted nodes
    forced: list[bool] | None = None  # with a grammar: per token of path, whether the grammar forced it
    mask_ms: float = 0.0  # the grammar's masks, on the host


class TargetState:
    """Target side for one rank: the model, its KV cache, committed token ids (for multi-turn KV reuse);
    ``vocab``, the model's tokenizer for a grammar (None: the model takes none)."""

    def __init__(self, model, max_slots: int, vocab: Vocabulary | None = None):
        if model.max_slots != max_slots:
            model.setup_cache(max_slots)
        self.model = model
        self.vocab = vocab
        self.cache = TreeKVCache(model, deferred=True)
        self._committed: list[int] = []
        self.prefill_tokens = 0
        self.features: Features | None = None  # of the last prefill, when it was asked for them
        self.device = model.k_cache.device
        self.staging = Staging(self.device)

    @property
    def committed(self) -> list[int]:
        """Token ids whose KV is in the prefix."""
        return self._committed

    @property
    def room(self) -> int:
        """Free KV slots behind the prefix."""
        return self.cache.capacity - self.cache.prefix_len

    def prefill(self, prompt_ids: list[int], sampler: Sampler, hidden: bool = False) -> int:
        """Prefills what is new since the committed prefix; returns the first new token (the first root,
        whose KV is computed as the root of the next verification or decode step). ``hidden``: keeps the
        recomputed positions' final hidden states in ``features`` (for a drafter that reads them)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        # The last prompt token is always recomputed: its logits give the first new token.
        reuse = min(common_prefix(self._committed, prompt_ids), len(prompt_ids) - 1)
        self._committed = self._committed[:reuse]
        self.cache.apply()
        self.cache.prefix_len = reuse
        logits, states = prefill_forward(self.model, prompt_ids[reuse:], reuse, hidden=hidden)
        self.features = Features(reuse, states) if hidden else None
        self._committed = list(prompt_ids)
        self.cache.prefix_len = len(prompt_ids)
        self.prefill_tokens = len(prompt_ids) - reuse
        one = np.ones((1, 1), dtype=bool)
        logits = sampler.logits(logits[None], prompt_ids[:-1], prompt_ids[-1:], one)
        masks = sampler.grammar_masks(prompt_ids[-1:], [-1])
        if masks is not None:
            logits = sampler.constrain(logits, torch.from_numpy(masks).to(logits.device))
        first = sampler.sample(logits[0])
        sampler.advance([first])
        return first

    def decode_step(self, token: int, sampler: Sampler) -> int:
        """``ar`` mode: computes the KV of ``token``, commits it and returns the next token."""
        return self.verify([token], [-1], sampler).path[0]

    def verify(self, tokens: list[int], parents: list[int], sampler: Sampler, hidden: bool = False) -> Verification:
        """One target forward over the tree (tokens[0] = the current root) with the prefix; then the root
        and the accepted nodes move into the prefix contiguously. ``hidden``: the verdict carries their
        final hidden states, one row per newly verified token.

        One copy to the device (the rows, the last verdict's KV moves, the penalty counts and the grammar's
        masks, staged together) and one read back (every node's choice: the verdict and the bonus token)."""
        t0 = time.perf_counter()
        n, p0 = len(tokens), self.cache.prefix_len
        if n > self.room:
            raise ContextFull(f"the KV cache ({self.cache.capacity} slots) is full")
        in_kernels = sampler.chooses_tree_in_kernels  # the penalties too: nothing to stage for them
        counts = None if in_kernels else sampler.penalty_counts(self._committed, tokens, parents)
        t_mask = time.perf_counter()
        masks = sampler.grammar_masks(tokens, parents)
        mask_ms = (time.perf_counter() - t_mask) * 1e3
        staged = self.staging.upload(target_rows(parents, tokens, p0), self.cache.pending.src, *(counts or ()),
                                     *(() if masks is None else (masks,)))
        self.cache.apply(staged.extras[0])  # before the forward writes behind the prefix
        out = self.model(staged.tokens, staged.positions, staged.slots, staged.mask, return_hidden=hidden)
        logits, states = out if hidden else (out, None)
        if in_kernels:
            choice = sampler.choose_tree(logits, self._committed, tokens, parents)
        else:
            if counts is not None:
                ids, found = staged.extras[1:3]
                logits = sampler.penalise(logits, ids, found.view(n, -1))
            if masks is not None:
                logits = sampler.constrain(logits, staged.extras[-1].view(n, -1))
            choice = sampler.choose(logits)
        v = walk(choice.tolist(), tokens, parents)
        emitted = [tokens[i] for i in v.path] + [v.bonus]
        sampler.advance(emitted)
        self.cache.commit([p0] + [p0 + i for i in v.path], 1 + len(v.path))
        self._committed += [tokens[0]] + [tokens[i] for i in v.path]
        rows = states.cpu()[[0, *v.path]] if hidden else None  # for the wire: a second read
        forced = None if masks is None else single_token(masks)[[0, *v.path]].tolist()  # the node each token was chosen at
        return Verification(emitted, len(v.path), n, (time.perf_counter() - t0) * 1e3, rows, forced, mask_ms)


class DraftState:
    """Draft side for one rank: the drafter, its token tree and its tree KV cache.

    Committed tokens whose draft KV is missing (``pending``: a verified token that was never expanded) are
    computed by the next draft forward, in the same batch as the new root.

    ``verify_cost[n - 1]``: the target's time to verify n nodes relative to one, for n = 1..bs: the
    profile's (profile_verify_cost) at first, then fitted to the verdicts' own times (observe_verification).
    When given, subtree() sends only as many of the bs best nodes as maximise the expected tokens per unit
    of target time, taking exp(weight) as a node's chance to be accepted: where a row costs a good part of
    a step (a CPU), a node the draft gives 2 % is not worth verifying. None: always bs (the paper).
    ``step_ms``, the target's time for one node, puts the draft's own time on the same scale: a sync
    round pays for its expansions before the verification, so they count in its cost (round_rate).
    ``shares_cores``: the draft runs on cores the target's verification uses (a small CPU machine), so
    an async draft's expansions during a verification would slow it down (it drafts between them), and so
    would a draft's polling for the verdict (it waits asleep).
    ``vocab``: the tokenizer for an answer's grammar (``constraint``, following the verified tokens),
    which prunes the proposals it refuses and proposes what it forces, whatever the drafter.
    """

    def __init__(self, drafter: Drafter, tree_params: TreeParams, verify_cost: list[float] | None = None,
                 step_ms: float | None = None, shares_cores: bool = False, vocab: Vocabulary | None = None):
        self.drafter = drafter
        self.params = tree_params.validate()
        self.verify_cost = verify_cost
        self.step_ms = step_ms
        self.shares_cores = shares_cores
        self.cache: TreeKVCache = drafter.cache
        self.k = self.params.bs - 1  # children per expanded leaf: more could never enter a subtree
        self.committed: list[int] = []  # verified tokens; the first cache.prefix_len have draft KV
        self.pending: list[int] = []
        self.tree: TokenTree | None = None
        self.next_slot = 0
        self.vocab = vocab
        self.constraint: Constraint | None = None
        self.cost_fit: VerifyCostFit | None = None

    def prefill(self, prompt_ids: list[int], features: Features | None = None, grammar: Grammar | None = None,
                draft_forced: bool = True) -> None:
        """A new answer to ``prompt_ids``, under ``grammar`` if any (``draft_forced``: SamplingParams')."""
        if grammar is not None and self.vocab is None:
            raise ConfigError("this draft takes no grammar: its tokenizer is unknown")
        self.constraint = None if grammar is None else Constraint(self.vocab, grammar, draft_forced)
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
        exp = Expansion(tree, leaves, self.cache.prefix_len, self.pending)
        proposals = self.drafter.propose(exp, self.k)
        if self.constraint is not None:
            proposals = self.constraint.proposals(exp.paths(), proposals)
        tree.expand(leaves, proposals)
        self.next_slot += len(leaves)
        self.cache.prefix_len += len(self.pending)
        self.pending = []
        return (time.perf_counter() - t0) * 1e3

    def reroot(self, path: list[int], features: Tensor | None = None) -> None:
        """Walks the tree along a verdict's path (the old root plus path[:-1] are now verified) and
        re-roots at path[-1], keeping its subtree and moving all surviving KV into place. ``features``:
        the target's hidden states of those verified tokens (Verification.hidden), for the drafter."""
        tree = self.tree
        nodes = tree.walk(path)
        verified = nodes[:len(path)]  # the old root and the accepted tokens: all in the tree
        if len(verified) != len(path):  # committing it would put KV that was never computed in the prefix
            raise WireError("a verdict accepted a token the draft never proposed")
        # A node without draft KV has no children, so only the last verified ones can lack it.
        with_kv = [tree.slot[i] for i in verified if tree.slot[i] >= 0]
        if len(nodes) > len(path):  # the bonus token is in the tree: keep its subtree
            new_tree, _ = tree.reroot(nodes[-1])
            survivors = sorted(s for s in new_tree.slot if s >= 0)
        else:
            new_tree, survivors = TokenTree(path[-1]), []
        self._move_on([tree.token[i] for i in verified], with_kv, new_tree, survivors, features)

    def advance(self, path: list[int], features: Tensor | None = None) -> None:
        """The target's plain steps (the verdict of a Plain): the root and path[:-1] are now verified, none
        of them past the root ever drafted, and path[-1] is the new root. Nothing else of the tree
        survives. ``features``: as reroot's."""
        root_kv = [self.tree.slot[0]] if self.tree.slot[0] >= 0 else []
        self._move_on([self.tree.token[0], *path[:-1]], root_kv, TokenTree(path[-1]), [], features)

    def _move_on(self, new_tokens: list[int], with_kv: list[int], new_tree: TokenTree, survivors: list[int],
                 features: Tensor | None) -> None:
        """``new_tokens`` join the prefix (the first len(with_kv) with their draft KV at those slots, the rest
        pending), the KV of the surviving nodes (slots ``survivors``) moves behind it, and ``new_tree`` is
        the tree."""
        self.pending += new_tokens[len(with_kv):]
        self.cache.commit(with_kv + survivors, len(with_kv))
        self.drafter.extend(new_tokens, features)
        if self.constraint is not None:
            self.constraint.advance(new_tokens)
        self.committed += new_tokens
        new_slot = {s: self.cache.prefix_len + j for j, s in enumerate(survivors)}
        new_tree.slot = [new_slot.get(s, -1) for s in new_tree.slot]
        self.tree = new_tree
        self.next_slot = self.cache.prefix_len + len(self.pending) + len(survivors)

    def subtree(self, drafting: float = 0.0) -> tuple[list[int], list[int]]:
        """The most probable connected subtree of bs nodes containing the root: (tokens, parents), with
        parents[0] == -1 and parents[i] < i; with a verify cost, cut where the round yields the most
        tokens per unit of time, ``drafting`` (in one-node steps) being the draft time the round pays."""
        nodes, _ = self._best(drafting)
        index = {node: i for i, node in enumerate(nodes)}
        return [self.tree.token[i] for i in nodes], [index.get(self.tree.parent[i], -1) for i in nodes]

    def observe_verification(self, n: int, ms: float) -> None:
        """The target took ``ms`` to verify n nodes: ``verify_cost`` and ``step_ms`` follow (VerifyCostFit),
        starting from what they are at the first verdict (the profile's). Without costs, or a time, nothing."""
        if self.verify_cost is None or ms <= 0:
            return
        if self.cost_fit is None:
            self.cost_fit = VerifyCostFit(self.verify_cost, self.step_ms or ms / self.verify_cost[n - 1])
        self.cost_fit.observe(n, ms)
        self.verify_cost = self.cost_fit.relative()
        if self.step_ms:
            self.step_ms = self.cost_fit.a

    def verify_ms(self, n: int) -> float | None:
        """The target's expected time to verify n nodes (None without verify_cost and step_ms)."""
        if self.verify_cost is None or not self.step_ms:
            return None
        return self.step_ms * self.verify_cost[n - 1]

    def round_rate(self, drafting_ms: float) -> float:
        """The tokens per one-node step that a round spending ``drafting_ms`` on the draft and then
        verifying subtree() is expected to yield (needs verify_cost and step_ms)."""
        return self._best(drafting_ms / self.step_ms)[1]

    def _best(self, drafting: float) -> tuple[list[int], float]:
        nodes = self.tree.subtree(self.params.bs)
        if self.verify_cost is None:
            return nodes, math.nan
        expected = [1.0]  # tokens a verification of the first n nodes yields, on average
        for node in nodes[1:]:
            expected.append(expected[-1] + math.exp(self.tree.weight[node]))
        rates = [e / (self.verify_cost[i] + drafting) for i, e in enumerate(expected)]
        n = max(range(len(nodes)), key=rates.__getitem__)
        return nodes[:n + 1], rates[n]


def profile_verify_cost(target: TargetState, bs: int, reps: int = 4, timer: CleanTimer | None = None) -> list[float]:
    """Target forward time for chains of 1..bs nodes behind the prefix, relative to one node (the fastest
    of interleaved runs: other work on the machine, the other workers' own start-up on a small one
    included, only ever adds time, and the medians of two read a 3-node verification as cheaper than a
    2-node one there; not forced monotone, as a GEMM kernel may favour one row count). Nothing is
    committed: the slots are tree slots. ``timer``: one whose ``clean`` the caller reads (a forward that
    ran beside other work is timed again)."""
    timer = timer or _timer(target)
    if target.room < bs:
        raise ContextFull("no room in the KV cache to profile the verification")
    times: dict[int, list[float]] = {n: [] for n in range(1, bs + 1)}
    for _ in range(reps + 1):  # the first round warms up
        for n in times:
            times[n].append(_tree_forward_s(target, n, timer))
    best = [min(times[n][1:]) for n in times]
    return [b / best[0] for b in best]


def tree_forward_ms(target: TargetState, n: int, reps: int = 3, timer: CleanTimer | None = None) -> float:
    """Median milliseconds of a forward of a chain of n tree nodes behind the prefix, after a warm-up;
    nothing is committed."""
    if target.room < n:
        raise ContextFull("no room in the KV cache to time a verification")
    timer = timer or _timer(target)
    return statistics.median([_tree_forward_s(target, n, timer) for _ in range(reps + 1)][1:]) * 1e3


def _timer(target: TargetState) -> CleanTimer:
    return CleanTimer(cpu_bound=Device.of(target.device) is Device.CPU)


def _tree_forward_s(target: TargetState, n: int, timer: CleanTimer) -> float:
    dev = target.device
    target.cache.apply()  # the tree slots it writes may hold the KV of the last verdict
    tokens = torch.zeros(n, dtype=torch.long, device=dev)
    positions, slots, mask = (t.to(dev) for t in target_inputs(list(range(-1, n - 1)), target.cache.prefix_len))
    return timer.seconds(lambda: target.model(tokens, positions, slots, mask))
