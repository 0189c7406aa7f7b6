"""Verification: greedy against a brute-force walk; sampling is lossless (chi-square against the target's
distribution on synthetic targets, for chains and for trees with siblings, with and without penalties,
and a planted path bug that the test catches); each node's penalty counts its own path; the Sampler's
distribution equals transformers' logits processors; the CPU's draw is exact and the
greedy choice is the first of equal maxima."""

import functools
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers.stats import chi_square_p
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.spec import sampling
from swiftspec.engine.spec.sampling import Sampler, window_counts
from swiftspec.engine.spec.tree import ancestors
from swiftspec.engine.spec.verify import verify_tree

V = 5  # synthetic vocabulary


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_greedy_follows_the_argmax_path(data):
    n = data.draw(st.integers(1, 12))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    # Siblings may repeat a token (a subtree from the wire could): the first one is followed.
    tokens = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-5, 5), min_size=V, max_size=V),
                                             min_size=n, max_size=n)))
    walk = verify_tree(logits, tokens, parents, Sampler(SamplingParams()))
    u, want = 0, []
    while True:  # brute force: the child carrying the argmax, if any
        best = int(logits[u].argmax())
        match = [c for c in range(n) if parents[c] == u and tokens[c] == best]
        if not match:
            break
        u = match[0]
        want.append(u)
    assert walk.path == want and walk.bonus == int(logits[u].argmax())


def random_tree(data, n_max: int = 12) -> tuple[list[int], list[int]]:
    """(parents, tokens) of a random tree, distinct tokens among siblings as in the draft tree."""
    n = data.draw(st.integers(1, n_max))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [data.draw(st.integers(0, V - 1))] + [0] * (n - 1)
    for i in range(1, n):
        used = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens[i] = data.draw(st.integers(0, V - 1).filter(lambda t, used=used: t not in used))
    return parents, tokens


def path_tokens(parents: list[int], tokens: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_each_node_counts_the_window_of_its_own_path(data):
    parents, tokens = random_tree(data)
    history = data.draw(st.lists(st.integers(0, V - 1), max_size=10))
    last_n = data.draw(st.integers(1, 16))
    ids, found = window_counts(history, tokens, ancestors(parents), last_n)
    counts = np.zeros((len(tokens), V), dtype=np.int64)
    counts[:, ids] = found
    for i in range(len(tokens)):
        window = (history + path_tokens(parents, tokens, i))[-last_n:]
        assert counts[i].tolist() == [window.count(v) for v in range(V)]


@functools.cache
def synthetic_logits(context: tuple[int, ...], sharp: float) -> torch.Tensor:
    """A fixed, context-dependent target distribution over V tokens (some nearly zero)."""
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.randn(V, generator=g) * sharp


TREES = {  # (parents, tokens): the root's token counts only for a penalty, the others are draft candidates
    "chain": ([-1, 0, 1, 2], [0, 1, 3, 2]),
    "siblings": ([-1, 0, 0, 0, 0], [0, 2, 0, 4, 1]),
    "tree": ([-1, 0, 0, 1, 1, 2, 3], [0, 3, 1, 0, 4, 2, 1]),
    "all-children": ([-1, 0, 0, 0, 0, 0], [0, 0, 1, 2, 3, 4]),
}
PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "processed": SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
}


@pytest.mark.parametrize("shape", sorted(TREES))
@pytest.mark.parametrize("setting", sorted(PARAMS))
def test_sampling_is_lossless(shape, setting):
    p, accepted = first_two_tokens(shape, SamplingParams(**{**PARAMS[setting].to_dict(), "seed": 1234}))
    assert p > 1e-3
    assert accepted > 0.2 * 6000  # the draft tokens were really used


PENALTIES = {  # strong, so that a node penalised with the wrong path has a visibly wrong distribution
    "repeat": SamplingParams(temperature=1.0, repeat_penalty=3.0, repeat_last_n=3),
    "presence+frequency": SamplingParams(temperature=0.8, presence_penalty=1.5, frequency_penalty=1.0, min_p=0.02),
}
HISTORY = [3, 3, 4]  # the tokens before the root


