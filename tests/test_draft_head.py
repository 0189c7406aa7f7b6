"""The EAGLE-style draft head: training unrolling equals the tree forward, exact decoding with it, the
features it receives, checkpoints (ours and EAGLE's layout) and their errors."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.stats import chi_square_p
from tiny_models import single_thread, tiny_model_dir

from swiftspec.engine.config import DraftKind, SamplingParams, TreeParams
from swiftspec.engine.host.startup import resolve_draft
from swiftspec.engine.model.cpu_backends import PackedLinear
from swiftspec.engine.model.fp16_linear import FP16WeightLinear
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.spec import drafters
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.draft_head import DraftHead, HeadArgs, HeadDrafter, load_head, save_head
from swiftspec.engine.spec.draft_spec import DraftSpec, HeadError, is_head_dir
from swiftspec.engine.spec.drafters import make_drafter
from swiftspec.engine.spec.loop import generate
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.spec.tree_cache import causal_mask
from swiftspec.kernels.cpu_linear import Format
from swiftspec.train_draft import unroll

PROMPTS = [[5, 17, 300, 42, 8, 99], [1, 200, 201, 202, 203, 200, 201]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def target_dir():
    return tiny_model_dir(seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, max_slots=512)


def random_head(target, seed=0, d2t=None, std=0.1, final_norm=True) -> DraftHead:
    torch.manual_seed(seed)
    args = HeadArgs.for_target(target.args)
    args.final_norm = final_norm
    head = DraftHead(args, d2t)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
        for norm in (head.ffn_norm, head.norm):
            if norm is not None:
                norm.weight.fill_(1.0)
    head.attach_target(target.tok_embeddings.weight, target.output.weight)
    return head


def test_training_unrolling_equals_the_tree_forward(target):
    """Step s of train_draft.unroll at row j is, to rounding, what the drafter computes for the node at depth
    s - 1 of a tree rooted at j - s + 1 (prefix rows from true features, deeper rows from predictions)."""
    head = random_head(target, std=0.2)
    head.setup_cache(64)
    L, S, dim = 12, 3, target.args.dim
    x = torch.randint(0, 500, (1, L))
    f = torch.randn(1, L, dim)
    feat_in = torch.nn.functional.pad(f, (0, 0, 1, 0))[:, :L]
    outs = unroll(head, x, [feat_in] * S, torch.arange(L)[None])
    checked = 0
    for root in range(1, L - S + 1):
        head.setup_cache(64)
        pos = torch.arange(root)
        head(x[0, :root], feat_in[0, :root], pos, pos, causal_mask(0, root))
        prev = f[0, root - 1][None]
        for s in range(1, S + 1):
            j = root + s - 1
            o = head(x[0, j:j + 1], prev, torch.tensor([j]), torch.tensor([j]), torch.ones(1, j + 1, dtype=torch.bool))
            scale = outs[s - 1].abs().max()
            assert (o[0] - outs[s - 1][0, j]).abs().max() <= 1e-5 * scale
            prev = o
            checked += 1
    assert checked == (L - S) * S
    # and the unrolled steps differ from step 1 (the predicted features really feed the deeper rows)
    assert not torch.allclose(outs[0][0, S:], outs[1][0, S:])


def _drafter(target, head, bs=8, w=4):
    return DraftState(HeadDrafter(head, 1024), TreeParams(bs=bs, w=w))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("bs,w,d", [(8, 4, 2), (4, 2, 1)])
def test_speculation_with_a_head_equals_ar(target, mode, bs, w, d):
    t = TargetState(target, 512)
    state = _drafter(target, random_head(target), bs, w)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        ar = [tok for s in generate(t, None, prompt, replace(params, mode="ar")) for tok in s.tokens]
        steps = generate(t, state, prompt, replace(params, mode=mode), d)
        assert [tok for s in steps for tok in s.tokens] == ar and len(ar) == 40
        assert all(s.tree_size <= bs for s in steps)


@pytest.mark.parametrize("mode", ["sync", "async", "sync-gated"])
def test_the_head_receives_the_targets_features(target, mode):
    """After a conversation and a follow-up turn (KV reuse), the drafter's feature of every committed
    position equals the target's own final hidden state there, computed afresh. sync-gated: the target's
    step looks so short that drafting never pays, so most rounds skip it (PaybackGate) and the verified
    tokens pile up as pending until the next expansion; the output is still ar's."""
    t = TargetState(target, 512)
    drafter = HeadDrafter(random_head(target), 1024)
    gated = mode == "sync-gated"
    state = DraftState(drafter, TreeParams(bs=8, w=4), **(
        {"verify_cost": [1.0 + 0.05 * i for i in range(8)], "step_ms": 1e-4} if gated else {}))
    mode = mode.removesuffix("-gated")
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    steps = generate(t, state, PROMPTS[0], replace(params, mode=mode), 2)
    first = [tok for s in steps for tok in s.tokens]
    if gated:
        assert first == [tok for s in generate(t, None, PROMPTS[0], replace(params, mode="ar")) for tok in s.tokens]
        rounds = [s for s in steps if s.tree_size]
        assert 0 < sum(s.draft_ms > 0 for s in rounds) < len(rounds) / 2
    follow = PROMPTS[0] + first + [7, 8, 9]
    list(generate(t, state, follow, replace(params, mode=mode), 2))
    n = drafter.n_committed
    assert n == len(state.committed) > len(follow)
    fresh = load_model(tiny_model_dir(seed=1), max_slots=512)
    pos = torch.arange(n)
    _, hidden = fresh(torch.tensor(state.committed), pos, pos, causal_mask(0, n), logits_rows=slice(0, 0),
                      return_hidden=True)
    assert torch.allclose(drafter.features[:n], hidden, atol=1e-4, rtol=1e-4)


