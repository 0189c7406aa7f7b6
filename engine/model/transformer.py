"""A Llama-family decoder in the gpt-fast style (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5).

One forward handles every case the engine needs: a prefill, a decode step, a draft expansion of w leaves
and a target verification of a token tree. The KV cache is static and addressed by *slot*: the caller
says where each new token's K/V goes (``slots``), where it sits in the sequence (``positions``, for RoPE)
and what it may attend to (``mask``: new tokens x cache slots ``[0, kv_len)``, True = attend). The new
tokens are written into the cache before attention, so the mask covers them too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from swiftspec import kernels
from swiftspec.engine.model.allreduce import all_reduce
from swiftspec.engine.model.model_args import ModelArgs
from swiftspec.engine.model.tp import shard_layout
from swiftspec.kernels import KeyList


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies, with Llama 3 / linear scaling applied as transformers does."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = args.rope_scaling
    if sc is None:
        return inv.float()
    if sc["rope_type"] == "linear":
        return (inv / sc["factor"]).float()
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_ctx = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE's cos and sin [T, head_dim] at ``positions`` [T] (rotate-half: each frequency twice)."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add is fused into the norm."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, args.head_dim
        qkv_out = (n_heads + 2 * n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(n_heads * args.head_dim, args.dim, bias=False)
        self.scale = 1.0 / math.sqrt(args.head_dim)

    def forward(self, x: Tensor | NormedRows, rope: Callable[[Tensor], Tensor], slots: Tensor,
                mask: Tensor | KeyList, k_cache: Tensor, v_cache: Tensor,
                attend: Callable = kernels.tree_attention) -> Tensor:
        t = x.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        if isinstance(self.wqkv, InvariantQKV):  # CUDA, batch-invariant: RoPE and the cache writes fused
            q = self.wqkv.rotate_and_write(x, rope, slots, k_cache, v_cache, nh, nkv)
        else:
            qk, v = self.wqkv(x).split_with_sizes([(nh + nkv) * hd, nkv * hd], dim=-1)
            q, k = rope(qk.view(t, nh + nkv, hd)).split_with_sizes([nh, nkv], dim=1)
            k_cache.index_copy_(1, slots, k.transpose(0, 1))
            v_cache.index_copy_(1, slots, v.view(t, nkv, hd).transpose(0, 1))
        # mask: kernels.prepare_mask's form of the [t, kv_len] bool mask
        kv_len = (mask.slots if isinstance(mask, KeyList) else mask).shape[-1]
        out = attend(q, k_cache.narrow(1, 0, kv_len), v_cache.narrow(1, 0, kv_len), mask, self.scale)
        return self.wo(out.reshape(t, nh * hd))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, inter: int):
        super().__init__()
        self.inter = inter
        self.w13 = nn.Linear(args.dim, 2 * inter, bias=False)  # gate rows, then up rows
        self.w2 = nn.Linear(inter, args.dim, bias=False)

    def forward(self, x: Tensor | NormedRows) -> Tensor:
        if isinstance(self.w13, InvariantGateUp):  # CUDA, batch-invariant: projection and activation fused
            return self.w2(self.w13.swiglu(x, self.inter))
        if isinstance(self.w13, nn.Linear):
            return self.w2(kernels.swiglu(x, self.w13.weight, self.inter))
        gate, up = self.w13(x).chunk(2, dim=-1)  # an int8 CPU linear: same math
        return self.w2(F.silu(gate) * up)


class InvariantLinear(nn.Module):
    """A CUDA linear whose rows do not depend on each other (kernels/triton_kernels.linear): the
    batch-invariant mode's replacement for nn.Linear, sharing its weight."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x: Tensor) -> Tensor:
        from swiftspec.kernels import triton_kernels  # triton: imported where a CUDA kernel first runs

        return triton_kernels.linear(x, self.weight, self.bias)


class InvariantGateUp(InvariantLinear):
    """The batch-invariant gate-up projection, which FeedForward runs fused with its activation
    (triton_kernels.swiglu with fixed 16-row tiles)."""

    def swiglu(self, x: Tensor, inter: int) -> Tensor:
        from swiftspec.kernels import triton_kernels  # triton: imported where a CUDA kernel first runs

        return triton_kernels.swiglu(x, self.weight, inter, invariant=True)


