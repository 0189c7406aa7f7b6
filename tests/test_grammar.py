"""Grammars through the token tree (engine/spec/grammar.py): constrained greedy answers are the same
tokens in ar, sync and async and validate against their schema (where the free answer is not JSON at
all); sampled ones obey the grammar; constrained sampling through a tree follows the masked target law
(chi-square, and a planted bug that masks every node by the root's state is caught); the draft prunes
what the grammar refuses and proposes what it forces with probability 1; refusals are clear."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers.stats import chi_square_p
from pydantic import BaseModel, ConfigDict, Field
from tiny_models import EOS_ID, make_tokenizer, single_thread, tiny_model_dir

from swiftspec.engine.config import ConfigError, Grammar, GrammarKind, SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.spec import grammar as grammar_module
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.drafters import ModelDrafter, SuffixDrafter
from swiftspec.engine.spec.grammar import Constraint, GrammarError, Vocabulary, allowed, check
from swiftspec.engine.spec.loop import generate
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.spec.verify import walk

PROMPTS = [[5, 17, 300, 42, 8, 99], [1, 200, 201, 202, 203, 200, 201], [77] * 3 + [400, 12, 77, 77]]


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(json_schema_extra={"enum": ["fox", "dog"]})
    age: int = Field(ge=0, le=99)


class Record(BaseModel):
    """Nesting, an enum, an array, numbers and an optional field."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    n: int = Field(ge=-999, le=999)
    score: float | None = Field(default=None, ge=0, le=1)
    ok: bool
    pets: list[Pet] = Field(max_length=2)


SCHEMA = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(Record.model_json_schema()))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def tiny():
    target_dir = tiny_model_dir(seed=1)
    vocab = Vocabulary(target_dir / "tokenizer.json", (EOS_ID,), 512)
    return {
        "vocab": vocab,
        "tokenizer": make_tokenizer(512),
        "target": TargetState(load_model(target_dir, max_slots=512), 512, vocab),
        "self": lambda: ModelDrafter(load_model(target_dir, max_slots=1024)),
        "other": lambda: ModelDrafter(load_model(tiny_model_dir(arch="qwen2", layers=1, hidden=32, seed=3),
                                                 max_slots=1024)),
        "suffix": SuffixDrafter,
    }


def answer(tiny, prompt, params, mode="ar", draft=None, bs=8, w=4, d=2) -> tuple[list[int], list]:
    state = None if mode == "ar" else DraftState(tiny[draft](), TreeParams(bs=bs, w=w), vocab=tiny["vocab"])
    steps = generate(tiny["target"], state, prompt, replace(params, mode=mode), d, eos={EOS_ID})
    return [t for s in steps for t in s.tokens], steps


def text_of(tiny, tokens: list[int]) -> str:
    return tiny["tokenizer"].decode([t for t in tokens if t != EOS_ID])


@pytest.mark.parametrize("draft", ["self", "other", "suffix"])
def test_constrained_greedy_is_the_same_in_every_mode_and_validates(tiny, draft):
    free = SamplingParams(max_new_tokens=160)
    params = replace(free, grammar=SCHEMA)
    accepted = 0
    for prompt in PROMPTS:
        plain, _ = answer(tiny, prompt, free)
        with pytest.raises(ValueError):
            Record.model_validate_json(text_of(tiny, plain))
        ar, steps = answer(tiny, prompt, params)
        assert steps[-1].finish == "eos" and ar[-1] == EOS_ID and steps[-1].complete
        assert sum(s.forced for s in steps) >= 8 and all(s.mask_ms > 0 for s in steps[1:])
        cut = answer(tiny, prompt, replace(params, max_new_tokens=6))[1]
        assert cut[-1].finish == "length" and cut[-1].complete is False
        Record.model_validate_json(text_of(tiny, ar))
        for mode, bs, d in (("sync", 8, 2), ("async", 4, 1), ("sync", 16, 3)):
            spec, steps = answer(tiny, prompt, params, mode, draft, bs=bs, d=d)
            assert spec == ar, (mode, bs)
            accepted += sum(s.accepted for s in steps)
    assert accepted > 30  # the forced keys and punctuation at least


