"""Placement and set-up of one rank: its arguments, devices and threads, process groups, models, and the
profiled step times that choose d."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from swiftspec.config import ConfigError, TreeParams
from swiftspec.engine import launcher
from swiftspec.engine.cuda_graphs import GraphedModel
from swiftspec.engine.decode import DraftState, TargetState
from swiftspec.engine.draft_head import is_head_dir
from swiftspec.engine.drafters import make_drafter
from swiftspec.engine.loader import default_dtype, load_model
from swiftspec.engine.loop import Message, Op
from swiftspec.engine.model_dir import eos_token_ids
from swiftspec.engine.protocol import RankInfo
from swiftspec.engine.worker.wire import Wire

PG_TIMEOUT = timedelta(days=3650)  # followers wait in a broadcast while the chat is idle
INIT_TIMEOUT = timedelta(seconds=120)  # for every rank to reach init_process_group and new_group
DRAFT_TREE_SLOTS = 512  # draft KV slots for the token tree beyond the verified prefix


@dataclass
class Ctx:
    """This rank's place in the world and what it holds."""

    args: argparse.Namespace
    rank: int
    world: int
    n_target: int
    role: str
    device: torch.device
    threads: int
    backend: str
    target_group: dist.ProcessGroup | None = None
    draft_group: dist.ProcessGroup | None = None
    target: TargetState | None = None  # on target ranks
    draft: DraftState | None = None  # on draft ranks
    eos: set[int] = field(default_factory=set)
    d: int = 1
    features: bool = False  # the drafter reads the target's hidden states (the draft leader says so)
    wire: Wire | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.target_group if self.role == "target" else self.draft_group

    @property
    def group_leader(self) -> int:
        return 0 if self.role == "target" else self.n_target

    @property
    def tp_rank(self) -> int:
        return self.rank - self.group_leader

    @property
    def tp_world(self) -> int:
        return self.n_target if self.role == "target" else self.world - self.n_target

    def tell(self, op: Op, tokens: list[int] = (), parents: list[int] = ()) -> None:
        """A group leader tells its TP followers which step comes next (loop.lead_target's ``tell``)."""
        if self.tp_world > 1:
            dist.broadcast(self.wire.pack(Message(op, tokens, parents)), src=self.group_leader, group=self.group)


# ---------------------------------------------------------------------------------------------- set-up

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m swiftspec.engine.worker",
                                description="SwiftSpec worker (started by torchrun; one process per rank)")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face layout)")
    p.add_argument("--draft", default="suffix",
                   help="draft model directory, 'suffix', 'int8', or 'none' (ar only: no draft ranks)")
    p.add_argument("--no-draft-history", dest="draft_history", action="store_false",
                   help="the suffix drafter forgets earlier conversations (fair benchmarks)")
    p.add_argument("--history-db", help="the suffix drafter also drafts from the answers in this history "
                                        "database (default: from the session's earlier conversations)")
    p.add_argument("--draft-corpus", help="the suffix drafter's corpus file (the target's own answers)")
    p.add_argument("--target-name", help="name shown for the target (default: its directory name)")
    p.add_argument("--target-procs", type=int, default=1, help="ranks 0..N-1 form the target group")
    p.add_argument("--target-devices", help="CUDA devices of the target ranks, e.g. 0,1,2")
    p.add_argument("--draft-devices", help="CUDA devices of the draft ranks, e.g. 3 (empty: CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda without device lists: each rank uses cuda:LOCAL_RANK (multi-node)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                   help="the target's rows independent of the call's size (exact 16-bit speculation); "
                        "auto: on except for fp32 on the CPU")
    p.add_argument("--max-seq-len", type=int, default=4096)
    # (--tree-*: torchrun's parser would take a bare --d for an abbreviation of its own options)
    p.add_argument("--tree-bs", dest="bs", type=int, default=8, help="nodes verified per target forward")
    p.add_argument("--tree-w", dest="w", type=int, default=8, help="leaves expanded per draft forward")
    p.add_argument("--tree-d", dest="d", type=int, default=None,
                   help="draft expansions per round (default: from profiled step times)")
    p.add_argument("--verify-cost", action="store_true",
                   help="verify only the subtree size worth its profiled target cost (DraftState.verify_cost)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per node, all ranks together")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--prompt", help="no Engine: run this prompt in each of --modes and print the results")
    p.add_argument("--modes", default="ar,async", help="with --prompt: modes to run, compared with the first")
    p.add_argument("--max-new-tokens", type=int, default=64, help="with --prompt")
    args = p.parse_args(argv)
    TreeParams(args.bs, args.w, args.d).validate()
    return args


