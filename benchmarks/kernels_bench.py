"""GPU benchmarks for swiftspec.kernels (run by scripts/gpu_check.sh; needs CUDA).

1. Micro-benchmarks: each Triton kernel against its PyTorch reference (and tree attention against torch
   SDPA), bf16, on the shapes of a 1B and an 8B Llama decode/verify step.
2. Decode step: a random-weight Llama stack (1B and 8B shapes) that runs the same ops as the engine's
   model, with the Triton kernels and with the references, timed as CUDA graphs. Reports the share of
   peak HBM bandwidth: bytes of weights read per step / step time / peak (goal >= 75 %).

Times are medians over CUDA-event-timed graph replays, with L2 flushed before each one, so launch cost
and cache hits do not flatter small kernels.
"""

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from swiftspec.kernels import reference

DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    inter: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SHAPES = {
    "1b": Shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "8b": Shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, tied=False),
}


class Timer:
    """Median GPU seconds of a callable, replayed from a CUDA graph after an L2 flush."""

    def __init__(self, iters: int):
        self.iters = iters
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile Triton kernels and fill lazy buffers before capture
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def eager_time(fn: Callable[[], object], iters: int) -> float:
    """Median seconds per call without graphs: what CPU launch overhead costs a step."""
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def row(label: str, seconds: float, nbytes: int, peak_bw: float) -> str:
    bw = nbytes / seconds
    return f"  {label:<34} {seconds * 1e6:10.1f} us  {bw / 1e9:8.0f} GB/s  {100 * bw / peak_bw:5.1f} % of peak"