@pytest.mark.parametrize("grammar", [Grammar(GrammarKind.REGEX, r"(fox|dog)( (fox|dog)){2,5}\."),
                                     Grammar(GrammarKind.LARK, 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,3}/'),
                                     Grammar(GrammarKind.JSON)])
def test_regex_lark_and_any_json_hold_in_every_mode(tiny, grammar):
    params = SamplingParams(max_new_tokens=40, grammar=grammar)
    ar, _ = answer(tiny, PROMPTS[0], params)
    for mode in ("sync", "async"):
        assert answer(tiny, PROMPTS[0], params, mode, "suffix")[0] == ar
    text = text_of(tiny, ar)
    if grammar.kind is GrammarKind.JSON:
        assert isinstance(json.loads(text), dict)
    elif grammar.kind is GrammarKind.REGEX:
        assert text.endswith(".") and set(text[:-1].split(" ")) <= {"fox", "dog"}
    else:
        assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", text)


def test_sampled_constrained_answers_obey_the_grammar(tiny):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=120, grammar=SCHEMA)
    for seed, mode in enumerate(["ar", "sync", "async"] * 2):
        tokens, steps = answer(tiny, PROMPTS[seed % 3], replace(params, seed=seed), mode, "self")
        if steps[-1].finish == "eos":
            Record.model_validate_json(text_of(tiny, tokens))


@pytest.mark.parametrize("draft_forced", [True, False])
def test_the_draft_prunes_refused_tokens_and_proposes_forced_ones_for_certain(tiny, draft_forced):
    """... unless told not to (SamplingParams.draft_forced, the bench's -noforce modes): then a forced
    token is proposed only where the drafter itself proposes it, at the drafter's probability."""
    ds = DraftState(tiny["self"](), TreeParams(bs=8, w=4), vocab=tiny["vocab"])
    ds.prefill(PROMPTS[0], grammar=SCHEMA, draft_forced=draft_forced)
    root = tiny["tokenizer"].encode("{")[0]
    ds.start(root)  # nothing verified yet: the root's token starts every path
    for _ in range(6):
        if ds.can_expand():
            ds.expand()
    tree, probe = ds.tree, Constraint(tiny["vocab"], SCHEMA)
    probe.advance([root])
    certain = 0  # nodes where the grammar forces a token, proposed for certain as their parent's only child
    for i in range(1, tree.size):
        path = [tree.token[a] for a in tree.path_to(i)]
        state = probe.states(path, list(range(-1, len(path) - 1)))
        assert state[-1] is not None, f"node {i} breaks the grammar"
        if state[-2].compute_ff_tokens():
            certain += tree.value[i] == 0.0 and len(tree.children[tree.parent[i]]) == 1
    if draft_forced:
        assert certain >= 3  # '"name": "' is forced after the '{'
    else:
        assert certain == 0


# Constrained sampling through one verification, against the masked target law.
GRAMMAR = Grammar(GrammarKind.REGEX, "[ab]+c?")


def test_a_paths_kept_state_is_dropped_when_the_answer_advances(tiny):
    a, b, c = (tiny["tokenizer"].convert_tokens_to_ids(t) for t in "abc")
    constraint = Constraint(tiny["vocab"], GRAMMAR)
    assert constraint.proposals([[a]], [[(b, -1.0)]]) == [[(b, -1.0)]]  # "ab" may follow
    constraint.advance([a, c])  # "ac" is whole: no path goes on from it
    assert constraint.proposals([[a]], [[(b, -1.0)]]) == [[]]

PARAMS = {"plain": SamplingParams(temperature=1.0), "processed": SamplingParams(temperature=0.8, top_k=4, top_p=0.9)}


def synthetic_logits(context: tuple[int, ...], favoured: list[int]) -> torch.Tensor:
    """A fixed, context-dependent target over the tiny vocabulary, the drafted tokens made likely."""
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    x = torch.randn(512, generator=g) * 2.0
    x[favoured] += 5.0
    return x


