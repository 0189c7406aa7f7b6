"""Weights as the CPU kernels read them: blocks of 32 values with a float scale (d) and offset (m) each,
as 4-bit (Q4) or 8-bit (Q8) integers; from a GGUF's own blocks (Q4_0, Q4_1, Q4_K, Q8_0), or quantised at
load (``--dtype int4``), and back (``dequantize``, exact)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from swiftspec.engine.model.gguf_io import q4_k_parts
from swiftspec.kernels.cpu_linear import Format

BLOCK_FORMATS = {"Q4_0": Format.Q4, "Q4_1": Format.Q4, "Q4_K": Format.Q4, "Q8_0": Format.Q8}


def _values(qs: Tensor, fmt: Format) -> Tensor:
    """GGUF-ordered blocks' values [..., nb, 32] (Q4: byte j holds value j low, j + 16 high)."""
    return qs if fmt == Format.Q8 else torch.cat([qs & 0x0F, qs >> 4], -1)


def _pack(values: Tensor, fmt: Format) -> Tensor:
    """The inverse of _values: [..., nb, 32] values as GGUF-ordered blocks."""
    return values if fmt == Format.Q8 else values[..., :16] | (values[..., 16:] << 4)


PANEL = 16  # columns a panel (kernels/cpu/kernels.h: SS_PANEL)


