"""The CPU backends (engine/model/cpu_backends.py over kernels/cpu/): each row of a multi-row forward
equals a one-row forward bit for bit, for every backend, row count and tree shape, so every decoding mode's
greedy output is the target's by construction; the kernels compute what their formats stand for; the
gguf backend stays close to the fp32 dequantised model; --dtype auto chooses by measurement."""

import dataclasses
import gc
import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_gguf, q4_k_blocks, single_thread, tiny_model_dir
from tree_steps import tree_and_steps as verified_and_stepped

from swiftspec.engine.config import Dtype, KvCache, SamplingParams, TreeParams
from swiftspec.engine.model import cpu_backends, cpu_blocks, gguf_io
from swiftspec.engine.model.cpu_backends import PackedLinear
from swiftspec.engine.model.cpu_blocks import Blocks
from swiftspec.engine.model.loader import LoadError, load_model, read_hf_state_dict
from swiftspec.engine.model.transformer import rope_cos_sin
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.drafters import ModelDrafter
from swiftspec.engine.spec.loop import generate
from swiftspec.engine.spec.tree import target_inputs
from swiftspec.kernels import cpu_linear, reference
from swiftspec.kernels.cpu_linear import Format

PROMPT = [5, 17, 300, 42, 8, 99, 3, 250, 11, 64, 7, 280]
TREES = {  # parents of each node: a chain, a star, and a root with three branches of unequal depth
    "chain": [-1, 0, 1, 2, 3, 4, 5, 6],
    "star": [-1, 0, 0, 0, 0, 0, 0, 0],
    "branches": [-1, 0, 0, 1, 1, 3, 2, 5],
}
BACKENDS = [Dtype.FLOAT32, Dtype.FLOAT16, Dtype.BFLOAT16, Dtype.GGUF, Dtype.INT4]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """A converted tiny GGUF whose layers hold Q4_0, Q4_1 and Q8_0 blocks (and Q5_0 / F16, dequantised)."""
    root = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWIFTSPEC_CACHE", str(root / "cache"))
        return gguf_io.ensure_converted(make_tiny_gguf(root / "tiny.gguf", layers=3, hidden=128))


def float_dir():
    return tiny_model_dir(seed=4, layers=3, hidden=128, heads=4, kv_heads=2, init_range=0.02, logit_scale=1.0)


def model_for(backend: Dtype, gguf_dir, slots: int = 128):
    return load_model(gguf_dir if backend is Dtype.GGUF else float_dir(), "cpu", backend, max_slots=slots)


