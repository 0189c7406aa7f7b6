"""Triton kernels for the GPU decode path; same signatures as kernels/reference.py.

At 1-64 new tokens per forward every op is bound by memory or launch latency, so each kernel reads its
operands once and does the follow-up elementwise work in registers.
"""

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import KeyList, key_list

ATTN_BLOCK_N = 64
INVARIANT_KEYS_PER_SPLIT = 512  # the batch-invariant attention's fixed key-axis split
PROGRAMS_PER_SM = 2  # enough resident programs to keep loads in flight on every SM
MAX_COUNTERS = 1 << 16
FP_FUSION = True  # multiply-adds fused, pinned: Triton 3.10 turns its default off, which would change
# every kernel's rounding (the same for each row either way)
_counters: dict[torch.device, Tensor] = {}


@functools.cache
def _programs_target(device: torch.device) -> int:
    """How many programs fill the GPU; the interpreter (CPU tensors) gets a small fixed count."""
    if device.type != "cuda":
        return 8
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _counters_for(device: torch.device, n: int) -> Tensor:
    """Arrival counters of the split merge. They are zero between launches (each merging program resets
    its own), so CUDA graphs replay without a memset; the buffer is made once per device, outside any
    capture, and never resized, so captured graphs keep a valid address. Split launches on one device
    must therefore not overlap in time (keep them on one stream)."""
    if n > MAX_COUNTERS:
        raise ValueError(f"tree_attention: {n} split programs, above the {MAX_COUNTERS} arrival counters")
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("call tree_attention once before capturing it in a CUDA graph")
        buf = _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf


