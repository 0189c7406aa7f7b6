"""The evolving tree KV cache: after random trees and random verification outcomes, every KV the draft or
the target keeps (verified prefix and surviving tree nodes) equals a from-scratch recompute."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import single_thread, tiny_model_dir

from swiftspec.engine.config import TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.spec.decode import DraftState
from swiftspec.engine.spec.drafters import ModelDrafter
from swiftspec.engine.spec.tree import target_inputs
from swiftspec.engine.spec.tree_cache import TreeKVCache, causal_mask, prefill_forward

ATOL = 1e-5
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def models():
    """(model under test, reference model): the same tiny weights, separate caches."""
    path = tiny_model_dir(seed=1)
    return load_model(path, max_slots=256), load_model(path, max_slots=256)


def scratch_kv(ref, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, H, len, D] of tokens computed causally from nothing."""
    pos = torch.arange(len(tokens))
    ref(torch.tensor(tokens), pos, pos, causal_mask(0, len(tokens)))
    return ref.k_cache[:, :, :len(tokens)].clone(), ref.v_cache[:, :, :len(tokens)].clone()


def assert_prefix_exact(model, ref, committed: list[int], n: int):
    k, v = scratch_kv(ref, committed[:n])
    torch.testing.assert_close(model.k_cache[:, :, :n], k, atol=ATOL, rtol=0)
    torch.testing.assert_close(model.v_cache[:, :, :n], v, atol=ATOL, rtol=0)


def check_draft(state: DraftState, ref):
    """Prefix KV exact; tree nodes with KV sit contiguously behind the prefix (and any pending tokens)
    and each one's KV equals that of its full context computed from scratch."""
    model, tree, p = state.drafter.model, state.tree, state.cache.prefix_len
    assert_prefix_exact(model, ref, state.committed, p)
    assert len(state.committed) == p + len(state.pending)
    slots = sorted(s for s in tree.slot if s >= 0)
    first = p + len(state.pending)
    assert slots == list(range(first, first + len(slots))) and state.next_slot == first + len(slots)
    checked = set()
    for i in sorted(range(tree.size), reverse=True):  # deepest first: one recompute covers a whole path
        if tree.slot[i] < 0 or i in checked:
            continue
        path = tree.path_to(i)
        k, v = scratch_kv(ref, state.committed + [tree.token[a] for a in path])
        for depth, a in enumerate(path):
            col = len(state.committed) + depth
            torch.testing.assert_close(model.k_cache[:, :, tree.slot[a]], k[:, :, col], atol=ATOL, rtol=0)
            torch.testing.assert_close(model.v_cache[:, :, tree.slot[a]], v[:, :, col], atol=ATOL, rtol=0)
            checked.add(a)


@given(st.data())
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_draft_cache_survives_random_verdicts(models, data):
    model, ref = models
    bs, w = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 4))
    state = DraftState(ModelDrafter(model), TreeParams(bs=bs, w=w))
    prompt = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12))
    state.prefill(prompt)
    state.start(data.draw(st.integers(3, VOCAB - 1)))
    for _ in range(data.draw(st.integers(1, 4))):
        for _ in range(data.draw(st.integers(0, 3))):  # 0 expansions leaves the root without KV
            if state.can_expand():
                state.expand()
        check_draft(state, ref)
        # A random verification outcome: walk down the subtree, then a bonus token in or out of the tree.
        tokens, parents = state.subtree()
        kids = {i: [j for j in range(len(parents)) if parents[j] == i] for i in range(len(parents))}
        path, u = [], 0
        while kids[u] and data.draw(st.booleans()):
            u = data.draw(st.sampled_from(kids[u]))
            path.append(tokens[u])
        under = list(state.tree.children[state.tree.walk(path)[-1]])
        in_tree = bool(under) and data.draw(st.booleans())
        bonus = data.draw(st.sampled_from(under)) if in_tree else data.draw(st.integers(3, VOCAB - 1))
        state.reroot(path + [bonus])
        check_draft(state, ref)
        assert state.tree.root == bonus


@given(st.data())
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_target_commit_keeps_accepted_path(models, data):
    model, ref = models
    cache = TreeKVCache(model)
    committed = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12))
    prefill_forward(model, committed, 0, logits=False)
    cache.prefix_len = len(committed)
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(1, 10))
        parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
        tokens = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n))
        p0 = cache.prefix_len
        positions, slots, mask = target_inputs(parents, p0)
        model(torch.tensor(tokens), positions, slots, mask)
        leaf = data.draw(st.integers(0, n - 1))  # accept the path from the root down to a random node
        path = [leaf]
        while parents[path[-1]] > 0:
            path.append(parents[path[-1]])
        path = sorted(set(path) - {0})
        cache.commit([p0] + [p0 + i for i in path], 1 + len(path))
        committed += [tokens[0]] + [tokens[i] for i in path]
        assert cache.prefix_len == len(committed)
        assert_prefix_exact(model, ref, committed, len(committed))
