"""TokenTree: expansion order, subtree selection, re-rooting, and the draft/target attention inputs
against brute-force constructions."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftspec.engine.config import TreeParams
from swiftspec.engine.spec.decode import DraftState
from swiftspec.engine.spec.drafters import SuffixDrafter
from swiftspec.engine.spec.transfers import Staging
from swiftspec.engine.spec.tree import TokenTree, target_inputs, target_rows, tree_mask


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


@st.composite
def random_trees(draw, max_rounds: int = 5):
    """A tree grown like the draft grows it: rounds of expanding the w best leaves, each given random
    children (token, log-prob); slots are handed out in expansion order."""
    tree = TokenTree(draw(st.integers(0, 30)))
    slot = draw(st.integers(0, 20))  # first tree slot (= prefix length)
    w = draw(st.integers(1, 4))
    for _ in range(draw(st.integers(0, max_rounds))):
        if not tree.leaves:
            break
        leaves = tree.best_leaves(w)
        props = [draw(st.lists(st.tuples(st.integers(0, 30), st.floats(-6.0, 0.0)), max_size=4))
                 for _ in leaves]
        for leaf in leaves:
            tree.slot[leaf] = slot
            slot += 1
        tree.expand(leaves, props)
    return tree


@given(random_trees())
@settings(max_examples=150, deadline=None)
def test_structure_invariants(tree):
    for i in range(1, tree.size):
        p = tree.parent[i]
        assert p < i and tree.depth[i] == tree.depth[p] + 1
        assert math.isclose(tree.weight[i], tree.weight[p] + tree.value[i])
        assert tree.weight[i] <= tree.weight[p]
        assert tree.children[p][tree.token[i]] == i
        assert tree.slot[p] >= 0  # a node with children has been expanded
    for kids in tree.children:  # siblings carry distinct tokens
        assert len(set(kids)) == len(kids)
    assert tree.leaves == {i for i in range(tree.size) if tree.slot[i] < 0}


@given(random_trees(), st.integers(1, 5))
@settings(max_examples=150, deadline=None)
def test_best_leaves_are_heaviest(tree, w):
    chosen = tree.best_leaves(w)
    assert len(chosen) == min(w, len(tree.leaves))
    rest = tree.leaves - set(chosen)
    if chosen and rest:
        assert min(tree.weight[i] for i in chosen) >= max(tree.weight[i] for i in rest)


@given(random_trees(), st.integers(1, 12))
@settings(max_examples=150, deadline=None)
def test_subtree_is_connected_and_most_probable(tree, bs):
    nodes = tree.subtree(bs)
    assert nodes[0] == 0 and len(nodes) == min(bs, tree.size) and len(set(nodes)) == len(nodes)
    pos = {n: j for j, n in enumerate(nodes)}
    for n in nodes[1:]:
        assert pos[tree.parent[n]] < pos[n]
    outside = set(range(tree.size)) - set(nodes)
    if outside:  # no node left out is more probable than one taken
        assert max(tree.weight[i] for i in outside) <= min(tree.weight[i] for i in nodes)
    for a, b in zip(nodes, nodes[1:], strict=False):  # siblings come most probable first
        if tree.parent[a] == tree.parent[b]:
            assert tree.weight[a] >= tree.weight[b]


@given(random_trees(), st.data())
@settings(max_examples=150, deadline=None)
def test_reroot_keeps_exactly_the_subtree(tree, data):
    new_root = data.draw(st.integers(0, tree.size - 1))
    new, old_ids = tree.reroot(new_root)
    expected = sorted(i for i in range(tree.size) if new_root in ancestors_or_self(tree.parent, i))
    assert old_ids == expected and new.size == len(expected)
    for j, old in enumerate(old_ids):
        assert new.token[j] == tree.token[old] and new.slot[j] == tree.slot[old]
        assert new.depth[j] == tree.depth[old] - tree.depth[new_root]
        assert math.isclose(new.weight[j], tree.weight[old] - tree.weight[new_root], abs_tol=1e-9)
        if j:
            assert old_ids[new.parent[j]] == tree.parent[old]
    assert new.leaves == {j for j, old in enumerate(old_ids) if old in tree.leaves}
    assert new.parent[0] == -1 and new.weight[0] == 0.0


def test_walk_stops_at_absent_token():
    tree = TokenTree(5)
    tree.slot[0] = 0
    tree.expand([0], [[(7, -0.1), (8, -2.0)]])
    tree.slot[1] = 1
    tree.expand([1], [[(9, -0.2)]])
    assert tree.walk([7, 9]) == [0, 1, 3]
    assert tree.walk([8, 1]) == [0, 2]
    assert tree.walk([3]) == [0]


@given(random_trees(), st.integers(0, 40), st.lists(st.integers(0, 30), max_size=3), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_draft_inputs_match_brute_force(tree, n_prefix, pending, w):
    if not tree.leaves:
        return
    # Slots as DraftState lays them out: pending at n_prefix.., then the tree region.
    used = [s for s in tree.slot if s >= 0]
    shift = n_prefix + len(pending) - (min(used) if used else 0)
    tree.slot = [s + shift if s >= 0 else -1 for s in tree.slot]
    leaves = tree.best_leaves(w)
    nxt = max([s + 1 for s in tree.slot if s >= 0], default=n_prefix + len(pending))
    for j, leaf in enumerate(leaves):
        tree.slot[leaf] = nxt + j
    rows = tree.draft_inputs(leaves, n_prefix, pending)
    mask = rows.host_mask()
    n_p, base = len(pending), n_prefix + len(pending)
    assert rows.tokens == pending + [tree.token[i] for i in leaves]
    assert rows.positions == list(range(n_prefix, base)) + [base + tree.depth[i] for i in leaves]
    assert rows.slots == list(range(n_prefix, base)) + [tree.slot[i] for i in leaves]
    by_slot = {s: i for i, s in enumerate(tree.slot) if s >= 0}
    for r in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if r < n_p:
                want = j <= n_prefix + r
            elif j < base:
                want = True
            else:
                want = j in by_slot and by_slot[j] in ancestors_or_self(tree.parent, leaves[r - n_p])
            assert bool(mask[r, j]) == want
    assert mask.shape[1] == max([base] + [tree.slot[i] + 1 for i in leaves])


@st.composite
def parent_lists(draw, max_n: int = 16):
    n = draw(st.integers(1, max_n))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@given(parent_lists(), st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_target_inputs_match_brute_force(parents, n_prefix):
    n = len(parents)
    positions, slots, mask = target_inputs(parents, n_prefix)
    assert slots.tolist() == list(range(n_prefix, n_prefix + n))
    assert positions.tolist() == [n_prefix + len(ancestors_or_self(parents, i)) - 1 for i in range(n)]
    want = torch.zeros(n, n_prefix + n, dtype=torch.bool)
    want[:, :n_prefix] = True
    for i in range(n):
        for a in ancestors_or_self(parents, i):
            want[i, n_prefix + a] = True
    assert torch.equal(mask, want)
    assert torch.equal(tree_mask(parents), want[:, n_prefix:])


class OneCopy(Staging):
    """Staging as on a GPU: one copy of a host buffer, the mask made by torch's ops."""

    on_host = False


