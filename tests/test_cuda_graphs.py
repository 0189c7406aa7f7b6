"""GraphedModel (engine/model/cuda_graphs.py) and the TP all-reduce (engine/model/allreduce.py).

On CPU: the padded forward (``capture=False``, the graph path without capture) gives the plain model's
logits and K/V, and its scratch slot never touches a real slot. On CUDA (marked gpu): graph replays give
eager bf16 results, and the one-shot all-reduce sums like NCCL (two GPUs).
"""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swiftspec.engine.config import Dtype
from swiftspec.engine.model.cuda_graphs import GraphedModel
from swiftspec.engine.model.loader import load_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
USABLE = 100  # slots the engine may use; the wrapped model has one more (the scratch slot)
VOCAB = 97
# fp32: padded and plain forwards differ only in GEMM row counts and in masked (weight 0) keys.
FP32_TOL = dict(rtol=1e-4, atol=1e-4)  # MKL takes other kernels for 39 and 64 rows: ~2e-5 apart; a padding bug is O(1)


@pytest.fixture(autouse=True)
def one_thread():
    """A 64-wide model gains nothing from threads, and on a shared CPU they only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama (GQA 4:2), with large weights so that greedy choices have clear margins."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return path


def load_pair(model_dir, device="cpu", dtype=Dtype.AUTO, **graph_kw):
    """(plain model, the same weights wrapped) with the same usable slots; kv buckets from 16 so that a
    100-slot cache crosses several."""
    plain = load_model(model_dir, device, dtype, max_slots=USABLE)
    wrapped = GraphedModel(load_model(model_dir, device, dtype, max_slots=USABLE + 1), min_kv=16, **graph_kw)
    assert wrapped.max_slots == wrapped.usable_slots == USABLE
    return plain, wrapped


def causal(start: int, n: int) -> torch.Tensor:
    return torch.ones(n, start + n, dtype=torch.bool).tril(start)


def tree_mask(parents: list[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target verification inputs for a tree at slots prefix..: (mask [n, prefix + n], positions)."""
    n = len(parents)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    depth = []
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
        mask[i, prefix + i] = True
        depth.append(0 if p < 0 else depth[p] + 1)
    return mask, prefix + torch.tensor(depth)


