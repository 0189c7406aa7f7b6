"""Hot-path ops of the model: Triton on CUDA, plain PyTorch (kernels/reference.py) everywhere else.

Triton is imported on the first CUDA call only, so importing this package stays cheap on CPU.
"""

import functools

import torch
from torch import Tensor

from . import reference

__all__ = ["KeyList", "add_rms_norm", "apply_rope", "prepare_mask", "rope_rotate_half", "rope_rotation", "swiglu",
           "tree_attention", "use_triton"]

# RoPE is one batched matmul on every device; elementwise in the batch-invariant mode.
rope_rotation = reference.rope_rotation
apply_rope = reference.apply_rope
rope_rotate_half = reference.rope_rotate_half
KeyList = reference.KeyList


@functools.cache
def _triton_kernels():
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def use_triton(tensor: Tensor) -> bool:
    """Triton kernels run on CUDA tensors when triton is installed."""
    return tensor.is_cuda and _triton_kernels() is not None


def prepare_mask(mask: Tensor, group: int, dtype: torch.dtype, invariant: bool = False) -> Tensor | KeyList:
    """The [T, S] bool mask (True = attend) in the form tree_attention takes; once per forward. ``group``:
    query heads per kv head; ``dtype``: the attention inputs' dtype; ``invariant``: the batch-invariant
    mode's per-row key lists."""
    ops = _triton_kernels() if use_triton(mask) else reference
    return ops.prepare_mask(mask, group, dtype, invariant)


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor | KeyList,
                   scale: float | None = None) -> Tensor:
    """q [T, H, D] (rotated), k/v cache [Hkv, S, D], mask from prepare_mask -> [T, H, D]."""
    ops = _triton_kernels() if use_triton(q) else reference
    return ops.tree_attention(q, k_cache, v_cache, mask, scale)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual); residual None means zero."""
    ops = _triton_kernels() if use_triton(x) else reference
    return ops.add_rms_norm(x, residual, weight, eps)


def swiglu(x: Tensor, w_gate_up: Tensor, inter: int) -> Tensor:
    """silu(x @ Wg.T) * (x @ Wu.T) with w_gate_up = [Wg; Wu] of shape [2*inter, dim]."""
    ops = _triton_kernels() if use_triton(x) else reference
    return ops.swiglu(x, w_gate_up, inter)
