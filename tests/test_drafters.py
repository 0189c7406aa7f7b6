"""Drafters: the suffix index and the corpus table against brute-force scans, the corpus file, the model
drafter's proposals against a from-scratch forward, and the vocabulary check."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_tokenizer, single_thread, tiny_model_dir

from swiftspec.engine.config import TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import LoadError
from swiftspec.engine.spec.corpus import CorpusIndex, check_corpus, load_corpus, read_metadata, save_corpus
from swiftspec.engine.spec.decode import DraftState
from swiftspec.engine.spec.drafters import ModelDrafter, SuffixDrafter, VocabMismatch, check_vocab_compatible
from swiftspec.engine.spec.tree_cache import causal_mask

tokens_st = st.lists(st.integers(0, 3), max_size=60)  # a small alphabet makes repeats likely


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def brute_lookup(corpus: list[int], context: list[int], max_order: int) -> tuple[dict[int, int], int]:
    for order in range(min(max_order, len(context)), 0, -1):
        key = context[-order:]
        counts: dict[int, int] = {}
        for j in range(len(corpus) - order):
            if corpus[j:j + order] == key:
                counts[corpus[j + order]] = counts.get(corpus[j + order], 0) + 1
        if counts:
            return counts, order
    return {}, 0


@given(tokens_st, tokens_st, st.lists(st.integers(0, 3), min_size=1, max_size=8), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_suffix_lookup_matches_brute_force(first, more, context, max_order):
    sd = SuffixDrafter(max_order=max_order)
    sd.prefill(first, 0)
    sd.extend(more)  # incremental indexing
    corpus = first + more
    assert sd.context.lookup(context) == brute_lookup(corpus, context, max_order)
    assert sd.context.lookup(corpus + context) == brute_lookup(corpus, corpus + context, max_order)
    assert sd.context.tokens == corpus


@given(tokens_st, tokens_st, st.integers(0, 60))
@settings(max_examples=100, deadline=None)
def test_suffix_prefill_extends_or_reindexes(old, new, keep):
    """A prompt that extends the context is indexed incrementally; any other starts a new context index
    and moves the old one into the session history."""
    sd = SuffixDrafter(max_order=4)
    sd.prefill(old, 0)
    new = old[:min(keep, len(old))] + new
    sd.prefill(new, 0)
    fresh = SuffixDrafter(max_order=4)
    fresh.prefill(new, 0)
    assert sd.context.tokens == new and sd.context.counts == fresh.context.counts
    assert sd.history.tokens == ([] if new[:len(old)] == old else old)


def test_suffix_history_serves_short_matches():
    sd = SuffixDrafter(max_order=4)
    sd.prefill([1, 2, 3, 4, 5], 0)
    sd.prefill([9, 9, 2, 3], 0)  # a new conversation: the first one becomes history
    assert sd.lookup([9, 2, 3]) == ({4: 1}, 2 / (2 + sd.history_unseen))  # only the history knows "2 3"
    sd.extend([7, 9, 9])
    assert sd.lookup([5, 9, 9]) == ({2: 1}, 2 / (2 + sd.confidence))  # the conversation's own match wins
    assert sd.match_weight(2) == 2 / (2 + sd.confidence)


def test_a_match_weighs_more_the_longer_it_is_and_most_at_full_depth():
    """The calibrated weights (SuffixDrafter's docstring): one token 0.2, then n / (n + 1.75), and a match
    as deep as the index a copy at 0.955, above every shorter one's."""
    sd = SuffixDrafter(max_order=16)
    weights = [sd.match_weight(n) for n in range(1, 17)]
    assert weights == sorted(set(weights)) and weights[0] == 0.2 and weights[-1] == 0.955
    assert sd.match_weight(4) == 4 / 5.75 and sd.match_weight(40) == 0.955
    sd.prefill(list(range(20)) * 2, 0)  # the conversation repeats itself: a full-depth copy
    assert sd.lookup(list(range(20))[-16:]) == ({0: 1}, 0.955)


def test_suffix_history_can_be_turned_off():
    """Benchmarks run one prompt once per mode: an earlier mode's answer must not draft a later one's."""
    sd = SuffixDrafter(max_order=4, history_tokens=0)
    sd.prefill([1, 2, 3, 4, 5], 0)
    sd.prefill([9, 9, 2, 3], 0)
    assert sd.history.tokens == [] and sd.lookup([9, 2, 3]) == ({}, 0)


segments_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=25), max_size=12)


def brute_corpus_lookup(segments: list[list[int]], context: list[int], max_order: int):
    """The longest suffix of context that some segment holds followed by a token, and those tokens' counts:
    no context runs across two answers."""
    for order in range(min(max_order, len(context)), 0, -1):
        counts: dict[int, int] = {}
        for seg in segments:
            for j in range(len(seg) - order):
                if seg[j:j + order] == context[-order:]:
                    counts[seg[j + order]] = counts.get(seg[j + order], 0) + 1
        if counts:
            return counts, order
    return {}, 0


def _corpus_tokens(segments: list[list[int]]) -> list[int]:
    return [t for seg in segments for t in seg + [-1]]