def rope(pos: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The [T, D, D] RoPE rotations of the model's forward (bf16, as the model builds them)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return reference.rope_rotation(emb.cos().to(DTYPE), emb.sin().to(DTYPE))


def chain_mask(T: int, prefix: int) -> torch.Tensor:
    """[T, prefix + T]: the whole prefix, then causal over the new tokens (a chain is a tree)."""
    mask = torch.ones(T, prefix + T, dtype=torch.bool, device="cuda")
    mask[:, prefix:] = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    return mask


def micro(timer: Timer, triton_ops, peak_bw: float) -> None:
    print("\n== micro-benchmarks (bf16) ==")
    for T, dim in [(1, 2048), (16, 4096), (64, 4096)]:
        x, res = (torch.randn(T, dim, device="cuda", dtype=DTYPE) for _ in range(2))
        w = torch.randn(dim, device="cuda", dtype=DTYPE)
        nbytes = 4 * x.numel() * x.element_size() + w.numel() * w.element_size()
        print(f"add_rms_norm T={T} dim={dim}")
        for name, ops in [("triton", triton_ops), ("reference", reference)]:
            print(row(name, timer(partial(ops.add_rms_norm, x, res, w, 1e-5)), nbytes, peak_bw))

    for shape in SHAPES.values():
        for T in (1, 16, 64):
            x = torch.randn(T, shape.dim, device="cuda", dtype=DTYPE)
            w = torch.randn(2 * shape.inter, shape.dim, device="cuda", dtype=DTYPE) * shape.dim**-0.5
            nbytes = w.numel() * w.element_size()
            print(f"swiglu {shape.name} T={T} dim={shape.dim} inter={shape.inter} (bytes: weights)")
            for name, ops in [("triton", triton_ops), ("reference (cuBLAS + silu*up)", reference)]:
                print(row(name, timer(partial(ops.swiglu, x, w, shape.inter)), nbytes, peak_bw))

    for shape in SHAPES.values():
        H, Hkv, D = shape.n_heads, shape.n_kv_heads, shape.head_dim
        for T, S in [(1, 1024), (16, 1024), (16, 8192), (64, 8192), (16, 32768)]:
            q = torch.randn(T, H, D, device="cuda", dtype=DTYPE)
            k, v = (torch.randn(Hkv, S, D, device="cuda", dtype=DTYPE) for _ in range(2))
            mask = chain_mask(T, S - T)
            q_rot = q.transpose(0, 1)[None]
            nbytes = 2 * k.numel() * k.element_size() + mask.numel()
            print(f"tree_attention {shape.name} T={T} S={S} H={H} Hkv={Hkv} D={D} (bytes: K, V, mask)")
            for name, ops in [("triton", triton_ops), ("reference (eager)", reference)]:
                t = timer(partial(ops.tree_attention, q, k, v, ops.prepare_mask(mask, H // Hkv, DTYPE)))
                print(row(name, t, nbytes, peak_bw))
            try:
                sdpa = partial(F.scaled_dot_product_attention, q_rot, k[None], v[None], attn_mask=mask, enable_gqa=True)
                print(row("torch SDPA", timer(sdpa), nbytes, peak_bw))
            except RuntimeError as e:  # no SDPA backend for this combination: say so, keep going
                print(f"  torch SDPA: not available ({str(e).splitlines()[0]})")


class RandomLlama:
    """A Llama decoder with random bf16 weights, only for timing: the same weights, cache layout and ops
    per step as swiftspec.engine.model, with the kernel module swappable (Triton or reference)."""

    def __init__(self, shape: Shape, max_seq: int):
        self.shape = shape
        s, hd = shape, shape.head_dim

        def w(*size: int) -> torch.Tensor:
            return torch.randn(*size, device="cuda", dtype=DTYPE) * size[-1] ** -0.5

        self.layers = [
            dict(
                wqkv=w((s.n_heads + 2 * s.n_kv_heads) * hd, s.dim),
                wo=w(s.dim, s.n_heads * hd),
                w13=w(2 * s.inter, s.dim),
                w2=w(s.dim, s.inter),
                attn_norm=torch.ones(s.dim, device="cuda", dtype=DTYPE),
                ffn_norm=torch.ones(s.dim, device="cuda", dtype=DTYPE),
            )
            for _ in range(s.n_layers)
        ]
        self.embed = torch.randn(s.vocab, s.dim, device="cuda", dtype=DTYPE)
        self.lm_head = self.embed if s.tied else w(s.vocab, s.dim)
        self.norm = torch.ones(s.dim, device="cuda", dtype=DTYPE)
        cache = (s.n_layers, s.n_kv_heads, max_seq, hd)
        self.k_cache = torch.randn(cache, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn(cache, device="cuda", dtype=DTYPE)

    def weight_bytes(self) -> int:
        """Bytes one step must read: every layer weight, the final norm and the LM head (the embedding
        lookup reads only T rows)."""
        tensors = [t for layer in self.layers for t in layer.values()] + [self.norm, self.lm_head]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_bytes(self, S: int) -> int:
        s = self.shape
        return 2 * s.n_layers * s.n_kv_heads * S * s.head_dim * self.k_cache.element_size()

    def step(self, ops, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor):
        s, hd = self.shape, self.shape.head_dim
        T, S = tokens.shape[0], mask.shape[1]
        rotation = rope(pos, hd, s.rope_theta)
        mask = ops.prepare_mask(mask, s.n_heads // s.n_kv_heads, DTYPE)
        h, residual = self.embed[tokens], None
        for i, layer in enumerate(self.layers):
            x, residual = ops.add_rms_norm(h, residual, layer["attn_norm"], s.eps)
            qkv = F.linear(x, layer["wqkv"])
            nqk = s.n_heads + s.n_kv_heads
            qk = reference.apply_rope(qkv[:, : nqk * hd].view(T, nqk, hd), rotation)
            self.k_cache[i].index_copy_(1, slots, qk[:, s.n_heads :].transpose(0, 1))
            self.v_cache[i].index_copy_(1, slots, qkv[:, nqk * hd :].view(T, s.n_kv_heads, hd).transpose(0, 1))
            o = ops.tree_attention(qk[:, : s.n_heads], self.k_cache[i, :, :S], self.v_cache[i, :, :S], mask)
            h = F.linear(o.reshape(T, s.n_heads * hd), layer["wo"])
            x, residual = ops.add_rms_norm(h, residual, layer["ffn_norm"], s.eps)
            h = F.linear(ops.swiglu(x, layer["w13"], s.inter), layer["w2"])
        x, _ = ops.add_rms_norm(h, residual, self.norm, s.eps)
        return F.linear(x, self.lm_head)


def decode(timer: Timer, triton_ops, shape: Shape, tokens: list[int], prefix: int, iters: int, peak_bw: float) -> None:
    model = RandomLlama(shape, prefix + max(tokens))
    wbytes = model.weight_bytes()
    print(f"\n== decode step: {shape.name}, random bf16 weights ({wbytes / 1e9:.2f} GB read per step), prefix={prefix} ==")
    for T in tokens:
        tok = torch.randint(0, shape.vocab, (T,), device="cuda")
        pos = torch.arange(prefix, prefix + T, device="cuda")
        mask = chain_mask(T, prefix)
        logits = {}
        print(f"T={T} (KV read {model.kv_bytes(prefix + T) / 1e6:.0f} MB)")
        for name, ops in [("triton", triton_ops), ("reference", reference)]:
            step = partial(model.step, ops, tok, pos, pos, mask)
            logits[name] = step().float()
            t = timer(step)
            share = wbytes / t / peak_bw
            share_kv = (wbytes + model.kv_bytes(prefix + T)) / t / peak_bw
            print(
                f"  {name:<10} graph {t * 1e3:7.3f} ms   eager {eager_time(step, iters) * 1e3:7.3f} ms   "
                f"HBM share: weights {100 * share:5.1f} %  weights+KV {100 * share_kv:5.1f} %"
            )
        agree = F.cosine_similarity(logits["triton"].flatten(), logits["reference"].flatten(), dim=0)
        print(f"  logits cosine(triton, reference) = {agree.item():.5f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="peak HBM bytes/s (H200: 4.8e12, H100 SXM: 3.35e12)")
    p.add_argument("--iters", type=int, default=50, help="timed runs per measurement (median reported)")
    p.add_argument("--prefix", type=int, default=1024, help="cached tokens before the new ones in the decode step")
    p.add_argument("--tokens", default="1,16", help="new tokens per decode step, comma-separated")
    p.add_argument("--models", default="1b,8b", help=f"decode-step shapes, from {','.join(SHAPES)}")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_bench: needs a CUDA GPU (torch.cuda.is_available() is False)")
    from swiftspec.kernels import triton_kernels  # triton is only needed from here on

    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  peak {args.peak_bw / 1e12:.2f} TB/s")
    timer = Timer(args.iters)
    if not args.skip_micro:
        micro(timer, triton_kernels, args.peak_bw)
    if not args.skip_decode:
        tokens = [int(t) for t in args.tokens.split(",")]
        for name in args.models.split(","):
            decode(timer, triton_kernels, SHAPES[name], tokens, args.prefix, args.iters, args.peak_bw)
            torch.cuda.empty_cache()  # hand the previous model's weights back before the next one


if __name__ == "__main__":
    main()