class InvariantQKV(InvariantLinear):
    """The batch-invariant QKV projection, followed by one kernel that rotates q and k and writes k and v
    into the cache (triton_kernels.rope_kv_write), in place of the elementwise RoPE and two copies."""

    def rotate_and_write(self, x: Tensor, rope: RotateHalf, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
                         n_heads: int, n_kv_heads: int) -> Tensor:
        from swiftspec.kernels import triton_kernels  # triton: imported where a CUDA kernel first runs

        qkv = self(x).view(x.shape[0], n_heads + 2 * n_kv_heads, -1)
        return triton_kernels.rope_kv_write(qkv, rope.cos, rope.sin, slots, k_cache, v_cache, n_heads, n_kv_heads)


@dataclass
class NormedRows:
    """rmsnorm(x + residual) * weight, not computed yet: what a PrologueNorm hands the projection after it
    (NormedQKV, NormedGateUp), whose kernel normalises the rows as it loads them and writes x + residual
    into ``new_residual`` (triton_kernels.rms_norm_linear). ``new_residual`` is x itself without a residual."""

    x: Tensor
    residual: Tensor | None
    weight: Tensor
    eps: float
    new_residual: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


class PrologueNorm(nn.Module):
    """The CUDA batch-invariant mode's RMSNorm before a fused projection, sharing the RMSNorm's weight: it
    launches nothing, but returns its input as NormedRows and the buffer the projection's kernel will
    fill with x + residual. That residual may only be read after the projection has run, which
    TransformerBlock.forward does (it is the next norm's input)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.eps, self.weight = norm.eps, norm.weight

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[NormedRows, Tensor]:
        new_residual = x if residual is None else torch.empty_like(x)
        return NormedRows(x, residual, self.weight, self.eps, new_residual), new_residual


class NormedQKV(InvariantQKV):
    """InvariantQKV with the attention norm in the projection's prologue: one launch for the norm, the
    residual add and the QKV projection, where add_rms_norm + linear take two."""

    def forward(self, x: NormedRows) -> Tensor:
        from swiftspec.kernels import triton_kernels  # triton: imported where a CUDA kernel first runs

        return triton_kernels.rms_norm_linear(x.x, x.residual, x.weight, x.eps, self.weight, self.bias,
                                              residual_out=x.new_residual)[0]


class NormedGateUp(InvariantGateUp):
    """InvariantGateUp with the MLP norm in the prologue: norm, residual add, gate-up projection and SwiGLU
    in one launch, where add_rms_norm + swiglu take two."""

    def swiglu(self, x: NormedRows, inter: int) -> Tensor:
        from swiftspec.kernels import triton_kernels  # triton: imported where a CUDA kernel first runs

        if self.weight.shape[0] != 2 * inter:
            raise ValueError(f"swiglu: a gate-up weight of {tuple(self.weight.shape)} rows for {inter} x 2")
        return triton_kernels.rms_norm_linear(x.x, x.residual, x.weight, x.eps, self.weight, swiglu=True,
                                              residual_out=x.new_residual)[0]


@dataclass
class RotateHalf:
    """The batch-invariant mode's RoPE: rotate-half, elementwise, by fp32 [T, head_dim] tables."""

    cos: Tensor
    sin: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        return kernels.rope_rotate_half(x, self.cos, self.sin)


