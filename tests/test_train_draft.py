"""``swiftspec train-draft`` on a tiny model: the data, the suffix drafter's corpus, a few epochs that lower
the loss, a head that loads and decodes exactly, resuming and determinism."""

import json
from dataclasses import replace

import pytest
import torch
from rich.console import Console
from safetensors.numpy import load_file
from tiny_models import single_thread, tiny_model_dir

from swiftspec.engine.config import SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.model.model_dir import eos_token_ids, load_tokenizer
from swiftspec.engine.spec.corpus import check_corpus, load_corpus, read_metadata
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.draft_head import HeadDrafter, load_head
from swiftspec.engine.spec.loop import generate
from swiftspec.train_draft import (
    CORPUS_FILE,
    TrainConfig,
    _batch,
    init_head,
    make_data,
    split,
    target_labels,
    train,
    unrolled_loss,
)
from swiftspec.train_prompts import TOPICS, training_prompts

CFG = TrainConfig(n_prompts=12, max_new_tokens=24, batch=6, draft_vocab=128, steps=2, epochs=2, lr=3e-3, seq_batch=4)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target_dir = tiny_model_dir(seed=1)
    out = tmp_path_factory.mktemp("head")
    curve = train(target_dir, out, CFG, training_prompts(CFG.n_prompts), torch.device("cpu"), Console(quiet=True))
    return target_dir, out, curve


def _loss(head, seqs, labels, t2d):
    with torch.no_grad():
        return float(unrolled_loss(head, _batch(seqs, labels, t2d, 512), CFG.steps, 0.0, None)[0])


def test_training_lowers_the_loss_and_the_head_decodes_exactly(trained):
    target_dir, out, curve = trained
    assert len(curve) == CFG.epochs and all(len(c) == CFG.steps for c in curve)
    target = load_model(target_dir, max_slots=512)
    tok = load_tokenizer(target_dir)
    seqs = make_data(target_dir, tok, eos_token_ids(target_dir), training_prompts(CFG.n_prompts), out, CFG,
                     torch.device("cpu"), _NoProgress())
    train_set, held = split(seqs, CFG.seed)
    assert len(held) == 1 and len(train_set) == CFG.n_prompts - 1
    assert all(s.features.shape == (len(s.tokens) - 1, target.args.dim) for s in seqs)
    labels = target_labels(train_set, target.output.weight)
    head = load_head(out, target.args)
    head.attach_target(target.tok_embeddings.weight, target.output.weight)
    t2d = torch.full((target.args.vocab_size,), -100, dtype=torch.long)
    t2d[head.d2t] = torch.arange(len(head.d2t))
    before = _loss(init_head(target, head.d2t, CFG.seed), train_set, labels, t2d)
    after = _loss(head, train_set, labels, t2d)
    assert after < 0.8 * before
    # the saved head drafts, and sync with it gives the target's own greedy tokens
    t = TargetState(target, 512)
    state = DraftState(HeadDrafter(head, 1024), TreeParams(bs=8, w=4))
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    prompt = seqs[0].tokens[:seqs[0].prompt_len].tolist()
    ar = [tok for s in generate(t, None, prompt, replace(params, mode="ar")) for tok in s.tokens]
    for mode in ("sync", "async"):
        steps = generate(t, state, prompt, replace(params, mode=mode), 2)
        assert [tok for s in steps for tok in s.tokens] == ar


def test_the_answers_make_a_corpus_and_corpus_only_stops_there(trained, tmp_path):
    target_dir, out, _ = trained
    tok = load_tokenizer(target_dir)
    seqs = make_data(target_dir, tok, eos_token_ids(target_dir), training_prompts(CFG.n_prompts), out, CFG,
                     torch.device("cpu"), _NoProgress())
    check_corpus(out / CORPUS_FILE, tok)
    meta = read_metadata(out / CORPUS_FILE)
    assert int(meta["answers"]) == CFG.n_prompts
    assert int(meta["answer_tokens"]) == sum(len(s.tokens) - s.prompt_len for s in seqs)
    table = load_corpus(out / CORPUS_FILE, load_model(target_dir, max_slots=8).args.vocab_size)
    s = seqs[0].tokens.tolist()
    counts, order = table.lookup(s[:seqs[0].prompt_len + 2])  # the answer's own words, after its lead-in
    assert s[seqs[0].prompt_len + 2] in counts and order >= 3
    only = tmp_path / "only"
    assert train(target_dir, only, CFG, training_prompts(CFG.n_prompts), torch.device("cpu"), Console(quiet=True),
                 corpus_only=True) == []
    assert read_metadata(only / CORPUS_FILE) == meta
    assert load_file(only / CORPUS_FILE)["tokens"].tolist() == load_file(out / CORPUS_FILE)["tokens"].tolist()
    assert not (only / "model.safetensors").exists()


def test_rerun_resumes_and_the_same_seed_gives_the_same_head(trained, tmp_path):
    target_dir, out, curve = trained
    state = json.loads((out / "train_state.json").read_text())
    assert state["epoch"] == CFG.epochs
    # a rerun with one more epoch continues from the saved state (the data shards are reused)
    shards = sorted((out / "data").glob("shard-*.safetensors"))
    mtimes = [p.stat().st_mtime_ns for p in shards]
    more = TrainConfig(**{**CFG.__dict__, "epochs": CFG.epochs + 1})
    longer = train(target_dir, out, more, training_prompts(CFG.n_prompts), torch.device("cpu"), Console(quiet=True))
    assert longer[:CFG.epochs] == curve and len(longer) == CFG.epochs + 1
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    # other settings in the same folder are refused rather than mixed
    with pytest.raises(ValueError, match="other settings"):
        train(target_dir, out, TrainConfig(**{**CFG.__dict__, "lr": 1e-4}), training_prompts(CFG.n_prompts),
              torch.device("cpu"), Console(quiet=True))
    # determinism: the same seed from scratch gives the same weights
    again = tmp_path / "again"
    train(target_dir, again, CFG, training_prompts(CFG.n_prompts), torch.device("cpu"), Console(quiet=True))
    target = load_model(target_dir, max_slots=8)
    a = load_head(again, target.args).state_dict()
    first = tmp_path / "first"
    train(target_dir, first, CFG, training_prompts(CFG.n_prompts), torch.device("cpu"), Console(quiet=True))
    b = load_head(first, target.args).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_training_prompts_are_distinct_and_share_no_topic_with_the_fresh_set():
    prompts = training_prompts(2000)
    assert len(set(prompts)) == len(prompts) == 2000
    from swiftspec.bench.prompts import builtin_prompts

    fresh = " ".join(p.text.lower() for p in builtin_prompts("fresh"))
    assert not [t for t in TOPICS if t.lower() in fresh]


class _NoProgress:
    def add_task(self, *a, **k):
        return 0

    def advance(self, *a, **k):
        pass
