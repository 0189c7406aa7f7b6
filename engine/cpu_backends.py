"""The CPU target's linear backends, each row-invariant by construction (kernels/cpu/): a row of
a multi-row forward equals a one-row forward bit for bit, so greedy speculation is exact without
one-row loops. Applied to a built Transformer as module surgery (``apply``), gpt-fast style:

* ``float32``, ``float16``, ``bfloat16``: the weights stored at that width, multiplied in fp32;
* ``gguf``: a GGUF's own blocks, as the file holds them: Q4_0 / Q4_1 / Q4_K as 4-bit blocks (w = d q + m per
  32 weights, the fp16 d and m widened to fp32 exactly; Q4_K's super-block scales folded into each
  sub-block's d and m, exactly), Q8_0 as 8-bit blocks, with the activations
  quantised to int16 per block of 32 (kernels/cpu/kernels.h says why not llama.cpp's int8). The embedding is looked up from its blocks.
  ``--quantize int4`` packs a float checkpoint the same way (Q4_1-style blocks, the lm_head and embedding
  as Q8_0-style ones).

Attention runs through the same library's fixed-order tree attention.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from swiftspec.engine.loader import q4_k_parts
from swiftspec.engine.model import LayerInputs, Layers, TransformerBlock
from swiftspec.engine.timing import CleanTimer
from swiftspec.kernels import cpu_linear
from swiftspec.kernels.cpu_linear import Format, KernelsUnavailable

FLOAT_FORMATS = {"float32": Format.F32, "float16": Format.F16, "bfloat16": Format.BF16}
CPU_BACKENDS = (*FLOAT_FORMATS, "gguf")
BLOCK_FORMATS = {"Q4_0": Format.Q4, "Q4_1": Format.Q4, "Q4_K": Format.Q4, "Q8_0": Format.Q8}


def library() -> ctypes.CDLL:
    """The kernels, built on first use into the cache (KernelsUnavailable without a C compiler)."""
    from swiftspec.engine.embedded import cache_dir

    return cpu_linear.load(cache_dir() / "kernels")


def kernels_available(args=None, tp_world: int = 1) -> str | None:
    """None when the kernels can be built here (and run a model of ``args``' shapes), else why not."""
    if args is not None:
        from swiftspec.engine.tp import shard_layout

        lay = shard_layout(args, tp_world)
        widths = {"hidden size": args.dim, "MLP width per rank": lay.intermediate,
                  "attention width per rank": lay.n_heads * args.head_dim}
        odd = [f"{k} {v}" for k, v in widths.items() if v % 32]
        if odd or args.head_dim % 2:
            return "the CPU kernels need widths that are multiples of 32 (" + ", ".join(odd or ["head size"]) + ")"
    try:
        library()
    except KernelsUnavailable as e:
        return str(e)
    return None


def _values(qs: Tensor, fmt: Format) -> Tensor:
    """GGUF-ordered blocks' values [..., nb, 32] (Q4: byte j holds value j low, j + 16 high)."""
    return qs if fmt == Format.Q8 else torch.cat([qs & 0x0F, qs >> 4], -1)


def _pack(values: Tensor, fmt: Format) -> Tensor:
    """The inverse of _values: [..., nb, 32] values as GGUF-ordered blocks."""
    return values if fmt == Format.Q8 else values[..., :16] | (values[..., 16:] << 4)


def kernel_groups(nb: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each group of a row of ``nb`` blocks in kernel order (kernels/cpu/kernels.h):
    groups of 8, then the nb % 8 last blocks as groups of 4, 2 and 1, as many as its binary digits say."""
    groups = [(b, 8) for b in range(0, nb // 8 * 8, 8)]
    at = nb // 8 * 8
    for size in (4, 2, 1):
        if nb % 8 & size:
            groups.append((at, size))
            at += size
    return groups


def to_kernel_order(qs: Tensor) -> Tensor:
    """GGUF-ordered blocks [N, nb, bytes] in the kernels' order (same shape): in each group of g blocks
    (kernel_groups), byte pair j of each of its blocks in turn, for j = 0, 1, ... (a Q8 pair is a step's
    two values; a Q4 byte pair holds a step's two values in its low nibbles and those of the step 8 later
    in its high ones). A group of one block is as GGUF stores it."""
    return _regroup(qs, to_kernel=True)


def from_kernel_order(qs: Tensor) -> Tensor:
    """The inverse of to_kernel_order."""
    return _regroup(qs, to_kernel=False)


def _regroup(qs: Tensor, to_kernel: bool) -> Tensor:
    """Each group's byte pairs [blocks, pairs] transposed to [pairs, blocks] (to_kernel) or back."""
    n, nb, size = qs.shape
    parts = []
    for b, g in kernel_groups(nb):
        pairs = qs[:, b:b + g].reshape(n, -1).view(torch.int16)
        shape = (n, g, size // 2) if to_kernel else (n, size // 2, g)
        parts.append(pairs.reshape(shape).transpose(1, 2).reshape(n, -1).view(qs.dtype).reshape(n, g, size))
    return torch.cat(parts, 1) if parts else qs.contiguous()


@dataclass
class Blocks:
    """A weight as packed blocks of 32: ``qs`` [N, nb, 16] uint8 (Q4) or [N, nb, 32] int8 (Q8), ``d``
    (and for Q4 ``m``) [N, nb] fp32. ``qs`` is in GGUF's order, or in the kernels' order once
    ``in_kernel_order`` made it so (what the kernels read)."""

    fmt: Format
    kind: str  # what the blocks came from: a GGUF type (Q4_1, Q8_0, ...) or "int4" / "int8" (--quantize)
    qs: Tensor
    d: Tensor
    m: Tensor | None = None
    kernel_order: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 32

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

    def in_kernel_order(self) -> Blocks:
        if self.kernel_order:
            return self
        return Blocks(self.fmt, self.kind, to_kernel_order(self.qs), self.d, self.m, True)

    def dequantize(self) -> Tensor:
        """The fp32 weight [N, K] the blocks stand for."""
        qs = from_kernel_order(self.qs) if self.kernel_order else self.qs
        w = _values(qs, self.fmt).float() * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(self.shape)

    def rows(self, index: Tensor) -> Blocks:
        return Blocks(self.fmt, self.kind, self.qs[index], self.d[index], None if self.m is None else self.m[index],
                      self.kernel_order)


def _narrow_scales(d: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A block weight's scales as float16 where that holds them exactly (a GGUF's Q4_0, Q4_1 and Q8_0
    store them so), else as they are: the kernels then read 2 bytes of scale a block instead of 4."""
    half = d.half()
    if not torch.equal(half.float(), d) or (m is not None and not torch.equal(m.half().float(), m)):
        return d, m
    return half, None if m is None else m.half()


class PackedLinear(nn.Module):
    """A CPU linear over packed weights through the kernels (kernels/cpu): rows independent of each other by
    construction. fp32 in and out."""

    def __init__(self, dll: ctypes.CDLL, weight: Tensor | Blocks, fmt: Format, bias: Tensor | None = None):
        super().__init__()
        self.dll, self.fmt = dll, fmt
        if isinstance(weight, Blocks):
            self.out_features, self.in_features = weight.shape
            weight = weight.in_kernel_order()
            self.qs, self.d, self.m = weight.qs, *_narrow_scales(weight.d, weight.m)
        else:
            self.out_features, self.in_features = weight.shape
            dtype = {Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.bfloat16}[fmt]
            self.qs, self.d, self.m = weight.detach().to(dtype).contiguous(), None, None
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def weight(self) -> Tensor:
        """The fp32 weight these packed ones stand for (made on each call: for a draft head that shares the
        target's lm_head, and for comparisons)."""
        if self.d is None:
            return self.qs.float()
        m = None if self.m is None else self.m.float()
        return Blocks(self.fmt, "", self.qs, self.d.float(), m, kernel_order=True).dequantize()

    def forward(self, x: Tensor) -> Tensor:
        return cpu_linear.linear(self.dll, self.fmt, x, self.out_features, self.qs, self.d, self.m, self.bias)


class BlockEmbedding(nn.Module):
    """An embedding looked up from its blocks: the rows of the asked tokens dequantised, as fp32."""

    def __init__(self, blocks: Blocks):
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.shape

    @property
    def weight(self) -> Tensor:
        """The whole fp32 table (made on each call: for a draft head that shares the target's embedding)."""
        return self.blocks.dequantize()

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        return self.blocks.rows(flat).dequantize().view(*tokens.shape, self.embedding_dim)


class CpuAttention:
    """Tree attention through the kernels (the mask stays a bool [T, S] mask): one fixed order over each
    row's keys."""

    def __init__(self, dll: ctypes.CDLL):
        self.dll = dll

    def prepare_mask(self, mask: Tensor, group: int, dtype: torch.dtype, invariant: bool = False) -> Tensor:
        return mask.contiguous()

    def tree_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
        """q [T, H, D]; k, v: the cache narrowed to the mask's S slots ([Hkv, S, D] views of [Hkv, S_max, D])."""
        d = q.shape[-1]
        full_k = k.as_strided((k.shape[0], k.stride(0) // d, d), k.stride())
        full_v = v.as_strided((v.shape[0], v.stride(0) // d, d), v.stride())
        return cpu_linear.attention(self.dll, q, full_k, full_v, mask, d ** -0.5 if scale is None else scale)


class _Lin(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("w", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Block(ctypes.Structure):
    _fields_ = [("wqkv", _Lin), ("wo", _Lin), ("w13", _Lin), ("w2", _Lin), ("attention_norm", ctypes.c_void_p),
                ("ffn_norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("dim", ctypes.c_int), ("n_heads", ctypes.c_int), ("n_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int)]


def _lin(p: PackedLinear) -> _Lin:
    ptr = lambda t: None if t is None else t.data_ptr()
    return _Lin(cpu_linear.scales_format(p.fmt, p.d), p.out_features, p.in_features, ptr(p.qs), ptr(p.d), ptr(p.m),
                ptr(p.bias))


class CpuBlock(nn.Module):
    """A decoder layer as two calls into the kernels (the attention half and the MLP half, with the
    tensor-parallel all-reduce between them): the norms, RoPE, the KV writes and the SwiGLU in C as well,
    where torch would spend ~20 small ops a layer. Holds the block's packed linears and norms."""

    def __init__(self, dll: ctypes.CDLL, block: nn.Module):
        super().__init__()
        self.dll = dll
        self.attention, self.feed_forward = block.attention, block.feed_forward
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm
        a, f = block.attention, block.feed_forward
        self.attention_norm.weight.data = self.attention_norm.weight.data.float().contiguous()
        self.ffn_norm.weight.data = self.ffn_norm.weight.data.float().contiguous()
        self.spec = _Block(_lin(a.wqkv), _lin(a.wo), _lin(f.w13), _lin(f.w2),
                           self.attention_norm.weight.data_ptr(), self.ffn_norm.weight.data_ptr(),
                           self.attention_norm.eps, a.scale, a.wo.out_features, a.n_heads, a.n_kv_heads,
                           a.head_dim, f.inter)

    def forward(self, x: Tensor, residual: Tensor | None, inp, k_cache: Tensor, v_cache: Tensor
                ) -> tuple[Tensor, Tensor]:
        x = x.contiguous()
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        out = torch.empty_like(x)
        mask = inp.mask
        t = x.shape[0]
        rc = self.dll.ss_attention_block(
            ctypes.byref(self.spec), t, x.data_ptr(), residual.data_ptr(), int(first), inp.cos.data_ptr(),
            inp.sin.data_ptr(), inp.slots.data_ptr(), mask.data_ptr(), mask.shape[1], k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[1], out.data_ptr())
        if rc != 0:
            raise MemoryError("cpu_linear: out of memory in a decoder block")
        x = inp.all_reduce(out)
        out = torch.empty_like(x)
        if self.dll.ss_mlp_block(ctypes.byref(self.spec), t, x.data_ptr(), residual.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("cpu_linear: out of memory in a decoder block")
        return inp.all_reduce(out), residual


class CpuLayers(Layers):
    """The decoder layers as CpuBlocks. Without tensor parallelism (``whole``) the stack is one call into
    the kernels, where Python would spend two calls with their arguments and three allocations a layer;
    with it, the blocks run in turn with the all-reduces between their halves."""

    def __init__(self, dll: ctypes.CDLL, blocks: list[CpuBlock], whole: bool):
        super().__init__(blocks)
        self.dll, self.whole = dll, whole
        self.specs = (_Block * len(blocks))(*(b.spec for b in blocks))

    def forward(self, x: Tensor, inp, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        if not self.whole:
            return super().forward(x, inp, k_cache, v_cache)
        x = x.clone(memory_format=torch.contiguous_format)  # the stack's output, in place of the embeddings
        residual, tmp = torch.empty_like(x), torch.empty_like(x)
        mask = inp.mask
        if self.dll.ss_layers(self.specs, len(self), x.shape[0], x.data_ptr(), residual.data_ptr(), inp.cos.data_ptr(),
                              inp.sin.data_ptr(), inp.slots.data_ptr(), mask.data_ptr(), mask.shape[1],
                              k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[2],
                              tmp.data_ptr()) != 0:
            raise MemoryError("cpu_linear: out of memory in a decoder block")
        return x, residual


def _linears(model: nn.Module):
    """(parent module, attribute name, linear) for every nn.Linear of the model, the lm_head last."""
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                yield mod, name, child


def apply(model: nn.Module, backend: str, blocks: dict[str, Blocks] | None = None, quantize: bool = False) -> str:
    """Replaces the model's linears (and, with blocks, its embedding) by packed ones and its attention by
    the library's; returns the precision label ("int4 (Q4_1 blocks) · int16 activations · AVX2").

    ``blocks``: the GGUF blocks by our parameter name (``layers.0.attention.wqkv.weight``,
    ``tok_embeddings.weight``); a linear without blocks keeps fp32 weights. ``quantize`` (gguf backend on a
    float checkpoint): every linear packed as Q4 blocks, the lm_head and embedding as Q8.
    """
    dll = library()
    blocks = dict(blocks or {})
    names = {id(mod): prefix for prefix, mod in model.named_modules()}
    if backend == "gguf" and quantize:
        for mod, name, lin in _linears(model):
            key = f"{names[id(mod)]}.{name}.weight".lstrip(".")
            blocks[key] = Blocks.quantize(lin.weight, Format.Q8 if key == "output.weight" else Format.Q4)
        blocks["tok_embeddings.weight"] = blocks["output.weight"] if model.args.tie_embeddings \
            else Blocks.quantize(model.tok_embeddings.weight, Format.Q8)
    in_order: dict[int, Blocks] = {}  # a tied embedding and lm_head share one copy
    for k, b in blocks.items():
        blocks[k] = in_order[id(b)] = in_order.get(id(b)) or b.in_kernel_order()
    if backend == "gguf":
        emb = blocks.get("tok_embeddings.weight")
        if emb is not None:
            model.tok_embeddings = BlockEmbedding(emb)
            if model.args.tie_embeddings:
                blocks["output.weight"] = emb
    for mod, name, lin in _linears(model):
        key = f"{names[id(mod)]}.{name}.weight".lstrip(".")
        if backend == "gguf":
            packed = PackedLinear(dll, blocks[key], blocks[key].fmt, lin.bias) if key in blocks \
                else PackedLinear(dll, lin.weight, Format.F32, lin.bias)
        else:
            packed = PackedLinear(dll, lin.weight, FLOAT_FORMATS[backend], lin.bias)
        setattr(mod, name, packed)
    model.attention_ops = CpuAttention(dll)
    model.layers = CpuLayers(dll, [CpuBlock(dll, layer) for layer in model.layers], whole=model.tp_world == 1)
    return label(backend, blocks, dll)


def label(backend: str, blocks: dict[str, Blocks], dll: ctypes.CDLL) -> str:
    """What the title bar shows: "int4 (Q4_1 blocks) · int16 activations · AVX2", "float16 weights · fp32
    math · AVX2"."""
    isa = cpu_linear.isa(dll)
    if backend != "gguf":
        return f"{backend} weights · fp32 math · {isa}"
    kinds = sorted({b.kind for k, b in blocks.items() if b.fmt == Format.Q4 and k != "tok_embeddings.weight"})
    what = f"int4 ({'/'.join(kinds)} blocks)" if kinds else "int8 blocks"
    return f"{what} · int16 activations · {isa}"


def unpack_gguf(state: dict[str, Tensor], kinds: dict[str, str]) -> dict[str, Blocks]:
    """Our state dict's block-typed entries (as convert_hf_state_dict keeps them) as Blocks; one tensor
    named twice (a tied lm_head) is unpacked once."""
    unpacked: dict[int, Blocks] = {}
    out = {}
    for k, v in state.items():
        if kinds.get(k) in BLOCK_FORMATS:
            out[k] = unpacked.setdefault(id(v), Blocks.from_gguf(v, kinds[k]))
    return out


def synthetic_costs(args, backend: str, rows: int, layers: int | None = None, timer: CleanTimer | None = None
                    ) -> list[float]:
    """Milliseconds of a forward of 1..``rows`` rows with ``backend``, measured on one decoder block and
    the lm_head of the model's shapes with random weights (what a step costs differs between backends in
    the weights' format only), scaled to the model's layers: the measurement behind --dtype auto.
    ``timer``: one whose ``clean`` the caller reads."""
    timer = timer or CleanTimer()

    g = torch.Generator().manual_seed(0)
    n_layers = layers or args.n_layers

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    dll = library()
    block = TransformerBlock(args, args.n_heads, args.n_kv_heads, args.intermediate_size)
    for mod, name, lin in _linears(block):
        lin.weight.data = rand(*lin.weight.shape)
        if lin.bias is not None:
            lin.bias.data = rand(*lin.bias.shape)
        fmt = Format.Q4 if backend == "gguf" else FLOAT_FORMATS[backend]
        w = Blocks.quantize(lin.weight, fmt) if backend == "gguf" else lin.weight
        setattr(mod, name, PackedLinear(dll, w, fmt, lin.bias))
    cpu_block = CpuBlock(dll, block)
    head_w = rand(args.vocab_size, args.dim)
    head = PackedLinear(dll, Blocks.quantize(head_w, Format.Q8), Format.Q8) if backend == "gguf" \
        else PackedLinear(dll, head_w, FLOAT_FORMATS[backend])
    prefix = 64
    kv = (args.n_kv_heads, prefix + rows, args.head_dim)
    k_cache, v_cache = torch.zeros(kv), torch.zeros(kv)
    costs = []
    for m in range(1, rows + 1):
        x = rand(m, args.dim)
        mask = torch.ones(m, prefix + m, dtype=torch.bool)
        cos, sin = torch.ones(m, args.head_dim), torch.zeros(m, args.head_dim)
        inp = LayerInputs(None, cos, sin, torch.arange(prefix, prefix + m), mask, None, lambda t: t)
        times = [timer.seconds(lambda x=x, inp=inp: cpu_block(x, None, inp, k_cache, v_cache)) * n_layers
                 + timer.seconds(lambda x=x: head(x)) for _ in range(3)]
        costs.append(min(times[1:]) * 1e3)  # the first call warms the caches
    return costs
