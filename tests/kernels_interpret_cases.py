"""Triton kernels vs their references on the CPU, under TRITON_INTERPRET=1.

Not collected on its own (no test_ prefix): tests/test_kernels.py runs it in a subprocess, because the
interpreter is chosen when @triton.jit runs and must not leak into modules that use Triton normally.
fp32 tolerances: the interpreter computes tl.dot with numpy, so only summation order differs. fp16 cases
cover the low-precision casts (q, p and outputs rounded to fp16; the reference also rounds its matmul
outputs). bf16 is left to the GPU tests: triton 3.9's interpreter computes tl.dot on bf16 wrongly.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1; run tests/test_kernels.py", allow_module_level=True)

from kernels_helpers import tree_case  # noqa: E402

from swiftspec.kernels import reference  # noqa: E402
from swiftspec.kernels import triton_kernels as tk  # noqa: E402

ATTN_TOL = dict(atol=1e-5, rtol=1e-5)
NORM_TOL = dict(atol=1e-5, rtol=1e-5)
SWIGLU_TOL = dict(atol=1e-5, rtol=1e-5)
FP16_TOL = dict(atol=1e-2, rtol=1e-2)


def check_attention(T, H, Hkv, D, S, kind, num_splits, seed, views=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mask, _ = tree_case(g, T, S, kind)
    if views:  # q sliced out of a fused qkv projection, k/v sliced out of a longer cache
        q = torch.randn(T, (H + 2 * Hkv) * D, generator=g)[:, : H * D].view(T, H, D)
        k = torch.randn(Hkv, S + 13, D, generator=g)[:, :S]
        v = torch.randn(Hkv, S + 13, D, generator=g)[:, :S]
    else:
        q = torch.randn(T, H, D, generator=g)
        k = torch.randn(Hkv, S, D, generator=g)
        v = torch.randn(Hkv, S, D, generator=g)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = tk.tree_attention(q, k, v, mask, num_splits=num_splits)
    tol = ATTN_TOL if dtype == torch.float32 else FP16_TOL
    expected = reference.tree_attention(q, k, v, reference.prepare_mask(mask, H // Hkv, dtype))
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize(
    "T,H,Hkv,D,S,kind,num_splits,views",
    [
        (1, 4, 4, 64, 1, "tree", None, False),  # one token, one key
        (1, 32, 8, 128, 1537, "tree", None, True),  # plain decode over a long prefix, GQA 4
        (7, 6, 3, 64, 1031, "sparse", 5, False),  # GQA 2, uneven last split
        (13, 8, 2, 64, 2000, "tree", 1, True),  # no split: the single-pass path
        (16, 8, 8, 32, 300, "sparse", 100, False),  # more splits asked than key blocks
        (64, 4, 1, 64, 129, "tree", 3, False),  # T*G > BLOCK_M: several query blocks
    ],
)
def test_tree_attention_cases(T, H, Hkv, D, S, kind, num_splits, views):
    check_attention(T, H, Hkv, D, S, kind, num_splits, seed=T * S, views=views)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    T=st.integers(1, 64),
    Hkv=st.sampled_from([1, 2, 4]),
    G=st.sampled_from([1, 2, 4]),
    D=st.sampled_from([16, 64, 128]),
    prefix=st.integers(0, 1200),
    kind=st.sampled_from(["tree", "sparse"]),
    num_splits=st.one_of(st.none(), st.integers(1, 9)),
    seed=st.integers(0, 2**16),
)
def test_tree_attention_random(T, Hkv, G, D, prefix, kind, num_splits, seed):
    check_attention(T, Hkv * G, Hkv, D, prefix + T, kind, num_splits, seed)


def test_tree_attention_relaunch_resets_counters():
    """The merging program zeroes its counter, so back-to-back launches (or graph replays) stay right."""
    for seed in range(3):
        check_attention(5, 8, 2, 64, 700, "tree", 4, seed)
    assert int(tk._counters[torch.device("cpu")].abs().sum()) == 0


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (16, 576), (2, 3, 1000), (5, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(shape, with_residual):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g) * 3
    residual = torch.randn(shape, generator=g) if with_residual else None
    weight = torch.randn(shape[-1], generator=g)
    normed, new_res = tk.add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_res = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL)


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(
    T=st.integers(1, 70),
    dim=st.integers(1, 600),
    inter=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_swiglu(T, dim, inter, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, dim, generator=g)
    w = torch.randn(2 * inter, dim, generator=g) / dim**0.5
    torch.testing.assert_close(tk.swiglu(x, w, inter), reference.swiglu(x, w, inter), **SWIGLU_TOL)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp16(num_splits):
    check_attention(11, 8, 2, 64, 900, "tree", num_splits, seed=num_splits, dtype=torch.float16)
    g = torch.Generator().manual_seed(num_splits)
    x, r = torch.randn(2, 11, 300, generator=g).half()
    w = torch.randn(300, generator=g).half()
    normed, new_res = tk.add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_res = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed, ref_normed, **FP16_TOL)
    wgu = (torch.randn(2 * 70, 300, generator=g) / 300**0.5).half()
    torch.testing.assert_close(tk.swiglu(x, wgu, 70), reference.swiglu(x, wgu, 70), **FP16_TOL)


# ------------------------------------------------------------------------------ the batch-invariant mode
# Values only: the interpreter's tl.dot is numpy's GEMM, whose rounding may change with the operands'
# alignment, so the bitwise row-invariance of these kernels is asserted on CUDA (tests/test_kernels.py).


@pytest.mark.parametrize("T,H,Hkv,D,S,kind", [(8, 4, 2, 64, 45, "tree"), (13, 8, 8, 32, 600, "sparse"), (1, 2, 2, 16, 1100, "tree")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_invariant_attention(T, H, Hkv, D, S, kind, dtype):
    g = torch.Generator().manual_seed(T + S)
    mask, _ = tree_case(g, T, S, kind)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k, v = (torch.randn(Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    out = tk.tree_attention(q, k, v, tk.prepare_mask(mask, H // Hkv, dtype, invariant=True))
    expected = reference.tree_attention(q, k, v, reference.prepare_mask(mask, H // Hkv, dtype))
    torch.testing.assert_close(out, expected, **(ATTN_TOL if dtype == torch.float32 else FP16_TOL))


@pytest.mark.parametrize("M,N,K,bias,dtype", [(37, 300, 200, False, torch.float32), (64, 1000, 576, True, torch.float32),
                                              (5, 16, 17, True, torch.float16)])
def test_invariant_linear(M, N, K, bias, dtype):
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(tk.linear(x, w, b), expected, **(ATTN_TOL if dtype == torch.float32 else FP16_TOL))


def test_swiglu_invariant_tiles():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 96, generator=g)
    w = torch.randn(2 * 50, 96, generator=g) / 96**0.5
    torch.testing.assert_close(tk.swiglu(x, w, 50, invariant=True), reference.swiglu(x, w, 50), **SWIGLU_TOL)


def rope_kv_case(T, H, Hkv, D, S, dtype, seed):
    """A fused projection's heads, RoPE tables, distinct slots and two caches with stale contents."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, H + 2 * Hkv, D, generator=g).to(dtype)
    angles = torch.randn(T, D // 2, generator=g) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(S, generator=g)[:T]
    k_cache, v_cache = (torch.randn(Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    return qkv, cos, sin, slots, k_cache, v_cache


@pytest.mark.parametrize("T,H,Hkv,D,S,dtype", [(5, 4, 2, 64, 40, torch.float32), (3, 8, 8, 16, 9, torch.float16),
                                               (1, 2, 1, 128, 3, torch.float32)])
def test_rope_kv_write(T, H, Hkv, D, S, dtype):
    """Against the unfused path (reference.rope_rotate_half, then the cache writes Attention makes)."""
    qkv, cos, sin, slots, k_cache, v_cache = rope_kv_case(T, H, Hkv, D, S, dtype, seed=T * D)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = tk.rope_kv_write(qkv, cos, sin, slots, k_cache, v_cache, H, Hkv)
    q_ref, k = reference.rope_rotate_half(qkv[:, :H + Hkv], cos, sin).split_with_sizes([H, Hkv], dim=1)
    k_ref.index_copy_(1, slots, k.transpose(0, 1))
    v_ref.index_copy_(1, slots, qkv[:, H + Hkv:].transpose(0, 1))
    tol = NORM_TOL if dtype == torch.float32 else FP16_TOL
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    assert torch.equal(v_cache, v_ref)


def test_rope_kv_write_rows_are_invariant():
    """Row i of a T-row call writes and returns, bit for bit, what the one-row call of row i does."""
    T, H, Hkv, D, S = 6, 4, 2, 32, 20
    qkv, cos, sin, slots, k_cache, v_cache = rope_kv_case(T, H, Hkv, D, S, torch.float16, seed=5)
    k_all, v_all = k_cache.clone(), v_cache.clone()
    q_all = tk.rope_kv_write(qkv, cos, sin, slots, k_all, v_all, H, Hkv)
    for i in range(T):
        k_one, v_one = k_cache.clone(), v_cache.clone()
        q_one = tk.rope_kv_write(qkv[i:i + 1], cos[i:i + 1], sin[i:i + 1], slots[i:i + 1], k_one, v_one, H, Hkv)
        assert torch.equal(q_one[0], q_all[i])
        assert torch.equal(k_one[:, slots[i]], k_all[:, slots[i]]) and torch.equal(v_one[:, slots[i]], v_all[:, slots[i]])


def norm_linear_case(M, K, N, dtype, seed, residual=True, bias=False, swiglu=False):
    """x, residual, the norm's weight, eps, the projection's weight ([Wg; Wu] with ``swiglu``) and bias."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    r = torch.randn(M, K, generator=g).to(dtype) if residual else None
    nw = (1 + torch.randn(K, generator=g) / 4).to(dtype)
    w = (torch.randn(2 * N if swiglu else N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, r, nw, 1e-6, w, b


def unfused(x, r, nw, eps, w, b, swiglu, ops):
    """add_rms_norm, then the projection: ``ops`` is tk (the Triton path the fusion replaces) or reference."""
    h, new_res = ops.add_rms_norm(x, r, nw, eps)
    if swiglu:
        return (tk.swiglu(h, w, w.shape[0] // 2, invariant=True) if ops is tk else reference.swiglu(h, w, w.shape[0] // 2)), new_res
    return (tk.linear(h, w, b) if ops is tk else torch.nn.functional.linear(h, w, b)), new_res


@pytest.mark.parametrize("M,K,N,dtype,residual,bias,swiglu", [
    (5, 200, 48, torch.float32, True, True, False),  # K over four tiles, the last one partial
    (3, 96, 40, torch.float32, False, False, False),  # the first layer: no residual yet
    (7, 130, 24, torch.float32, True, False, True),  # norm + gate-up + SwiGLU
    (17, 64, 20, torch.float32, True, False, True),  # two row tiles
    (4, 300, 32, torch.float16, True, True, False),
    (6, 140, 36, torch.float16, True, False, True),
])  # fmt: skip
def test_rms_norm_linear_matches_unfused(M, K, N, dtype, residual, bias, swiglu):
    """Against add_rms_norm then linear (or the invariant swiglu) in Triton and in torch; fp32 within
    NORM_TOL (the rms is summed in another order than add_rms_norm's), fp16 within FP16_TOL of the fp32
    reference. The residual x + residual is exact, written once for all column tiles (N spans several)."""
    x, r, nw, eps, w, b = norm_linear_case(M, K, N, dtype, seed=M * K, residual=residual, bias=bias, swiglu=swiglu)
    y, new_res = tk.rms_norm_linear(x, r, nw, eps, w, b, swiglu=swiglu)
    y_tk, res_tk = unfused(x, r, nw, eps, w, b, swiglu, tk)
    f32 = [None if t is None else t.float() for t in (x, r, nw, w, b)]
    y_ref, _ = unfused(*f32[:3], eps, *f32[3:], swiglu, reference)
    assert y.shape == (M, N) and y.dtype == dtype
    if residual:
        assert torch.equal(new_res, x + r) and torch.equal(new_res, res_tk)
    else:
        assert new_res is x
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_tk, **NORM_TOL)
        torch.testing.assert_close(y, y_ref, **NORM_TOL)
    else:
        torch.testing.assert_close(y.float(), y_ref, **FP16_TOL)
        torch.testing.assert_close(y, y_tk, **FP16_TOL)


def test_rms_norm_linear_writes_the_given_residual_buffer():
    x, r, nw, eps, w, b = norm_linear_case(3, 70, 40, torch.float32, seed=3)
    buf = torch.full_like(x, float("nan"))
    y, new_res = tk.rms_norm_linear(x, r, nw, eps, w, residual_out=buf)
    assert new_res is buf and torch.equal(buf, x + r)
    assert torch.equal(y, tk.rms_norm_linear(x, r, nw, eps, w)[0])


@pytest.mark.parametrize("dtype,swiglu", [(torch.float32, False), (torch.float16, False), (torch.float32, True),
                                          (torch.float16, True)])
def test_rms_norm_linear_rows_are_invariant(dtype, swiglu):
    """For M = 1..8, each row of an M-row call (K over several tiles) is bit for bit what it is in a call
    whose other rows all differ (the 8-row call of fresh rows around it), output and residual; row 0 is
    also the one-row call's. Not every row against the one-row call: numpy's GEMM, which computes tl.dot
    here, rounds a row by its position in the tile (test_gpu_rms_norm_linear_rows_bf16 checks that on CUDA)."""
    x, r, nw, eps, w, b = norm_linear_case(8, 150, 24, dtype, seed=11, bias=not swiglu, swiglu=swiglu)
    others = norm_linear_case(8, 150, 24, dtype, seed=12, bias=not swiglu, swiglu=swiglu)[:2]
    alone = []  # row i among other rows
    for i in range(8):
        xo, ro = others[0].clone(), others[1].clone()
        xo[i], ro[i] = x[i], r[i]
        alone.append(tk.rms_norm_linear(xo, ro, nw, eps, w, b, swiglu=swiglu))
    alone[0] = tk.rms_norm_linear(x[:1], r[:1], nw, eps, w, b, swiglu=swiglu)
    for m in range(1, 9):
        y, new_res = tk.rms_norm_linear(x[:m], r[:m], nw, eps, w, b, swiglu=swiglu)
        for i in range(m):
            assert torch.equal(y[i], alone[i][0][i]), (m, i)
            assert torch.equal(new_res[i], alone[i][1][i]), (m, i)


def invariant_transformer(fuse_norms: bool):
    """A 2-layer random fp32 Transformer with the CUDA batch-invariant mode's modules, on the CPU: the
    whole forward (attention_ops = reference, not the CPU's one-row fallback), attention in torch."""
    from swiftspec.engine.model.model_args import ModelArgs
    from swiftspec.engine.model.transformer import Transformer

    args = ModelArgs(vocab_size=32, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, intermediate_size=48,
                     qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + torch.randn_like(p) / 4 if "norm" in name else torch.randn_like(p) / 8)
    model.eval()
    model.batch_invariant, model.attention_ops = True, reference
    model.use_invariant_kernels(fuse_norms)
    model.setup_cache(16)
    return model


def test_fused_norms_forward_equals_unfused(monkeypatch):
    """The model with both layer norms in the projections' prologues against the same weights unfused
    (add_rms_norm, then InvariantQKV / InvariantGateUp): a 4-token prefill, then a one-token step; and the
    fused forward's launches: per layer two norm + projection kernels and no norm of its own, one final norm."""
    from swiftspec.engine.model.transformer import NormedGateUp, NormedQKV, PrologueNorm
    from swiftspec.engine.spec.tree_cache import causal_mask

    fused, plain = invariant_transformer(True), invariant_transformer(False)
    layer = fused.layers[0]
    assert isinstance(layer.attention_norm, PrologueNorm) and isinstance(layer.ffn_norm, PrologueNorm)
    assert isinstance(layer.attention.wqkv, NormedQKV) and isinstance(layer.feed_forward.w13, NormedGateUp)
    assert layer.attention_norm.weight is fused.state_dict(keep_vars=True)["layers.0.attention_norm.weight"]
    assert not isinstance(plain.layers[0].attention_norm, PrologueNorm)
    tokens = torch.randint(0, 32, (5,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5)
    for model in (fused, plain):
        model.logits = [model(tokens[:4], pos[:4], pos[:4], causal_mask(0, 4))]
        model.logits.append(model(tokens[4:], pos[4:], pos[4:], causal_mask(4, 1)))
    for a, b in zip(fused.logits, plain.logits, strict=True):
        torch.testing.assert_close(a, b, **NORM_TOL)
    torch.testing.assert_close(fused.k_cache, plain.k_cache, **NORM_TOL)
    torch.testing.assert_close(fused.v_cache, plain.v_cache, **NORM_TOL)

    calls = {}
    for mod, name in ((tk, "rms_norm_linear"), (tk, "linear"), (tk, "swiglu"), (tk, "rope_kv_write"),
                      (tk, "add_rms_norm"), (reference, "add_rms_norm")):
        def count(*a, _f=getattr(mod, name), _key=f"{mod.__name__.split('.')[-1]}.{name}", **k):
            calls[_key] = calls.get(_key, 0) + 1
            return _f(*a, **k)
        monkeypatch.setattr(mod, name, count)
    fused(tokens[4:], pos[4:], pos[4:], causal_mask(4, 1))
    layers = fused.args.n_layers
    assert calls == {"triton_kernels.rms_norm_linear": 2 * layers, "triton_kernels.rope_kv_write": layers,
                     "triton_kernels.linear": 2 * layers + 1, "reference.add_rms_norm": 1}, calls
