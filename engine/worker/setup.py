"""Placement and set-up of one rank: its arguments, devices and threads, process groups, models, and the
profiled step times that choose d. Each phase of a start is a frozen dataclass made whole by the function
that ends it (setup: Placement, load: Loaded, profiling.tune: Tuned, profiling.profile: Profiled), so no
field waits for a later phase and none changes after its own."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from swiftspec.engine.config import (
    ConfigError,
    Device,
    DraftCorpus,
    DraftKind,
    Dtype,
    EngineConfig,
    Role,
    SamplingParams,
)
from swiftspec.engine.host import launcher
from swiftspec.engine.host.protocol import RankInfo
from swiftspec.engine.host.worker_spec import WorkerSpec
from swiftspec.engine.model.cpu_backends import kernels_available, library
from swiftspec.engine.model.cuda_graphs import GraphedModel
from swiftspec.engine.model.gguf_io import precision_label
from swiftspec.engine.model.loader import default_dtype, load_model
from swiftspec.engine.model.model_dir import eos_token_ids, read_args, resolved_dtype
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.draft_spec import DraftSpec
from swiftspec.engine.spec.drafters import make_drafter
from swiftspec.engine.spec.grammar import Vocabulary
from swiftspec.engine.spec.messages import FollowerStep, Wire
from swiftspec.engine.worker.collectives import RankReport, any_rank
from swiftspec.kernels import cpu_linear

PG_TIMEOUT = timedelta(days=3650)  # followers wait in a broadcast while the chat is idle
INIT_TIMEOUT = timedelta(seconds=120)  # for every rank to reach init_process_group and new_group
DRAFT_TREE_SLOTS = 512  # draft KV slots for the token tree beyond the verified prefix


@dataclass(frozen=True)
class Placement:
    """This rank's place in the world, fixed once its process groups exist (``setup``): every later phase
    is a Placement with more fields (Loaded, Tuned, Profiled), so a function takes the earliest it needs."""

    spec: WorkerSpec
    rank: int
    world: int
    n_target: int
    role: Role
    device: torch.device
    threads: int
    backend: str
    wire: Wire  # the messages between leaders and to TP followers, sized by the tree's bs
    target_group: dist.ProcessGroup
    draft_group: dist.ProcessGroup | None  # None without draft ranks (``ar`` only)

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

    def tell(self, step: FollowerStep) -> None:
        """A group leader tells its TP followers which step comes next (loop.lead_target's ``tell``)."""
        if self.tp_world > 1:
            dist.broadcast(self.wire.pack_step(step), src=self.group_leader, group=self.group)

    def next_step(self) -> FollowerStep:
        """A TP follower's next step from its group leader."""
        buf = self.wire.buffer()
        dist.broadcast(buf, src=self.group_leader, group=self.group)
        return self.wire.unpack_step(buf)


@dataclass(frozen=True)
class Loaded(Placement):
    """A placed rank with its models (``load``)."""

    dtype: Dtype  # as loaded (profiling.target_dtype): the config's, or a CPU target's measured backend
    target: TargetState | None  # on target ranks, None on draft ranks
    draft: DraftState | None  # on draft ranks, None on target ranks
    eos: frozenset[int]  # the ids that end an answer (the leader's Finisher and EngineInfo)


@dataclass(frozen=True)
class Tuned(Loaded):
    """A loaded rank with how its models run (profiling.tune): what every rank must agree on before the
    step times are measured, since they are measured this way."""

    features: bool  # the drafter reads the target's hidden states (the draft leader says so)
    kernel_threads: dict[str, int]  # CPU kernels' threads by mode (profiling.choose_kernel_threads)


@dataclass(frozen=True)
class Profiled(Tuned):
    """A tuned rank with its measured step times and the d they chose (profiling.profile): ready to serve."""

    t_verify_ms: float  # the slowest rank's target verification of bs nodes (0 without a draft)
    t_expand_ms: float  # the slowest rank's draft expansion (0 without a draft)
    d: int  # draft expansions per round (0 without a draft)
    verify_cost: tuple[float, ...]  # the target's verification of 1..bs nodes in one-node forwards (): unmeasured


P = TypeVar("P", bound=Placement)


def next_phase(cls: type[P], done: Placement, **more) -> P:
    """The phase ``cls`` of the rank ``done`` describes: its fields and ``more``."""
    return cls(**{f.name: getattr(done, f.name) for f in fields(done)}, **more)


# ---------------------------------------------------------------------------------------------- set-up

@dataclass(frozen=True)
class HandRun:
    """A worker group started by hand (``--prompt``): each request answers the prompt, printed, compared.
    Its requests are validated where every rank parses its flags, so a bad one stops them all alike."""

    prompt: str
    requests: list[SamplingParams]


def parse_args(argv: list[str] | None = None) -> tuple[WorkerSpec, HandRun | None]:
    """The Engine's WorkerSpec (``--spec``), or for a hand run one made of the few flags below, every
    other setting at EngineConfig's default."""
    defaults = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m swiftspec.engine.worker",
                                description="SwiftSpec worker (started by torchrun; one process per rank)")
    p.add_argument("--spec", type=Path, help="the WorkerSpec JSON the Engine wrote into its run directory")
    p.add_argument("--target", help="without --spec: the target model directory (Hugging Face layout)")
    p.add_argument("--draft", default=defaults.draft,
                   help="without --spec: a draft model directory, 'suffix', 'int8', or 'none'")
    p.add_argument("--target-procs", type=int, default=defaults.target_procs,
                   help="without --spec: ranks 0..N-1 form the target group")
    p.add_argument("--device", choices=list(Device), default=defaults.device,
                   help="without --spec: cuda puts each rank on cuda:LOCAL_RANK (several nodes)")
    p.add_argument("--threads", type=int, default=defaults.threads,
                   help="without --spec: CPU threads per node, all ranks together")
    p.add_argument("--prompt", help="no Engine: run this prompt in each of --modes and print the results")
    p.add_argument("--modes", default="ar,async", help="with --prompt: modes to run, compared with the first")
    p.add_argument("--max-new-tokens", type=int, default=64, help="with --prompt")
    args = p.parse_args(argv)
    hand = None
    if args.prompt is not None:
        try:
            hand = HandRun(args.prompt, [SamplingParams(mode=m, max_new_tokens=args.max_new_tokens).validate()
                                         for m in args.modes.split(",")])
        except ConfigError as e:
            p.error(str(e))
    if args.spec is not None:
        return WorkerSpec.read(args.spec), hand
    if args.target is None or hand is None:
        p.error("give --spec (the Engine does), or --target and --prompt")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = EngineConfig(target=args.target, draft=args.draft, target_procs=args.target_procs,
                          device=args.device, threads=args.threads, draft_corpus=DraftCorpus.NONE).validate()
    return WorkerSpec(config, launcher.Layout(args.target_procs, world - args.target_procs), args.target,
                      args.draft), hand