# Flash-decoding split: one program per (query block, kv head, key range); the last program of each
# (query block, kv head) to finish merges the partial softmaxes, so a forward is one launch, not two.
@triton.jit
def _tree_attention_kernel(
    Q, K, V, Mask, KeySlots, Lengths, Out, MidM, MidL, MidO, Counter,
    scale_log2, T, S, G, num_splits, keys_per_split,
    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_mt,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, INVARIANT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    if INVARIANT:
        # One token per program, its G query heads as rows, over its own key list (KeySlots: the allowed
        # slots in sequence order): a row's arithmetic depends on its keys alone, not on the call.
        r = tl.arange(0, BLOCK_M)
        rows = pid_m * BLOCK_M + r
        row_ok = r < G
        t = tl.zeros([BLOCK_M], tl.int32) + pid_m
        head = kvh * G + r
        seq_len = tl.load(Lengths + pid_m)
    else:
        # Rows are (token, head-in-group) pairs: the G query heads sharing a kv head share every K/V load.
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < T * G
        t = rows // G
        head = kvh * G + rows % G
        seq_len = S

    q_ptrs = Q + t[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + d[None, :], mask=row_ok[:, None], other=0.0)

    # Online softmax over this program's key range, in base 2. Rows with no allowed key so far keep
    # m = -inf; m_safe keeps their exp2 arguments at -inf (weight 0) instead of NaN.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        if INVARIANT:
            key = tl.load(KeySlots + pid_m * stride_mt + n, mask=n_ok, other=0)
        else:
            key = n
        k = tl.load(K + kvh * stride_kh + key[:, None] * stride_ks + d[None, :], mask=n_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if INVARIANT:
            s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
        else:
            allowed = tl.load(Mask + t[:, None] * stride_mt + n[None, :], mask=row_ok[:, None] & n_ok[None, :],
                              other=0)
            s = tl.where(allowed != 0, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kvh * stride_vh + key[:, None] * stride_vs + d[None, :], mask=n_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v)
        m_i = m_new

    out_ptrs = Out + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Publish this split's partial, then take a ticket; the last arrival merges all partials. The
        # barrier + acq_rel atomic is the CUDA threadfence-reduction pattern: stores before, loads after.
        m_rows = tl.num_programs(0) * BLOCK_M
        mid = (kvh * num_splits + split) * m_rows + rows
        tl.store(MidM + mid, m_i)
        tl.store(MidL + mid, l_i)
        tl.store(MidO + mid[:, None] * HEAD_DIM + d[None, :], acc)
        tl.debug_barrier()
        counter = Counter + kvh * tl.num_programs(0) + pid_m
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_run = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            for j in range(num_splits):
                mid = (kvh * num_splits + j) * m_rows + rows
                m_j = tl.load(MidM + mid, cache_modifier=".cg")
                l_j = tl.load(MidL + mid, cache_modifier=".cg")
                o_j = tl.load(MidO + mid[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_j)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                a = tl.exp2(m_run - m_safe)
                b = tl.exp2(m_j - m_safe)
                l_run = l_run * a + l_j * b
                acc = acc * a[:, None] + o_j * b[:, None]
                m_run = m_new
            out = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
            tl.store(counter, 0)


def prepare_mask(mask: Tensor, group: int, dtype: torch.dtype, invariant: bool = False) -> Tensor | KeyList:
    """The kernel reads the [T, S] bool mask as it is, or in the batch-invariant mode the key lists."""
    return key_list(mask) if invariant else mask


def tree_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor | KeyList,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
) -> Tensor:
    """See reference.tree_attention. num_splits overrides the key-axis split (tests use it).

    With a KeyList (the batch-invariant mode) each program takes one token and the key axis is split at
    fixed multiples of INVARIANT_KEYS_PER_SPLIT, so a row's rounding depends on its own keys only: the
    splits past its length are empty and merge as exact no-ops.
    """
    T, H, D = q.shape
    Hkv, S, _ = k_cache.shape
    if H % Hkv or D < 16 or D & (D - 1):
        raise ValueError(f"tree_attention: heads {H} over {Hkv} kv heads of size {D} (a power of two, at least 16)")
    if not q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1:
        raise ValueError("tree_attention: q, k and v need contiguous rows")
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    invariant = isinstance(mask, KeyList)
    if invariant:
        if mask.slots.shape != (T, S) or num_splits is not None:
            raise ValueError(f"tree_attention: slots {tuple(mask.slots.shape)} for {T} rows of {S} keys, no split")
        keys, lengths = mask.slots.contiguous(), mask.lengths
        mask_arg = keys  # the kernel reads KeySlots and Lengths only
        block_m = max(16, triton.next_power_of_2(G))
        m_blocks = T
        keys_per_split = INVARIANT_KEYS_PER_SPLIT
        num_splits = triton.cdiv(S, keys_per_split)
    else:
        if mask.shape != (T, S):
            raise ValueError(f"tree_attention: a mask of {tuple(mask.shape)} for {T} rows of {S} keys")
        mask_arg = mask.contiguous().view(torch.uint8)
        keys = lengths = mask_arg  # the kernel reads Mask only
        block_m = min(64, max(16, triton.next_power_of_2(T * G)))
        m_blocks = triton.cdiv(T * G, block_m)
        n_blocks = triton.cdiv(S, ATTN_BLOCK_N)
        if num_splits is None:
            num_splits = _programs_target(q.device) // (m_blocks * Hkv)
        blocks_per_split = triton.cdiv(n_blocks, max(1, min(num_splits, n_blocks)))
        num_splits = triton.cdiv(n_blocks, blocks_per_split)  # no empty splits
        keys_per_split = blocks_per_split * ATTN_BLOCK_N
    split = num_splits > 1
    rows = Hkv * num_splits * m_blocks * block_m if split else 1
    mid_m = torch.empty(rows, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(rows, dtype=torch.float32, device=q.device)
    mid_o = torch.empty(rows, D, dtype=torch.float32, device=q.device)
    counter = _counters_for(q.device, m_blocks * Hkv) if split else mid_m  # unused without a split

    _tree_attention_kernel[(m_blocks, Hkv, num_splits)](
        q, k_cache, v_cache, mask_arg, keys, lengths, out, mid_m, mid_l, mid_o, counter,
        scale * math.log2(math.e), T, S, G, num_splits, keys_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        mask_arg.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=ATTN_BLOCK_N, SPLIT=split, IEEE=q.dtype == torch.float32,
        INVARIANT=invariant,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    h = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        h = h.to(ROut.dtype.element_ty)  # normalise what the residual stream stores, as the reference does
        tl.store(ROut + row * stride_ro + cols, h, mask=ok)
        h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (h * rstd * w).to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """See reference.add_rms_norm: one read of x and residual, one write of each output."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    r2 = x2 if residual is None else residual.reshape(-1, N)
    if not x2.stride(-1) == r2.stride(-1) == weight.stride(-1) == 1:
        raise ValueError("rms_norm: x, the residual and the weight need contiguous rows")
    out = torch.empty_like(x2)
    new_res = x2 if residual is None else torch.empty_like(x2)
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, new_res, x2.stride(0), r2.stride(0), out.stride(0), new_res.stride(0), N, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out.view(x.shape), new_res.view(x.shape)


@triton.jit
def _swiglu_kernel(
    X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
    g_ptrs = W + rn[:, None] * stride_wn + rk[None, :]  # gate rows [0, N)
    u_ptrs = g_ptrs + N * stride_wn  # up rows [N, 2N)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        w_mask = (rn < N)[:, None] & k_ok[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if IEEE:
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision="ieee")
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(x, tl.trans(wg), acc_g)
            acc_u = tl.dot(x, tl.trans(wu), acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def swiglu(x: Tensor, w_gate_up: Tensor, inter: int, invariant: bool = False) -> Tensor:
    """See reference.swiglu: gate and up tiles share each x tile, and [T, 2*inter] never reaches memory.
    ``invariant``: 16-row tiles whatever the rows, so that a row's result does not depend on the call
    (the tiles over the weight and K already depend on the weight's shape alone): the batch-invariant
    mode's gate-up projection and activation in one launch, where InvariantLinear + silu + mul take three."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if w_gate_up.shape != (2 * inter, K) or not x2.stride(-1) == w_gate_up.stride(-1) == 1:
        raise ValueError(f"swiglu: a gate-up weight of {tuple(w_gate_up.shape)} for {inter} x {K}, contiguous rows")
    y = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    block_m = 16 if invariant else min(64, max(16, triton.next_power_of_2(M)))
    block_k = 128 if x.element_size() == 2 else 64
    block_n = _weight_block_n(inter, x.device)
    grid = (triton.cdiv(inter, block_n), triton.cdiv(M, block_m))
    _swiglu_kernel[grid](
        x2, w_gate_up, y, M, inter, K, x2.stride(0), w_gate_up.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=4,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return y.view(*x.shape[:-1], inter)


@triton.jit
def _linear_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(X + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + (k0 + rk)[None, :], mask=(rn < N)[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _weight_block_n(n: int, device: torch.device) -> int:
    """Output columns per program for a weight of n output rows: narrower tiles until the weight stream
    is spread over every SM."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < _programs_target(device):
        block_n //= 2
    return block_n


def _linear_tiles(n: int, device: torch.device, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a weight: chosen from its shape alone, never from the rows of a call."""
    return 16, _weight_block_n(n, device), 128 if element_size == 2 else 64


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias with a row's result independent of the other rows (batch-invariant): fixed tiles,
    no split over K, one reduction order, whatever the number of rows. Memory-bound at decode sizes."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], weight.shape[0]
    if weight.shape[1] != K or weight.stride(-1) != 1:
        raise ValueError(f"linear: a weight of {tuple(weight.shape)} for {K} inputs, contiguous rows")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _linear_tiles(N, x.device, x.element_size())
    _linear_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        x2, weight, weight if bias is None else bias, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return y.view(*x.shape[:-1], N)


@triton.jit
def _residual_rows(X, R, rm, k, ok, stride_xm, stride_rm, HAS_RESIDUAL: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of x + residual, rounded to x's dtype as _add_rms_norm_kernel rounds it."""
    h = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rm[:, None] * stride_rm + k[None, :], mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return h


@triton.jit
def _rms_norm_linear_kernel(
    X, R, NW, W, B, Y, ROut, M, N, K, stride_xm, stride_rm, stride_rom, stride_wn, stride_ym, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    # Prologue: each row's sum of squares in fixed BLOCK_K tiles, one lane per column of a tile, then one
    # reduction over the lanes; the first column tile's programs (pid_n == 0) store x + residual.
    sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = m_ok[:, None] & ((k0 + rk) < K)[None, :]
        h = _residual_rows(X, R, rm, k0 + rk, ok, stride_xm, stride_rm, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if pid_n == 0:
                tl.store(ROut + rm[:, None] * stride_rom + (k0 + rk)[None, :], h, mask=ok)
        hf = h.to(tl.float32)
        sq += hf * hf
    rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)
    # The GEMM of _linear_kernel (or _swiglu_kernel's two), its x tiles normalised as they are loaded.
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        h = _residual_rows(X, R, rm, k0 + rk, m_ok[:, None] & k_ok[None, :], stride_xm, stride_rm, HAS_RESIDUAL)
        nw = tl.load(NW + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
        x = (h.to(tl.float32) * rstd[:, None] * nw[None, :]).to(X.dtype.element_ty)
        w_ptrs = W + rn[:, None] * stride_wn + (k0 + rk)[None, :]
        w_mask = (rn < N)[:, None] & k_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if SWIGLU:  # the up rows [N, 2N) share the x tile
            wu = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            if IEEE:
                acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(x, tl.trans(wu), acc_u)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_u
    elif HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & (rn < N)[None, :])


def rms_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                    bias: Tensor | None = None, *, swiglu: bool = False,
                    residual_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """linear(add_rms_norm(x, residual, norm_weight, eps)[0], weight, bias) in one launch, and x + residual.

    With ``swiglu`` the weight is [Wg; Wu] of 2 * inter rows and the result swiglu's silu(gate) * up (no
    bias). x + residual is written into ``residual_out`` (allocated when None; x itself is returned
    without a residual). Batch-invariant as ``linear`` is: the tiles of ``_linear_tiles``, whatever the
    rows; each row's rms is summed in the same fixed BLOCK_K tiles whatever the call.

    Two passes over each row's K: the first sums the squares (the rms needs the whole row before the
    first tile enters the dot), the second normalises each tile as it is loaded and multiplies. Each
    program reads its rows' x and residual twice (from L2; a few KB at decode sizes, next to its share of
    the weight), where one pass scaling the accumulator by the rms at the end would feed the dot the
    unnormalised row, rounded otherwise than the unfused path's. So the dot's operands are those
    add_rms_norm hands linear, but for the rms's summation order (add_rms_norm sums a row at once):
    equal to the unfused path up to that last bit of the rms, not bit for bit.
    """
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    r2 = x2 if residual is None else residual.reshape(-1, K)
    M = x2.shape[0]
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if weight.shape[1] != K or norm_weight.shape != (K,) or (swiglu and bias is not None):
        raise ValueError(f"rms_norm_linear: a weight of {tuple(weight.shape)} and a norm of {tuple(norm_weight.shape)} "
                         f"for {K} inputs{', SwiGLU without a bias' if swiglu else ''}")
    assert x2.stride(-1) == r2.stride(-1) == weight.stride(-1) == norm_weight.stride(-1) == 1
    if residual is None:
        residual_out = x
    elif residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ro2 = x2 if residual is None else residual_out.view(-1, K)  # other programs still read x and residual
    assert residual is None or ro2.data_ptr() not in (x2.data_ptr(), r2.data_ptr())
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _linear_tiles(n, x.device, x.element_size())
    _rms_norm_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(M, block_m))](
        x2, r2, norm_weight, weight, weight if bias is None else bias, y, ro2, M, n, K,
        x2.stride(0), r2.stride(0), ro2.stride(0), weight.stride(0), y.stride(0), eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n), residual_out


@triton.jit
def _rope_kv_kernel(
    QKV, Cos, Sin, Slots, Q, KCache, VCache, n_heads, n_kv_heads,
    stride_xt, stride_xh, stride_ct, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
    HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)  # a head of the fused projection: q heads, then k heads, then v heads
    d = tl.arange(0, HALF)
    x = QKV + t * stride_xt + h * stride_xh + d
    x1 = tl.load(x)
    x2 = tl.load(x + HALF)
    slot = tl.load(Slots + t)
    if h < n_heads + n_kv_heads:  # q or k: rotate-half RoPE in fp32, each element on its own
        c1, c2 = tl.load(Cos + t * stride_ct + d), tl.load(Cos + t * stride_ct + HALF + d)
        s1, s2 = tl.load(Sin + t * stride_ct + d), tl.load(Sin + t * stride_ct + HALF + d)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        r1, r2 = f1 * c1 + -f2 * s1, f2 * c2 + f1 * s2
        if h < n_heads:
            out = Q + t * stride_qt + h * stride_qh + d
        else:
            out = KCache + (h - n_heads) * stride_kh + slot * stride_ks + d
        tl.store(out, r1.to(Q.dtype.element_ty))
        tl.store(out + HALF, r2.to(Q.dtype.element_ty))
    else:  # v: written into the cache as it is
        out = VCache + (h - n_heads - n_kv_heads) * stride_vh + slot * stride_vs + d
        tl.store(out, x1)
        tl.store(out + HALF, x2)


def rope_kv_write(qkv: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
                  n_heads: int, n_kv_heads: int) -> Tensor:
    """The fused projection's heads qkv [T, n_heads + 2 n_kv_heads, D]: q and k rotated as
    reference.rope_rotate_half does (fp32 [T, D] cos/sin), k and v written into the caches
    ([n_kv_heads, S, D]) at ``slots`` [T]; returns q [T, n_heads, D]. One launch where the batch-invariant
    mode's elementwise RoPE and the two cache writes take about nine, each element computed on its own
    (row-invariant by construction)."""
    T, N, D = qkv.shape
    assert N == n_heads + 2 * n_kv_heads and D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, qkv.shape
    assert qkv.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1 and qkv.dtype == k_cache.dtype
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(T, n_heads, D, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(T, N)](
        qkv, cos, sin, slots, q, k_cache, v_cache, n_heads, n_kv_heads,
        qkv.stride(0), qkv.stride(1), cos.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), HALF=D // 2,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return q