def first_two_tokens(shape: str, params: SamplingParams, n_trials: int = 6000) -> tuple[float, int]:
    """Verifies the tree ``shape`` n_trials times over (penalised) synthetic targets; the chi-square
    p-value of the first two emitted tokens against p(x1) p(x2 | x1) under the processed target
    distribution, each position penalised by its true context, and the number of draft tokens accepted.
    When a verification emits one token, the second comes from the next step's draw."""
    parents, tokens = TREES[shape]
    sampler = Sampler(params)
    contexts = [()]
    for i in range(1, len(parents)):
        contexts.append(contexts[parents[i]] + (tokens[i],))
    logits = sampler.logits(torch.stack([synthetic_logits(c, 2.0) for c in contexts]), HISTORY, tokens,
                            ancestors(parents))
    root = tokens[0]

    def true_probs(context: tuple[int, ...]) -> torch.Tensor:  # one position, penalised by brute force
        window = (HISTORY + [root, *context])[-params.repeat_last_n:]
        x = synthetic_logits(context, 2.0).clone()
        seen = torch.tensor([float(v in window) for v in range(V)])
        count = torch.tensor([float(window.count(v)) for v in range(V)])
        rp = params.repeat_penalty
        x = torch.where(seen > 0, torch.where(x > 0, x / rp, x * rp), x)
        return sampler.probs(x - params.frequency_penalty * count - params.presence_penalty * seen)

    counts = torch.zeros(V * V)
    accepted = 0
    for _ in range(n_trials):
        walk = verify_tree(logits, tokens, parents, sampler)
        out = [tokens[i] for i in walk.path] + [walk.bonus]
        accepted += len(walk.path)
        if len(out) == 1:  # the next step: a one-node tree rooted at the bonus token
            nxt = sampler.logits(synthetic_logits((out[0],), 2.0)[None], HISTORY + [root], out[:1],
                                 ancestors([-1]))
            out.append(int(sampler.draw(sampler.probs(nxt[0]))))
        counts[out[0] * V + out[1]] += 1
    p1 = true_probs(())
    expected = torch.stack([p1[a] * true_probs((a,)) for a in range(V)]).flatten()
    return chi_square_p(counts, expected), accepted


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("setting", sorted(PENALTIES))
def test_penalised_sampling_is_lossless(shape, setting):
    p, accepted = first_two_tokens(shape, replace(PENALTIES[setting], seed=99))
    assert p > 1e-3
    assert accepted > 0.2 * 6000


@pytest.mark.parametrize("setting", sorted(PENALTIES))
def test_a_penalty_from_the_prefix_alone_is_caught(setting, monkeypatch):
    """The planted bug: every node penalised with the context before the tree and itself, its ancestors
    ignored. The same test as above must reject it."""
    real = sampling.window_counts
    monkeypatch.setattr(sampling, "window_counts", lambda history, tokens, ancestors, last_n: real(
        history, tokens, np.eye(len(tokens), dtype=bool), last_n))
    try:
        p, _ = first_two_tokens("chain", replace(PENALTIES[setting], seed=99))
    except AssertionError:  # it even emitted a token that min-p rules out
        p = 0.0
    assert p < 1e-6


def test_sampling_chain_depth_marginals():
    """Deeper along a chain: the third emitted token's joint law with the first two, chi-square too."""
    parents, tokens = [-1, 0, 1, 2], [0, 1, 3, 2]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    contexts = [(), (1,), (1, 3), (1, 3, 2)]
    logits = torch.stack([synthetic_logits(c, 1.0) for c in contexts])
    counts = torch.zeros(V ** 3)
    for _ in range(8000):
        walk = verify_tree(logits, tokens, parents, sampler)
        out = [tokens[i] for i in walk.path] + [walk.bonus]
        while len(out) < 3:
            out.append(int(sampler.draw(sampler.probs(synthetic_logits(tuple(out), 1.0)))))
        counts[out[0] * V * V + out[1] * V + out[2]] += 1
    expected = torch.tensor([
        float(sampler.probs(synthetic_logits((), 1.0))[a] * sampler.probs(synthetic_logits((a,), 1.0))[b]
              * sampler.probs(synthetic_logits((a, b), 1.0))[c])
        for a, b, c in itertools.product(range(V), repeat=3)])
    assert chi_square_p(counts, expected) > 1e-3


def test_sampler_matches_transformers_processors():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.6, 20, 1.0), (1.3, 0, 0.85), (0.8, 50, 0.7)]:
        ours = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)).probs(logits)
        x = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            x = TopKLogitsWarper(top_k)(None, x)
        if top_p < 1:
            x = TopPLogitsWarper(top_p)(None, x)
        torch.testing.assert_close(ours, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)


def test_penalties_and_min_p_match_transformers_processors():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 300, generator=g) * 3
    context = torch.randint(0, 300, (1, 40), generator=g)
    for penalty, min_p in [(1.1, 0.0), (1.5, 0.05), (0.8, 0.2)]:
        sampler = Sampler(SamplingParams(temperature=0.7, repeat_penalty=penalty, repeat_last_n=1000, min_p=min_p))
        ids = context[0].tolist()
        ours = sampler.probs(sampler.logits(logits, ids[:-1], ids[-1:], ancestors([-1])))
        x = RepetitionPenaltyLogitsProcessor(penalty)(context, logits.clone())
        x = TemperatureLogitsWarper(0.7)(context, x)
        if min_p:
            x = MinPLogitsWarper(min_p)(context, x)
        torch.testing.assert_close(ours, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)