def calls(device) -> list[tuple]:
    """The engine's shapes, in order over one growing context: a short prefill, ar steps, a target tree
    verification (several logits_rows forms), a draft expansion of leaves at scattered slots with a
    non-square mask, and a chunk that fills the cache up to its last usable slot."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=g)
    out = [(rand(13), torch.arange(13), torch.arange(13), causal(0, 13), {})]
    for i in range(13, 40):  # kv 14..40: buckets 16, 32, 64
        out.append((rand(1), torch.tensor([i]), torch.tensor([i]), causal(i, 1), {}))
    parents = [-1, 0, 0, 1, 1, 2, 3]
    mask, pos = tree_mask(parents, 40)
    slots = torch.arange(40, 47)
    toks = rand(7)
    out += [(toks, pos, slots, mask, {}),
            (toks, pos, slots, mask, dict(logits_rows=torch.tensor([0, 3, 6]))),
            (toks, pos, slots, mask, dict(logits_rows=slice(-1, None), return_hidden=True))]
    # A smaller tree over the same slots, in the same bucket: stale pad slots would overwrite 45, 46.
    mask, pos = tree_mask([-1, 0, 1, 1, 2], 40)
    out.append((rand(5), pos, torch.arange(40, 45), mask, {}))
    # Draft leaves at scattered slots, each seeing the prefix, some tree slots and itself; the second
    # expansion, in the same bucket, has fewer mask columns (stale ones would stay True).
    for leaf_slots, sees, kv_len in (([52, 47, 60], [[41, 44], [40], [42, 45]], 61),
                                     ([53, 48, 55], [[41], [43, 47], [44]], 56)):
        mask = torch.zeros(3, kv_len, dtype=torch.bool)
        mask[:, :40] = True
        for row, (slot, seen) in enumerate(zip(leaf_slots, sees, strict=True)):
            mask[row, seen + [slot]] = True
        out.append((rand(3), torch.tensor([43, 41, 43]), torch.tensor(leaf_slots), mask,
                    dict(logits_rows=slice(0, 3))))
    out.append((rand(39), torch.arange(61, 100), torch.arange(61, 100), causal(61, 39), {}))  # kv 100
    return [(t.to(device), p.to(device), s.to(device), m.to(device), kw) for t, p, s, m, kw in out]


def as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def test_padded_forward_matches_plain_model(model_dir):
    plain, wrapped = load_pair(model_dir, capture=False)
    for i, (tokens, pos, slots, mask, kw) in enumerate(calls("cpu")):
        want = as_tuple(plain(tokens, pos, slots, mask, **kw))
        got = as_tuple(wrapped(tokens, pos, slots, mask, **kw))
        assert [g.shape for g in got] == [w.shape for w in want], i
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **FP32_TOL, msg=lambda m, i=i: f"call {i}: {m}")
    # Every bucket the calls needed, and no other: (token bucket, kv bucket), kv capped at the cache.
    assert set(wrapped._static) == {(16, 16), (1, 16), (1, 32), (1, 64), (8, 64), (4, 64), (64, 101)}
    # Real slots hold the plain model's K/V; the scratch slot got the pad rows' K/V and nothing else did.
    for ours, theirs in ((wrapped.k_cache, plain.k_cache), (wrapped.v_cache, plain.v_cache)):
        torch.testing.assert_close(ours[:, :, :USABLE], theirs, **FP32_TOL)
        assert ours[:, :, USABLE].abs().sum() > 0


def test_padded_forward_is_bit_exact_in_bf16(model_dir):
    """bf16 takes the batch-invariant mode (the default off fp32-on-CPU): padding rows and kv columns can
    then change nothing in a real row, and the graph path gives the plain model's logits and K/V bit for bit."""
    plain, wrapped = load_pair(model_dir, dtype=Dtype.BFLOAT16, capture=False)
    assert plain.batch_invariant and wrapped.batch_invariant
    for i, (tokens, pos, slots, mask, kw) in enumerate(calls("cpu")):
        want = as_tuple(plain(tokens, pos, slots, mask, **kw))
        got = as_tuple(wrapped(tokens, pos, slots, mask, **kw))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), i
    assert torch.equal(wrapped.k_cache[:, :, :USABLE], plain.k_cache)
    assert torch.equal(wrapped.v_cache[:, :, :USABLE], plain.v_cache)


def test_scratch_slot_is_never_a_real_slot(model_dir):
    """Pad rows of a 3-token call (bucket 4) write only the scratch slot: untouched slots stay zero."""
    _, wrapped = load_pair(model_dir, capture=False)
    wrapped(torch.tensor([5, 6, 7]), torch.arange(3), torch.tensor([0, 1, 9]), torch.ones(3, 10, dtype=torch.bool))
    written = (wrapped.k_cache != 0).any(dim=(0, 1, 3))
    assert written.nonzero().flatten().tolist() == [0, 1, 9, USABLE]


def test_long_calls_and_cpu_capture_run_the_plain_model(model_dir):
    plain, wrapped = load_pair(model_dir)  # capture=True on CPU: no graphs, plain calls
    _, padded = load_pair(model_dir, capture=False)
    args = (torch.arange(3, 73), torch.arange(70), torch.arange(70), causal(0, 70))  # 70 > 64 tokens
    want = plain(*args)
    assert torch.equal(wrapped(*args), want) and torch.equal(padded(*args), want)
    step = (torch.tensor([3]), torch.tensor([70]), torch.tensor([70]), causal(70, 1))
    assert torch.equal(wrapped(*step), plain(*step))
    assert not wrapped._static and not padded._static


def test_setup_cache_keeps_the_scratch_slot_and_drops_buckets(model_dir):
    _, wrapped = load_pair(model_dir, capture=False)
    wrapped(torch.tensor([5]), torch.tensor([0]), torch.tensor([0]), causal(0, 1))
    assert wrapped._static
    wrapped.setup_cache(40)
    assert wrapped.max_slots == 40 and wrapped.model.max_slots == 41 and not wrapped._static


