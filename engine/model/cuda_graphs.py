"""CUDA graphs for the decode-sized forwards: ``ar`` steps, target verification of bs nodes, draft expansion
of w leaves, short prefills.

At 1-64 tokens per forward each kernel runs for microseconds, so launching a forward's hundreds of kernels
from Python costs more than running them; a graph replay launches them all at once. A graph has fixed
shapes and addresses, so each call is padded to a (token bucket, kv bucket) shape and copied into that
graph's static inputs:

* tokens grow to the next token bucket. Pad rows write their K/V into a scratch slot, the cache's last
  slot, which the engine never sees (``max_slots`` here is the model's minus one), and attend to slot 0
  (every mask row needs a True); their outputs are dropped.
* kv_len grows to the next power of two (at least ``min_kv``, at most the cache); the new mask columns are
  False.

Rows are independent everywhere in the model (attention included, since a masked key weighs exactly 0),
so padding leaves the real rows' results as they were (tests/test_cuda_graphs.py checks it on CPU with
``capture=False``, the same path without graphs). One graph is captured per bucket pair on first use;
longer calls (prefill chunks) run eagerly, unpadded, as on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # up to the Triton tree-attention's decode-sized queries


@dataclass
class _Static:
    """One bucket's fixed-address inputs, and after capture its graph and outputs."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor
    mask: Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: Tensor | None = None
    hidden: Tensor | None = None


class GraphedModel:
    """Wraps a ``Transformer``: called like it, and it forwards every other attribute (``args``,
    ``k_cache``, ...) to it, except ``max_slots`` and ``setup_cache``, which hide the scratch slot.

    ``capture=False`` runs the padded forward eagerly (on any device): the tests' view of the graph path.
    """

    def __init__(self, model, token_buckets: tuple[int, ...] = TOKEN_BUCKETS, min_kv: int = 256,
                 capture: bool = True):
        self.model = model
        self.token_buckets = tuple(sorted(token_buckets))
        self.min_kv = min_kv
        self.capture = capture
        self._static: dict[tuple[int, int], _Static] = {}
        self._pool = None

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    @property
    def max_slots(self) -> int:
        """Slots the engine may use: all but the scratch slot (the last one)."""
        return self.model.max_slots - 1

    usable_slots = max_slots

    def setup_cache(self, max_slots: int) -> None:
        """Gives the model ``max_slots`` usable slots plus the scratch slot; drops the graphs, which read
        the old cache."""
        self.model.setup_cache(max_slots + 1)
        self._static.clear()

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                 logits_rows: Tensor | slice | None = None, return_hidden: bool = False):
        t = mask.shape[0]
        if t > self.token_buckets[-1] or (self.capture and not self.model.k_cache.is_cuda):
            return self.model(tokens, positions, slots, mask, logits_rows, return_hidden)
        s = self._fill(tokens, positions, slots, mask)
        if not self.capture:
            logits, hidden = self._forward(s)
        else:
            if s.graph is None:
                self._capture(s)
            s.graph.replay()
            logits, hidden = s.logits, s.hidden
        # Copies: the graph overwrites its outputs on the next replay.
        logits = (logits[:t] if logits_rows is None else logits[:t][logits_rows]).clone()
        return (logits, hidden[:t].clone()) if return_hidden else logits

    def _fill(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> _Static:
        """Copies a call into its bucket's static inputs (made on first use)."""
        t, kv_len = mask.shape
        tb = next(b for b in self.token_buckets if b >= t)
        kb = min(max(self.min_kv, 1 << (kv_len - 1).bit_length()), self.model.max_slots)
        s = self._static.get((tb, kb))
        if s is None:
            dev = self.model.k_cache.device
            s = _Static(*(torch.zeros(tb, dtype=torch.long, device=dev) for _ in range(3)),
                        mask=torch.zeros(tb, kb, dtype=torch.bool, device=dev))
            self._static[(tb, kb)] = s
        # Pad rows keep stale tokens and positions (valid values, results dropped) but must never write
        # into a real slot, so their slots are reset on every call.
        s.tokens[:t].copy_(tokens)
        s.positions[:t].copy_(positions)
        s.slots[:t].copy_(slots)
        s.slots[t:].fill_(self.model.max_slots - 1)
        s.mask.zero_()
        s.mask[:t, :kv_len].copy_(mask)
        s.mask[t:, 0] = True
        return s

    def _forward(self, s: _Static) -> tuple[Tensor, Tensor]:
        return self.model(s.tokens, s.positions, s.slots, s.mask, None, True)

    def _capture(self, s: _Static) -> None:
        """Warms up on a side stream first: Triton compiles, cuBLAS picks its kernels, and the all-reduce
        buffer and attention counters are allocated, none of which may happen during a capture. The
        warm-up writes the same K/V into the same slots as the replay that follows."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(s)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one pool: graphs replay one at a time
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of a worker (NCCL's watchdog, the leader's socket reader) run on.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            s.logits, s.hidden = self._forward(s)
        s.graph = graph
