"""``sync`` (serial tree speculation) against ``ar``: identical greedy output on tiny random models with a
different draft model, with the target as its own draft and with the suffix drafter, and on the embedded
model with the suffix drafter; stopping rules, multi-turn KV reuse and validation."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import single_thread, tiny_model_dir

from swiftspec.config import ConfigError, SamplingParams, TreeParams
from swiftspec.engine.decode import DraftState, TargetState, generate_ar, generate_sync, profile_verify_cost
from swiftspec.engine.drafters import ModelDrafter, SuffixDrafter
from swiftspec.engine.loader import load_model
from swiftspec.engine.sampling import Sampler
from swiftspec.engine.tree_cache import ContextFull, causal_mask

PROMPTS = [[5, 17, 300, 42, 8, 99], [1, 200, 201, 202, 203, 200, 201], [77] * 3 + [400, 12, 77, 77]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def run(gen) -> tuple[list[int], list]:
    steps = list(gen)
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def tiny():
    """Target (llama) and three drafts: a different model (qwen2, other weights), the target's own weights
    and the suffix drafter."""
    target_dir = tiny_model_dir(seed=1)
    return {
        "target": load_model(target_dir, max_slots=512),
        "other": lambda: ModelDrafter(load_model(tiny_model_dir(arch="qwen2", layers=1, hidden=32, seed=3),
                                                 max_slots=1024)),
        "self": lambda: ModelDrafter(load_model(target_dir, max_slots=1024)),
        "suffix": SuffixDrafter,
    }


@pytest.mark.parametrize("draft", ["other", "self", "suffix"])
@pytest.mark.parametrize("bs,w,d", [(8, 8, 2), (4, 2, 1), (16, 4, 3)])
def test_sync_greedy_equals_ar_tiny(tiny, draft, bs, w, d):
    target = TargetState(tiny["target"], 512)
    state = DraftState(tiny[draft](), TreeParams(bs=bs, w=w))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for prompt in PROMPTS:
        ar, _ = run(generate_ar(target, prompt, params))
        sync, steps = run(generate_sync(target, state, prompt, params, d))
        assert sync == ar and len(ar) == 48
        assert all(s.tree_size <= bs for s in steps)


def test_cost_aware_subtrees_keep_the_output(tiny):
    target = TargetState(tiny["target"], 512)
    target.prefill(PROMPTS[0], Sampler(SamplingParams()))
    cost = profile_verify_cost(target, 8)
    assert len(cost) == 8 and cost[0] == 1.0 and min(cost) > 0
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        ar, _ = run(generate_ar(target, prompt, params))
        draft = DraftState(tiny["self"](), TreeParams(), verify_cost=[1.0 + 0.3 * i for i in range(8)])
        sync, steps = run(generate_sync(target, draft, prompt, params, 2))
        assert sync == ar and max(s.tree_size for s in steps) < 8


def test_self_draft_accepts_what_a_perfect_draft_could(tiny):
    """With the target as its own draft, the draft's top child at every node is the target's greedy
    token; a perfect draft would get the whole top-1 chain of each verified subtree accepted."""
    target = TargetState(tiny["target"], 512)
    draft = DraftState(tiny["self"](), TreeParams(bs=8, w=4))
    accepted = perfect = rounds = 0
    for prompt in PROMPTS:
        sampler = Sampler(SamplingParams())
        root = target.prefill(prompt, sampler)
        draft.prefill(prompt)
        draft.start(root)
        for _ in range(12):
            for _ in range(2):
                draft.expand()
            tokens, parents = draft.subtree()
            chain, u = 0, 0
            while u in parents:  # the first child in subtree order is the most probable one
                u, chain = parents.index(u), chain + 1
            v = target.verify(tokens, parents, sampler)
            draft.reroot(v.path)
            accepted, perfect, rounds = accepted + v.accepted, perfect + chain, rounds + 1
    assert accepted >= 0.95 * perfect and accepted >= 2 * rounds


def test_stops_at_eos_and_max_tokens(tiny):
    model = tiny["target"]
    target = TargetState(model, 512)
    params = SamplingParams(max_new_tokens=40)
    ar, _ = run(generate_ar(target, PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    eos = ar[17]
    stop = ar.index(eos)
    saved = model.args.eos_token_ids
    model.args.eos_token_ids = (eos,)
    try:
        for gen in (generate_ar(target, PROMPTS[0], params),
                    generate_sync(target, DraftState(SuffixDrafter(), TreeParams()), PROMPTS[0], params, 2),
                    generate_sync(target, DraftState(tiny["self"](), TreeParams()), PROMPTS[0], params, 2)):
            out, steps = run(gen)
            assert out == ar[:stop + 1] and steps[-1].finish_reason == "eos"
            assert all(s.finish_reason is None for s in steps[:-1])
    finally:
        model.args.eos_token_ids = saved
    short = SamplingParams(max_new_tokens=13, ignore_eos=True)
    out, steps = run(generate_sync(target, DraftState(tiny["self"](), TreeParams()), PROMPTS[0], short, 3))
    assert out == ar[:13] and steps[-1].finish_reason == "length"


def scratch_kv(ref, tokens):
    pos = torch.arange(len(tokens))
    ref(torch.tensor(tokens), pos, pos, causal_mask(0, len(tokens)))
    return ref.k_cache[:, :, :len(tokens)]


def test_multi_turn_reuses_the_prefix(tiny):
    target = TargetState(tiny["target"], 512)
    drafter = tiny["self"]()
    draft = DraftState(drafter, TreeParams(bs=6, w=3))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    turn1, _ = run(generate_sync(target, draft, PROMPTS[0], params, 2))
    prompt2 = PROMPTS[0] + turn1 + [9, 8, 7]
    turn2, _ = run(generate_sync(target, draft, prompt2, params, 2))
    assert target.prefill_tokens <= 3 + 1  # the new tokens and at most the last answer token
    fresh, _ = run(generate_ar(TargetState(load_model(tiny_model_dir(seed=1), max_slots=512), 512),
                               prompt2, params))
    assert turn2 == fresh
    ref = load_model(tiny_model_dir(seed=1), max_slots=512)
    p = draft.cache.prefix_len
    assert draft.committed[:len(prompt2)] == prompt2
    torch.testing.assert_close(drafter.model.k_cache[:, :, :p], scratch_kv(ref, draft.committed[:p]),
                               atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible(tiny):
    target = TargetState(tiny["target"], 512)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=24, ignore_eos=True)
    outs = [run(generate_sync(target, DraftState(tiny["self"](), TreeParams()), PROMPTS[1], params, 2))[0]
            for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 24
    ars = [run(generate_ar(target, PROMPTS[1], params))[0] for _ in range(2)]
    assert ars[0] == ars[1]


def test_context_limits(tiny):
    small = load_model(tiny_model_dir(seed=1), max_slots=40)
    target = TargetState(small, 40)
    out, steps = run(generate_sync(target, DraftState(SuffixDrafter(), TreeParams()), PROMPTS[0],
                                   SamplingParams(max_new_tokens=100, ignore_eos=True), 2))
    assert len(out) == 40 - len(PROMPTS[0]) + 1 and steps[-1].finish_reason == "length"
    with pytest.raises(ContextFull):
        target.prefill(list(range(3, 50)), Sampler(SamplingParams()))


def test_tree_parameters_are_validated(tiny):
    with pytest.raises(ConfigError, match="bs"):
        DraftState(SuffixDrafter(), TreeParams(bs=0))
    with pytest.raises(ConfigError, match="w "):
        DraftState(SuffixDrafter(), TreeParams(w=99))
    target = TargetState(tiny["target"], 512)
    with pytest.raises(ConfigError, match="d "):
        next(generate_sync(target, DraftState(SuffixDrafter(), TreeParams()), PROMPTS[0], SamplingParams(), 0))


def embedded_prompts(tokenizer, n: int) -> list[list[int]]:
    root = Path(__file__).resolve().parents[1] / "swiftspec" / "prompts"
    cats = ["chat", "code", "math", "qa", "summarisation", "extraction"]
    texts = [json.loads((root / f"{c}.jsonl").read_text().splitlines()[1])["prompt"] for c in cats]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for t in texts[:n]]


@pytest.mark.slow
def test_sync_greedy_equals_ar_embedded(embedded_dir, embedded_tokenizer):
    target = TargetState(load_model(embedded_dir, max_slots=1024), 1024)
    draft = DraftState(SuffixDrafter(), TreeParams())
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    accepted = verifications = 0
    for prompt in embedded_prompts(embedded_tokenizer, 5):
        ar, _ = run(generate_ar(target, prompt, params))
        sync, steps = run(generate_sync(target, draft, prompt, params, 4))
        assert sync == ar and len(ar) == 128
        accepted += sum(s.accepted for s in steps)
        verifications += len(steps) - 1
    assert accepted / verifications > 0.3  # the suffix drafter does find repeats
