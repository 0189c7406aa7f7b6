"""Kernel tests: references against independent formulas, CPU dispatch, Triton under the interpreter
(tests/kernels_interpret_cases.py, in a subprocess), and bf16 Triton on CUDA (marked gpu)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernels_helpers import rope_tables, tree_case

import swiftspec.kernels as kernels
from swiftspec.kernels import reference

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16 on CUDA against an fp32 reference of the same bf16 inputs: bf16 keeps 8 bits of mantissa
# (eps 7.8e-3), and attention also rounds the softmax weights to bf16 before the PV product.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def test_triton_kernels_match_reference_under_interpreter():
    """Every Triton kernel vs its reference on CPU; the interpreter needs its own process (see that file)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels_interpret_cases.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_import_does_not_load_triton():
    code = "import sys, torch, swiftspec.kernels as k; k.use_triton(torch.zeros(1)); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_cpu_dispatches_to_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=g)
    assert not kernels.use_triton(x)
    w = torch.randn(32, generator=g)
    for a, b in zip(kernels.add_rms_norm(x, x, w, 1e-5), reference.add_rms_norm(x, x, w, 1e-5), strict=True):
        assert torch.equal(a, b)
    wgu = torch.randn(2 * 16, 32, generator=g)
    assert torch.equal(kernels.swiglu(x, wgu, 16), reference.swiglu(x, wgu, 16))


def test_rope_rotation_is_the_complex_rotation():
    """Independent formula: RoPE rotates each (x[i], x[i + D/2]) pair by position * inv_freq[i]."""
    T, N, D = 9, 5, 32
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 100, (T,), generator=g)  # fp32 tables lose ~pos * 6e-8 rad, as in HF
    x = torch.randn(T, N, D, generator=g)
    angles = pos[:, None, None].double() * (1.0 / 10000 ** (torch.arange(0, D, 2).double() / D))
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2 :].double()) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat([z.real, z.imag], dim=-1).float()
    rotation = reference.rope_rotation(*rope_tables(pos, D))
    torch.testing.assert_close(reference.apply_rope(x, rotation), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 2)])
def test_reference_tree_attention_matches_sdpa(H, Hkv):
    """Independent formula: GQA by repeating kv heads, then torch SDPA."""
    T, S, D = 9, 50, 32
    g = torch.Generator().manual_seed(H * Hkv)
    mask, _ = tree_case(g, T, S, "tree")
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(Hkv, S, D, generator=g), torch.randn(Hkv, S, D, generator=g)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(H // Hkv, dim=0),
        v.repeat_interleave(H // Hkv, dim=0),
        attn_mask=mask,
        scale=1 / math.sqrt(D),
    ).transpose(0, 1)
    out = reference.tree_attention(q, k, v, reference.prepare_mask(mask, H // Hkv, q.dtype))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_add_rms_norm_and_swiglu():
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(4, 48, generator=g), torch.randn(4, 48, generator=g), torch.randn(48, generator=g)
    normed, new_res = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_res, x + r)
    torch.testing.assert_close(normed, F.rms_norm(x + r, (48,), w, 1e-6), atol=1e-6, rtol=1e-6)
    normed, new_res = reference.add_rms_norm(x, None, w, 1e-6)
    assert new_res is x

    wg, wu = torch.randn(20, 48, generator=g), torch.randn(20, 48, generator=g)
    expected = (x @ wg.T) * torch.sigmoid(x @ wg.T) * (x @ wu.T)
    torch.testing.assert_close(reference.swiglu(x, torch.cat([wg, wu]), 20), expected, atol=1e-5, rtol=1e-5)


# (kernel, pointer dtypes, float arguments, constexprs, num_warps, num_stages): the variants the wrappers
# launch for 8B-shaped bf16 decode/verify steps; other arguments are int32.
ATTN_POINTERS = dict(Q="bf16", K="bf16", V="bf16", Mask="u8", KeySlots="u8", Lengths="u8", Out="bf16", MidM="fp32",
                     MidL="fp32", MidO="fp32", Counter="i32")
INVARIANT_ATTN_POINTERS = {**ATTN_POINTERS, "Mask": "i32", "KeySlots": "i32", "Lengths": "i32"}
NORM_LINEAR_POINTERS = dict(X="bf16", R="bf16", NW="bf16", W="bf16", B="bf16", Y="bf16", ROut="bf16")
HOPPER_VARIANTS = {
    "tree_attention_split": ("_tree_attention_kernel", ATTN_POINTERS, ["scale_log2"],
                             dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, SPLIT=True, IEEE=False, INVARIANT=False), 4, 3),
    "tree_attention_single": ("_tree_attention_kernel", ATTN_POINTERS, ["scale_log2"],
                              dict(HEAD_DIM=64, BLOCK_M=16, BLOCK_N=64, SPLIT=False, IEEE=False, INVARIANT=False), 4, 3),
    "tree_attention_invariant": ("_tree_attention_kernel", INVARIANT_ATTN_POINTERS, ["scale_log2"],
                                 dict(HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64, SPLIT=True, IEEE=False, INVARIANT=True), 4, 3),
    "linear_invariant": ("_linear_kernel", dict(X="bf16", W="bf16", B="bf16", Y="bf16"), [],
                         dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False), 4, 4),
    "add_rms_norm": ("_add_rms_norm_kernel", dict(X="bf16", R="bf16", W="bf16", Out="bf16", ROut="bf16"),
                     ["eps"], dict(HAS_RESIDUAL=True, BLOCK=4096), 8, 3),
    "swiglu": ("_swiglu_kernel", dict(X="bf16", W="bf16", Y="bf16"), [],
               dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, IEEE=False), 4, 4),
    "rms_norm_linear": ("_rms_norm_linear_kernel", NORM_LINEAR_POINTERS, ["eps"],
                        dict(HAS_RESIDUAL=True, HAS_BIAS=True, SWIGLU=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                             IEEE=False), 4, 4),
    "rms_norm_swiglu": ("_rms_norm_linear_kernel", NORM_LINEAR_POINTERS, ["eps"],
                        dict(HAS_RESIDUAL=True, HAS_BIAS=False, SWIGLU=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                             IEEE=False), 4, 4),
    "rope_kv_write": ("_rope_kv_kernel", dict(QKV="bf16", Cos="fp32", Sin="fp32", Slots="i64", Q="bf16",
                                              KCache="bf16", VCache="bf16"), [], dict(HALF=64), 4, 3),
}  # fmt: skip


