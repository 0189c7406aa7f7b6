"""Tensor parallelism inside one group (gpt-fast style): shard the checkpoint, the model all-reduces.

Attention heads are split column-wise (wqkv rows) and row-wise (wo columns); the MLP likewise (w13 rows,
w2 columns). Each rank then owns whole heads, and one all-reduce after wo and one after w2 restore the
full activations. Shapes that do not divide are padded with zero heads / zero MLP channels, which add
exactly nothing (a zero wo column, silu(0) * 0 = 0), as the SwiftSpec paper does. KV heads that are
fewer than the ranks are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftspec.engine.model.model_args import ModelArgs


@dataclass(frozen=True)
class ShardLayout:
    n_heads: int  # query heads per rank (after padding)
    n_kv_heads: int  # KV heads per rank
    intermediate: int  # MLP channels per rank (after padding)
    expand_kv: bool  # KV heads replicated to one per query head before padding


def shard_layout(args: ModelArgs, world: int) -> ShardLayout:
    nh, nkv = args.n_heads, args.n_kv_heads
    inter = -(-args.intermediate_size // world)
    if nh % world == 0 and (nkv % world == 0 or world % nkv == 0):
        return ShardLayout(nh // world, max(1, nkv // world), inter, False)
    heads = -(-nh // world)  # pad query heads; give every query head its own KV head
    return ShardLayout(heads, heads, inter, True)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def shard_state_dict(state: dict[str, torch.Tensor], args: ModelArgs, rank: int, world: int
                     ) -> dict[str, torch.Tensor]:
    """This rank's slice of a (converted, unsharded) state dict."""
    lay = shard_layout(args, world)
    hd, nh, nkv = args.head_dim, args.n_heads, args.n_kv_heads
    group = nh // nkv
    q_lo = rank * lay.n_heads
    out = {}
    for name, t in state.items():
        if name.endswith("attention.wqkv.weight") or name.endswith("attention.wqkv.bias"):
            q, k, v = t.split([nh * hd, nkv * hd, nkv * hd])
            q, k, v = (x.reshape(-1, hd, *t.shape[1:]) for x in (q, k, v))
            if lay.expand_kv:
                k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
                q, k, v = (_pad_rows(x, lay.n_heads * world) for x in (q, k, v))
                kv_idx = torch.arange(q_lo, q_lo + lay.n_heads)
            elif nkv >= world:
                kv_idx = torch.arange(rank * lay.n_kv_heads, (rank + 1) * lay.n_kv_heads)
            else:
                kv_idx = torch.tensor([q_lo // group])
            q = q[q_lo:q_lo + lay.n_heads]
            out[name] = torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k[kv_idx], v[kv_idx])])
        elif name.endswith("attention.wo.weight"):
            cols = t.reshape(t.shape[0], nh, hd)
            cols = torch.cat([cols, cols.new_zeros(t.shape[0], lay.n_heads * world - nh, hd)], 1)
            out[name] = cols[:, q_lo:q_lo + lay.n_heads].reshape(t.shape[0], -1).contiguous()
        elif name.endswith("feed_forward.w13.weight"):
            gate, up = t.chunk(2)
            sl = slice(rank * lay.intermediate, (rank + 1) * lay.intermediate)
            gate, up = (_pad_rows(x, lay.intermediate * world)[sl] for x in (gate, up))
            out[name] = torch.cat([gate, up])
        elif name.endswith("feed_forward.w2.weight"):
            padded = _pad_rows(t.T, lay.intermediate * world).T
            out[name] = padded[:, rank * lay.intermediate:(rank + 1) * lay.intermediate].contiguous()
        else:
            out[name] = t
    return out