def _panel_count(n: int) -> int:
    return -(-n // PANEL)


def to_panels(qs: Tensor) -> Tensor:
    """GGUF-ordered blocks [N, nb, bytes] as the kernels' panels [P, nb, bytes * PANEL] (P = N / PANEL,
    rounded up; the last panel padded with zero columns): for each block in turn, its byte pairs in turn,
    each as PANEL columns x 2 bytes (a Q8 pair is two values; a Q4 pair j holds values 2j, 2j + 1 in its low
    nibbles and 2j + 16, 2j + 17 in its high ones, as GGUF's bytes do)."""
    n, nb, size = qs.shape
    padded = _panel_count(n) * PANEL
    if padded > n:
        qs = torch.cat([qs, qs.new_zeros(padded - n, nb, size)])
    pairs = qs.contiguous().view(torch.int16).reshape(padded // PANEL, PANEL, nb, size // 2)
    return pairs.permute(0, 2, 3, 1).contiguous().view(qs.dtype).reshape(padded // PANEL, nb, size * PANEL)


def from_panels(qs: Tensor, n: int) -> Tensor:
    """The inverse of to_panels, for the first ``n`` columns."""
    panels, nb, size = qs.shape
    pairs = qs.contiguous().view(torch.int16).reshape(panels, nb, size // (2 * PANEL), PANEL)
    flat = pairs.permute(0, 3, 1, 2).reshape(panels * PANEL, nb, -1).contiguous().view(qs.dtype)
    return flat[:n]


def scales_to_panels(d: Tensor) -> Tensor:
    """Scales [N, nb] as the panels hold them, [P, nb, PANEL] (the padding columns' scales 0)."""
    n, nb = d.shape
    padded = _panel_count(n) * PANEL
    if padded > n:
        d = torch.cat([d, d.new_zeros(padded - n, nb)])
    return d.reshape(padded // PANEL, PANEL, nb).transpose(1, 2).contiguous()


def scales_from_panels(d: Tensor, n: int) -> Tensor:
    """The inverse of scales_to_panels, for the first ``n`` columns."""
    return d.transpose(1, 2).reshape(-1, d.shape[1])[:n]


@dataclass
class Blocks:
    """A weight as packed blocks of 32: ``qs`` [N, nb, 16] uint8 (Q4) or [N, nb, 32] int8 (Q8), ``d``
    (and for Q4 ``m``) [N, nb] fp32, in GGUF's order; or, once ``in_panels`` made it so, in the kernels'
    panels (``panels``, ``n`` columns): qs [P, nb, bytes * PANEL], d and m [P, nb, PANEL]."""

    fmt: Format
    kind: str  # what the blocks came from: a GGUF type (Q4_1, Q8_0, ...) or "int4" / "int8" (--quantize)
    qs: Tensor
    d: Tensor
    m: Tensor | None = None
    panels: bool = False
    n: int = 0  # the columns, where ``panels``

    @property
    def shape(self) -> tuple[int, int]:
        return self.n if self.panels else self.qs.shape[0], self.qs.shape[1] * 32

    @classmethod
    def from_gguf(cls, raw: Tensor, kind: str) -> Blocks:
        """A GGUF tensor's blocks ([rows, bytes per row], uint8) unpacked into our layout."""
        if kind == "Q4_K":  # 8 Q4_1-like blocks a super-block: d = d * scale, m = -(dmin * min), exactly
            scale, offset, q = q4_k_parts(raw.reshape(-1, 144))
            rows = raw.shape[0]
            return cls(Format.Q4, kind, _pack(q.reshape(rows, -1, 32), Format.Q4), scale.reshape(rows, -1),
                       -offset.reshape(rows, -1))
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        b = raw.reshape(raw.shape[0], -1, size)
        d = b[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
        if kind == "Q8_0":
            return cls(Format.Q8, kind, b[..., 2:].contiguous().view(torch.int8), d)
        if kind == "Q4_0":
            return cls(Format.Q4, kind, b[..., 2:].contiguous(), d, d * -8.0)  # d (q - 8) = d q + (-8 d), exactly
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        return cls(Format.Q4, kind, b[..., 4:].contiguous(), d, m)

    @classmethod
    def quantize(cls, w: Tensor, fmt: Format) -> Blocks:
        """A float weight [N, K] as blocks: Q4 asymmetric (d = range / 15, m = min) or Q8 symmetric."""
        n, k = w.shape
        x = w.detach().float().reshape(n, k // 32, 32)
        if fmt == Format.Q8:
            d = x.abs().amax(-1) / 127
            q = torch.round(x / torch.where(d > 0, d, 1)[..., None]).clamp_(-127, 127).to(torch.int8)
            return cls(Format.Q8, "int8", q, d)
        lo, hi = x.amin(-1), x.amax(-1)
        d = (hi - lo) / 15
        q = torch.round((x - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]).clamp_(0, 15).to(torch.uint8)
        return cls(Format.Q4, "int4", _pack(q, fmt), d, lo)

    def in_panels(self) -> Blocks:
        """The same weight in the kernels' panels (what they read)."""
        if self.panels:
            return self
        m = None if self.m is None else scales_to_panels(self.m)
        return Blocks(self.fmt, self.kind, to_panels(self.qs), scales_to_panels(self.d), m, True, self.qs.shape[0])

    def in_gguf_order(self) -> Blocks:
        if not self.panels:
            return self
        m = None if self.m is None else scales_from_panels(self.m, self.n)
        return Blocks(self.fmt, self.kind, from_panels(self.qs, self.n), scales_from_panels(self.d, self.n), m)

    def dequantize(self) -> Tensor:
        """The fp32 weight [N, K] the blocks stand for."""
        b = self.in_gguf_order()
        w = _values(b.qs, self.fmt).float() * b.d.float()[..., None]
        if b.m is not None:
            w = w + b.m.float()[..., None]
        return w.reshape(self.shape)

    def rows(self, index: Tensor) -> Blocks:
        """The blocks of the rows (columns of the linear) ``index``, in GGUF's order: an embedding's lookup."""
        if not self.panels:
            return Blocks(self.fmt, self.kind, self.qs[index], self.d[index],
                          None if self.m is None else self.m[index])
        panel, lane = index // PANEL, index % PANEL
        panels, nb, size = self.qs.shape
        pairs = self.qs.view(torch.int16).reshape(panels, nb, size // (2 * PANEL), PANEL)
        qs = pairs[panel, :, :, lane].contiguous().view(self.qs.dtype)
        m = None if self.m is None else self.m[panel, :, lane]
        return Blocks(self.fmt, self.kind, qs, self.d[panel, :, lane], m)


def narrow_scales(d: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A block weight's scales as float16 where that holds them exactly (a GGUF's Q4_0, Q4_1 and Q8_0
    store them so), else as they are: the kernels then read 2 bytes of scale a block instead of 4."""
    half = d.half()
    if not torch.equal(half.float(), d) or (m is not None and not torch.equal(m.half().float(), m)):
        return d, m
    return half, None if m is None else m.half()


def unpack_gguf(state: dict[str, Tensor], kinds: dict[str, str]) -> dict[str, Blocks]:
    """Our state dict's block-typed entries (as convert_hf_state_dict keeps them) as Blocks; one tensor
    named twice (a tied lm_head) is unpacked once."""
    unpacked: dict[int, Blocks] = {}
    out = {}
    for k, v in state.items():
        if kinds.get(k) in BLOCK_FORMATS:
            out[k] = unpacked.setdefault(id(v), Blocks.from_gguf(v, kinds[k]))
    return out