def _local_ranks(rank: int, n_target: int) -> tuple[int, int]:
    """This node's ranks: how many, and how many of them are target ranks."""
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return local_world, sum(r < n_target for r in range(rank - local_rank, rank - local_rank + local_world))


def _cpu_threads(threads: int | None, draft: DraftSpec, rank: int, n_target: int) -> int:
    """Divides this node's cores between its local ranks (``threads``, or every core but one on the node
    that holds the Engine, whose process streams the text). The suffix drafter (light Python) and a draft
    head (one layer) take one thread each, on a core of their own, and the target ranks share the rest; a
    draft model gets its share like any rank. These are torch's threads, and the CPU kernels' in a draft
    model; a target's kernels may take more cores in the modes where no draft runs beside it
    (profiling.choose_kernel_threads, by measurement)."""
    local_world, n_local_target = _local_ranks(rank, n_target)
    engine_here = rank == int(os.environ["LOCAL_RANK"])  # this node holds rank 0, the Engine's peer
    total = threads or max(1, len(os.sched_getaffinity(0)) - engine_here)
    if draft.own_model:
        return max(1, total // local_world)
    if rank >= n_target:
        return 1
    return max(1, (total - (local_world - n_local_target)) // max(1, n_local_target))


def free_threads(threads: int | None, rank: int, n_target: int) -> int:
    """A target rank's share of its node's cores while no draft runs beside its forwards (``ar``, and
    ``sync`` between its drafts): all of them (``threads``, or every core) over the node's target ranks."""
    return max(1, (threads or len(os.sched_getaffinity(0))) // max(1, _local_ranks(rank, n_target)[1]))


def draft_shares_cores(tuned: Tuned, ranks: list[RankInfo]) -> bool:
    """Whether the CPU ranks on the draft leader's node want more cores in ``async`` than the node has: the
    draft's threads, and the target's kernel threads for async (``Tuned.kernel_threads``, which may be all
    the cores) or its share. The draft's expansions during a verification then slow it down."""
    host = ranks[tuned.n_target].host
    wanted = sum(tuned.kernel_threads.get("async", r.torch_threads) if r.role == "target" else r.torch_threads
                 for r in ranks if r.host == host and r.device == Device.CPU)
    return wanted > len(os.sched_getaffinity(0))


def uses_cpu_kernels(loaded: Loaded) -> bool:
    """This target rank's model runs through the kernels of kernels/cpu/ (a CPU backend labels its precision)."""
    return loaded.role == "target" and bool(getattr(loaded.target.model, "precision", None))


def set_kernel_threads(n: int) -> None:
    cpu_linear.set_threads(library(), n)


def use_kernel_threads(tuned: Tuned, mode: str) -> None:
    """The CPU kernels' threads for an answer in ``mode``: what profiling chose, else this rank's share."""
    if uses_cpu_kernels(tuned):
        set_kernel_threads(tuned.kernel_threads.get(mode, tuned.threads))


def setup(spec: WorkerSpec) -> Placement:
    """This rank placed: its device, threads and process groups, with every rank met in them."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config, layout = spec.config, spec.layout
    n_target = layout.n_target
    if not spec.draft_spec.speculative and n_target != world:
        raise ConfigError(f"without a draft all {world} ranks are target ranks, not {n_target}")
    if spec.draft_spec.speculative and not 1 <= n_target < world:
        raise ConfigError(f"{world} ranks cannot hold {n_target} target rank(s) and at least one draft rank")
    role = "target" if rank < n_target else "draft"
    if layout.cuda:
        devices = launcher.rank_devices(layout)
    else:
        devices = [Device.CUDA if config.device == Device.CUDA else Device.CPU] * world
    device = torch.device(devices[rank] if devices[rank] != Device.CUDA else f"cuda:{os.environ['LOCAL_RANK']}")
    if Device.of(device) is Device.CUDA:
        torch.cuda.set_device(device)
        share = launcher.memory_fraction(devices, rank, n_target)
        if share is not None:
            torch.cuda.set_per_process_memory_fraction(share, device)
    threads = _cpu_threads(config.threads, spec.draft_spec, rank, n_target)
    torch.set_num_threads(threads)
    groups = launcher.process_groups(devices, n_target)
    store_path = os.environ.get(launcher.ENV_STORE)
    if store_path:  # one node: a FileStore in the Engine's private run directory, no listener
        dist.init_process_group(groups["world"].backend, store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world, timeout=INIT_TIMEOUT)
    else:  # several nodes: torchrun's rendezvous (MASTER_ADDR / MASTER_PORT)
        dist.init_process_group(groups["world"].backend, timeout=INIT_TIMEOUT)
    backend = groups["target"].backend if role == "target" else groups["draft"].backend
    target_group = dist.new_group(list(groups["target"].ranks), timeout=INIT_TIMEOUT, backend=groups["target"].backend)
    draft_group = None
    if world > n_target:
        draft_group = dist.new_group(list(groups["draft"].ranks), timeout=INIT_TIMEOUT, backend=groups["draft"].backend)
    place = Placement(spec, rank, world, n_target, role, device, threads, backend, Wire(config.tree.bs),
                      target_group, draft_group)
    # torch has no public way to lengthen a group's timeout once it exists: without this private one, an
    # idle chat would time its followers out, so its absence is an error at start, not an hour later
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        raise RuntimeError(f"torch {torch.__version__} lacks torch.distributed's _set_pg_timeout")
    for group in (None, place.group):  # all met: from now on, waits while the chat is idle are fine
        set_timeout(PG_TIMEOUT, group)
    return place


def barrier() -> None:
    """A barrier over CPU tensors (the world group is gloo only; see launcher.process_groups)."""
    dist.all_reduce(torch.zeros(1))


def gather_ranks(place: Placement) -> list[RankInfo]:
    """Every rank's pid, device and threads, on every rank."""
    mine = RankReport(os.getpid(), place.threads, -1 if Device.of(place.device) is Device.CPU else place.device.index,
                      socket.gethostname())
    ranks = []
    for r, report in enumerate(RankReport.gather(mine)):
        role = "target" if r < place.n_target else "draft"
        lead = 0 if role == "target" else place.n_target
        tp_world = place.n_target if role == "target" else place.world - place.n_target
        device = "cpu" if report.cuda_index < 0 else f"cuda:{report.cuda_index}"
        ranks.append(RankInfo(rank=r, role=role, device=device, tp_rank=r - lead, tp_world=tp_world,
                              torch_threads=report.threads, host=report.host, pid=report.pid))
    return ranks


def load(place: Placement, dtype: Dtype) -> Loaded:
    """Target ranks load their shard of the target at ``dtype`` (profiling.target_dtype); draft ranks build
    the drafter and its tree state."""
    spec, config = place.spec, place.spec.config
    target_dir = Path(spec.target_dir)
    slots = config.max_seq_len + config.tree.bs + 1  # the prefix plus one tree being verified
    eos = eos_token_ids(target_dir, config.trust_remote_code)
    # Every rank masks or prunes by an answer's grammar itself, the same way: TP peers stay in step.
    vocab = Vocabulary(target_dir / "tokenizer.json", tuple(sorted(eos)), read_args(target_dir).vocab_size)

    def model_for(path: Path, n_slots: int, group, int8: bool = False, batch_invariant: bool | None = False):
        """Our model on this rank's device; on CUDA wrapped in CUDA graphs (one more slot: the graphs'
        scratch slot, hidden from the caller). Drafts skip the batch-invariant mode on CUDA (their rounding
        only changes what is proposed, never what is output); on the CPU the invariant kernels are also
        the fast ones, and a draft runs them too."""
        cuda = Device.of(place.device) is Device.CUDA
        model = load_model(path, place.device, dtype, max_slots=n_slots + cuda, tp_group=group,
                           tp_rank=place.tp_rank, tp_world=place.tp_world, int8=int8, batch_invariant=batch_invariant,
                           activations=config.activations, kv_cache=config.kv_cache)
        return GraphedModel(model) if cuda else model

    if place.role == "target":
        model = model_for(target_dir, slots, place.target_group, batch_invariant=config.batch_invariant.forced)
        return next_phase(Loaded, place, dtype=dtype, target=TargetState(model, slots, vocab), draft=None,
                          eos=frozenset(eos))
    drafter = make_drafter(spec.draft_spec, target_dir, config.trust_remote_code, config.draft_history,
                           lambda path, int8: model_for(path, slots + DRAFT_TREE_SLOTS, place.draft_group, int8,
                                                        None if Device.of(place.device) is Device.CPU else False),
                           place.device, default_dtype(place.device, dtype), slots + DRAFT_TREE_SLOTS,
                           Path(spec.corpus) if spec.corpus else None, spec.vocab_size,
                           Path(config.history_db) if config.drafts_from_store else None)
    if Device.of(place.device) is Device.CPU and (spec.draft_spec.own_model or spec.draft_spec.kind is DraftKind.HEAD):
        if kernels_available() is None:  # a draft model or head runs the kernels too, on its share of the cores
            set_kernel_threads(place.threads)
    if drafter.wants_features and place.tp_world > 1:
        raise ConfigError("a draft that reads the target's hidden states runs on one draft rank only")
    return next_phase(Loaded, place, dtype=dtype, target=None, draft=DraftState(drafter, config.tree, vocab=vocab),
                      eos=frozenset(eos))


def agree_on_features(loaded: Loaded) -> bool:
    """Whether the drafter reads the target's hidden states (Tuned.features), on every rank: only the
    draft ranks hold the drafter that knows."""
    return any_rank(loaded.role == "draft" and loaded.draft.drafter.wants_features)


def target_precision(loaded: Loaded) -> str:
    """What the title bar says the target runs at: the CPU backend's label ("gguf (Q4_1 blocks) · int16
    activations · AVX2"), else the dtype, and for a converted GGUF the type its blocks came in."""
    model = getattr(loaded.target.model, "model", loaded.target.model)  # through a CUDA-graphs wrapper
    if model.precision:
        return model.precision
    return precision_label(Path(loaded.spec.target_dir), resolved_dtype(Device.of(loaded.device) is Device.CUDA, loaded.dtype))
