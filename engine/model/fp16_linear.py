"""CPU linears with fp16 weights in FBGEMM's packed layout, applied as module surgery: a draft head's CPU
linears, train-draft's data generation, and the target's float16 where the row-invariant kernels are off."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def fbgemm_available() -> bool:
    """Whether this torch has FBGEMM (x86 builds), whose kernels FP16WeightLinear calls."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class FP16WeightLinear(nn.Module):
    """A CPU linear with fp16 weights in FBGEMM's packed layout, multiplied in fp32 (inputs and outputs
    fp32); its rows are not independent of each other: a draft head's CPU linears, train-draft's data
    generation, and the target's float16 where the row-invariant kernels are off."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(),
                                                              None if bias is None else bias.detach().float())

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


def pack_fp16_linears(module: nn.Module) -> None:
    """Replaces every nn.Linear inside ``module`` by an FP16WeightLinear of its weights."""
    for mod in list(module.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, name, FP16WeightLinear(child.weight, child.bias))
