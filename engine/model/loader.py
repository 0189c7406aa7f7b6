"""Reads a model directory's weights (safetensors; a converted GGUF's blocks are dequantised here) into
our Transformer, or into transformers' own model for comparisons. Finding the directory, its config and
its tokenizer is ``engine.model_dir``'s part.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from swiftspec.engine.config import Activations, Device, Dtype, KvCache
from swiftspec.engine.model import cpu_backends, cpu_blocks, tp
from swiftspec.engine.model.fp16_linear import fbgemm_available, pack_fp16_linears
from swiftspec.engine.model.gguf_io import BLOCK_FORMATS, GGUF_METADATA, dequantize
from swiftspec.engine.model.model_args import ModelArgs
from swiftspec.engine.model.model_dir import (
    LoadError,
    read_args,
    resolved_dtype,
    stored_float_dtype,
    weight_files,
)
from swiftspec.engine.model.transformer import Transformer


def read_weights(model_dir: Path, names: set[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor in the directory's safetensors (or only ``names``), and the block type of those a GGUF
    conversion kept as GGUF blocks (``dequantize`` them)."""
    state: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                kinds.update(json.loads((fh.metadata() or {}).get(GGUF_METADATA, "{}")))
                for k in fh.keys():
                    if names is None or k in names:
                        state[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises several types for corrupt files
            raise LoadError(f"cannot read weights from {f}: {e}") from None
    return state, kinds


def read_hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the directory's safetensors, GGUF blocks dequantised."""
    state, kinds = read_weights(model_dir)
    return {k: dequantize(v, kinds[k]) if k in kinds else v for k, v in state.items()}


def load_target_io(model_dir: Path, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head weights and nothing else: what a draft head reads."""
    args = read_args(model_dir)
    names = {"model.embed_tokens.weight"} | (set() if args.tie_embeddings else {"lm_head.weight"})
    state, kinds = read_weights(model_dir, names)
    if set(state) != names:
        raise LoadError(f"{model_dir}: {', '.join(sorted(names - set(state)))} missing from the checkpoint")
    state = {k: (dequantize(v, kinds[k]) if k in kinds else v).to(device=device, dtype=dtype) for k, v in state.items()}
    embed = state["model.embed_tokens.weight"]
    return embed, embed if args.tie_embeddings else state["lm_head.weight"]


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """The transformers model of ``model_dir``, which the tests and the bench's hf modes compare with. A
    converted GGUF keeps blocks transformers cannot read: it gets the weights dequantised as ours are."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with safe_open(str(weight_files(model_dir)[0]), framework="pt") as fh:
        converted = GGUF_METADATA in (fh.metadata() or {})
    if not converted:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=dtype)
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in read_hf_state_dict(model_dir).items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise LoadError(f"{model_dir}: weights do not match the config: {unexpected or missing}")
    model.tie_weights()
    return model


def convert_hf_state_dict(hf: dict[str, torch.Tensor], args: ModelArgs, kinds: dict[str, str] | None = None,
                          keep_blocks: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Maps Hugging Face names onto ours, fusing q/k/v into wqkv and gate/up into w13. GGUF blocks (named
    in ``kinds``) are dequantised here, the fused ones after their blocks are concatenated: one fp32 copy of
    them instead of two, the costlier half of loading a converted GGUF. With ``keep_blocks`` the blocks
    stay raw (fused parts of one type concatenated, as rows of blocks) for the gguf CPU backend; the
    second dict names their block types by our names."""
    kinds = kinds or {}
    kept: dict[str, str] = {}

    def raw(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise LoadError(f"weight {name!r} is missing from the checkpoint") from None

    def take(name: str, ours: str | None = None) -> torch.Tensor:
        if name not in kinds:
            return raw(name)
        if keep_blocks and ours is not None and kinds[name] in BLOCK_FORMATS:
            kept[ours] = kinds[name]
            return raw(name)
        return dequantize(raw(name), kinds[name])

    def fuse(names: list[str], ours: str) -> torch.Tensor:
        if len({kinds.get(n) for n in names}) == 1 and names[0] in kinds:  # rows of blocks of one type
            if keep_blocks and kinds[names[0]] in BLOCK_FORMATS:
                kept[ours] = kinds[names[0]]
                return torch.cat([raw(n) for n in names])
            return dequantize(torch.cat([raw(n) for n in names]), kinds[names[0]])
        return torch.cat([take(n) for n in names])

    out = {"tok_embeddings.weight": take("model.embed_tokens.weight", "tok_embeddings.weight"),
           "norm.weight": take("model.norm.weight")}
    out["output.weight"] = out["tok_embeddings.weight"] if args.tie_embeddings else take("lm_head.weight", "output.weight")
    if args.tie_embeddings and "tok_embeddings.weight" in kept:
        kept["output.weight"] = kept["tok_embeddings.weight"]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        a = f"layers.{i}."
        out[a + "attention.wqkv.weight"] = fuse([p + f"self_attn.{n}_proj.weight" for n in "qkv"], a + "attention.wqkv.weight")
        if args.qkv_bias:
            out[a + "attention.wqkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        out[a + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight", a + "attention.wo.weight")
        out[a + "feed_forward.w13.weight"] = fuse([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                                  a + "feed_forward.w13.weight")
        out[a + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight", a + "feed_forward.w2.weight")
        out[a + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        out[a + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return out, kept


def default_dtype(device: torch.device, dtype: Dtype = Dtype.AUTO) -> torch.dtype:
    """The dtype a model computes in (its activations and KV cache): fp32 on the CPU, whatever the
    weights' format (engine/model/cpu_backends.py); on GPUs the dtype asked for (bf16 for auto)."""
    if Device.of(device) is Device.CPU:
        return torch.float32
    return getattr(torch, resolved_dtype(True, dtype))


def cpu_backend(dtype: Dtype, has_blocks: bool, tp_world: int = 1, stored: Dtype = Dtype.FLOAT32) -> Dtype:
    """The CPU backend a --dtype names (int4: the gguf backend on blocks quantised at load); auto without
    a measured choice (engine/worker/profiling.py makes one at a worker's start): a GGUF's own blocks where
    the checkpoint has them and one rank holds the whole model, else the width it is ``stored`` at."""
    if dtype is Dtype.AUTO:
        return Dtype.GGUF if has_blocks and tp_world == 1 else stored
    if dtype.blocks and tp_world > 1:
        raise LoadError(f"--dtype {dtype} runs a target of one rank: use --target-procs 1, or a float --dtype")
    return Dtype.GGUF if dtype is Dtype.INT4 else dtype


def load_model(model_dir: Path, device: torch.device | str = "cpu", dtype: Dtype = Dtype.AUTO,
               max_slots: int = 4096, tp_group=None, tp_rank: int = 0, tp_world: int = 1,
               int8: bool = False, batch_invariant: bool | None = None,
               activations: Activations = Activations.INT16, kv_cache: KvCache = KvCache.AUTO) -> Transformer:
    """Builds our Transformer from a Hugging Face directory, sharded for tensor parallelism if asked.

    On the CPU ``dtype`` names a backend of engine/model/cpu_backends.py (float32, float16, bfloat16, gguf; auto:
    see cpu_backend), row-invariant by construction; int4 packs a checkpoint's linears as 4-bit blocks
    at load (the gguf backend; opt-in, never chosen by auto). ``batch_invariant=False`` on the CPU keeps torch's own linears (MKL
    fp32, FBGEMM fp16 weights): faster to build, rows not invariant (train-draft, comparisons).
    Without a C compiler the CPU falls back to torch's linears with one-row forwards (exact, slow).
    ``int8``: dynamic int8 linears (FBGEMM, CPU only), for a fast approximate copy of a model that
    serves as a draft: its proposals are verified, so the approximation never reaches the output.
    On CUDA ``batch_invariant``: see Transformer.make_batch_invariant; None = on. ``activations``: what the
    CPU kernels' integer blocks (gguf, int4) or bfloat16 weights multiply; ``kv_cache``: what they keep the
    keys and values in.
    """

    device = torch.device(device)
    args = read_args(model_dir)
    hf, kinds = read_weights(model_dir)
    cpu = Device.of(device) is Device.CPU
    quantize = dtype is Dtype.INT4
    if dtype.blocks and not cpu:
        raise LoadError(f"--dtype {dtype} is a CPU backend; on GPUs use auto, bfloat16, float16 or float32")
    if kv_cache is not KvCache.AUTO and not cpu:
        raise LoadError(f"--kv-cache {kv_cache} is a setting of the CPU kernels; on GPUs the cache holds the "
                        "dtype the target computes in")
    backend = None
    if cpu and not int8 and batch_invariant is not False:
        backend = cpu_backend(dtype, bool(kinds), tp_world, stored_float_dtype(model_dir))
        if (why := cpu_backends.kernels_available(args, tp_world)) is not None:
            if backend is Dtype.GGUF:
                raise LoadError(f"the gguf backend needs the CPU kernels, which cannot be built here: {why}")
            backend = None  # torch's linears, exact through one-row forwards
        if activations is Activations.BF16 and backend not in (None, Dtype.BFLOAT16):
            raise LoadError(f"--activations bf16 multiplies bfloat16 weights: {model_dir.name} runs as {backend} here "
                            "(use --dtype bfloat16 with a bfloat16 checkpoint)")
    elif cpu and dtype.blocks:
        raise LoadError(f"--dtype {dtype} runs through the row-invariant kernels: it cannot be combined with "
                        "int8 or --batch-invariant off")
    state, kept = convert_hf_state_dict(hf, args, kinds, keep_blocks=backend is Dtype.GGUF and not quantize)
    blocks = cpu_blocks.unpack_gguf({k: state.pop(k) for k in list(kept)}, kept)
    if tp_world > 1:
        state = tp.shard_state_dict(state, args, tp_rank, tp_world)
    with torch.device("meta"):
        model = Transformer(args, tp_group=tp_group, tp_world=tp_world)
    for name, b in blocks.items():  # placeholders the packed modules replace: no memory behind them
        state[name] = torch.empty(()).expand(b.shape)
    torch_dtype = default_dtype(device, dtype)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise LoadError(f"{model_dir}: weights do not match the config: {e}") from None
    del hf, state  # the model holds what it keeps: a backend's copies below free the originals as they go
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model = model.to(device=device, dtype=torch_dtype)
    if int8:
        if not cpu:
            raise LoadError("the int8 draft is a CPU (fp32) feature; on GPUs pass a draft model path")
        quantize_int8(model)
    elif backend is not None:
        model.precision = cpu_backends.apply(model, backend, blocks, quantize, activations, kv_cache)
        model.batch_invariant = True
    elif cpu:
        if dtype is Dtype.FLOAT16:
            if not fbgemm_available():
                raise LoadError("float16 on the CPU needs FBGEMM (x86 with AVX2), which this torch build lacks; "
                                "use --dtype float32")
            pack_fp16_linears(model)  # the lm_head too (a copy of its own when tied)
        else:
            model.transpose_cpu_weights()
        if batch_invariant is not False:
            model.make_batch_invariant()  # no kernels: exact through one-row forwards
    elif batch_invariant is not False:
        model.make_batch_invariant()
    model.eval()
    model.setup_cache(max_slots)
    if cpu:
        del blocks  # the GGUF-ordered copies: the model holds what it runs
        _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Hands the heap's freed pages back to the system, which glibc keeps otherwise: loading frees the
    blocks' GGUF-ordered copies and the conversion's staging (~55 MB of the embedded model's worker)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # another C library: nothing to trim


def quantize_int8(model: Transformer) -> None:
    """Dynamic int8 weights for every linear, the lm_head too: a small model's largest linear."""
    import warnings

    from torch import nn
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice; the FBGEMM kernels are what we want
        quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
