"""Plain-PyTorch kernels: the CPU path runs these, and the Triton kernels are tested against them."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """HF (non-interleaved) RoPE: the two halves of the head dim form the complex pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D], cos/sin [T, D]; rotated in fp32 so every path rounds once, at the end."""
    xf = x.float()
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def tree_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, cos: Tensor, sin: Tensor, scale: float | None = None
) -> Tensor:
    """Attention of T new tokens over S cached keys under an arbitrary [T, S] mask (prefix + draft tree).

    q [T, H, D] is not rotated yet; k/v [Hkv, S, D] hold rotated keys; head h reads kv head h // (H // Hkv).
    Every mask row needs a True (pad rows can attend to themselves): an empty row is NaN here, 0 in Triton.
    Matmuls run in the input dtype and the softmax in fp32, like HF's eager attention.
    """
    T, H, D = q.shape
    Hkv, S, _ = k_cache.shape
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q = apply_rope(q, cos, sin).view(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)
    scores = torch.bmm(q, k_cache.transpose(1, 2)).float().view(Hkv, G, T, S) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v_cache.dtype).view(Hkv, G * T, S)
    out = torch.bmm(p, v_cache).view(Hkv, G, T, D)
    return out.permute(2, 0, 1, 3).reshape(T, H, D)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Pre-norm block entry: returns (rmsnorm(x + residual) * weight, x + residual).

    The sum is rounded to x's dtype before normalising, so the fused and unfused paths agree bit for bit
    on what the residual stream holds.
    """
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), h


def swiglu(x: Tensor, w_gate_up: Tensor, inter: int) -> Tensor:
    """Llama MLP up half: silu(x @ Wg.T) * (x @ Wu.T), with w_gate_up = [Wg; Wu] of shape [2*inter, dim]."""
    gate, up = F.linear(x, w_gate_up).split(inter, dim=-1)
    return F.silu(gate) * up
