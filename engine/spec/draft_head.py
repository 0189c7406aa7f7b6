"""An EAGLE-style draft head: one decoder layer that reads the target's own final hidden states.

A row of the head at position j takes the embedding of token x_j and the feature of position j - 1 (the
target's final, normed hidden state there, or the head's own prediction of it deeper in the draft tree),
fuses them with ``fc``, runs one Llama decoder layer (no input norm, as in EAGLE) and a final RMSNorm (as
EAGLE-3; it puts the prediction on the target features' scale at once) and outputs a predicted feature
for position j; the target's own lm_head turns it into the distribution of x_{j+1}. The lm_head
may be restricted to a sub-vocabulary (``d2t``: draft index -> target id): on a small model the lm_head is
most of the head's cost, and the tokens it drops are simply never proposed.

Checkpoints: our format is a directory with ``config.json`` (``"swiftspec_draft_head": 1`` plus the
fields of HeadArgs) and ``model.safetensors`` holding

    fc.weight [dim, 2 dim], fc.bias [dim]                 input fusion of [embedding ; feature]
    attention.wqkv.weight [(H + 2 Hkv) hd, dim]           q, k, v rows (Hugging Face RoPE layout)
    attention.wo.weight [dim, H hd]
    ffn_norm.weight [dim]                                 the layer's post-attention RMSNorm
    feed_forward.w13.weight [2 inter, dim]                gate rows, then up rows
    feed_forward.w2.weight [dim, inter]
    norm.weight [dim]                                     the final RMSNorm (absent if final_norm is false)
    d2t [draft_vocab] int64                               optional: the sub-vocabulary's target ids

The public EAGLE (v1/v2) layout is read too: a Llama ``config.json`` and ``model.safetensors`` or
``pytorch_model.bin`` (loaded with ``weights_only``) with ``fc.{weight,bias}``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.post_attention_layernorm.weight`` and
``layers.0.mlp.{gate,up,down}_proj.weight`` (an ``embed_tokens.weight`` there is ignored: the target's
embedding is used); such a head has no final norm.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swiftspec import kernels
from swiftspec.engine.model.cpu_backends import CpuAttention, PackedLinear
from swiftspec.engine.model.cpu_blocks import Blocks
from swiftspec.engine.model.fp16_linear import FP16WeightLinear, pack_fp16_linears
from swiftspec.engine.model.model_args import ModelArgs, ModelConfigError
from swiftspec.engine.model.transformer import Attention, FeedForward, RMSNorm, RotateHalf, rope_inv_freq
from swiftspec.engine.spec.draft_io import Expansion, read_top
from swiftspec.engine.spec.draft_spec import HEAD_CONFIG_KEY, HeadError, read_bin
from swiftspec.engine.spec.transfers import Staging
from swiftspec.engine.spec.tree_cache import PREFILL_CHUNK, TreeKVCache, causal_mask
from swiftspec.kernels.cpu_linear import Format

HEAD_FORMAT = 1


@dataclass
class HeadArgs:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (the embedding the head reads)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    fc_bias: bool = True
    final_norm: bool = True  # an RMSNorm on the output (ours); EAGLE v1/v2 heads have none

    @classmethod
    def for_target(cls, t: ModelArgs) -> HeadArgs:
        """A head shaped like one layer of the target (EAGLE's choice)."""
        return cls(t.dim, t.n_heads, t.n_kv_heads, t.head_dim, t.intermediate_size, t.vocab_size,
                   t.norm_eps, t.rope_theta, t.rope_scaling)

    def model_args(self) -> ModelArgs:
        return ModelArgs(self.vocab_size, self.dim, 1, self.n_heads, self.n_kv_heads, self.head_dim,
                         self.intermediate_size, self.norm_eps, self.rope_theta, self.rope_scaling)

    def check_target(self, t: ModelArgs, where: str) -> None:
        if (self.dim, self.vocab_size) != (t.dim, t.vocab_size):
            raise HeadError(f"the draft head {where} has hidden size {self.dim} and vocabulary {self.vocab_size}, "
                            f"but the target has hidden size {t.dim} and vocabulary {t.vocab_size}: a head "
                            "only drafts for the target it was trained on")


class DraftHead(nn.Module):
    """The head's own weights, plus the target's embedding and (sub-vocabulary) lm_head, frozen."""

    def __init__(self, args: HeadArgs, d2t: Tensor | None = None):
        super().__init__()
        self.args = args
        margs = args.model_args()
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=args.fc_bias)
        self.attention = Attention(margs, args.n_heads, args.n_kv_heads)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(margs, args.intermediate_size)
        self.norm = RMSNorm(args.dim, args.norm_eps) if args.final_norm else None
        self.d2t = None if d2t is None else d2t.long()
        self.embed_weight: Tensor | None = None  # the target's, [vocab, dim]
        self.lm_head_weight: Tensor | None = None  # the target's rows of the draft vocabulary, [draft_vocab, dim]
        self.lm_head: nn.Module | None = None  # those rows packed (pack_fp16_cpu_weights, pack_cpu_kernels)
        self.attention_ops = kernels  # prepare_mask and tree_attention (the CPU kernels' after pack_cpu_kernels)
        self.inv_freq: Tensor | None = None
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.slot_features: Tensor | None = None  # the head's predicted feature of each slot's row

    @property
    def max_slots(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[2]

    def own_state_dict(self) -> dict[str, Tensor]:
        """What a checkpoint holds: the head's weights (and d2t), not the target's."""
        state = dict(self.state_dict())
        if self.d2t is not None:
            state["d2t"] = self.d2t
        return state

    def attach_target(self, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        """Reads the target's embedding and lm_head (not copied, except the sub-vocabulary's rows)."""
        self.embed_weight = embed_weight.detach()
        out = lm_head_weight.detach()
        self.lm_head_weight = out if self.d2t is None else out[self.d2t.to(out.device)].contiguous()
        if self.d2t is not None:
            self.d2t = self.d2t.to(out.device)

    def setup_cache(self, max_slots: int) -> None:
        p = self.ffn_norm.weight  # (the linears' weights may be packed)
        self.inv_freq_for(p.device)
        shape = (1, self.args.n_kv_heads, max_slots, self.args.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.slot_features = torch.zeros(max_slots, self.args.dim, dtype=p.dtype, device=p.device)

    def move_slots(self, src: Tensor, dst: Tensor) -> None:
        """The predicted features follow their rows' KV (TreeKVCache.commit)."""
        self.slot_features.index_copy_(0, dst, self.slot_features.index_select(0, src))

    def fuse(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self.fc(torch.cat([F.embedding(tokens, self.embed_weight), features.to(self.ffn_norm.weight.dtype)], -1))

    def finish(self, h: Tensor) -> Tensor:
        """The MLP half of the layer after the attention's residual h, then the final norm: the predicted
        feature, in the space of the target's (normed) final hidden states."""
        out = h + self.feed_forward(self.ffn_norm(h)[0])
        return out if self.norm is None else self.norm(out)[0]

    def logits(self, features: Tensor) -> Tensor:
        """Logits over the draft vocabulary (fp32)."""
        if self.lm_head is not None:
            return self.lm_head(features)
        return F.linear(features, self.lm_head_weight).float()

    def pack_fp16_cpu_weights(self) -> None:
        """Drafting on the CPU: the linears and the lm_head rows as FBGEMM fp16-weight linears (fp32 math).
        Most of an expansion's time goes to fp32 GEMMs of a few rows, which is where FBGEMM's are cheap
        (docs/ARCHITECTURE.md gives figures); a draft's rounding never reaches the output. Inference only:
        training keeps the fp32 weights."""
        pack_fp16_linears(self)
        self.lm_head = FP16WeightLinear(self.lm_head_weight)

    def pack_cpu_kernels(self, dll: ctypes.CDLL) -> None:
        """Drafting on the CPU through the kernels (kernels/cpu): every linear and the lm_head rows as Q8
        blocks, multiplied at the library's activation width, and the library's attention. An expansion of
        a few leaves then takes about 0.6 of its time with FBGEMM's fp16-weight linears (docs/ARCHITECTURE.md
        gives figures); the blocks' rounding only changes what is proposed. Inference only."""

        def packed(weight: Tensor, bias: Tensor | None = None) -> PackedLinear:
            return PackedLinear(dll, Blocks.quantize(weight, Format.Q8), Format.Q8, bias)

        for mod in list(self.modules()):
            for name, child in list(mod.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(mod, name, packed(child.weight, child.bias))
        self.lm_head = packed(self.lm_head_weight)
        self.attention_ops = CpuAttention(dll)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """One tree forward over the cache (as Transformer.forward): tokens, positions, slots [T]; features
        [T, dim] (each row's input feature); mask [T, kv_len]. Returns the predicted features [T, dim];
        each row's is also kept at its slot in ``slot_features``."""
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = RotateHalf(emb.cos(), emb.sin())
        attn = self.attention
        ops = self.attention_ops
        attn_mask = ops.prepare_mask(mask, attn.n_heads // attn.n_kv_heads, self.ffn_norm.weight.dtype)
        x = self.fuse(tokens, features)
        h = x + attn(x, rope, slots, attn_mask, self.k_cache[0], self.v_cache[0], ops.tree_attention)
        out = self.finish(h)
        self.slot_features.index_copy_(0, slots, out)
        return out

    def inv_freq_for(self, device: torch.device) -> Tensor:
        """The RoPE frequencies on ``device`` (computed once per device)."""
        if self.inv_freq is None or self.inv_freq.device != device:
            self.inv_freq = rope_inv_freq(self.args.model_args()).to(device)
        return self.inv_freq


# ------------------------------------------------------------------------------------------ checkpoints

def _read_weights(path: Path) -> dict[str, Tensor]:
    st = path / "model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except Exception as e:  # safetensors raises several types for corrupt files
            raise HeadError(f"cannot read the draft head {st}: {e}") from None
    if (path / "pytorch_model.bin").is_file():
        return read_bin(path)
    raise HeadError(f"the draft head {path} has no model.safetensors (or pytorch_model.bin)")


def _eagle_to_ours(cfg: dict, w: dict[str, Tensor]) -> tuple[HeadArgs, dict[str, Tensor]]:
    """EAGLE v1/v2 names onto ours: q/k/v fused into wqkv, gate/up into w13. Its config is a one-layer
    Llama config, read as the target's is."""
    try:
        args = HeadArgs.for_target(ModelArgs.from_hf_config(cfg))
    except ModelConfigError as e:
        raise HeadError(f"not an EAGLE head for a Llama target: {e}") from None
    args.fc_bias, args.final_norm = "fc.bias" in w, False
    p = "layers.0."
    out = {"fc.weight": w["fc.weight"],
           "attention.wqkv.weight": torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
           "attention.wo.weight": w[p + "self_attn.o_proj.weight"],
           "ffn_norm.weight": w[p + "post_attention_layernorm.weight"],
           "feed_forward.w13.weight": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
           "feed_forward.w2.weight": w[p + "mlp.down_proj.weight"]}
    if "fc.bias" in w:
        out["fc.bias"] = w["fc.bias"]
    return args, out


def load_head(path: Path, target_args: ModelArgs, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> DraftHead:
    """Reads a head directory (ours or EAGLE's) and checks it against the target; the caller attaches
    the target's embedding and lm_head."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise HeadError(f"cannot read the draft head's config {path / 'config.json'}: {e}") from None
    if HEAD_CONFIG_KEY in cfg and cfg[HEAD_CONFIG_KEY] != HEAD_FORMAT:
        raise HeadError(f"the draft head {path} has format {cfg[HEAD_CONFIG_KEY]}; this version reads {HEAD_FORMAT}")
    weights = _read_weights(path)
    try:
        if HEAD_CONFIG_KEY in cfg:
            names = {f.name for f in fields(HeadArgs)}
            args = HeadArgs(**{k: v for k, v in cfg.items() if k in names})
            state = weights
        else:
            args, state = _eagle_to_ours(cfg, weights)
    except (KeyError, TypeError) as e:
        raise HeadError(f"the draft head {path} is incomplete or not a draft head: missing {e}") from None
    args.check_target(target_args, str(path))
    d2t = state.pop("d2t", None)
    if d2t is not None and (d2t.ndim != 1 or d2t.numel() == 0 or int(d2t.min()) < 0
                            or int(d2t.max()) >= target_args.vocab_size):
        raise HeadError(f"the draft head {path}: its d2t map is not a list of target token ids")
    with torch.device("meta"):
        head = DraftHead(args, None)
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise HeadError(f"the draft head {path}: weights do not match its config: {e}") from None
    head.d2t = d2t
    return head.to(device=device, dtype=dtype).eval()


def save_head(head: DraftHead, out: Path, extra: dict | None = None) -> None:
    """Writes our format (config.json + model.safetensors), atomically per file."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.own_state_dict().items()}
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(out / "model.safetensors")
    cfg = {HEAD_CONFIG_KEY: HEAD_FORMAT, **asdict(head.args), **(extra or {})}
    (out / "config.json.tmp").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "config.json.tmp").replace(out / "config.json")


# ------------------------------------------------------------------------------------------ the drafter

NONE, FROM_TARGET, FROM_PARENT = 0, 1, 2  # where a draft row's input feature comes from


class HeadDrafter:
    """Drafts with a DraftHead over the token tree (see drafters.py for the interface).

    It wants the target's features: ``prefill`` and ``extend`` receive the target's final hidden states
    of the committed positions, kept in ``features`` by position. A row's input feature is the target's
    at the position before it (pending tokens, and the root of a fresh tree), or the head's own
    prediction at its parent (deeper nodes); predictions live by slot in ``head.slot_features`` and move
    with the KV when a subtree survives a re-root (no recompute).
    """

    wants_features = True

    def __init__(self, head: DraftHead, max_slots: int):
        self.head = head
        head.setup_cache(max_slots)
        self.cache = TreeKVCache(head, head.move_slots)
        p = head.ffn_norm.weight
        self.features = torch.zeros(max_slots, head.args.dim, dtype=p.dtype, device=p.device)
        self.n_committed = 0  # committed positions whose target feature is in ``features``
        self.staging = Staging(p.device)

    def _store(self, start: int, hidden: Tensor) -> None:
        self.features[start:start + hidden.shape[0]] = hidden.to(self.features.dtype)

    def _prev_features(self, positions: list[int]) -> Tensor:
        """The target's feature at each position - 1 (zeros before the first token)."""
        idx = torch.tensor([max(p - 1, 0) for p in positions], device=self.features.device)
        feats = self.features.index_select(0, idx)
        if positions and positions[0] == 0:
            feats[0] = 0
        return feats

    def prefill(self, tokens: list[int], reuse: int, features=None) -> None:
        """features: the target's hidden states at positions features.start..len(tokens) - 1."""
        if features is None:
            raise RuntimeError("the draft head needs the target's features")
        self._store(features.start, features.hidden)
        self.n_committed = len(tokens)
        new = list(range(reuse, len(tokens)))
        dev = self.head.ffn_norm.weight.device
        for s in range(0, len(new), PREFILL_CHUNK):
            pos = new[s:s + PREFILL_CHUNK]
            pos_t = torch.tensor(pos, device=dev)
            self.head(torch.tensor(tokens[pos[0]:pos[-1] + 1], device=dev), self._prev_features(pos), pos_t,
                      pos_t, causal_mask(pos[0], len(pos)).to(dev))

    def extend(self, tokens: list[int], features=None) -> None:
        if features is None:
            raise RuntimeError("the draft head needs the target's features")
        self._store(self.n_committed, features)
        self.n_committed += len(tokens)

    def propose(self, exp: Expansion, k: int) -> list[list[tuple[int, float]]]:
        tree, n_p = exp.tree, len(exp.pending)
        rows = tree.draft_inputs(exp.leaves, exp.n_prefix, exp.pending)
        # Each row's input feature: the target's at the position before it (pending rows and the root;
        # zeros before the first token) or the head's own at its parent's slot, gathered on the device
        # from indices staged with the rows.
        base = exp.n_prefix + n_p  # the root's position
        by_position = list(range(exp.n_prefix, base)) + [base if tree.parent[leaf] < 0 else -1
                                                           for leaf in exp.leaves]
        parent_slot = [0] * n_p + [tree.slot[tree.parent[leaf]] if tree.parent[leaf] >= 0 else 0
                                   for leaf in exp.leaves]
        source = [FROM_PARENT if p < 0 else NONE if p == 0 else FROM_TARGET for p in by_position]
        s = self.staging.upload(rows, [max(p - 1, 0) for p in by_position], parent_slot, source)
        prev, slot, src = s.extras
        feats = torch.where((src == FROM_PARENT)[:, None], self.head.slot_features.index_select(0, slot),
                            self.features.index_select(0, prev))
        feats = torch.where((src == NONE)[:, None], 0, feats)
        out = self.head(s.tokens, feats, s.positions, s.slots, s.mask)
        logp = self.head.logits(out[n_p:]).log_softmax(-1)
        return read_top(logp, k, self.head.d2t)