def test_cpu_draw_is_exact():
    """The CPU's draw after probs() (the inverse of the cumulative distribution) over a vocabulary of 2748:
    chi-square against p, and never a token of mass 0 (p is 0 between the tokens below, the first and the
    last among them)."""
    vocab, support = 2748, [0, 5, 1023, 1024, 1500, 2047, 2048, 2747]
    p = torch.zeros(vocab)
    p[support] = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.1, 0.1])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
    drawn = torch.cat([sampler.draw(p.expand(50, vocab)) for _ in range(200)])
    assert set(drawn.tolist()) <= set(support)
    counts = torch.bincount(drawn, minlength=vocab).double()[support]
    assert chi_square_p(counts, p[support].double()) > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(temperature=1.3)])
def test_the_kernels_draw_the_samplers_distribution(params):
    """Without top-k and top-p the CPU's draw is the kernels' (temperature, min-p and the inverse of the
    cumulative distribution in one pass over a row, kernels/cpu/sample.c): chi-square against probs()
    over a vocabulary of several search blocks, and never a token of mass 0 (a -inf logit, one min-p
    removes)."""
    assert sampling._kernels() is not None
    g = torch.Generator().manual_seed(21)
    logits = torch.full((1000,), -30.0)
    live = torch.tensor([3, 255, 256, 400, 640, 999])
    logits[live] = torch.randn(len(live), generator=g) * 1.5
    logits[[10, 700]] = -torch.inf
    sampler = Sampler(replace(params, seed=5))
    want = sampler.probs(logits).double()
    drawn = torch.cat([sampler.choose(logits.expand(40, -1)) for _ in range(300)])
    assert not set(drawn.tolist()) & {10, 700}
    assert chi_square_p(torch.bincount(drawn, minlength=1000).double(), want / want.sum()) > 1e-3


def test_greedy_choice_is_the_first_of_equal_maxima():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    assert Sampler(SamplingParams()).choose(logits).tolist() == [1, 0]
    wide = torch.full((3, 21), -torch.inf)  # past the kernels' 8 lanes: a maximum in the tail, equal ones apart
    wide[0, 20] = 1.0
    wide[1, [3, 11, 19]] = 5.0
    assert Sampler(SamplingParams()).choose(wide).tolist() == [20, 3, 0]


KERNEL_PENALTIES = [
    SamplingParams(repeat_penalty=1.3, repeat_last_n=5),
    SamplingParams(repeat_penalty=0.7, presence_penalty=0.5, frequency_penalty=0.3, repeat_last_n=64),
    SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.1, repeat_last_n=3),
    SamplingParams(temperature=1.2, presence_penalty=-0.4, frequency_penalty=1.5, repeat_last_n=9),
]


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_kernels_penalise_and_choose_as_the_sampler_does(data):
    """A tree's penalties and choice in the kernels' one pass (choose_tree, the CPU's verification) against
    the Sampler's torch path (each node's window counts, penalise, then choose): the same penalised logits
    bit for bit and the same tokens, greedy and drawn at the same seed."""
    vocab = 301
    parents, _ = random_tree(data)
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=len(parents), max_size=len(parents)))
    history = data.draw(st.lists(st.integers(0, vocab - 1), max_size=80))
    params = replace(data.draw(st.sampled_from(KERNEL_PENALTIES)), seed=data.draw(st.integers(0, 99)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    logits = torch.randn(len(parents), vocab, generator=g) * 4
    logits[:, tokens[:3]] = logits[:, tokens[:3]].abs() * data.draw(st.sampled_from([1.0, -1.0]))
    in_kernels, in_torch = Sampler(params), Sampler(params)
    assert in_kernels.chooses_tree_in_kernels
    want = in_torch.logits(logits, history, tokens, ancestors(parents))
    got = logits.clone()
    chosen = in_kernels.choose_tree(got, history, tokens, parents)
    assert torch.equal(got, want)
    assert chosen.tolist() == in_torch.choose(want).tolist()


def test_seeded_sampler_is_reproducible():
    logits = torch.randn(100)
    a, b = (Sampler(SamplingParams(temperature=1.0, seed=5)) for _ in range(2))
    assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]
    assert Sampler(SamplingParams()).sample(logits) == int(logits.argmax())
