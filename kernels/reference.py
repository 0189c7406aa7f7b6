"""Plain-PyTorch kernels: the CPU path runs these, and the Triton kernels are tested against them."""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def rope_rotation(cos: Tensor, sin: Tensor) -> Tensor:
    """[T, D] cos/sin tables -> [T, D, D] matrices R with x @ R = x * cos + [-x2, x1] * sin: Hugging Face's
    rotate-half RoPE as one batched matmul over every head of q and k, built once per forward."""
    half = cos.shape[-1] // 2
    return (torch.diag_embed(cos) + torch.diag_embed(sin[:, half:], offset=half)
            + torch.diag_embed(-sin[:, :half], offset=-half))


def apply_rope(x: Tensor, rotation: Tensor) -> Tensor:
    """x [T, N, D] (any number of q and k heads) rotated by rope_rotation's [T, D, D]: one op, where the
    elementwise form costs six, and on a CPU ops, not flops, cost at decode sizes."""
    return torch.bmm(x, rotation)


def rope_rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, N, D] rotated elementwise in fp32 by [T, D] cos/sin tables (Hugging Face's rotate-half form):
    every element depends on its own row only, on any device, which the batched matmul form does not
    promise on a GPU. The batch-invariant mode's RoPE."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(x.dtype)


@dataclass
class KeyList:
    """The batch-invariant form of a [T, S] mask: row t attends to the keys at ``slots[t, :lengths[t]]``.

    Allowed slots are listed in slot order, which is sequence order (the prefix, then a node's ancestors,
    which the tree cache always stores before the node). A verified tree node therefore attends to the
    very same key sequence, in the same order, as the one-token step that would have produced it, and
    attention computed over that compacted sequence cannot tell the two apart.
    """

    slots: Tensor  # [T, S] int32; entries past lengths[t] are unspecified
    lengths: Tensor  # [T] int32


def key_list(mask: Tensor) -> KeyList:
    """Compacts each row's True columns to its front, in order (no host sync: CUDA-graph safe)."""
    T, S = mask.shape
    where = torch.where(mask, mask.cumsum(1, dtype=torch.int32) - 1, S)  # a dump column for masked keys
    slots = torch.zeros(T, S + 1, dtype=torch.int32, device=mask.device)
    slots.scatter_(1, where.long(), torch.arange(S, dtype=torch.int32, device=mask.device).expand(T, S))
    return KeyList(slots[:, :S], mask.sum(1, dtype=torch.int32))


def prepare_mask(mask: Tensor, group: int, dtype: torch.dtype, invariant: bool = False) -> Tensor | KeyList:
    """The [T, S] bool mask as tree_attention takes it, built once per forward rather than once per layer:
    an additive mask (0 or -inf) with one row per (query head of a kv group, token), in the scores' dtype;
    in the batch-invariant mode, the rows' key lists."""
    if invariant:
        return key_list(mask)
    return torch.where(mask, 0.0, float("-inf")).to(dtype).repeat(group, 1)


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor | KeyList,
                   scale: float | None = None) -> Tensor:
    """Attention of T new tokens over S cached keys under an arbitrary mask (prefix + draft tree).

    q [T, H, D] and k/v [Hkv, S, D] hold rotated queries and keys; head h reads kv head h // (H // Hkv);
    ``mask`` is prepare_mask's [G * T, S] form of the [T, S] bool mask, or its KeyList: then each row is
    computed on its own, over its gathered keys (batch-invariant).
    Every mask row needs a True (pad rows can attend to themselves): an empty row is NaN here, 0 in Triton.
    Matmuls run in the input dtype and the softmax in fp32, like HF's eager attention.
    """
    T, H, D = q.shape
    Hkv, S, _ = k_cache.shape
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if isinstance(mask, KeyList):
        rows = []
        for t in range(T):
            idx = mask.slots[t, : int(mask.lengths[t])].long()
            keys, values = k_cache.index_select(1, idx), v_cache.index_select(1, idx)
            rows.append(_attend(q[t].view(Hkv, G, D), keys, values, None, scale).view(H, D))
        return torch.stack(rows)
    q = q.view(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)
    out = _attend(q, k_cache, v_cache, mask, scale).view(Hkv, G, T, D)
    return out.permute(2, 0, 1, 3).reshape(T, H, D)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T * scale + mask) v per kv head: q [Hkv, R, D], k/v [Hkv, S, D] -> [Hkv, R, D]."""
    if mask is None:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    else:
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)  # scale and mask in the same op
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.bmm(_cast(p, v.dtype), v)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Pre-norm block entry: returns (rmsnorm(x + residual) * weight, x + residual).

    The sum is rounded to x's dtype before normalising, so the fused and unfused paths agree bit for bit
    on what the residual stream holds.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    # rsqrt(mean(h^2) + eps) as rsqrt(eps + n * n / D), n = ||h||: three ops where pow, mean, add and
    # rsqrt take five (at decode sizes a CPU pays per op, not per flop).
    n = torch.linalg.vector_norm(hf, dim=-1, keepdim=True)
    inv_rms = torch.addcmul(_scalar(eps, n.device), n, n, value=1.0 / hf.shape[-1]).rsqrt_()
    return _cast((hf * inv_rms).mul_(weight), x.dtype), h


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x.to(dtype), without the call when it would be a no-op (a call costs more than the math here)."""
    return x if x.dtype == dtype else x.to(dtype)


@functools.cache
def _scalar(value: float, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def swiglu(x: Tensor, w_gate_up: Tensor, inter: int) -> Tensor:
    """Llama MLP up half: silu(x @ Wg.T) * (x @ Wu.T), with w_gate_up = [Wg; Wu] of shape [2*inter, dim]."""
    gate, up = F.linear(x, w_gate_up).split(inter, dim=-1)
    return F.silu(gate) * up
