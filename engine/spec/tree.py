"""The draft's token tree and the attention inputs built from it.

A node carries its token, its parent, its depth below the root, ``value`` = log p_draft(token | ancestors)
and ``weight`` = the sum of values from the root, so a node's weight never exceeds its parent's. A node's
draft KV exists once it has been *expanded* (fed to the draft, which proposed its children); its cache
slot is then ``slot[i] >= 0``. Leaves are the nodes not expanded yet; expansion takes the w leaves of
highest weight. Node ids are creation order, so a parent's id is always below its children's.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import Tensor

from swiftspec.engine.spec.transfers import Rows


class TokenTree:
    def __init__(self, root: int):
        self.token = [root]
        self.parent = [-1]
        self.depth = [0]
        self.value = [0.0]
        self.weight = [0.0]
        self.slot = [-1]
        self.children: list[dict[int, int]] = [{}]  # token -> node id
        self.leaves = {0}  # nodes not expanded yet

    @property
    def size(self) -> int:
        return len(self.token)

    @property
    def root(self) -> int:
        return self.token[0]

    def add(self, parent: int, token: int, logp: float) -> int:
        i = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.value.append(logp)
        self.weight.append(self.weight[parent] + logp)
        self.slot.append(-1)
        self.children.append({})
        self.children[parent][token] = i
        self.leaves.add(i)
        return i

    def best_leaves(self, w: int) -> list[int]:
        """The w leaves of highest weight (ties: the older node), in that order."""
        return heapq.nlargest(w, self.leaves, key=lambda i: (self.weight[i], -i))

    def expand(self, leaves: list[int], proposals: list[list[tuple[int, float]]]) -> None:
        """Marks leaves expanded (their slots are set by the caller) and adds their proposed children."""
        for leaf, props in zip(leaves, proposals, strict=True):
            self.leaves.discard(leaf)
            for token, logp in props:
                if token not in self.children[leaf] and logp > float("-inf"):
                    self.add(leaf, token, logp)

    def path_to(self, i: int) -> list[int]:
        """Node ids from the root down to i."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parent[i]
        return path[::-1]

    def subtree(self, bs: int) -> list[int]:
        """The most probable connected subtree of at most bs nodes containing the root, best first.

        Best-first search from the root: since weights only decrease downwards, the bs nodes it pops are
        the bs heaviest nodes of the tree, and every parent comes before its children (and siblings in
        decreasing draft probability, which is the order verification tries them in).
        """
        out, heap = [], [(-0.0, 0)]
        while heap and len(out) < bs:
            _, i = heapq.heappop(heap)
            out.append(i)
            for c in self.children[i].values():
                heapq.heappush(heap, (-self.weight[c], c))
        return out

    def walk(self, tokens: list[int]) -> list[int]:
        """Node ids reached from the root along ``tokens`` (root first); stops where a token is absent."""
        nodes = [0]
        for t in tokens:
            nxt = self.children[nodes[-1]].get(t)
            if nxt is None:
                break
            nodes.append(nxt)
        return nodes

    def reroot(self, new_root: int) -> tuple[TokenTree, list[int]]:
        """The subtree under node ``new_root`` as a new tree (weights re-based at 0, ids renumbered in
        creation order), and the old ids of its nodes in new-id order."""
        keep = [new_root]
        for i in keep:  # breadth-first; grows while iterating
            keep.extend(self.children[i].values())
        keep.sort()
        new_id = {old: j for j, old in enumerate(keep)}
        t = TokenTree.__new__(TokenTree)
        base_w, base_d = self.weight[new_root], self.depth[new_root]
        t.token = [self.token[i] for i in keep]
        t.parent = [-1] + [new_id[self.parent[i]] for i in keep[1:]]
        t.depth = [self.depth[i] - base_d for i in keep]
        t.value = [0.0] + [self.value[i] for i in keep[1:]]
        t.weight = [self.weight[i] - base_w for i in keep]
        t.slot = [self.slot[i] for i in keep]
        t.children = [{tok: new_id[c] for tok, c in self.children[i].items()} for i in keep]
        t.leaves = {new_id[i] for i in keep if i in self.leaves}
        return t, keep

    def draft_inputs(self, leaves: list[int], n_prefix: int, pending: list[int]) -> Rows:
        """The rows of one draft forward: the pending tokens (verified, no draft KV yet; they go to slots
        ``n_prefix..``, each seeing the prefix and the pending tokens before it) then the leaves, which
        must already have their slots and see the whole prefix (pending included) and the slots of their
        ancestors and themselves."""
        n_p = len(pending)
        base = n_prefix + n_p
        own = list(range(n_prefix, base))
        paths = [[self.slot[a] for a in self.path_to(leaf)] for leaf in leaves]
        width = max([1] + [len(p) for p in paths])
        table = [[s] * width for s in own] + [p + [p[-1]] * (width - len(p)) for p in paths]  # padded: own slot
        return Rows(tokens=pending + [self.token[i] for i in leaves],
                    positions=own + [base + self.depth[i] for i in leaves],
                    slots=own + [self.slot[i] for i in leaves],
                    visible=[s + 1 for s in own] + [base] * len(leaves), ancestors=table,
                    kv_len=max([base] + [self.slot[i] + 1 for i in leaves]))


def ancestor_lists(parents: list[int]) -> list[list[int]]:
    """Node i's ancestors and itself, root first (parents[i] < i, parents[0] == -1)."""
    out: list[list[int]] = []
    for i, p in enumerate(parents):
        out.append((out[p] if p >= 0 else []) + [i])
    return out


def ancestors(parents: list[int]) -> np.ndarray:
    """[n, n] bool: node i's ancestors and itself."""
    m = np.zeros((len(parents), len(parents)), dtype=bool)
    for i, anc in enumerate(ancestor_lists(parents)):
        m[i, anc] = True
    return m


def tree_mask(parents: list[int]) -> Tensor:
    """ancestors() as a tensor: node i attends to its ancestors and itself."""
    return torch.from_numpy(ancestors(parents))


def target_rows(parents: list[int], tokens: list[int], n_prefix: int) -> Rows:
    """The rows of a target verification: the n tree nodes go to slots ``n_prefix..n_prefix+n`` in order
    and see the whole prefix and the slots of their ancestors and themselves."""
    paths = ancestor_lists(parents)
    width = max(len(p) for p in paths)
    slots = [n_prefix + i for i in range(len(parents))]
    return Rows(tokens=tokens, positions=[n_prefix + len(p) - 1 for p in paths], slots=slots,
                visible=[n_prefix] * len(parents), kv_len=n_prefix + len(parents),
                ancestors=[[n_prefix + a for a in p] + [s] * (width - len(p)) for p, s in zip(paths, slots, strict=True)])


def target_inputs(parents: list[int], n_prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """Positions, slots and mask (host tensors) of a target verification (see target_rows)."""
    rows = target_rows(parents, [0] * len(parents), n_prefix)
    return torch.tensor(rows.positions), torch.tensor(rows.slots), rows.host_mask()