@pytest.mark.parametrize("variant", HOPPER_VARIANTS)
def test_triton_kernels_compile_for_hopper(variant):
    """Lower each kernel to sm_90 machine code with the bundled ptxas: catches what the interpreter cannot
    (layouts, shared memory) on machines without a GPU. Ints and pointers get the divisible-by-16 hint
    the JIT gives them at real launches."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from swiftspec.kernels import triton_kernels

    name, pointers, floats, constexprs, num_warps, num_stages = HOPPER_VARIANTS[variant]
    kernel = getattr(triton_kernels, name)
    signature = {
        arg: "constexpr" if arg in constexprs else "*" + pointers[arg] if arg in pointers else "fp32" if arg in floats else "i32"
        for arg in kernel.arg_names
    }
    hinted = [(i,) for i, arg in enumerate(kernel.arg_names) if signature[arg] not in ("constexpr", "fp32")]
    src = triton.compiler.ASTSource(kernel, signature, constexprs, attrs={k: [["tt.divisibility", 16]] for k in hinted})
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(
        dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=triton_kernels.FP_FUSION))
    compiled = triton.compile(src, target=target, options=options.__dict__)
    assert compiled.metadata.shared <= 227 * 1024  # per-block shared memory limit on sm_90


def _attention_inputs(T, H, Hkv, D, S, kind, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    mask, _ = tree_case(g, T, S, kind)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(Hkv, S, D, generator=g), torch.randn(Hkv, S, D, generator=g)
    return [t.to("cuda", dtype) for t in (q, k, v)] + [mask.cuda()]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "T,H,Hkv,D,S,kind",
    [(1, 32, 8, 128, 4097, "tree"), (16, 32, 8, 64, 1024, "tree"), (13, 12, 4, 64, 777, "sparse"),
     (64, 16, 16, 128, 32768, "tree"), (40, 8, 2, 64, 100, "sparse")],
)  # fmt: skip
def test_gpu_tree_attention_bf16(T, H, Hkv, D, S, kind):
    q, k, v, mask = _attention_inputs(T, H, Hkv, D, S, kind, seed=S)
    assert kernels.use_triton(q)
    out = kernels.tree_attention(q, k, v, kernels.prepare_mask(mask, H // Hkv, q.dtype))
    expected = reference.tree_attention(
        q.float(), k.float(), v.float(), reference.prepare_mask(mask, H // Hkv, torch.float32)
    )
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)


@pytest.mark.gpu
@cuda
def test_gpu_tree_attention_graph_replay():
    """The cross-program merge (arrival counters) must survive relaunches and CUDA-graph replays."""
    q, k, v, mask = _attention_inputs(16, 32, 8, 128, 8191, "tree", seed=0)
    first = kernels.tree_attention(q, k, v, mask)
    assert torch.equal(kernels.tree_attention(q, k, v, mask), first)  # merge order is fixed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.tree_attention(q, k, v, mask)
    for seed in range(3):
        new = _attention_inputs(16, 32, 8, 128, 8191, "tree", seed=seed + 1)
        for dst, src in zip((q, k, v, mask), new, strict=True):
            dst.copy_(src)
        graph.replay()
        expected = reference.tree_attention(q.float(), k.float(), v.float(), reference.prepare_mask(mask, 4, torch.float32))
        torch.testing.assert_close(out.float(), expected, **BF16_TOL)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T,dim", [(1, 2048), (16, 4096), (7, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_add_rms_norm_bf16(T, dim, with_residual):
    g = torch.Generator().manual_seed(dim)
    x, r, w = (torch.randn(s, generator=g).to("cuda", torch.bfloat16) for s in ((T, dim), (T, dim), (dim,)))
    r = r if with_residual else None
    normed, new_res = kernels.add_rms_norm(x, r, w, 1e-5)
    ref_normed, ref_res = reference.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed.float(), ref_normed.float(), **BF16_TOL)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T,dim,inter", [(1, 2048, 8192), (16, 4096, 14336), (37, 576, 1536), (64, 1000, 300)])
def test_gpu_swiglu_bf16(T, dim, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(T, dim, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(2 * inter, dim, generator=g) / dim**0.5).to("cuda", torch.bfloat16)
    expected = reference.swiglu(x.float(), w.float(), inter)
    torch.testing.assert_close(kernels.swiglu(x, w, inter).float(), expected, **BF16_TOL)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T,dim,inter", [(16, 2048, 8192), (37, 576, 1536)])
def test_gpu_swiglu_invariant_rows_bf16(T, dim, inter):
    """Fixed 16-row tiles: row i of a T-row call is, bit for bit, the one-row call of row i."""
    from swiftspec.kernels import triton_kernels as tk

    g = torch.Generator().manual_seed(inter)
    x = torch.randn(T, dim, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(2 * inter, dim, generator=g) / dim**0.5).to("cuda", torch.bfloat16)
    rows = tk.swiglu(x, w, inter, invariant=True)
    torch.testing.assert_close(rows.float(), reference.swiglu(x.float(), w.float(), inter), **BF16_TOL)
    for i in (0, T // 2, T - 1):
        assert torch.equal(tk.swiglu(x[i:i + 1], w, inter, invariant=True)[0], rows[i])


@pytest.mark.gpu
@cuda
def test_gpu_rope_kv_write_bf16_rows_are_invariant():
    from swiftspec.kernels import triton_kernels as tk

    T, H, Hkv, D, S = 9, 32, 8, 128, 300
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(T, H + 2 * Hkv, D, generator=g).to("cuda", torch.bfloat16)
    cos, sin = (t.cuda() for t in rope_tables(torch.randint(0, 4000, (T,), generator=g), D))
    slots = torch.randperm(S, generator=g)[:T].cuda()
    k_cache = torch.zeros(Hkv, S, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q = tk.rope_kv_write(qkv, cos, sin, slots, k_cache, v_cache, H, Hkv)
    q_ref, k_ref = reference.rope_rotate_half(qkv[:, :H + Hkv], cos, sin).split_with_sizes([H, Hkv], dim=1)
    torch.testing.assert_close(q.float(), q_ref.float(), **BF16_TOL)
    torch.testing.assert_close(k_cache[:, slots].transpose(0, 1).float(), k_ref.float(), **BF16_TOL)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), qkv[:, H + Hkv:])
    for i in (0, T - 1):
        k_one, v_one = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        q_one = tk.rope_kv_write(qkv[i:i + 1], cos[i:i + 1], sin[i:i + 1], slots[i:i + 1], k_one, v_one, H, Hkv)
        assert torch.equal(q_one[0], q[i]) and torch.equal(k_one[:, slots[i]], k_cache[:, slots[i]])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T,dim,n,swiglu", [(16, 2048, 3072, False), (9, 4096, 14336, True), (37, 576, 1536, True)])
def test_gpu_rms_norm_linear_rows_bf16(T, dim, n, swiglu):
    """Norm + projection (+ SwiGLU) in one launch: within BF16_TOL of the fp32 unfused reference, the
    residual exact, and each row of a 1..8-row and of the T-row call bit for bit the one-row call's."""
    from swiftspec.kernels import triton_kernels as tk

    g = torch.Generator().manual_seed(n)
    x, r = ((torch.randn(T, dim, generator=g) * 3).to("cuda", torch.bfloat16) for _ in range(2))
    nw = (1 + torch.randn(dim, generator=g) / 4).to("cuda", torch.bfloat16)
    w = (torch.randn(2 * n if swiglu else n, dim, generator=g) / dim**0.5).to("cuda", torch.bfloat16)
    b = None if swiglu else torch.randn(n, generator=g).to("cuda", torch.bfloat16)
    y, new_res = tk.rms_norm_linear(x, r, nw, 1e-5, w, b, swiglu=swiglu)
    assert torch.equal(new_res, x + r)
    h = reference.add_rms_norm(x.float(), r.float(), nw.float(), 1e-5)[0]
    expected = reference.swiglu(h, w.float(), n) if swiglu else F.linear(h, w.float(), b.float())
    torch.testing.assert_close(y.float(), expected, **BF16_TOL)
    one = [tk.rms_norm_linear(x[i:i + 1], r[i:i + 1], nw, 1e-5, w, b, swiglu=swiglu) for i in range(T)]
    for m in [*range(1, min(T, 8) + 1), T]:
        rows, res = tk.rms_norm_linear(x[:m], r[:m], nw, 1e-5, w, b, swiglu=swiglu)
        for i in range(m):
            assert torch.equal(rows[i], one[i][0][0]) and torch.equal(res[i], one[i][1][0]), (m, i)
