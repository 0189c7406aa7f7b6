"""The shipped loops (engine/spec/loop.py) in one process: ``sync`` and ``async`` against ``ar``, identical
greedy output on tiny random models with a different draft model, with the target as its own draft and
with the suffix drafter, and on the embedded model with the suffix drafter, plain and penalised (and
penalised as transformers does); the finisher's stopping rules and loop guard, multi-turn KV reuse,
validation, and the target's hidden states reaching a drafter that reads them."""

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import single_thread, tiny_model_dir

from swiftspec.engine.config import ConfigError, SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.spec import loop
from swiftspec.engine.spec.decode import DraftState, TargetState, profile_verify_cost
from swiftspec.engine.spec.draft_policy import PaybackGate
from swiftspec.engine.spec.drafters import ModelDrafter, SuffixDrafter
from swiftspec.engine.spec.loop import (
    HOLD_BELOW_US,
    Finisher,
    LoopGuard,
    Request,
    _End,
    generate,
    lead_target,
)
from swiftspec.engine.spec.messages import Start, Subtree
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.spec.tree_cache import ContextFull, causal_mask, prefill_forward
from swiftspec.engine.worker.wire import features_from_wire, features_to_wire

PROMPTS = [[5, 17, 300, 42, 8, 99], [1, 200, 201, 202, 203, 200, 201], [77] * 3 + [400, 12, 77, 77]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def run(target, draft, prompt, params, mode="ar", d=2, **kw) -> tuple[list[int], list]:
    steps = generate(target, draft, prompt, replace(params, mode=mode), d, **kw)
    return [t for s in steps for t in s.tokens], steps


@contextlib.contextmanager
def clocked(target: TargetState, step_ms: float, cost: list[float]):
    """target's verifications of n nodes report step_ms * cost[n - 1] ms (a fixed clock): a draft's costs,
    which follow the verdicts' times, then stay the declared ones."""
    verify = target.verify

    def timed(tokens, parents, sampler, **kw):
        v = verify(tokens, parents, sampler, **kw)
        v.target_ms = step_ms * cost[len(tokens) - 1]
        return v

    target.verify = timed
    try:
        yield target
    finally:
        del target.verify


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
@pytest.mark.parametrize("bs,w,d,mode", [(8, 8, 2, "sync"), (4, 2, 1, "async"), (16, 4, 3, "sync")])
def test_speculation_greedy_equals_ar_tiny(tiny, draft, bs, w, d, mode):
    target = TargetState(tiny["target"], 512)
    state = DraftState(tiny[draft](), TreeParams(bs=bs, w=w))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for prompt in PROMPTS:
        ar, _ = run(target, None, prompt, params)
        spec, steps = run(target, state, prompt, params, mode, d)
        assert spec == ar and len(ar) == 48
        assert all(s.tree_size <= bs for s in steps)


PENALISED = {  # strong enough to change the tiny models' greedy answers
    "repeat": SamplingParams(repeat_penalty=1.8, repeat_last_n=16),
    "presence+frequency": SamplingParams(presence_penalty=1.5, frequency_penalty=0.7, repeat_last_n=32),
}


@pytest.mark.parametrize("draft", ["self", "suffix"])
@pytest.mark.parametrize("setting", sorted(PENALISED))
def test_penalised_greedy_speculation_equals_ar_tiny(tiny, draft, setting):
    """Each tree node is penalised by its own path, so sync and async keep ar's tokens, which the
    penalty did change."""
    target = TargetState(tiny["target"], 512)
    params = replace(PENALISED[setting], max_new_tokens=48, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        plain, _ = run(target, None, prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
        ar, _ = run(target, None, prompt, params)
        assert ar != plain
        for mode, bs, d in (("sync", 8, 2), ("async", 4, 1), ("sync", 16, 3)):
            spec, steps = run(target, DraftState(tiny[draft](), TreeParams(bs=bs, w=4)), prompt, params, mode, d)
            assert spec == ar, (mode, bs)
            accepted += sum(s.accepted for s in steps)
    # The self draft's trees get deep nodes accepted, each verified with its own path's penalty (the suffix
    # drafter proposes repeats, which strong penalties rule out).
    assert accepted > 20 or draft == "suffix"


def test_repeat_penalty_over_the_whole_context_is_transformers_greedy(tiny):
    """With a window longer than the context, --repeat-penalty is transformers' repetition_penalty."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(seed=1), torch_dtype=torch.float32)
    target = TargetState(tiny["target"], 512)
    params = SamplingParams(repeat_penalty=1.8, repeat_last_n=4096, max_new_tokens=32, ignore_eos=True)
    for prompt in PROMPTS:
        ours, _ = run(target, DraftState(tiny["self"](), TreeParams()), prompt, params, "sync")
        out = hf.generate(torch.tensor([prompt]), do_sample=False, repetition_penalty=1.8, max_new_tokens=32,
                          min_new_tokens=32, pad_token_id=0)
        assert ours == out[0, len(prompt):].tolist()


def loops(a: list[int], n: int, k: int) -> bool:
    """Brute force: the last n tokens of ``a`` are one span, at most n / k long, repeated."""
    return len(a) >= n and any(a[-n:] == (a[-span:] * n)[-n:] for span in range(1, n // k + 1))


@given(st.lists(st.integers(0, 2), max_size=60), st.integers(2, 12), st.integers(2, 4))
@settings(max_examples=300, deadline=None)
def test_the_loop_guard_notices_exactly_the_repeated_spans(tokens, n, k):
    guard = LoopGuard(n, k)
    assert [guard.add(t) for t in tokens] == [loops(tokens[:i + 1], n, k) for i in range(len(tokens))]


def test_the_loop_guard_ends_the_answer_at_the_same_token_in_every_mode(tiny):
    """With a guard the answer ends, reason "repetition", right after the first token that shows the loop,
    in every mode at the same token; an answer that never loops runs to its length."""
    target = TargetState(tiny["target"], 512)
    drafts = {"ar": lambda: None, "sync": lambda: DraftState(SuffixDrafter(), TreeParams()),
              "async": lambda: DraftState(tiny["self"](), TreeParams())}
    caught = 0
    for prompt in PROMPTS:
        full, _ = run(target, None, prompt, SamplingParams(max_new_tokens=80, ignore_eos=True))
        for n, k in ((3, 3), (4, 2), (6, 2)):
            end = next((i for i in range(1, len(full) + 1) if loops(full[:i], n, k)), None)
            caught += end is not None
            params = SamplingParams(max_new_tokens=80, ignore_eos=True, loop_guard=n, loop_repeats=k)
            for mode, draft in drafts.items():
                out, steps = run(target, draft(), prompt, params, mode)
                assert out == full[:end] and steps[-1].finish == ("repetition" if end else "length"), (mode, n)
    assert caught >= 2


def test_cost_aware_subtrees_keep_the_output(tiny):
    target = TargetState(tiny["target"], 512)
    target.prefill(PROMPTS[0], Sampler(SamplingParams()))
    cost = profile_verify_cost(target, 8)
    assert len(cost) == 8 and min(cost) > 0
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        ar, _ = run(target, None, prompt, params)
        cost = [1.0 + 0.3 * i for i in range(8)]
        draft = DraftState(tiny["self"](), TreeParams(), verify_cost=cost)
        with clocked(target, 1.0, cost):
            sync, steps = run(target, draft, prompt, params, "sync")
        assert sync == ar and max(s.tree_size for s in steps) < 8


def test_a_draft_learns_the_targets_cost_from_its_verdicts(tiny):
    """A draft whose profile says rows are free, beside a target whose every row costs half a step: each
    verdict carries the target's time, the draft's costs follow, and its later rounds verify at most half
    the nodes of its first (which thought 8 rows cost one). Output: ar's."""
    target = TargetState(tiny["target"], 512)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ar, _ = run(target, None, PROMPTS[1], params)
    draft = DraftState(tiny["self"](), TreeParams(), verify_cost=[1.0] * 8, step_ms=1.0)
    with clocked(target, 1.0, [1.0 + 0.5 * i for i in range(8)]):
        out, steps = run(target, draft, PROMPTS[1], params, "sync", d=4)
    rounds = [s.tree_size for s in steps if s.tree_size]
    assert out == ar
    assert rounds[0] == 8 and max(rounds[len(rounds) // 2:]) <= 4
    assert draft.verify_cost[7] > 3.5 and draft.step_ms == pytest.approx(1.0, rel=0.2)


TIMED = {1e-4: {"step_ms": 1e-4}, 1e6: {"step_ms": 1e6}}  # an expansion costs thousands of steps; nothing


def timed_runs(tiny, mode: str, drafts: dict = TIMED, expand_ms: float | None = None):
    """For each prompt, ar's tokens and, per entry of ``drafts`` (DraftState's timing arguments; by default
    a target whose one-node step is 1e-4 ms and one whose step is 1e6 ms): the speculative tokens, the
    draft expansions per verification round, and the rounds' steps. d = 6, a cost profile, the self draft;
    ``expand_ms``: each expansion reads as taking that long (a fixed clock)."""
    target = TargetState(tiny["target"], 512)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    cost = [1.0 + 0.05 * i for i in range(8)]
    for prompt in PROMPTS:
        ar, _ = run(target, None, prompt, params)
        runs = {}
        for key, timing in drafts.items():
            draft = DraftState(tiny["self"](), TreeParams(), verify_cost=cost, **timing)
            expansions = []

            def counted(expand=draft.expand, expansions=expansions) -> float:
                ms = expand()
                expansions.append(1)
                return ms if expand_ms is None else expand_ms

            draft.expand = counted
            with clocked(target, timing["step_ms"], cost):
                out, steps = run(target, draft, prompt, params, mode, d=6)
            rounds = [s for s in steps if s.tree_size]
            runs[key] = (out, len(expansions) / len(rounds), rounds)
        yield ar, runs


def test_sync_rounds_count_the_drafts_time(tiny):
    """A sync round that knows the target's step time weighs its expansions against it: where one costs
    thousands of steps, a round stops after its first expansion, and as that never pays, most rounds do
    not draft at all (plain steps); where they are free, rounds expand while the expected yield grows and
    verify full subtrees. Either way the output is ar's."""
    for ar, runs in timed_runs(tiny, "sync"):
        (slow, slow_rate, rounds), (free, free_rate, free_rounds) = runs[1e-4], runs[1e6]
        assert slow == free == ar
        assert slow_rate < 0.5 < 2 <= free_rate
        assert sum(s.draft_ms == 0 for s in rounds) > len(rounds) / 2
        assert max(s.tree_size for s in free_rounds) == 8
        assert all(s.draft_ms > 0 for s in free_rounds)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_draft_that_sits_out_lets_the_target_step_alone(tiny, monkeypatch, mode):
    """Where drafting never pays (the target's step reads as 1e-4 ms), the draft sits rounds out as Plain
    messages (async: on the target's cores, as sync): the target takes those steps on its own, one
    verdict for them all, and the draft follows past its tree (DraftState.advance). The output is ar's,
    and the draft ends holding what the target committed."""
    plain = []
    real = loop.plain_steps
    monkeypatch.setattr(loop, "plain_steps", lambda *a: plain.append(a[2]) or real(*a))
    target = TargetState(tiny["target"], 512)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    cost = [1.0 + 0.05 * i for i in range(8)]
    for prompt in PROMPTS:
        ar, _ = run(target, None, prompt, params)
        draft = DraftState(tiny["self"](), TreeParams(), verify_cost=cost, step_ms=1e-4, shares_cores=True)
        with clocked(target, 1e-4, cost):
            out, _ = run(target, draft, prompt, params, mode)
        assert out == ar
        assert draft.committed == target.committed
    assert max(plain) == TreeParams().bs  # the back-off grew to a verdict's worth of steps


def test_the_payback_gate_backs_off_while_drafting_does_not_pay():
    gate = PaybackGate(weight=1.0)  # the means are then the last round's
    waits = []
    for _ in range(8):
        gate.judge(0.5, 0.5)
        waits.append(gate.sit_out())  # plain steps, all at once, then it drafts again
        assert gate.sit_out() == 0
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32]
    gate.judge(1.2, 0.5)  # a round that paid: draft every round again
    assert gate.misses == 0 and gate.sit_out() == 0
    gate.judge(0.9, 0.5)
    assert gate.sit_out() == 1  # the back-off starts over
    cheap = PaybackGate(weight=1.0)  # a round that adds a tenth of a step waits at most 10 steps
    waits = []
    for _ in range(6):
        cheap.judge(0.9, 0.1)
        waits.append(cheap.sit_out())
    assert waits == [1, 2, 4, 8, 10, 10]


def test_the_payback_gate_judges_a_draft_by_all_its_rounds():
    """A draft whose drafting is cheap is never sat out, even in a run of rounds that gained nothing; one
    whose rounds pay on average is not sat out for its dear rounds, which are mostly those that gained
    nothing (each is 1 token for a step and a tenth), however many there are in a row."""
    cheap = PaybackGate()
    for _ in range(50):
        cheap.judge(0.97, 0.03)
        assert cheap.sit_out() == 0
    paying = PaybackGate()
    for _ in range(20):
        paying.judge(2.5, 0.02)
    for _ in range(3):
        paying.judge(1 / 1.1, 0.1)
        assert paying.sit_out() == 0
    for _ in range(20):  # only losing rounds: the means fall below 1 and past 5 % of a step
        paying.judge(1 / 1.1, 0.1)
    assert paying.sit_out() > 0


def test_async_expansions_fit_in_the_verification(tiny):
    """While the target verifies, an async draft that knows the target's costs expands only as long as
    the verification of what it sent should take: with a target that verifies in no time it expands only
    to top the tree up to bs, with a slow one d times a round. Output: ar's."""
    for ar, runs in timed_runs(tiny, "async"):
        (fast, fast_rate, _), (slow, slow_rate, _) = runs[1e-4], runs[1e6]
        assert fast == slow == ar
        assert fast_rate < 6 <= slow_rate


def test_an_async_draft_on_the_targets_cores_drafts_between_verifications_as_sync_does(tiny):
    """Where the draft shares the target's cores (DraftState.shares_cores), its expansions during a
    verification would slow that verification down: its rounds are a sync draft's, expansion for
    expansion; on cores of its own it expands as long as the verification lasts. Each expansion takes a
    fifth of a step here (a fixed clock). Output: ar's."""
    drafts = {False: {"step_ms": 100.0}, True: {"step_ms": 100.0, "shares_cores": True}}
    for (ar, runs), (_, sync) in zip(timed_runs(tiny, "async", drafts, expand_ms=20.0),
                                     timed_runs(tiny, "sync", {True: drafts[True]}, expand_ms=20.0), strict=True):
        (own, own_rate, _), (shared, shared_rate, shared_rounds) = runs[False], runs[True]
        assert own == shared == ar
        assert shared_rate + 1 < own_rate, (shared_rate, own_rate)
        assert (shared, shared_rate) == sync[True][:2]
        assert [(s.tree_size, s.accepted, s.draft_ms) for s in shared_rounds] == \
            [(s.tree_size, s.accepted, s.draft_ms) for s in sync[True][2]]


def test_a_draft_on_the_targets_cores_waits_for_its_verdicts_asleep(tiny, monkeypatch):
    """A draft that knows the target's costs tells its link when each verdict is due, so that the link
    polls for it from shortly before; one on the target's cores (DraftState.shares_cores) does not, since
    its polling would take a core from that verification. In both modes; output: ar's."""
    dues: list = []

    def post_recv(end, due=None):
        dues.append(due)
        return end.recv

    monkeypatch.setattr(_End, "post_recv", post_recv)
    drafts = {False: {"step_ms": 100.0}, True: {"step_ms": 100.0, "shares_cores": True}}
    for mode in ("sync", "async"):
        for ar, runs in timed_runs(tiny, mode, {False: drafts[False]}):
            assert runs[False][0] == ar and dues and all(isinstance(d, float) for d in dues)
            dues.clear()
        for ar, runs in timed_runs(tiny, mode, {True: drafts[True]}):
            assert runs[True][0] == ar and dues and all(d is None for d in dues)
            dues.clear()


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


def test_the_finisher_cuts_exactly(tiny):
    """EOS kept and nothing after it, exactly max_new_tokens, exactly the context's room (ending with the
    step that fills it, not one more), a cancel at the next step: in every mode, wherever the cut falls
    inside a step's tokens."""
    target = TargetState(tiny["target"], 512)
    ar, _ = run(target, None, PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    eos = ar[17]
    stop = ar.index(eos)
    drafts = {"ar": lambda: None, "sync": lambda: DraftState(SuffixDrafter(), TreeParams()),
              "async": lambda: DraftState(tiny["self"](), TreeParams())}
    for mode, draft in drafts.items():
        out, steps = run(target, draft(), PROMPTS[0], SamplingParams(max_new_tokens=40), mode, eos={eos})
        assert out == ar[:stop + 1] and steps[-1].finish == "eos", mode
        assert all(s.finish is None for s in steps[:-1])
        for n in (1, 2, 13):
            out, steps = run(target, draft(), PROMPTS[0], SamplingParams(max_new_tokens=n, ignore_eos=True), mode, 3)
            assert out == ar[:n] and steps[-1].finish == "length" and steps[-1].tokens, (mode, n)
        room = 9
        out, steps = run(target, draft(), PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True), mode,
                         max_seq_len=len(PROMPTS[0]) + room)
        assert out == ar[:room] and steps[-1].finish == "context" and steps[-1].tokens, mode
        asked = iter(range(100))
        out, steps = run(target, draft(), PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True), mode,
                         cancelled=lambda asked=asked: next(asked) >= 2)
        assert len(steps) == 3 and steps[-1].finish == "cancelled" and out == ar[:len(out)], mode


def scratch_kv(ref, tokens):
    pos = torch.arange(len(tokens))
    ref(torch.tensor(tokens), pos, pos, causal_mask(0, len(tokens)))
    return ref.k_cache[:, :, :len(tokens)]


def test_multi_turn_reuses_the_prefix(tiny):
    target = TargetState(tiny["target"], 512)
    drafter = tiny["self"]()
    draft = DraftState(drafter, TreeParams(bs=6, w=3))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    turn1, _ = run(target, draft, PROMPTS[0], params, "sync")
    prompt2 = PROMPTS[0] + turn1 + [9, 8, 7]
    turn2, _ = run(target, draft, prompt2, params, "async")
    assert target.prefill_tokens <= 3 + 1  # the new tokens and at most the last answer token
    fresh, _ = run(TargetState(load_model(tiny_model_dir(seed=1), max_slots=512), 512), None, prompt2, params)
    assert turn2 == fresh
    ref = load_model(tiny_model_dir(seed=1), max_slots=512)
    p = draft.cache.prefix_len
    assert draft.committed[:len(prompt2)] == prompt2
    torch.testing.assert_close(drafter.model.k_cache[:, :, :p], scratch_kv(ref, draft.committed[:p]),
                               atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible(tiny):
    target = TargetState(tiny["target"], 512)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=24, ignore_eos=True)
    outs = [run(target, DraftState(tiny["self"](), TreeParams()), PROMPTS[1], params, "sync")[0]
            for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 24
    ars = [run(target, None, PROMPTS[1], params)[0] for _ in range(2)]
    assert ars[0] == ars[1]


def test_context_limits(tiny):
    small = load_model(tiny_model_dir(seed=1), max_slots=40)
    target = TargetState(small, 40)
    out, steps = run(target, DraftState(SuffixDrafter(), TreeParams()), PROMPTS[0],
                     SamplingParams(max_new_tokens=100, ignore_eos=True), "sync")
    # the context is what the cache holds besides one tree of bs + 1 nodes
    assert len(out) == 40 - 9 - len(PROMPTS[0]) and steps[-1].finish == "context"
    with pytest.raises(ContextFull):
        target.prefill(list(range(3, 50)), Sampler(SamplingParams()))


def test_tree_parameters_are_validated(tiny):
    with pytest.raises(ConfigError, match="bs"):
        DraftState(SuffixDrafter(), TreeParams(bs=0))
    with pytest.raises(ConfigError, match="w "):
        DraftState(SuffixDrafter(), TreeParams(w=99))
    target = TargetState(tiny["target"], 512)
    with pytest.raises(ConfigError, match="d "):
        run(target, DraftState(SuffixDrafter(), TreeParams()), PROMPTS[0], SamplingParams(), "sync", 0)


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
        ar, _ = run(target, None, prompt, params)
        sync, steps = run(target, draft, prompt, params, "sync", 4)
        assert sync == ar and len(ar) == 128
        accepted += sum(s.accepted for s in steps)
        verifications += len(steps) - 1
    assert accepted / verifications > 0.3  # the suffix drafter does find repeats
    penalised = replace(params, repeat_penalty=1.3, repeat_last_n=64, frequency_penalty=0.3, max_new_tokens=64)
    for prompt in embedded_prompts(embedded_tokenizer, 3):
        ar, _ = run(target, None, prompt, penalised)
        assert run(target, draft, prompt, penalised, "sync", 4)[0] == ar
        assert run(target, draft, prompt, penalised, "async", 4)[0] == ar


class FeatureReader(ModelDrafter):
    """A drafter that reads the target's hidden states and keeps what it got, position by position."""

    wants_features = True

    def __init__(self, model):
        super().__init__(model)
        self.seen: dict[int, tuple[int, torch.Tensor]] = {}  # position: (token, hidden state)
        self.starts: list[int] = []

    def prefill(self, tokens, reuse, features):
        super().prefill(tokens, reuse, features)
        assert features.hidden.shape[0] == len(tokens) - features.start
        self.starts.append(features.start)
        self.seen.update((p, (tokens[p], features.hidden[p - features.start])) for p in range(features.start, len(tokens)))
        self.n = len(tokens)

    def extend(self, tokens, features):
        super().extend(tokens, features)
        assert features.shape[0] == len(tokens)
        self.seen.update((self.n + i, (t, features[i])) for i, t in enumerate(tokens))
        self.n += len(tokens)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_feature_reading_drafter_gets_the_targets_hidden_states(tiny, mode, monkeypatch):
    """Prefill features (across prefill chunks, from the target's reuse point on a second turn) and one
    row per newly verified token, each equal to the target's hidden state at that position."""
    monkeypatch.setattr("swiftspec.engine.spec.tree_cache.PREFILL_CHUNK", 4)
    target = TargetState(tiny["target"], 512)
    reader = FeatureReader(load_model(tiny_model_dir(seed=1), max_slots=1024))  # the target's weights
    draft = DraftState(reader, TreeParams(bs=6, w=3))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    turn1, _ = run(target, draft, PROMPTS[2], params, mode)
    prompt2 = PROMPTS[2] + turn1 + [9, 8, 7]
    turn2, steps = run(target, draft, prompt2, params, mode)
    assert reader.starts == [0, len(prompt2) - target.prefill_tokens] and target.prefill_tokens <= 4
    assert sum(s.accepted for s in steps) > 0
    seq = prompt2 + turn2
    ref_model = load_model(tiny_model_dir(seed=1), max_slots=512)
    _, ref = prefill_forward(ref_model, seq, 0, logits=False, hidden=True)
    # every position the draft holds, except the last verified one, whose row comes with the next verdict
    assert sorted(reader.seen) == list(range(reader.n)) and reader.n >= len(seq) - 1 - 8
    for p, (token, hidden) in reader.seen.items():
        assert token == seq[p]
        torch.testing.assert_close(hidden, ref[p], atol=1e-4, rtol=1e-4)


def test_features_cross_the_wire_as_float16():
    hidden = torch.randn(5, 64) * 3
    wire = features_to_wire(hidden)
    assert wire.dtype == torch.int16 and wire.shape == (5, 64)
    assert torch.equal(features_from_wire(wire), hidden.half().float())


class NothingDraft:
    """A Link standing in for a draft leader that proposes nothing (each subtree is the root alone: the
    last verdict's bonus token) and dies after ``rounds`` subtrees; ``events`` records what the target
    leader's loop saw, in order."""

    def __init__(self, rounds: int, events: list, expand_us: int = 100):
        self.root, self.left, self.events, self.expand_us = None, rounds, events, expand_us

    def send(self, msg) -> None:
        self.root = msg.root if isinstance(msg, Start) else msg.path[-1]

    def recv(self, due=None):
        if not self.left:
            raise RuntimeError("the draft died")
        self.left -= 1
        self.events.append("subtree")
        return Subtree([self.root], [-1], expansions=1, expand_us=self.expand_us)


def test_a_loop_guard_longer_than_the_answer_can_be_is_none_and_costs_nothing():
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, loop_guard=10**12, loop_repeats=2)
    fin = Finisher(Request(0, [1, 2, 3], params), 256, set(), lambda: False)
    assert fin.guard is None and fin.cut([5] * 8) == ([5] * 8, None)
    assert Finisher(Request(0, [1, 2, 3], replace(params, loop_guard=64)), 256, set(), lambda: False).guard


@pytest.mark.parametrize("hold, expand_us", [(False, 100), (True, 100), (True, HOLD_BELOW_US)])
def test_held_steps_reach_the_user_after_the_next_subtree_and_none_is_lost(tiny, hold, expand_us):
    """hold_steps emits each round's step once the next subtree is in, so the user's side works while the
    target verifies; every step still arrives, in order and with ar's tokens, the one held when the draft
    dies included (then the error). Behind a draft that takes HOLD_BELOW_US or more to draft a round,
    steps go out at once."""
    target = TargetState(tiny["target"], 512)
    prompt, rounds = PROMPTS[0], 5
    ar, _ = run(target, None, prompt, SamplingParams(max_new_tokens=rounds + 1, ignore_eos=True))
    events: list = []
    req = Request(0, prompt, SamplingParams(mode="sync", max_new_tokens=64, ignore_eos=True))
    fin = Finisher(req, 256, set(), lambda: False)
    with pytest.raises(RuntimeError, match="the draft died"):
        lead_target(target, NothingDraft(rounds, events, expand_us), req, fin, events.append, hold_steps=hold)
    steps = [e for e in events if e != "subtree"]
    assert [t for s in steps for t in s.tokens] == ar
    order = ["step" if e != "subtree" else e for e in events]
    if hold and expand_us < HOLD_BELOW_US:  # the prefill's step, then each after the next subtree; the last held one on the error
        assert order == ["step", "subtree", "subtree"] + ["step", "subtree"] * (rounds - 2) + ["step", "step"]
    else:
        assert order == ["step"] + ["subtree", "step"] * rounds
