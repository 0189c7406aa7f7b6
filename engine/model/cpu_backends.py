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

Attention runs through the same library's fixed-order tree attention. With the gguf backend the KV cache
holds float16 (llama.cpp's default too): attention streams the keys and values of the whole context at
every step, and at half the bytes a decode step's attention ran 20-30 % faster; the float backends keep
float32.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch
from torch import Tensor, nn

from swiftspec.engine.config import Activations, Dtype, KvCache
from swiftspec.engine.model.cpu_blocks import Blocks, narrow_scales
from swiftspec.engine.model.tp import shard_layout
from swiftspec.engine.model.transformer import LayerInputs, Layers, TransformerBlock, rope_cos_sin
from swiftspec.engine.paths import cache_dir
from swiftspec.engine.timing import CleanTimer
from swiftspec.kernels import cpu_linear
from swiftspec.kernels.cpu_linear import Format, KernelsUnavailable

FLOAT_FORMATS = {Dtype.FLOAT32: Format.F32, Dtype.FLOAT16: Format.F16, Dtype.BFLOAT16: Format.BF16}


def kv_dtype(backend: Dtype, kv_cache: KvCache = KvCache.AUTO) -> torch.dtype:
    """What a backend's KV cache holds: as ``kv_cache`` says, where auto is float16 beside a GGUF's blocks
    and float32 beside float weights."""
    if kv_cache is KvCache.AUTO:
        return torch.float16 if backend == Dtype.GGUF else torch.float32
    return torch.float16 if kv_cache is KvCache.FLOAT16 else torch.float32


def library(activations: Activations | None = None) -> ctypes.CDLL:
    """The kernels, built on first use into the cache (KernelsUnavailable without a C compiler), rounding
    the activations to ``activations`` from now on where given."""
    if activations is None:
        return cpu_linear.load(cache_dir() / "kernels")
    return cpu_linear.load(cache_dir() / "kernels", activations.bits, bf16_activations=activations is Activations.BF16)


def kernels_available(args=None, tp_world: int = 1) -> str | None:
    """None when the kernels can be built here (and run a model of ``args``' shapes), else why not."""
    if args is not None:
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


class PackedLinear(nn.Module):
    """A CPU linear over packed weights through the kernels (kernels/cpu): rows independent of each other by
    construction. fp32 in and out."""

    def __init__(self, dll: ctypes.CDLL, weight: Tensor | Blocks, fmt: Format, bias: Tensor | None = None):
        super().__init__()
        self.dll, self.fmt = dll, fmt
        if isinstance(weight, Blocks):
            self.out_features, self.in_features = weight.shape
            weight = weight.in_panels()
            self.qs, self.d, self.m = weight.qs, *narrow_scales(weight.d, weight.m)
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
        return Blocks(self.fmt, "", self.qs, self.d.float(), m, panels=True, n=self.out_features).dequantize()

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
            inp.sin.data_ptr(), inp.slots.data_ptr(), mask.data_ptr(), mask.shape[1], cpu_linear.kv_half(k_cache),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], out.data_ptr())
        if rc != 0:
            raise MemoryError("cpu_linear: out of memory in a decoder block")
        x = inp.all_reduce(out)
        out = torch.empty_like(x)
        if self.dll.ss_mlp_block(ctypes.byref(self.spec), t, x.data_ptr(), residual.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("cpu_linear: out of memory in a decoder block")
        return inp.all_reduce(out), residual


class CpuLayers(Layers):
    """The decoder layers as CpuBlocks, run in turn with the all-reduces between their halves (tensor
    parallelism; one rank's model runs whole, CpuForward). Holds their specs as one array for ss_forward."""

    def __init__(self, blocks: list[CpuBlock]):
        super().__init__(blocks)
        self.specs = (_Block * len(blocks))(*(b.spec for b in blocks))


class CpuNorm(nn.Module):
    """The final RMSNorm through the kernels (with the residual add fused, as RMSNorm's): the bits that
    CpuForward's final norm has, for a model run module by module."""

    def __init__(self, dll: ctypes.CDLL, norm: nn.Module):
        super().__init__()
        self.dll, self.eps = dll, norm.eps
        self.weight = nn.Parameter(norm.weight.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x = x.float().contiguous()
        residual = None if residual is None else residual.float().contiguous()  # held through the call
        h, out = torch.empty_like(x), torch.empty_like(x)
        self.dll.ss_add_rms_norm(x.shape[0], x.shape[1], self.eps, x.data_ptr(),
                                 None if residual is None else residual.data_ptr(), out.data_ptr(),
                                 self.weight.data_ptr(), h.data_ptr())
        return h, out


class _Model(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_void_p), ("n_layers", ctypes.c_int), ("vocab", ctypes.c_int),
                ("rope_positions", ctypes.c_int), ("embedding", _Lin), ("output", _Lin), ("norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("eps", ctypes.c_float)]


class CpuForward:
    """A forward of a model without tensor parallelism as one call into the kernels (ss_forward): the
    embedding lookup, every layer, the final norm and the lm_head, the same bits as the modules in turn
    (CpuLayers, CpuNorm, PackedLinear). Python and torch around the layers' call took ~0.4 ms of a 3.6 ms
    decode step of the embedded model, on ops that run slow just after the layers have streamed the weights
    through the caches. RoPE's cos and sin come from tables that ``rope_cos_sin`` makes (the bits a forward's
    own would have), extended when a position passes their end."""

    def __init__(self, dll: ctypes.CDLL, model: nn.Module):
        self.dll, self.layers, self.norm, self.output = dll, model.layers, model.norm, model.output
        emb = model.tok_embeddings
        if isinstance(emb, BlockEmbedding):
            b = emb.blocks
            self.table = (b.qs, b.d, b.m)
            embedding = _Lin(int(b.fmt), b.n, emb.embedding_dim, b.qs.data_ptr(), b.d.data_ptr(),
                             None if b.m is None else b.m.data_ptr(), None)
        else:
            self.table = (emb.weight.detach().float().contiguous(),)
            embedding = _Lin(int(Format.F32), emb.num_embeddings, emb.embedding_dim, self.table[0].data_ptr(),
                             None, None, None)
        self.cos = self.sin = torch.empty(0)
        self.spec = _Model(ctypes.addressof(self.layers.specs), len(self.layers), emb.num_embeddings, 0, embedding,
                           _lin(self.output), self.norm.weight.data_ptr(), None, None, self.norm.eps)

    def _extend_rope(self, model: nn.Module, positions: int) -> None:
        self.cos, self.sin = rope_cos_sin(torch.arange(positions), model.inv_freq)
        self.spec.rope_positions, self.spec.cos, self.spec.sin = positions, self.cos.data_ptr(), self.sin.data_ptr()

    def __call__(self, model: nn.Module, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                 logits_rows: Tensor | slice | None = None, return_hidden: bool = False):
        """Transformer.forward's arguments and results."""
        t = tokens.shape[0]
        tokens, positions, slots = (x.to(torch.int64).contiguous() for x in (tokens, positions, slots))
        mask = mask.contiguous()
        rows = None if logits_rows is None else torch.arange(t)[logits_rows].reshape(-1).contiguous()
        hidden = torch.empty(t, self.norm.weight.shape[0])
        logits = torch.empty(t if rows is None else rows.numel(), self.output.out_features)
        k, v = model.k_cache, model.v_cache
        while (rc := self.dll.ss_forward(
                ctypes.byref(self.spec), t, tokens.data_ptr(), positions.data_ptr(), slots.data_ptr(), mask.data_ptr(),
                mask.shape[1], cpu_linear.kv_half(k), k.data_ptr(), v.data_ptr(), k.stride(0), k.shape[2],
                logits.shape[0], None if rows is None else rows.data_ptr(), hidden.data_ptr(),
                logits.data_ptr())) == -2:
            self._extend_rope(model, max(int(positions.max()) + 1, 2 * self.spec.rope_positions, model.max_slots))
        if rc == -3:
            raise IndexError(f"a token outside the vocabulary of {self.spec.vocab}")
        if rc != 0:
            raise MemoryError("cpu_linear: out of memory in a forward")
        return (logits, hidden) if return_hidden else logits


HUGE_PAGE = 2 << 20


def _huge_mapping(nbytes: int) -> Tensor | None:
    """``nbytes`` zero bytes from a 2 MB boundary of a fresh mapping that the OS is asked to back with 2 MB
    pages (Linux's transparent huge pages), as a uint8 tensor whose storage keeps the mapping alive; None
    where the OS cannot be asked. A step streams ~100 MB of weights, and the keys and values of its
    context, and with 4 KB pages every 4 KB of them costs a TLB miss and ends the hardware prefetcher's
    run: the embedded model's `ar` step took 6 % less time with them in 2 MB pages (docs/ARCHITECTURE.md
    gives figures). The pages are only made as they are first written."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    size = (nbytes + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        pages.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    except OSError:  # a kernel without transparent huge pages
        return None
    return whole[start:start + nbytes]


def in_huge_pages(tensors: list[Tensor]) -> None:
    """Moves contiguous ``tensors`` into one _huge_mapping, in this order, each in place: every reference
    to one sees its new storage. Where there is none they stay."""
    places, at = [], 0
    for t in tensors:
        places.append(at)
        at += (t.numel() * t.element_size() + 63) // 64 * 64
    arena = _huge_mapping(at) if tensors else None
    if arena is None:
        return
    for t, place in zip(tensors, places, strict=True):
        moved = arena[place:place + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        moved.copy_(t)
        t.set_(moved)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor of zeros in a _huge_mapping of its own (torch's zeros where there is none): the CPU
    kernels' KV cache, whose pages are made as the context reaches them."""
    nbytes = math.prod(shape) * dtype.itemsize
    pages = _huge_mapping(nbytes)
    return torch.zeros(shape, dtype=dtype) if pages is None else pages.view(dtype).view(shape)


def _linears(model: nn.Module):
    """(parent module, attribute name, linear) for every nn.Linear of the model, the lm_head last."""
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                yield mod, name, child


def apply(model: nn.Module, backend: Dtype, blocks: dict[str, Blocks] | None = None, quantize: bool = False,
          activations: Activations = Activations.INT16, kv_cache: KvCache = KvCache.AUTO) -> str:
    """Replaces the model's linears (and, with blocks, its embedding) by packed ones and its attention by
    the library's; returns the precision label ("gguf (Q4_1 blocks) · int16 activations · fp16 KV · AVX2").

    ``blocks``: the GGUF blocks by our parameter name (``layers.0.attention.wqkv.weight``,
    ``tok_embeddings.weight``); a linear without blocks keeps fp32 weights. ``quantize`` (gguf backend on a
    float checkpoint): every linear packed as Q4 blocks, the lm_head and embedding as Q8. ``activations``:
    what the integer blocks multiply, a setting of the library and so of the process (as its threads are),
    which serves one model (bf16: the bfloat16 backend's); ``kv_cache``: what the cache (set up after
    this) holds.
    """
    dll = library(activations)
    blocks = dict(blocks or {})
    names = {id(mod): prefix for prefix, mod in model.named_modules()}
    if backend == Dtype.GGUF and quantize:
        for mod, name, lin in _linears(model):
            key = f"{names[id(mod)]}.{name}.weight".lstrip(".")
            blocks[key] = Blocks.quantize(lin.weight, Format.Q8 if key == "output.weight" else Format.Q4)
        blocks["tok_embeddings.weight"] = blocks["output.weight"] if model.args.tie_embeddings \
            else Blocks.quantize(model.tok_embeddings.weight, Format.Q8)
    in_order: dict[int, Blocks] = {}  # a tied embedding and lm_head share one copy
    for k, b in blocks.items():
        blocks[k] = in_order[id(b)] = in_order.get(id(b)) or b.in_panels()
    if backend == Dtype.GGUF:
        emb = blocks.get("tok_embeddings.weight")
        if emb is not None:
            model.tok_embeddings = BlockEmbedding(emb)
            if model.args.tie_embeddings:
                blocks["output.weight"] = emb
    for mod, name, lin in _linears(model):
        key = f"{names[id(mod)]}.{name}.weight".lstrip(".")
        if backend == Dtype.GGUF:
            packed = PackedLinear(dll, blocks[key], blocks[key].fmt, lin.bias) if key in blocks \
                else PackedLinear(dll, lin.weight, Format.F32, lin.bias)
        else:
            packed = PackedLinear(dll, lin.weight, FLOAT_FORMATS[backend], lin.bias)
        setattr(mod, name, packed)
    in_huge_pages([t for lin in model.modules() if isinstance(lin, PackedLinear) for t in (lin.qs, lin.d, lin.m)
                   if t is not None])
    model.new_cache = huge_page_zeros
    model.attention_ops = CpuAttention(dll)
    model.kv_dtype = kv_dtype(backend, kv_cache)
    model.layers = CpuLayers([CpuBlock(dll, layer) for layer in model.layers])
    model.norm = CpuNorm(dll, model.norm)
    if model.tp_world == 1:
        model.whole_forward = CpuForward(dll, model)
    return label(backend, blocks, dll, quantize, activations, model.kv_dtype)


def label(backend: Dtype, blocks: dict[str, Blocks], dll: ctypes.CDLL, quantized: bool = False,
          activations: Activations = Activations.INT16, kv: torch.dtype = torch.float32) -> str:
    """What the title bar shows, in --dtype's own words: "gguf (Q4_1 blocks) · int16 activations · fp16 KV ·
    AVX2" (a GGUF's own blocks, named by their 4-bit types, else their types), "int4 (packed at load) · …",
    "float16 weights · fp32 math · fp32 KV · AVX2", "bfloat16 weights · bf16 activations · …"; ``kv``: what
    the KV cache holds."""
    isa = cpu_linear.isa(dll)
    cache = "fp16 KV" if kv == torch.float16 else "fp32 KV"
    if backend != Dtype.GGUF:
        math = "bf16 activations" if activations is Activations.BF16 else "fp32 math"
        return f"{backend} weights · {math} · {cache} · {isa}"
    linears = [b for k, b in blocks.items() if k != "tok_embeddings.weight"]
    kinds = sorted({b.kind for b in linears if b.fmt == Format.Q4}) or sorted({b.kind for b in linears})
    what = "int4 (packed at load)" if quantized else f"gguf ({'/'.join(kinds)} blocks)"
    return f"{what} · {activations} activations · {cache} · {isa}"


def synthetic_costs(args, backend: Dtype, rows: int, layers: int | None = None, timer: CleanTimer | None = None,
                    activations: Activations = Activations.INT16, kv_cache: KvCache = KvCache.AUTO) -> list[float]:
    """Milliseconds of a forward of 1..``rows`` rows with ``backend``, measured on one decoder block and
    the lm_head of the model's shapes with random weights (what a step costs differs between backends in
    the weights' format only), scaled to the model's layers: the measurement behind --dtype auto.
    ``timer``: one whose ``clean`` the caller reads; ``activations``: what the integer blocks multiply;
    ``kv_cache``: what the KV cache holds."""
    timer = timer or CleanTimer()

    g = torch.Generator().manual_seed(0)
    n_layers = layers or args.n_layers

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    dll = library(activations)
    block = TransformerBlock(args, args.n_heads, args.n_kv_heads, args.intermediate_size)
    for mod, name, lin in _linears(block):
        lin.weight.data = rand(*lin.weight.shape)
        if lin.bias is not None:
            lin.bias.data = rand(*lin.bias.shape)
        fmt = Format.Q4 if backend == Dtype.GGUF else FLOAT_FORMATS[backend]
        w = Blocks.quantize(lin.weight, fmt) if backend == Dtype.GGUF else lin.weight
        setattr(mod, name, PackedLinear(dll, w, fmt, lin.bias))
    cpu_block = CpuBlock(dll, block)
    head_w = rand(args.vocab_size, args.dim)
    head = PackedLinear(dll, Blocks.quantize(head_w, Format.Q8), Format.Q8) if backend == Dtype.GGUF \
        else PackedLinear(dll, head_w, FLOAT_FORMATS[backend])
    prefix = 64
    kv = (args.n_kv_heads, prefix + rows, args.head_dim)
    k_cache, v_cache = (torch.zeros(kv, dtype=kv_dtype(backend, kv_cache)) for _ in range(2))
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