@given(segments_st, st.lists(st.integers(0, 4), min_size=1, max_size=8), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_corpus_lookup_matches_brute_force(segments, context, max_order):
    table = CorpusIndex(_corpus_tokens(segments), max_order, top_k=10)
    assert table.lookup(context) == brute_corpus_lookup(segments, context, max_order)


def test_corpus_keeps_the_most_frequent_continuations():
    segments = [[1, 2, 5], [1, 2, 5], [1, 2, 5], [1, 2, 6], [1, 2, 6], [1, 2, 7], [3, 2, 8]]
    table = CorpusIndex(_corpus_tokens(segments), 3, top_k=2)
    assert table.lookup([1, 2]) == ({5: 3, 6: 2}, 2)
    assert table.lookup([9, 2]) == ({5: 3, 6: 2}, 1)  # "2" is followed by 5 x3, 6 x2, 7 and 8 once
    assert table.lookup([2, 7]) == ({}, 0)  # an answer's last token is followed by nothing


def test_suffix_drafter_falls_back_to_the_corpus():
    """Where neither the conversation nor the history has a match of two tokens, a longer corpus match
    proposes, with the corpus's lower confidence."""
    sd = SuffixDrafter(max_order=4, corpus=CorpusIndex(_corpus_tokens([[4, 5, 6, 7], [4, 5, 6, 8]]), 4))
    sd.prefill([1, 5, 2, 6, 6, 3], 0)
    assert sd.lookup([9, 4, 5, 6]) == ({7: 1, 8: 1}, 3 / (3 + sd.corpus_confidence))
    assert sd.lookup([9, 9, 6, 6]) == ({3: 1}, 2 / (2 + sd.confidence))  # the conversation's own "6 6"
    assert sd.lookup([9, 9, 9, 5]) == ({2: 1}, 1 / (1 + sd.one_token_confidence))  # equally long: the conversation's


def test_corpus_file_round_trip_and_refusals(tmp_path):
    tok = make_tokenizer(512)
    path = tmp_path / "corpus.safetensors"
    assert save_corpus(path, [([1, 2, 3, 10, 11, 12], 3), ([4, 5, 3, 10, 11, 13], 3)], tok) == 6
    meta = read_metadata(path)
    assert (meta["vocab_size"], meta["answers"], meta["answer_tokens"]) == ("512", "2", "6")
    table = load_corpus(path, 512)
    assert table.lookup([3, 10, 11]) == ({12: 1, 13: 1}, 3)  # the lead-in keeps the prompt's last tokens
    assert table.lookup([11, 12]) == ({}, 0)  # an answer's end is followed by nothing, not the next answer
    check_corpus(path, make_tokenizer(512))
    with pytest.raises(LoadError, match="another tokenizer"):
        check_corpus(path, make_tokenizer(400))
    with pytest.raises(LoadError, match="outside the target's vocabulary of 12"):
        load_corpus(path, 12)
    with pytest.raises(LoadError, match="not a file"):
        read_metadata(tmp_path / "missing.safetensors")
    other = tiny_model_dir(seed=2) / "model.safetensors"
    with pytest.raises(LoadError, match="not a SwiftSpec draft corpus"):
        read_metadata(other)
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:-20])
    with pytest.raises(LoadError, match="truncated"):
        read_metadata(tmp_path / "cut.safetensors")


def test_suffix_drafter_proposes_frequent_continuations_first():
    state = DraftState(SuffixDrafter(), TreeParams(bs=4, w=2))
    state.prefill([5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 8, 3, 9])
    state.start(5)
    state.expand()  # root 5 after ...9: context [.., 9, 5] -> longest match "5" -> 6 (x3)
    state.expand()  # "5 6" -> 8 (x2), 7 (x1)
    tokens, parents = state.subtree()
    assert tokens == [5, 6, 8, 7] and parents == [-1, 0, 1, 1]
    assert state.tree.value[2] > state.tree.value[3] and max(state.tree.value) <= 0


@pytest.fixture(scope="module")
def tiny_pair():
    path = tiny_model_dir(seed=2)
    return load_model(path, max_slots=256), load_model(path, max_slots=256)


def test_model_drafter_proposals_are_the_draft_top_k(tiny_pair):
    model, ref = tiny_pair
    state = DraftState(ModelDrafter(model), TreeParams(bs=4, w=3))
    prompt = [7, 100, 42, 9, 300]
    state.prefill(prompt)
    state.start(11)
    for _ in range(3):
        state.expand()
    tree = state.tree
    expanded = [i for i in range(tree.size) if tree.slot[i] >= 0]
    assert len(expanded) == 1 + 3 + 3
    for i in expanded:
        ctx = prompt + [tree.token[a] for a in tree.path_to(i)]
        pos = torch.arange(len(ctx))
        logp = ref(torch.tensor(ctx), pos, pos, causal_mask(0, len(ctx)), logits_rows=slice(-1, None))[0]
        top = logp.log_softmax(-1).topk(state.k)
        kids = sorted(tree.children[i].values(), key=lambda c: -tree.value[c])
        assert [tree.token[c] for c in kids] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([tree.value[c] for c in kids]), top.values, atol=1e-4, rtol=0)


def test_vocab_check():
    a, b = make_tokenizer(512), make_tokenizer(512)
    assert check_vocab_compatible(a, b) == 512
    with pytest.raises(VocabMismatch, match="tokenizer differs"):
        check_vocab_compatible(a, make_tokenizer(400))