def tree_and_steps(model, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return verified_and_stepped(model, PROMPT, parents, 300)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_rows_equal_one_token_steps(backend, tree, gguf_dir):
    model = model_for(backend, gguf_dir)
    assert isinstance(model.output, PackedLinear) and model.precision
    for n in range(1, len(TREES[tree]) + 1):  # every row count 1..bs
        rows, steps = tree_and_steps(model, TREES[tree][:n])
        assert torch.equal(rows, steps), (backend, tree, n)


def forward_in_both_ways(model) -> list[torch.Tensor]:
    """A verified tree (logits, and every second row's logits with the hidden states), then the cache, run
    as one call (CpuForward) and as the modules in turn (CpuLayers, CpuNorm, PackedLinear), in that order."""
    found = []
    whole = model.whole_forward
    for run in (whole, None):
        model.whole_forward = run
        rows, _ = tree_and_steps(model, TREES["branches"])
        positions, slots, mask = target_inputs(TREES["branches"], len(PROMPT))
        tokens = torch.arange(3, 3 + len(TREES["branches"]))
        picked, hidden = model(tokens, positions, slots, mask, logits_rows=slice(1, None, 2), return_hidden=True)
        found.append([rows, picked, hidden, model.k_cache.clone(), model.v_cache.clone()])
    model.whole_forward = whole
    return found


@pytest.mark.parametrize("backend", [Dtype.GGUF, Dtype.FLOAT32, Dtype.INT4])
def test_the_forward_in_one_call_computes_the_modules_in_turn(backend, gguf_dir):
    """Without TP a forward is one call into the kernels (embedding lookup, layers, final norm, lm_head);
    with TP the modules run in turn, around the all-reduces: the same bits, and the same cache contents. The
    embedding from a GGUF's Q8 blocks, int4's tied Q8 blocks, and float rows."""
    model = load_model(float_dir(), "cpu", backend, max_slots=128) if backend is Dtype.INT4 \
        else model_for(backend, gguf_dir)
    assert isinstance(model.whole_forward, cpu_backends.CpuForward)
    assert isinstance(model.layers, cpu_backends.CpuLayers) and isinstance(model.norm, cpu_backends.CpuNorm)
    whole, in_turn = forward_in_both_ways(model)
    n = len(TREES["branches"])
    assert whole[1].shape == (n // 2, model.args.vocab_size) and whole[2].shape == (n, model.args.dim)
    assert all(torch.equal(a, b) for a, b in zip(whole, in_turn, strict=True))


def test_the_forward_in_one_call_looks_up_an_embedding_of_q4_blocks(gguf_dir):
    """A GGUF may store its embedding as Q4 blocks (Q4_0 files do): the lookup in C gives each row as the
    blocks stand for it, d q + m, the same bits as the modules' lookup."""
    model = model_for(Dtype.GGUF, gguf_dir)
    q4 = Blocks.quantize(model.tok_embeddings.weight, Format.Q4).in_panels()
    model.tok_embeddings = cpu_backends.BlockEmbedding(q4)
    model.whole_forward = cpu_backends.CpuForward(cpu_backends.library(), model)
    whole, in_turn = forward_in_both_ways(model)
    assert all(torch.equal(a, b) for a, b in zip(whole, in_turn, strict=True))


def test_the_forward_in_one_call_extends_its_rope_tables_and_checks_tokens(gguf_dir):
    """RoPE's tables cover the cache's slots at first and grow for a later position, with the bits a
    forward's own cos and sin would have; a token outside the vocabulary is an IndexError, as torch's
    lookup raises."""
    model = model_for(Dtype.GGUF, gguf_dir, slots=64)
    whole = model.whole_forward
    at = torch.tensor([1000])
    mask = torch.ones(1, 1, dtype=torch.bool)
    logits = model(torch.tensor([7]), at, torch.tensor([0]), mask)
    assert whole.spec.rope_positions >= 1001
    cos, sin = rope_cos_sin(at, model.inv_freq)
    assert torch.equal(whole.cos[1000:1001], cos) and torch.equal(whole.sin[1000:1001], sin)
    model.whole_forward = None
    assert torch.equal(model(torch.tensor([7]), at, torch.tensor([0]), mask), logits)
    model.whole_forward = whole
    with pytest.raises(IndexError):
        model(torch.tensor([model.args.vocab_size]), at, torch.tensor([0]), mask)


def test_the_gguf_backend_keeps_its_kv_cache_in_half_rounded_to_nearest_even(gguf_dir):
    """The kernels write the keys and values as halves: the first layer's (whose inputs do not depend on
    the cache) are the float cache's rounded as torch rounds them."""
    model = model_for(Dtype.GGUF, gguf_dir)
    assert model.k_cache.dtype == model.v_cache.dtype == torch.float16 and "· fp16 KV ·" in model.precision
    tree_and_steps(model, TREES["branches"])
    halves = model.k_cache[0].clone(), model.v_cache[0].clone()
    floats = load_model(gguf_dir, "cpu", Dtype.GGUF, max_slots=128, kv_cache=KvCache.FLOAT32)
    assert floats.k_cache.dtype == torch.float32 and "· fp32 KV ·" in floats.precision
    tree_and_steps(floats, TREES["branches"])
    assert halves[0].abs().sum() > 0
    assert all(torch.equal(h, f[0].half()) for h, f in zip(halves, (floats.k_cache, floats.v_cache), strict=True))


def test_a_float_backend_keeps_floats_unless_told_and_its_rows_stay_independent_over_halves():
    model = load_model(float_dir(), "cpu", Dtype.FLOAT32, max_slots=128)
    assert model.k_cache.dtype == torch.float32
    halves = load_model(float_dir(), "cpu", Dtype.FLOAT32, max_slots=128, kv_cache=KvCache.FLOAT16)
    assert halves.k_cache.dtype == torch.float16
    rows, steps = tree_and_steps(halves, TREES["branches"])
    assert torch.equal(rows, steps)


def test_the_kv_cache_setting_is_the_cpu_kernels():
    with pytest.raises(LoadError, match="--kv-cache float16"):
        load_model(float_dir(), "cuda", Dtype.FLOAT32, kv_cache=KvCache.FLOAT16)


def test_the_gguf_backend_runs_the_files_own_blocks(gguf_dir):
    model = model_for(Dtype.GGUF, gguf_dir)
    fmts = {name: m.fmt for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert fmts["layers.1.attention.wqkv"] == Format.Q4  # Q4_1 rows fused as blocks
    assert fmts["layers.0.attention.wqkv"] == Format.F32  # q/k Q4_1 with v Q8_0: dequantised
    assert fmts["layers.1.feed_forward.w13"] == Format.Q8 and fmts["layers.0.attention.wo"] == Format.Q4  # Q4_0
    assert fmts["output"] == Format.Q4  # the tiny GGUF's lm_head is Q4_0
    assert isinstance(model.tok_embeddings, cpu_backends.BlockEmbedding)
    hf = read_hf_state_dict(gguf_dir)  # dequantised as transformers does
    emb = model.tok_embeddings(torch.arange(10))
    assert torch.equal(emb, hf["model.embed_tokens.weight"][:10])
    assert fmts["layers.2.feed_forward.w2"] == Format.Q4  # Q4_K
    assert model.precision.startswith("gguf (Q4_0/Q4_1/Q4_K blocks) · int16 activations")


def test_gguf_logits_stay_close_to_the_fp32_dequantised_model(gguf_dir):
    """int16 activations: within 0.2 % of the logits' range of the fp32 model's."""
    ours, fp32 = model_for(Dtype.GGUF, gguf_dir), load_model(gguf_dir, "cpu", Dtype.FLOAT32, max_slots=128, batch_invariant=False)
    a, _ = tree_and_steps(ours, TREES["branches"])
    b, _ = tree_and_steps(fp32, TREES["branches"])
    assert (a - b).abs().max() < 0.002 * (b.max() - b.min())


@pytest.mark.parametrize("fmt", list(Format))
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_rows_are_independent_and_compute_the_format(fmt, threads):
    dll = cpu_backends.library()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 320, generator=g) * 0.1  # 10 blocks a row: one group of 8 and two alone
    bias = torch.randn(200, generator=g)
    if fmt in (Format.Q4, Format.Q8):
        packed = Blocks.quantize(w, fmt)
        lin, exact = PackedLinear(dll, packed, fmt, bias), packed.dequantize()
    else:
        lin = PackedLinear(dll, w, fmt, bias)
        exact = w.to({Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.bfloat16}[fmt]).float()
    x = torch.randn(11, 320, generator=g)
    cpu_linear.set_threads(dll, threads)
    try:
        out = lin(x)
        alone = [lin(x[i:i + 1]) for i in range(len(x))]
    finally:
        cpu_linear.set_threads(dll, 1)
    assert all(torch.equal(out[i:i + 1], row) for i, row in enumerate(alone))
    assert torch.equal(out, lin(x))  # and with one thread
    want = x @ exact.T + bias
    tol = 2e-4 if fmt in (Format.Q4, Format.Q8) else 1e-5  # int16 activations: 1/65534 of a block's max
    assert (out - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
@pytest.mark.parametrize("columns", [5, 16, 37])  # one padded panel, one whole, two and a padded one
def test_the_panels_hold_the_same_weights(fmt, columns):
    blocks = Blocks.quantize(torch.randn(columns, 32 * 19), fmt)
    panels = blocks.in_panels()
    assert panels.panels and panels.shape == blocks.shape and panels.qs.shape[0] == -(-columns // 16)
    assert torch.equal(cpu_blocks.from_panels(panels.qs, columns), blocks.qs)
    assert torch.equal(panels.in_gguf_order().d, blocks.d)
    assert torch.equal(panels.dequantize(), blocks.dequantize())
    assert torch.equal(panels.rows(torch.tensor([3, 1, columns - 1])).dequantize(),
                       blocks.dequantize()[[3, 1, columns - 1]])
    if columns == 16:  # column c's pair j of block b: 2 bytes at (b, j, c)
        pairs = panels.qs.view(torch.int16).reshape(1, 19, -1, 16)
        assert torch.equal(pairs[0, 7, 2, 11], blocks.qs[11, 7].view(torch.int16)[2])


def test_q4_blocks_dequantise_as_gguf_does():
    """Q4_0 as d * (q - 8), Q4_1 as d * q + m and Q4_K as (d * scale) q - dmin * min, from the file's bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quants

    w = torch.randn(8, 64).numpy()
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        raw = quants.quantize(w, GGMLQuantizationType[kind])
        want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]))
        torch.testing.assert_close(Blocks.from_gguf(torch.from_numpy(raw), kind).dequantize(), want, rtol=1e-6, atol=1e-6)
    raw = q4_k_blocks(np.random.default_rng(0), 8, 512)  # Q4_K: gguf-py only dequantises it
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K))
    assert torch.equal(Blocks.from_gguf(torch.from_numpy(raw), "Q4_K").dequantize(), want)
    assert torch.equal(gguf_io.dequantize(torch.from_numpy(raw), "Q4_K"), want)  # as the conversion checks


def test_in_huge_pages_moves_tensors_in_place():
    """Every reference to a moved tensor sees its values at the new place, one mapping from a 2 MB boundary
    on, which outlives the call."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 7, generator=g), torch.randint(-128, 127, (1000,), dtype=torch.int8, generator=g),
               torch.randn(5, 3, generator=g).half()]
    before = [t.clone() for t in tensors]
    alias = tensors[1]
    cpu_backends.in_huge_pages(tensors)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no way to ask this OS for huge pages")
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % cpu_backends.HUGE_PAGE == 0 and starts == sorted(starts)
    assert starts[-1] - starts[0] < cpu_backends.HUGE_PAGE and all(s % 64 == 0 for s in starts)
    assert alias.data_ptr() == starts[1]
    gc.collect()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b) and t.is_contiguous()


def test_the_kernels_weights_and_cache_live_in_huge_pages(gguf_dir):
    """The packed weights in one mapping, in the order a forward reads them, and the KV cache in another."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no way to ask this OS for huge pages")
    model = model_for(Dtype.GGUF, gguf_dir)
    packed = [t for m in model.modules() if isinstance(m, PackedLinear) for t in (m.qs, m.d, m.m) if t is not None]
    starts = [t.data_ptr() for t in packed]
    assert starts[0] % cpu_backends.HUGE_PAGE == 0 and starts == sorted(starts)
    lm_head = [t.data_ptr() for t in (model.output.qs, model.output.d, model.output.m) if t is not None]
    assert starts[-len(lm_head):] == lm_head  # read last
    assert model.k_cache.data_ptr() % cpu_backends.HUGE_PAGE == 0
    model.setup_cache(64)  # again, another size
    assert model.k_cache.data_ptr() % cpu_backends.HUGE_PAGE == 0 and model.max_slots == 64


def test_attention_rows_are_independent_and_match_the_reference():
    dll = cpu_backends.library()
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, D, P = 8, 8, 2, 64, 300
    q = torch.randn(T, H, D, generator=g)
    k, v = (torch.randn(Hkv, P + 16, D, generator=g) for _ in range(2))
    _, _, mask = target_inputs(TREES["branches"], P)
    att = cpu_backends.CpuAttention(dll)
    out = att.tree_attention(q, k[:, :P + T], v[:, :P + T], mask)
    for t in range(T):
        assert torch.equal(att.tree_attention(q[t:t + 1], k[:, :P + T], v[:, :P + T], mask[t:t + 1]), out[t:t + 1])
    want = reference.tree_attention(q, k[:, :P + T], v[:, :P + T], reference.prepare_mask(mask, H // Hkv, torch.float32))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculation_equals_ar(backend, gguf_dir):
    target = TargetState(model_for(backend, gguf_dir, 256), 256)
    params = SamplingParams(mode="ar", max_new_tokens=40, ignore_eos=True)
    ar = [t for s in generate(target, None, PROMPT, params) for t in s.tokens]
    draft_dir = gguf_dir if backend is Dtype.GGUF else float_dir()
    draft = DraftState(ModelDrafter(load_model(draft_dir, "cpu", Dtype.FLOAT32, max_slots=512, batch_invariant=False)),
                       TreeParams(bs=8, w=4))
    for mode in ("sync", "async"):
        spec = [t for s in generate(target, draft, PROMPT, dataclasses.replace(params, mode=mode), 2) for t in s.tokens]
        assert spec == ar and len(ar) == 40, (backend, mode)


def test_auto_weighs_step_time_against_verification_cost():
    from swiftspec.engine.worker.profiling import expected_rate

    flat, steep = [10.0, 11.0, 12.0, 13.0], [9.0, 18.0, 27.0, 36.0]
    assert expected_rate(steep, 0.0) > expected_rate(flat, 0.0)  # plain decoding: the faster step
    assert expected_rate(flat, 0.5) > expected_rate(steep, 0.5)  # speculation: cheap extra rows
    assert expected_rate(flat, 0.5) == pytest.approx(1.75 / 12.0)  # three rows: the best subtree


def test_synthetic_costs_measure_every_row_count():
    from swiftspec.engine.model.model_args import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((float_dir() / "config.json").read_text()))
    for backend in (Dtype.GGUF, Dtype.FLOAT16):
        costs = cpu_backends.synthetic_costs(args, backend, 4)
        assert len(costs) == 4 and all(c > 0 for c in costs)


def test_widths_the_kernels_cannot_take_fall_back_to_one_row_forwards():
    odd = tiny_model_dir(seed=1, layers=1, hidden=48, heads=4, kv_heads=2)
    model = load_model(odd, "cpu", Dtype.AUTO, max_slots=32)
    assert not isinstance(model.output, PackedLinear) and model.batch_invariant  # exact, the slow way
    assert "multiples of 32" in cpu_backends.kernels_available(model.args)


STEP_PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"


def test_the_step_profile_times_a_forward_by_part(gguf_dir, tmp_path):
    """benchmarks/step_profile.py runs a GGUF target on the kernels built with the blocks' timers: each part's
    time is there, the layers' parts and the lm_head within the forward. The engine's own build has no timers."""
    assert cpu_backends.library().ss_step_profile(None) == -1
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(STEP_PROFILE), "--model", str(gguf_dir), "--threads", "1,2", "--rows",
                           "1,3", "--context", "12", "--reps", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "gguf" in result["precision"] and [(r["threads"], r["rows"]) for r in result["results"]] == \
        [(1, 1), (1, 3), (2, 1), (2, 3)]
    for r in result["results"]:
        ms = r["ms"]
        inside = sum(ms[p] for p in ("wqkv", "wo", "w13", "w2", "attention", "glue", "lm_head"))
        assert all(ms[p] > 0 for p in ("wqkv", "wo", "w13", "w2", "attention", "lm_head"))
        assert inside < ms["forward"] and 0 < r["linears_share"] < 1