def first_two_tokens(tiny, params: SamplingParams, n_trials: int = 6000) -> tuple[float, int]:
    ids = {c: tiny["tokenizer"].convert_tokens_to_ids(c) for c in "abcx"}
    tokens = [0, ids["a"], ids["b"], ids["x"], ids["a"], ids["c"], ids["b"]]
    parents = [-1, 0, 0, 0, 1, 1, 2]
    sampler = Sampler(replace(params, grammar=GRAMMAR), vocab=tiny["vocab"])
    contexts = [()]
    for i in range(1, len(tokens)):
        contexts.append(contexts[parents[i]] + (tokens[i],))
    masks = torch.from_numpy(sampler.grammar_masks(tokens, parents))
    favoured = list(ids.values())
    logits = sampler.constrain(torch.stack([synthetic_logits(c, favoured) for c in contexts]), masks)

    def true_probs(context: tuple[int, ...]) -> torch.Tensor:  # target-only constrained decoding
        probe = Constraint(tiny["vocab"], GRAMMAR)
        probe.advance(list(context))
        mask = torch.from_numpy(probe.masks([0], [-1]))
        return sampler.probs(sampler.constrain(synthetic_logits(context, favoured)[None], mask))[0]

    p1 = true_probs(())
    second = {a: true_probs((a,)) for a in p1.nonzero().flatten().tolist()}
    counts, accepted = torch.zeros(512 * 512), 0
    for _ in range(n_trials):
        w = walk(sampler.choose(logits).tolist(), tokens, parents)
        out = [tokens[i] for i in w.path] + [w.bonus]
        accepted += len(w.path)
        if len(out) == 1:
            out.append(int(sampler.draw(second[out[0]])))
        counts[out[0] * 512 + out[1]] += 1
    expected = torch.stack([p1[a] * second[a] if a in second else torch.zeros(512) for a in range(512)])
    return chi_square_p(counts, expected.flatten()), accepted


@pytest.mark.parametrize("setting", sorted(PARAMS))
def test_constrained_sampling_through_a_tree_follows_the_masked_target(tiny, setting):
    p, accepted = first_two_tokens(tiny, replace(PARAMS[setting], seed=5))
    assert p > 1e-3
    assert accepted > 0.2 * 6000


def test_masking_every_node_by_the_roots_state_is_caught(tiny, monkeypatch):
    monkeypatch.setattr(grammar_module.Constraint, "states", lambda self, tokens, parents: [self.matcher] * len(tokens))
    try:
        p, _ = first_two_tokens(tiny, replace(PARAMS["plain"], seed=5))
    except AssertionError:  # it emitted a token the grammar refuses
        p = 0.0
    assert p < 1e-6


def test_every_node_masks_by_its_own_path(tiny):
    c = Constraint(tiny["vocab"], GRAMMAR)
    ids = {ch: tiny["tokenizer"].convert_tokens_to_ids(ch) for ch in "abcx"}
    tokens, parents = [0, ids["a"], ids["x"], ids["c"], ids["b"]], [-1, 0, 0, 1, 3]
    masks = c.masks(tokens, parents)
    assert allowed(masks[0], ids["a"]) and not allowed(masks[0], ids["c"])
    assert allowed(masks[1], ids["c"]) and allowed(masks[1], ids["b"])
    assert (masks[2] == -1).all() and (masks[4] == -1).all()  # refused, and below a refused node
    assert allowed(masks[3], EOS_ID) and not allowed(masks[3], ids["a"])  # complete: only EOS follows
    assert not np.array_equal(masks[0], masks[1])


@pytest.mark.parametrize("grammar,words", [
    (Grammar(GrammarKind.JSON_SCHEMA, '{"type": "objectx"}'), "objectx"),
    (Grammar(GrammarKind.JSON_SCHEMA, "{not json"), "not valid"),
    (Grammar(GrammarKind.REGEX, "[a-"), "unclosed"),
    (Grammar(GrammarKind.LARK, 'start: "a" b'), "unknown name"),
    (Grammar(GrammarKind.LARK, ""), "No 'root' rule found"),  # the GBNF converter raises a bare Exception
    (Grammar(GrammarKind.LARK, "GGUF"), "Expected ::="),
    (Grammar(GrammarKind.JSON_SCHEMA, "[" * 50_000), "not valid"),  # deeper than Python's json reads
])
def test_a_grammar_the_library_refuses_is_a_clear_error(grammar, words):
    with pytest.raises(GrammarError, match=words):
        check(grammar)