@dataclass
class LayerInputs:
    """What every layer of one forward shares."""

    rope: Callable[[Tensor], Tensor]
    cos: Tensor  # [T, head_dim] fp32: the RoPE tables behind ``rope``
    sin: Tensor
    slots: Tensor
    mask: Tensor | KeyList  # in the form attention_ops.prepare_mask made
    attend: Callable  # attention_ops.tree_attention
    all_reduce: Callable[[Tensor], Tensor]  # sums the tensor-parallel partials


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, n_heads: int, n_kv_heads: int, inter: int):
        super().__init__()
        self.attention = Attention(args, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(args, inter)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, residual: Tensor | None, inp: LayerInputs, k_cache: Tensor,
                v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's output and the residual stream before it (added into the next layer's norm)."""
        h, residual = self.attention_norm(x, residual)
        x = inp.all_reduce(self.attention(h, inp.rope, inp.slots, inp.mask, k_cache, v_cache, inp.attend))
        h, residual = self.ffn_norm(x, residual)
        return inp.all_reduce(self.feed_forward(h)), residual


class Layers(nn.ModuleList):
    """The decoder layers, run in turn over the static cache's per-layer slices. A backend that runs the
    whole stack in one call replaces it (engine/model/cpu_backends.py)."""

    def forward(self, x: Tensor, inp: LayerInputs, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        residual = None
        for layer, k, v in zip(self, k_cache.unbind(0), v_cache.unbind(0), strict=True):
            x, residual = layer(x, residual, inp, k, v)
        return x, residual


class Transformer(nn.Module):
    """The decoder plus its static KV cache ([layers, kv_heads, slots, head_dim] for K and for V).

    With tensor parallelism (``tp_group`` of size > 1) this rank holds its shard of the heads and MLP
    columns (see ``engine/model/tp.py``); one all-reduce follows the attention output and one the MLP down
    projection.
    """

    def __init__(self, args: ModelArgs, tp_group: dist.ProcessGroup | None = None, tp_world: int = 1):
        super().__init__()
        self.args, self.tp_group, self.tp_world = args, tp_group, tp_world
        lay = shard_layout(args, tp_world)
        # _weight skips the random init: on the meta device that init alone imports torch._refs, which is slow.
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = Layers(TransformerBlock(args, lay.n_heads, lay.n_kv_heads, lay.intermediate)
                                    for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.inv_freq: Tensor | None = None
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.batch_invariant = False
        # prepare_mask and tree_attention: kernels' (Triton on CUDA, torch elsewhere), or the CPU backends'
        # row-invariant ones (engine/model/cpu_backends.py)
        self.attention_ops = kernels
        self.precision: str | None = None  # the CPU backend's label, when one is applied
        self.kv_dtype: torch.dtype | None = None  # the KV cache's, where a backend sets it; else the compute dtype
        # a backend's forward of the whole model in one call, in place of the modules below (the CPU kernels':
        # engine/model/cpu_backends.py); called with the model and forward's arguments
        self.whole_forward: Callable | None = None
        # a backend's allocation of the KV cache's zeros (shape, dtype), in place of torch's (the CPU
        # kernels': in 2 MB pages, cpu_backends.huge_page_zeros)
        self.new_cache: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None

    @property
    def max_slots(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[2]

    def setup_cache(self, max_slots: int) -> None:
        """Allocates the static cache once (its contents are managed by the caller through slots) and
        the RoPE frequencies (fp32, on the weights' device)."""
        p = self.norm.weight  # a parameter in the compute dtype, whatever the embedding is
        self.inv_freq = rope_inv_freq(self.args).to(p.device)
        nkv = self.layers[0].attention.n_kv_heads
        shape = (self.args.n_layers, nkv, max_slots, self.args.head_dim)
        dtype = self.kv_dtype or p.dtype
        zeros = self.new_cache or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=p.device))
        self.k_cache, self.v_cache = zeros(shape, dtype), zeros(shape, dtype)

    def transpose_cpu_weights(self) -> None:
        """Stores every linear's weight column-major (fp32 CPU only): MKL's GEMM for the handful of rows a
        decode step or a small verification forwards is fastest that way (beyond a few rows both layouts
        cost the same; docs/ARCHITECTURE.md gives figures). The tied lm_head gets its own copy, so the
        embedding lookup keeps reading contiguous rows. Not MKL's prepacked weights: they pad 2..7 rows to
        8, so a small verification costs as much as eight rows, and they take a while to pack at load."""
        if self.tok_embeddings.weight.dtype != torch.float32:
            return
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                mod.weight = nn.Parameter(mod.weight.detach().t().contiguous().t(), requires_grad=False)

    def make_batch_invariant(self) -> None:
        """Every row's result stops depending on how many rows share the forward and where they sit: a
        verification of n tree nodes then computes, bit for bit, what n one-token steps would (16-bit
        GEMMs and split reductions otherwise round differently by row count, and greedy argmaxes flip).

        On CUDA: batch-invariant Triton linears and attention, elementwise RoPE, fused around the layer's
        projections (use_invariant_kernels). On the CPU the backends of engine/model/cpu_backends.py are
        invariant by construction; without them (no C compiler) a forward of T rows runs as T one-row
        forwards (T times the weight reads). Attention reads each row's own key list
        on CUDA and in the one-row fallback (kernels.KeyList). Exact across ranks only without TP (or with
        an all-reduce whose summation order is fixed).
        """
        self.batch_invariant = True
        if self.tok_embeddings.weight.is_cuda:
            self.use_invariant_kernels()

    def use_invariant_kernels(self, fuse_norms: bool = True) -> None:
        """The CUDA batch-invariant mode's modules (Triton; tests run them on the CPU under
        TRITON_INTERPRET=1): every linear an InvariantLinear; each layer's QKV projection followed by one
        kernel for RoPE and the cache writes (InvariantQKV), its gate-up projection fused with SwiGLU
        (InvariantGateUp); with ``fuse_norms`` both layer norms computed in the prologue of the
        projection they feed (PrologueNorm, NormedQKV, NormedGateUp). A layer then launches six kernels
        (without TP's all-reduces): norm + QKV, RoPE + KV writes, attention, output projection,
        norm + gate-up + SwiGLU, down projection; eight with the norms on their own."""
        if fuse_norms:
            fused = {"wqkv": NormedQKV, "w13": NormedGateUp}
        else:
            fused = {"wqkv": InvariantQKV, "w13": InvariantGateUp}
        for mod in list(self.modules()):
            for name, child in list(mod.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(mod, name, fused.get(name, InvariantLinear)(child))
        if fuse_norms:  # not the final norm: its output, the hidden states, is returned
            for layer in self.layers:
                layer.attention_norm = PrologueNorm(layer.attention_norm)
                layer.ffn_norm = PrologueNorm(layer.ffn_norm)

    def _all_reduce(self, x: Tensor) -> Tensor:
        """Sums the TP partials. On CUDA this is the one-shot symmetric-memory all-reduce where it works
        (engine/model/allreduce.py): at <= 16 tokens per forward all-reduce latency, not bandwidth, dominates a
        TP layer. On CPU it is plain ``dist.all_reduce`` (gloo)."""
        if self.tp_world == 1:
            return x
        if not x.is_cuda:
            dist.all_reduce(x, group=self.tp_group)
            return x
        return all_reduce(x, self.tp_group)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                logits_rows: Tensor | slice | None = None, return_hidden: bool = False):
        """tokens, positions, slots: [T] int64; mask: [T, kv_len] bool over cache slots.

        Returns logits [R, vocab] (fp32) for ``logits_rows`` (default: all T rows), and the final hidden
        states [T, dim] as well when ``return_hidden``.
        """
        if self.k_cache is None:
            raise RuntimeError("call setup_cache() first")
        if self.whole_forward is not None:
            return self.whole_forward(self, tokens, positions, slots, mask, logits_rows, return_hidden)
        invariant = self.batch_invariant
        ops = self.attention_ops
        if invariant and mask.shape[0] > 1 and not tokens.is_cuda and ops is kernels:
            return self._forward_rows(tokens, positions, slots, mask, logits_rows, return_hidden)
        dtype = self.norm.weight.dtype
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        if invariant:
            rope = RotateHalf(cos, sin)
        else:
            rope = partial(kernels.apply_rope, rotation=kernels.rope_rotation(cos.to(dtype), sin.to(dtype)))
        attn = self.layers[0].attention
        attn_mask = ops.prepare_mask(mask, attn.n_heads // attn.n_kv_heads, dtype, invariant)
        inp = LayerInputs(rope, cos, sin, slots, attn_mask, ops.tree_attention, self._all_reduce)
        x = self.tok_embeddings(tokens)
        x, residual = self.layers(x, inp, self.k_cache, self.v_cache)
        hidden, _ = self.norm(x, residual)
        rows = hidden if logits_rows is None else hidden[logits_rows]
        logits = self.output(rows).float()
        return (logits, hidden) if return_hidden else logits

    def _forward_rows(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                      logits_rows: Tensor | slice | None, return_hidden: bool):
        """The batch-invariant forward on a CPU without the row-invariant kernels: one one-row forward per
        row, in order. Rows only attend to
        earlier rows (a prefill is causal, a tree lists parents first), whose KV is then already written.
        The lm_head runs for the rows whose logits are asked for."""
        order = torch.arange(mask.shape[0])
        order = (order if logits_rows is None else order[logits_rows]).reshape(-1).tolist()
        logits_at, hidden = {}, []
        for i in range(mask.shape[0]):
            one = slice(i, i + 1)
            logits, h = self.forward(tokens[one], positions[one], slots[one], mask[one],
                                     slice(0, 1 if i in order else 0), True)
            logits_at[i] = logits
            hidden.append(h)
        logits = torch.cat([logits_at[i] for i in order]) if order else logits[:0]
        return (logits, torch.cat(hidden)) if return_hidden else logits