@given(parent_lists(), st.integers(0, 30), st.lists(st.integers(0, 50), max_size=6))
@settings(max_examples=100, deadline=None)
def test_the_hosts_staging_gives_the_devices_inputs(parents, n_prefix, extra):
    """On the CPU a round's inputs are numpy's (Staging.on_host): the same tensors as the one-copy way."""
    rows = target_rows(parents, list(range(len(parents))), n_prefix)
    host = Staging("cpu").upload(rows, extra, [7, 8])
    device = OneCopy("cpu").upload(rows, extra, [7, 8])
    for a, b in zip((host.tokens, host.positions, host.slots, host.mask, *host.extras),
                    (device.tokens, device.positions, device.slots, device.mask, *device.extras), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_subtree_size_follows_the_verify_cost():
    """With a cost profile, only the nodes worth their verification time are sent (expected tokens per
    unit of target time: 1/1, 1.9/1.1, 2.4/1.2 = 2.0 best, 2.45/1.3)."""
    state = DraftState(SuffixDrafter(), TreeParams(bs=4), verify_cost=[1.0, 1.1, 1.2, 1.3])
    state.start(7)
    state.tree.slot[0] = 0
    state.tree.expand([0], [[(1, math.log(0.9)), (2, math.log(0.5)), (3, math.log(0.05))]])
    assert state.subtree() == ([7, 1, 2], [-1, 0, 0])
    state.verify_cost = None
    assert state.subtree() == ([7, 1, 2, 3], [-1, 0, 0, 0])