def echo_head(target) -> DraftHead:
    """A head built by hand to output its input feature (fc passes the feature, the layer is zero): it
    proposes, at every depth, the target's own prediction from the position before the root."""
    head = random_head(target, final_norm=False)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, target.args.dim:] = torch.eye(target.args.dim)
    return head


def test_a_head_that_echoes_the_feature_gets_accepted(target):
    """The echo head is right wherever the target repeats a token (504 504, 77 77 77 in this answer). Its
    drafts are accepted only if the target's features really reach the head (with zero features it
    proposes nothing useful)."""
    head = echo_head(target)
    t = TargetState(target, 512)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = [tok for s in generate(t, None, [77] * 4, replace(params, mode="ar")) for tok in s.tokens]
    repeats = sum(a == b for a, b in zip(ar, ar[1:], strict=False))
    assert repeats >= 3
    steps = generate(t, _drafter(target, head), [77] * 4, replace(params, mode="sync"), 2)
    assert [tok for s in steps for tok in s.tokens] == ar
    assert sum(s.accepted for s in steps) >= repeats


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sampling_with_a_head_is_lossless(target, target_dir, mode):
    """Sampling through the shipped loops with the echo head drafting: the first two tokens (the
    prefill's draw, then the first verification's) follow p(t1) p(t2 | t1) of the processed target
    distribution (chi-square over every seed's answer), while the head's drafts are really accepted."""

    params = SamplingParams(mode=mode, temperature=1.0, top_k=3, max_new_tokens=2, ignore_eos=True)
    prompt = [77] * 4
    fresh = load_model(target_dir, max_slots=16)  # the exact law, from a model no loop has touched
    sampler = Sampler(params)

    def law(context: list[int]) -> torch.Tensor:
        pos = torch.arange(len(context))
        return sampler.probs(fresh(torch.tensor(context), pos, pos, causal_mask(0, len(context)))[-1])

    p1 = law(prompt)
    cells = [(a, b) for a in p1.nonzero().flatten().tolist() for b in law(prompt + [a]).nonzero().flatten().tolist()]
    expected = torch.tensor([float(p1[a] * law(prompt + [a])[b]) for a, b in cells])
    t, state = TargetState(target, 512), _drafter(target, echo_head(target), bs=4, w=4)
    counts, accepted, trials = torch.zeros(len(cells)), 0, 1500
    for seed in range(trials):
        steps = generate(t, state, prompt, replace(params, seed=seed), 2)
        pair = tuple(tok for s in steps for tok in s.tokens)
        assert pair in cells, pair  # a token outside the top-k support would be a bug, not noise
        counts[cells.index(pair)] += 1
        accepted += sum(s.accepted for s in steps)
    assert chi_square_p(counts, expected) > 1e-3
    assert accepted > 0.2 * trials