# A grammar whose Earley row, after its first "a", holds one item per alternative: more than the limit.
WIDE = Grammar(GrammarKind.LARK, "start: " + " | ".join(f"x{i}" for i in range(2100)) + "\n"
               + "\n".join(f'x{i}: "a" "b{i}"' for i in range(2100)))


def test_a_grammar_past_the_librarys_limits_fails_mid_answer_with_a_clear_error(tiny, monkeypatch):
    a = tiny["tokenizer"].convert_tokens_to_ids("a")
    constraint = Constraint(tiny["vocab"], WIDE)  # compiles: the limit is reached while answering
    with pytest.raises(GrammarError, match=r"the grammar failed: .*2100 items; max is 2000;"):
        constraint.advance([a])
    # the limit, not the grammar, is what failed it
    monkeypatch.setattr(grammar_module, "LIMITS", grammar_module.llguidance.LLParserLimits(max_items_in_row=3000))
    Constraint(tiny["vocab"], WIDE).advance([a])


def test_a_grammar_nested_as_deep_as_the_size_cap_allows_compiles_without_crashing(tmp_path):
    """A chain of $refs within MAX_GRAMMAR_CHARS: the library's recursive compile of it crashed the process
    (SIGSEGV: a server killed by one request) on a default 8 MB stack. Run apart, so a crash fails only
    this test."""
    import subprocess
    import sys

    from swiftspec.engine.config import MAX_GRAMMAR_CHARS

    n = 2000
    defs = {str(i): {"items": {"$ref": f"#/$defs/{i + 1}"}} for i in range(n)} | {str(n): {"type": "integer"}}
    schema = json.dumps({"$defs": defs, "$ref": "#/$defs/0"}, separators=(",", ":"))
    assert len(schema) <= MAX_GRAMMAR_CHARS
    (tmp_path / "schema.json").write_text(schema)
    code = ("import sys; from pathlib import Path; from swiftspec.engine.config import Grammar;"
            "from swiftspec.engine.spec.grammar import check;"
            "check(Grammar('json_schema', Path(sys.argv[1]).read_text())); print('compiled')")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "schema.json")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "compiled", (done.returncode, done.stderr[-500:])


def test_grammar_settings_are_validated():
    with pytest.raises(ConfigError, match="grammar kind"):
        SamplingParams(grammar={"kind": "xml", "source": "x"}).validate()
    with pytest.raises(ConfigError, match="no source"):
        SamplingParams(grammar={"kind": "json", "source": "{}"}).validate()
    with pytest.raises(ConfigError, match="draft-forced must be true or false"):
        SamplingParams(draft_forced="no").validate()
    params = SamplingParams(grammar={"kind": "regex", "source": "a+"}).validate()
    assert params.grammar == Grammar(GrammarKind.REGEX, "a+")
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    assert "regex" in params.summary()
    with pytest.raises(ConfigError, match="takes no grammar"):
        Sampler(params)


@pytest.mark.slow
def test_worker_groups_with_tensor_parallelism_keep_the_constrained_answer(target_dir):
    """Every target rank masks by its own matcher, so a TP 2 target and its draft stay in step: the same
    valid answer in every mode; a grammar the library refuses never reaches the workers."""
    from helpers.engines import answer as engine_answer
    from helpers.engines import no_processes_left, start

    engine = start(target_dir, "suffix", 2)
    try:
        messages = [{"role": "user", "content": "Name a pet."}]
        outputs = {mode: engine_answer(engine, messages, mode=mode, max_new_tokens=160, grammar=SCHEMA)
                   for mode in ("ar", "sync", "async")}
        assert outputs["ar"][0] == outputs["sync"][0] == outputs["async"][0]
        assert outputs["ar"][2][-1].finish_reason == "eos"
        Record.model_validate_json(outputs["ar"][1])
        with pytest.raises(GrammarError, match="objectx"):
            list(engine.generate(messages, SamplingParams(grammar=Grammar(GrammarKind.JSON_SCHEMA, '{"type": "objectx"}'))))
    finally:
        engine.close()
    assert no_processes_left(engine)