# ------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@cuda
def test_gpu_graph_replays_match_eager_bf16(model_dir):
    """Three bf16 copies see the same calls: plain eager, padded eager, and graph replays. Replays equal
    the padded eager forward (same kernels, same shapes) and stay within bf16 rounding of plain eager;
    earlier results are copies that later replays do not overwrite."""
    plain, graphed = load_pair(model_dir, "cuda")
    padded = GraphedModel(load_model(model_dir, "cuda", max_slots=USABLE + 1), min_kv=16, capture=False)
    results = []
    for i, (tokens, pos, slots, mask, kw) in enumerate(calls("cuda")):
        want = as_tuple(plain(tokens, pos, slots, mask, **kw))
        same_shapes = as_tuple(padded(tokens, pos, slots, mask, **kw))
        got = as_tuple(graphed(tokens, pos, slots, mask, **kw))
        for g, s, w in zip(got, same_shapes, want, strict=True):
            torch.testing.assert_close(g, s, rtol=1e-2, atol=1e-2, msg=lambda m, i=i: f"call {i}: {m}")
            scale = w.float().abs().max()
            assert (g.float() - w.float()).abs().max() <= 0.05 * scale, f"call {i}"
        results.append((got[0].clone(), got[0]))
    assert all(torch.equal(a, b) for a, b in results)
    assert all(s.graph is not None for s in graphed._static.values())
    assert set(graphed._static) == set(padded._static)
    torch.testing.assert_close(graphed.k_cache[:, :, :USABLE].float(), plain.k_cache.float(), rtol=0.05, atol=0.05)


@pytest.mark.gpu
@cuda
def test_gpu_greedy_decode_graphed_equals_eager(model_dir):
    """Greedy ar decoding through graph replays: every token is the eager model's choice, up to ties
    within bf16 rounding (both models are fed the graphed choices)."""
    plain, graphed = load_pair(model_dir, "cuda")
    dev = torch.device("cuda")
    ids = list(range(3, 15))
    n = len(ids)
    args = (torch.tensor(ids, device=dev), torch.arange(n, device=dev), torch.arange(n, device=dev),
            causal(0, n).to(dev))
    want, got = plain(*args)[-1], graphed(*args)[-1]
    for i in range(n, 80):  # kv 13..80: four kv buckets, each replayed many times
        choice = int(got.argmax())
        assert want.max() - want[choice] <= 0.02 * want.abs().max(), f"step {i}"
        at = torch.tensor([i], device=dev)
        args = (torch.tensor([choice], device=dev), at, at, causal(i, 1).to(dev))
        want, got = plain(*args)[0], graphed(*args)[0]
    assert len(graphed._static) == 5


def _all_reduce_worker(rank: int, world: int, store: str, out: dict) -> None:
    import torch.distributed as dist

    from swiftspec.engine.model import allreduce

    os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"] = str(world)  # one node, as torchrun sets
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    g = torch.Generator(device="cuda").manual_seed(rank)
    errors = []
    for rows in (1, 8, 64, 200):  # 200 x 4096 bf16 is above ONE_SHOT_MAX_BYTES: NCCL
        x = torch.randn(rows, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want)
        errors.append(float((allreduce.all_reduce(x) - want).abs().max()))
    used_one_shot = allreduce._buffers.get((dist.group.WORLD.group_name, torch.bfloat16)) is not None
    x = torch.zeros(8, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = allreduce.all_reduce(x)
    for i in range(3):
        x.fill_(rank + i)
        graph.replay()
        errors.append(float((y - sum(r + i for r in range(world))).abs().max()))
    out[rank] = (errors, used_one_shot)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_one_shot_all_reduce_matches_nccl(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_all_reduce_worker, args=(2, str(tmp_path / "store"), out), nprocs=2)
        result = dict(out)
    for rank, (errors, used_one_shot) in result.items():
        assert max(errors) <= 0.05, (rank, errors)  # bf16 sums of N(0, 1) pairs: within an ulp or two
        if torch.cuda.can_device_access_peer(0, 1):
            assert used_one_shot, rank