# ------------------------------------------------------------------------------------------ checkpoints

def test_our_format_round_trips(target, target_dir, tmp_path):
    d2t = torch.tensor([2, 5, 7, 11, 300])
    head = random_head(target, d2t=d2t)
    save_head(head, tmp_path / "head")
    assert is_head_dir(tmp_path / "head")
    loaded = load_head(tmp_path / "head", target.args)
    loaded.attach_target(target.tok_embeddings.weight, target.output.weight)
    assert torch.equal(loaded.d2t, d2t)
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert loaded.lm_head_weight.shape[0] == 5
    assert resolve_draft(str(tmp_path / "head"), target_dir) == DraftSpec(DraftKind.HEAD, tmp_path / "head")


def _packed_by_make_drafter(target, target_dir, tmp_path):
    """A random head (a sub-vocabulary) saved and loaded by make_drafter on the CPU; its fp32 original."""
    head = random_head(target, d2t=torch.arange(0, 320, 3))
    save_head(head, tmp_path / "head")
    return head, make_drafter(DraftSpec.of(str(tmp_path / "head")), target_dir, False, False, load=None).head


def _same_head_to(head: DraftHead, packed: DraftHead, tol: float) -> None:
    """The packed head's features and logits are the fp32 head's to ``tol`` of their largest magnitude,
    and not its bits."""
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    n = 12
    tokens, pos = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(0)), torch.arange(n)
    feats = torch.randn(n, head.args.dim, generator=torch.Generator().manual_seed(1))
    outs = []
    for h in (head, packed):
        h.setup_cache(64)
        outs.append(h(tokens, feats, pos, pos, causal_mask(0, n)))
    logits = [h.logits(outs[0]) for h in (head, packed)]
    for a, b in (outs, logits):
        assert (b - a).abs().max() <= tol * a.abs().max()
    assert not torch.equal(*logits)  # it is the packed path


def test_the_cpu_drafter_runs_the_head_on_the_kernels(target, target_dir, tmp_path):
    """make_drafter on the CPU with the kernels: the head's linears and lm_head rows become Q8 blocks of
    the row-invariant kernels, and its features and logits stay the fp32 head's to 8-bit rounding."""
    head, packed = _packed_by_make_drafter(target, target_dir, tmp_path)
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.feed_forward.w13, PackedLinear)
    assert {m.fmt for m in packed.modules() if isinstance(m, PackedLinear)} == {Format.Q8}
    _same_head_to(head, packed, 2e-2)


def test_without_the_kernels_the_cpu_drafter_packs_the_head_in_fp16(target, target_dir, tmp_path, monkeypatch):
    """Where the kernels cannot be built, the head's linears and lm_head rows become FBGEMM fp16-weight
    linears instead, to fp16 rounding."""
    monkeypatch.setattr(drafters, "kernels_available", lambda args=None: "no C compiler")
    head, packed = _packed_by_make_drafter(target, target_dir, tmp_path)
    assert isinstance(packed.lm_head, FP16WeightLinear) and isinstance(packed.feed_forward.w13, FP16WeightLinear)
    _same_head_to(head, packed, 1e-3)


EXPANSION_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "head_expansion.py"