def _devices(spec: str | None) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()] if spec else []


def _cpu_threads(args: argparse.Namespace, rank: int, n_target: int) -> int:
    """Divides this node's cores between its local ranks (``--threads``, or every core but one on the node
    that holds the Engine, whose process streams the text). The suffix drafter (light Python) and a draft
    head (one layer) take one thread each, on a core of their own, and the target ranks share the rest; a
    draft model gets its share like any rank. Oversubscribing costs more than a thread brings: on a 2-core
    machine SmolLM2 decodes at ~16 tok/s with its target on both cores, at ~21-24 tok/s on one."""
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    engine_here = rank == local_rank  # this node holds rank 0, the Engine's peer
    total = args.threads or max(1, len(os.sched_getaffinity(0)) - engine_here)
    local = range(rank - local_rank, rank - local_rank + local_world)
    if args.draft not in ("suffix", "none") and not is_head_dir(Path(args.draft)):
        return max(1, total // local_world)
    if rank >= n_target:
        return 1
    n_local_target = sum(r < n_target for r in local)
    return max(1, (total - (local_world - n_local_target)) // max(1, n_local_target))


def setup(args: argparse.Namespace) -> Ctx:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n_target = args.target_procs
    if args.draft == "none" and n_target != world:
        raise ConfigError(f"without a draft all {world} ranks are target ranks, not {n_target}")
    if args.draft != "none" and not 1 <= n_target < world:
        raise ConfigError(f"{world} ranks cannot hold {n_target} target rank(s) and at least one draft rank")
    role = "target" if rank < n_target else "draft"
    if args.target_devices is not None:
        layout = launcher.Layout(n_target, world - n_target, _devices(args.target_devices), _devices(args.draft_devices))
        devices = launcher.rank_devices(layout)
    else:
        devices = ["cuda" if args.device == "cuda" else "cpu"] * world
    device = torch.device(devices[rank] if devices[rank] != "cuda" else f"cuda:{os.environ['LOCAL_RANK']}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        share = launcher.memory_fraction(devices, rank, n_target)
        if share is not None:
            torch.cuda.set_per_process_memory_fraction(share, device)
    threads = _cpu_threads(args, rank, n_target)
    torch.set_num_threads(threads)
    groups = launcher.process_groups(devices, n_target)
    store_path = os.environ.get(launcher.ENV_STORE)
    if store_path:  # one node: a FileStore in the Engine's private run directory, no listener
        dist.init_process_group(groups["world"].backend, store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world, timeout=INIT_TIMEOUT)
    else:  # several nodes: torchrun's rendezvous (MASTER_ADDR / MASTER_PORT)
        dist.init_process_group(groups["world"].backend, timeout=INIT_TIMEOUT)
    backend = groups["target"].backend if role == "target" else groups["draft"].backend
    ctx = Ctx(args, rank, world, n_target, role, device, threads, backend, wire=Wire(args.bs))
    ctx.target_group = dist.new_group(list(groups["target"].ranks), timeout=INIT_TIMEOUT,
                                      backend=groups["target"].backend)
    if world > n_target:
        ctx.draft_group = dist.new_group(list(groups["draft"].ranks), timeout=INIT_TIMEOUT,
                                         backend=groups["draft"].backend)
    for group in (None, ctx.group):  # all met: from now on, waits while the chat is idle are fine
        dist.distributed_c10d._set_pg_timeout(PG_TIMEOUT, group)
    return ctx


def barrier() -> None:
    """A barrier over CPU tensors (the world group is gloo only; see launcher.process_groups)."""
    dist.all_reduce(torch.zeros(1))


def gather_ranks(ctx: Ctx) -> list[RankInfo]:
    """Every rank's pid, device and threads, gathered as int64 tensors (no pickles between ranks)."""
    host = socket.gethostname().encode()[:48].ljust(48, b"\0")
    dev = -1 if ctx.device.type == "cpu" else ctx.device.index
    mine = torch.tensor([os.getpid(), ctx.threads, dev, *host], dtype=torch.int64)
    allr = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(allr, mine)
    ranks = []
    for r, t in enumerate(allr):
        v = t.tolist()
        role = "target" if r < ctx.n_target else "draft"
        lead = 0 if role == "target" else ctx.n_target
        tp_world = ctx.n_target if role == "target" else ctx.world - ctx.n_target
        ranks.append(RankInfo(rank=r, role=role, device="cpu" if v[2] < 0 else f"cuda:{v[2]}", tp_rank=r - lead,
                              tp_world=tp_world, threads=v[1], host=bytes(v[3:]).rstrip(b"\0").decode(),
                              pid=v[0]))
    return ranks


def load(ctx: Ctx) -> None:
    """Target ranks load their shard of the target; draft ranks build the drafter and its tree state."""
    args = ctx.args
    target_dir = Path(args.target)
    slots = args.max_seq_len + args.bs + 1  # the prefix plus one tree being verified

    def model_for(path: Path, n_slots: int, group, int8: bool = False, batch_invariant: bool | None = False):
        """Our model on this rank's device; on CUDA wrapped in CUDA graphs (one more slot: the graphs'
        scratch slot, hidden from the caller). Drafts skip the batch-invariant mode on CUDA (their rounding
        only changes what is proposed, never what is output); on the CPU the invariant kernels are also
        the fast ones, and a draft runs them too."""
        cuda = ctx.device.type == "cuda"
        model = load_model(path, ctx.device, args.dtype, max_slots=n_slots + cuda, tp_group=group,
                           tp_rank=ctx.tp_rank, tp_world=ctx.tp_world, int8=int8, batch_invariant=batch_invariant)
        return GraphedModel(model) if cuda else model

    if ctx.role == "target":
        invariant = {"auto": None, "on": True, "off": False}[args.batch_invariant]
        model = model_for(target_dir, slots, ctx.target_group, batch_invariant=invariant)
        ctx.target = TargetState(model, slots)
        if ctx.rank == 0:
            ctx.eos = set(eos_token_ids(target_dir, args.trust_remote_code))
    else:
        drafter = make_drafter(args.draft, target_dir, args.trust_remote_code, args.draft_history,
                               lambda path, int8: model_for(path, slots + DRAFT_TREE_SLOTS, ctx.draft_group, int8,
                                                            None if ctx.device.type == "cpu" else False),
                               ctx.device, default_dtype(ctx.device, args.dtype), slots + DRAFT_TREE_SLOTS,
                               Path(args.draft_corpus) if args.draft_corpus else None,
                               Path(args.history_db) if args.history_db else None)
        if drafter.wants_features and ctx.tp_world > 1:
            raise ConfigError("a draft that reads the target's hidden states runs on one draft rank only")
        ctx.draft = DraftState(drafter, TreeParams(args.bs, args.w, args.d))


def target_precision(ctx: Ctx) -> str:
    """What the title bar says the target runs at: the CPU backend's label ("int4 (Q4_1 blocks) · int8
    activations · AVX2"), else the dtype, and for a converted GGUF the type its blocks came in."""
    from swiftspec.embedded import precision_label
    from swiftspec.engine.model_dir import default_dtype_name

    model = getattr(ctx.target.model, "model", ctx.target.model)  # through a CUDA-graphs wrapper
    if model.precision:
        return model.precision
    return precision_label(Path(ctx.args.target), default_dtype_name(ctx.device.type == "cuda", ctx.args.dtype))

