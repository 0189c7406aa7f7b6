"""The batch-invariant mode (Transformer.make_batch_invariant): in 16-bit a verified tree node must compute,
bit for bit, what the one-token step that would have produced it computes, so that speculation is exact.
On the CPU through the one-row forwards, on CUDA (marked gpu) through the invariant Triton kernels."""

import dataclasses

import pytest
import torch
from tiny_models import single_thread, tiny_model_dir
from tree_steps import tree_and_steps as verified_and_stepped

from swiftspec.engine.config import Dtype, EngineConfig, SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.drafters import ModelDrafter
from swiftspec.engine.spec.loop import generate
from swiftspec.engine.spec.tree import target_inputs
from swiftspec.kernels import reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])]
PROMPT = [5, 17, 300, 42, 8, 99, 3, 250, 11, 64, 7, 480]
PARENTS = [-1, 0, 0, 1, 1, 3, 2, 5, 0, 8]  # a root with three branches, the deepest four levels long


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def model_dir():
    # Flat logits (small init, no lm_head scaling): near-ties, where rounding decides the argmax.
    return tiny_model_dir(seed=4, layers=3, hidden=128, heads=4, kv_heads=2, init_range=0.02, logit_scale=1.0)


def tree_and_steps(device: str, dtype: Dtype, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one verification of a 10-node tree behind PROMPT, and of the matching one-token steps."""
    model = load_model(model_dir(), device, dtype, max_slots=64, batch_invariant=invariant)
    return verified_and_stepped(model, PROMPT, PARENTS, 512, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [Dtype.BFLOAT16, Dtype.FLOAT16, Dtype.FLOAT32])
def test_tree_rows_equal_one_token_steps(device, dtype):
    tree, steps = tree_and_steps(device, dtype, invariant=True)
    assert torch.equal(tree, steps)


def attention_rows_and_steps(invariant: bool, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention of a 10-node tree behind a 700-token prefix, and of the one-token steps that
    would have computed each node: its ancestors' keys contiguous behind the prefix, in a wider cache."""
    g = torch.Generator().manual_seed(1)
    P, T, H, Hkv, D = 700, len(PARENTS), 8, 2, 64
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k, v = (torch.randn(Hkv, P + T, D, generator=g).to(dtype) for _ in range(2))
    _, _, mask = target_inputs(PARENTS, P)
    rows = reference.tree_attention(q, k, v, reference.prepare_mask(mask, H // Hkv, dtype, invariant))
    steps = []
    for t in range(T):
        keys = mask[t].nonzero().squeeze(1)
        kc, vc = (torch.cat([c[:, keys], c[:, :5]], dim=1) for c in (k, v))
        step_mask = torch.arange(len(keys) + 5)[None] < len(keys)
        steps.append(reference.tree_attention(q[t:t + 1], kc, vc, reference.prepare_mask(step_mask, H // Hkv, dtype,
                                                                                           invariant))[0])
    return rows, torch.stack(steps)


def test_attention_rows_equal_one_token_steps_over_their_key_lists():
    rows, steps = attention_rows_and_steps(invariant=True)
    assert torch.equal(rows, steps)


def test_without_key_lists_rows_depend_on_the_layout():
    """What the mode is for: with masked keys interleaved, the softmax and PV sums run in another order
    than over the step's contiguous keys, and the last bits differ (in 16-bit now and then a whole ulp,
    which over a long answer flips a greedy near-tie)."""
    rows, steps = attention_rows_and_steps(invariant=False)
    assert not torch.equal(rows, steps)
    torch.testing.assert_close(rows, steps)


def test_key_list_lists_each_rows_keys_in_order():
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    keys = reference.key_list(mask)
    assert keys.lengths.tolist() == [3, 1, 5]
    assert [keys.slots[t, :n].tolist() for t, n in enumerate(keys.lengths.tolist())] == [[0, 2, 3], [4], [0, 1, 2, 3, 4]]


def test_default_is_on():
    assert EngineConfig().batch_invariant == "auto"
    assert load_model(model_dir(), "cpu", Dtype.FLOAT32, max_slots=16).batch_invariant


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_speculation_equals_ar(device):
    target = TargetState(load_model(model_dir(), device, Dtype.BFLOAT16, max_slots=256), 256)
    params = SamplingParams(mode="ar", max_new_tokens=40, ignore_eos=True)
    ar = [t for s in generate(target, None, PROMPT, params) for t in s.tokens]
    draft = DraftState(ModelDrafter(load_model(model_dir(), device, Dtype.BFLOAT16, max_slots=512, batch_invariant=False)),
                       TreeParams(bs=8, w=4))
    for mode in ("sync", "async"):
        spec = [t for s in generate(target, draft, PROMPT, dataclasses.replace(params, mode=mode), 2) for t in s.tokens]
        assert spec == ar and len(ar) == 40, mode