def test_the_expansion_benchmark_times_each_backend(target, target_dir, tmp_path):
    """benchmarks/head_expansion.py times a saved head's expansions with FBGEMM and with the kernels at each
    activation width."""
    save_head(random_head(target, d2t=torch.arange(0, 320, 3)), tmp_path / "head")
    out = tmp_path / "expansion.json"
    proc = subprocess.run([sys.executable, str(EXPANSION_SCRIPT), "--model", str(target_dir), "--head",
                           str(tmp_path / "head"), "--leaves", "1,3", "--context", "20", "--reps", "3", "--json",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ms = json.loads(out.read_text())["ms"]
    kernels = [name for name in ms if name.startswith("kernels Q8")]
    assert [name.split(" · ")[1] for name in kernels] == ["int16 activations", "int8 activations"]
    assert ("FBGEMM fp16 weights" in ms) == drafters.fbgemm_available()
    assert all(set(times) == {"1", "3"} and min(times.values()) > 0 for times in ms.values())


def _eagle_checkpoint(head: DraftHead, out, dim_override=None, fmt="safetensors"):
    """The public EAGLE v1/v2 layout: a one-layer Llama config and fc / layers.0.* weights."""
    a = head.args
    q, k, v = head.attention.wqkv.weight.split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim,
                                                a.n_kv_heads * a.head_dim])
    gate, up = head.feed_forward.w13.weight.chunk(2)
    w = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias,
         "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
         "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": head.attention.wo.weight,
         "layers.0.post_attention_layernorm.weight": head.ffn_norm.weight,
         "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
         "layers.0.mlp.down_proj.weight": head.feed_forward.w2.weight,
         "embed_tokens.weight": head.embed_weight}
    w = {n: t.detach().clone().contiguous() for n, t in w.items()}
    out.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": dim_override or a.dim, "num_hidden_layers": 1,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
           "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps,
           "rope_theta": a.rope_theta, "bias": True}
    (out / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(w, str(out / "model.safetensors"))
    else:
        torch.save(w, out / "pytorch_model.bin")


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_layout_loads_as_the_same_head(target, tmp_path, fmt):
    head = random_head(target, final_norm=False)  # EAGLE v1/v2 heads have no final norm
    _eagle_checkpoint(head, tmp_path / "eagle", fmt=fmt)
    assert is_head_dir(tmp_path / "eagle")
    loaded = load_head(tmp_path / "eagle", target.args)
    loaded.attach_target(target.tok_embeddings.weight, target.output.weight)
    for h in (head, loaded):
        h.setup_cache(16)
    pos = torch.arange(5)
    toks, feats = torch.tensor([3, 9, 27, 81, 243]), torch.randn(5, target.args.dim)
    a = head(toks, feats, pos, pos, causal_mask(0, 5))
    b = loaded(toks, feats, pos, pos, causal_mask(0, 5))
    assert torch.equal(a, b)


def test_a_head_for_another_target_is_refused(target, target_dir, tmp_path):
    _eagle_checkpoint(random_head(target), tmp_path / "eagle", dim_override=target.args.dim * 2)
    with pytest.raises(HeadError, match=rf"hidden size {target.args.dim * 2}.*target has hidden size {target.args.dim}"):
        resolve_draft(str(tmp_path / "eagle"), target_dir)


def test_a_corrupt_head_is_a_clear_error(target, target_dir, tmp_path):
    save_head(random_head(target), tmp_path / "head")
    data = (tmp_path / "head" / "model.safetensors").read_bytes()
    (tmp_path / "head" / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(HeadError, match="cannot read the draft head"):
        resolve_draft(str(tmp_path / "head"), target_dir)
    (tmp_path / "head" / "model.safetensors").write_bytes(data)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**cfg, "swiftspec_draft_head": 99}))
    with pytest.raises(HeadError, match="format 99"):
        resolve_draft(str(tmp_path / "head"), target_dir)
