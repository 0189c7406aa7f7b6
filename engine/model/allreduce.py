"""The tensor-parallel all-reduce: symmetric-memory one-shot on CUDA where it works, else ``dist.all_reduce``.

At <= 16 tokens per forward the decoder's two all-reduces per layer carry a few KB to a few hundred KB,
and their cost is latency, not bandwidth: NCCL's ring/tree protocols take several steps and handshakes
per call. The one-shot all-reduce of ``torch.distributed._symmetric_memory`` is a single kernel: each rank
copies its input into a buffer that every peer maps (NVLink / PCIe P2P), one barrier, then every rank
reads all peers' copies and sums them, in rank order, so every rank gets the same bits, as TP needs. It
runs inside CUDA graphs. Larger messages (prefills) and every other setup (CPU/gloo, fp16, several nodes,
a torch build without symmetric memory) use ``dist.all_reduce``.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

ONE_SHOT_MAX_BYTES = 1 << 19  # 64 tokens x 4096 bf16; one-shot reads world x bytes, so keep it small
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel is built for
_buffers: dict[tuple[str, torch.dtype], Tensor | None] = {}


def all_reduce(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sum of x over group. Returns a new tensor (one-shot) or x reduced in place (``dist.all_reduce``).

    Collective: every rank of group must call it with the same shape and dtype.
    """
    if x.is_cuda and x.dtype in ONE_SHOT_DTYPES and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
        group = group or dist.group.WORLD
        buf = _symmetric_buffer(group, x.dtype, x.device)
        if buf is not None:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(
                buf[: x.numel()].view(x.shape), x.contiguous(), "sum", group.group_name)
    dist.all_reduce(x, group=group)
    return x


def _symmetric_buffer(group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The group's symmetric buffer for dtype, made on first use (a collective: allocation, rendezvous and
    an agreement that every rank succeeded), or None where one-shot cannot run."""
    key = (group.group_name, dtype)
    if key in _buffers:
        return _buffers[key]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("run the model once eagerly before capturing it: the all-reduce buffer is "
                           "allocated on first use")
    buf = None
    # Symmetric memory maps peers' memory, so it needs NCCL ranks on one node (torchrun sets both sizes).
    # The backend is "nccl" or a per-device one such as "cpu:gloo,cuda:nccl".
    if "nccl" in dist.get_backend(group) and os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group)
        except (ImportError, RuntimeError) as e:
            warnings.warn(f"symmetric-memory all-reduce unavailable, using NCCL: {e}", stacklevel=2)
            buf = None
        ok = torch.tensor([buf is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        buf = buf if ok.item() else None
    _buffers[key] = buf
    return buf
