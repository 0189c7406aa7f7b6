"""What crosses between the host and the device in a round, and how it is counted.

On a GPU every host->device copy and every read of a device value costs a round trip the model does not
need: at a 1 ms step, a handful of them is a tenth of the token. So a round stages all of its inputs in
one host buffer and sends them in one copy (``Staging.upload``), builds the attention mask on the device
from them (``rows_mask``), and reads back one tensor: every node's choice, from which the host walks the
verdict and its bonus token (engine/spec/verify.py).

``TransferCounter`` counts, while it is active in a thread, the calls that would move data or force a
synchronisation on a GPU. On the CPU it cannot tell the host from the device, so it counts what the call
would do on a GPU, conservatively: every copy to a named device or from another tensor, every tensor made
from host data for a device, and every read of a tensor's values into Python. On CUDA it counts only
the calls that really cross (a CPU tensor going to CUDA or back). What it cannot see: a host tensor
handed straight to a device op (torch copies it implicitly), so the round code never does that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from swiftspec.engine.config import Device


@dataclass
class Rows:
    """One forward's rows, described on the host: row r has ``tokens[r]`` at ``positions[r]``, writes its
    KV into ``slots[r]`` and attends to the slots ``[0, visible[r])`` and to the slots in ``ancestors[r]``
    (its tree ancestors and itself, padded with its own slot), over ``kv_len`` cache slots."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    visible: list[int]
    ancestors: list[list[int]]  # [rows][width]
    kv_len: int

    def host_mask(self) -> Tensor:
        """The rows' mask as a host tensor (tests, profiling: outside the rounds)."""
        return rows_mask(torch.tensor(self.visible), torch.tensor(self.ancestors), self.kv_len)


@dataclass
class StagedRows:
    """Rows on the device: what a model forward takes, and the extras staged with them (int64, flat)."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor
    mask: Tensor  # [rows, kv_len] bool
    extras: list[Tensor]


def rows_mask(visible: Tensor, ancestors: Tensor, kv_len: int) -> Tensor:
    """[rows, kv_len] bool: row r sees the slots below visible[r] and those in ancestors[r] (on the
    tensors' device, without reading them)."""
    mask = torch.arange(kv_len, device=visible.device)[None, :] < visible[:, None]
    return mask.scatter_(1, ancestors, True)


class Staging:
    """A host buffer (pinned on CUDA) and a device buffer of int64: a forward's inputs and its extras go
    to the device in one copy. The buffers grow when a round needs more and are reused otherwise; a
    round's download waits for the copy, so the next round may overwrite the host side.

    On the CPU the host is the device: the inputs are numpy arrays that become tensors in place, the mask
    made in numpy too. Right after a forward, whose weights have just streamed through the caches, torch's
    ops run several times slower than warm: the copy, the split and the mask's ops took 0.17 ms of a 4 ms
    decode step on the Zen 4, numpy's way 0.06."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._host = self._dev = torch.empty(0, dtype=torch.int64)
        self._host_np = self._host.numpy()

    @property
    def on_host(self) -> bool:
        return Device.of(self.device) is Device.CPU

    def _reserve(self, n: int) -> None:
        if n > len(self._host_np):
            size = max(n, 2 * len(self._host_np), 256)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=Device.of(self.device) is Device.CUDA)
            self._host_np = self._host.numpy()
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)

    def upload(self, rows: Rows, *extras: np.ndarray | list[int]) -> StagedRows:
        if self.on_host:
            return self._on_host(rows, extras)
        n = len(rows.tokens)
        parts = [rows.tokens, rows.positions, rows.slots, rows.visible, [s for row in rows.ancestors for s in row],
                 *(np.asarray(e, dtype=np.int64).reshape(-1) for e in extras)]
        sizes = [len(p) for p in parts]
        self._reserve(sum(sizes))
        at = 0
        for p, size in zip(parts, sizes, strict=True):
            self._host_np[at:at + size] = p
            at += size
        dev = self._dev[:at]
        dev.copy_(self._host[:at], non_blocking=True)
        tokens, positions, slots, visible, anc, *rest = dev.split_with_sizes(sizes)
        mask = rows_mask(visible, anc.view(n, -1), rows.kv_len)
        return StagedRows(tokens, positions, slots, mask, rest)

    @staticmethod
    def _on_host(rows: Rows, extras: tuple[np.ndarray | list[int], ...]) -> StagedRows:
        ints = np.array([rows.tokens, rows.positions, rows.slots], dtype=np.int64)
        mask = np.zeros((len(rows.tokens), rows.kv_len), dtype=bool)
        for r, (visible, ancestors) in enumerate(zip(rows.visible, rows.ancestors, strict=True)):
            mask[r, :visible] = True
            mask[r, ancestors] = True
        return StagedRows(*(torch.from_numpy(a) for a in ints), torch.from_numpy(mask),
                          [torch.from_numpy(np.array(e, dtype=np.int64).reshape(-1)) for e in extras])


# What the counter treats as a read of device values into Python (a device->host synchronisation); not
# Tensor.numpy, which only takes host tensors.
READS = frozenset({
    Tensor.item, Tensor.tolist, Tensor.cpu, Tensor.__bool__, Tensor.__int__, Tensor.__float__,
    Tensor.__index__, Tensor.nonzero, Tensor.unique, Tensor.masked_select, torch.nonzero, torch.unique,
    torch.masked_select, torch.multinomial, Tensor.multinomial,
})
MAKERS = frozenset({torch.tensor, torch.as_tensor})  # host data made into a tensor; counted with a device
MOVES = frozenset({Tensor.to, Tensor.cuda, Tensor.copy_})


class TransferCounter(TorchFunctionMode):
    """Counts host->device copies (``up``) and device->host reads (``down``) in this thread while active,
    with the name of each call in ``calls`` (see the module docstring for what counts)."""

    def __init__(self):
        super().__init__()
        self.up = 0
        self.down = 0
        self.calls: Counter[str] = Counter()

    def reset(self) -> None:
        self.up = self.down = 0
        self.calls.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in READS or (func is Tensor.__getitem__ and _bool_index(args[1])):
            if _on_device(args[0]):
                self.down += 1
                self.calls[name] += 1
        elif func in MAKERS and kwargs.get("device") is not None:
            if Device.of(torch.device(kwargs["device"])) is not Device.CPU or not torch.cuda.is_available():
                self.up += 1
                self.calls[name] += 1
        elif func in MOVES and _moves(func, args, kwargs):
            self.up += 1
            self.calls[name] += 1
        return func(*args, **kwargs)


def _on_device(t) -> bool:
    """Whether reading t crosses to the host: always on a CPU-only machine (we count what a GPU would)."""
    return not torch.cuda.is_available() or (isinstance(t, Tensor) and t.is_cuda)


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)


def _moves(func, args, kwargs) -> bool:
    """A copy from the host to a device (every copy to a device or from a tensor, on a CPU-only machine)."""
    src = args[0]
    if func is Tensor.copy_:
        dst, src = args[0], args[1]
        return not torch.cuda.is_available() or (dst.is_cuda and not src.is_cuda)
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (torch.device, str, Tensor)):
            target = a
    if func is Tensor.cuda:
        target = "cuda"
    if target is None:
        return False
    if not torch.cuda.is_available():
        return True
    target = target.device if isinstance(target, Tensor) else torch.device(target)
    return Device.of(target) is Device.CUDA and not src.is_cuda
