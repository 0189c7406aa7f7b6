"""The torchrun entry point: ``python -m swiftspec.engine.worker``, one process per rank.

Ranks 0..x-1 are the target group (tensor parallel over x), ranks x..world-1 the draft group. Target rank
0 is the leader: it talks to the Engine over the authenticated socket, decides when an answer stops, and
starts every request on every rank. Inside each group the group leader tells its TP followers which step
comes next, so all ranks of a group make the same calls in the same order. Between the groups only two
small int64 messages travel, leader to leader: the subtree to verify (token ids, parent indices) one way,
the verdict (accepted tokens + bonus) the other.

In ``async`` mode the draft expands its tree d times while the target verifies (the verdict lands in a
posted irecv meanwhile); in ``sync`` mode it expands d times, sends, and waits; ``ar`` runs the target
group alone.
"""

from __future__ import annotations

from swiftspec.engine.lifeline import die_with_launcher

if __name__ == "__main__":  # first thing: importing torch takes seconds (see lifeline)
    die_with_launcher()

import argparse
import json
import math
import os
import queue
import secrets
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from swiftspec.config import (
    BUILTIN_DRAFTS,
    MODES,
    ConfigError,
    SamplingParams,
    StepEvent,
    StepStats,
    TreeParams,
)
from swiftspec.engine import launcher, protocol
from swiftspec.engine.protocol import EngineInfo, RankInfo

PG_TIMEOUT = timedelta(days=3650)  # followers wait in a broadcast while the chat is idle
INIT_TIMEOUT = timedelta(seconds=120)  # for every rank to reach init_process_group and new_group
D_MAX = 16
DRAFT_TREE_SLOTS = 512  # draft KV slots for the token tree beyond the verified prefix

# Request header, broadcast by the leader to every rank: int64[4] = cmd, mode, prompt length, params length.
CMD_SHUTDOWN, CMD_GENERATE = 0, 1

# Messages between the group leaders and from a group leader to its followers, int64[4 + 2 bs]:
# kind, n, a, b, tokens[bs], parents[bs].
START, CONT, STOP, SUBTREE = 1, 2, 3, 4  # target -> draft: START / CONT / STOP; draft -> target: SUBTREE
OP_END, OP_VERIFY, OP_DECODE, OP_START, OP_EXPAND, OP_REROOT, OP_SUBTREE = 10, 11, 12, 13, 14, 15, 16


class Wire:
    """Packs and unpacks the fixed-size int64 messages (gloo needs the size known to the receiver)."""

    def __init__(self, bs: int):
        self.bs = bs
        self.size = 4 + 2 * bs

    def pack(self, kind: int, tokens=(), parents=(), a: int = 0, b: int = 0) -> torch.Tensor:
        pad = self.bs - len(tokens)
        vals = [kind, len(tokens), a, b, *tokens, *[0] * pad, *parents, *[0] * (self.bs - len(parents))]
        return torch.tensor(vals, dtype=torch.int64)

    def buffer(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.int64)

    def unpack(self, t: torch.Tensor) -> tuple[int, list[int], list[int], int, int]:
        v = t.tolist()
        n = v[1]
        return v[0], v[4:4 + n], v[4 + self.bs:4 + self.bs + n], v[2], v[3]


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams


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
    target: object = None  # TargetState on target ranks
    draft: object = None  # DraftState on draft ranks
    tokenizer: object = None  # leader only
    eos: set[int] = field(default_factory=set)
    d: int = 1
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

    def tell_followers(self, msg: torch.Tensor) -> None:
        if self.tp_world > 1:
            dist.broadcast(msg, src=self.group_leader, group=self.group)


# ---------------------------------------------------------------------------------------------- set-up

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m swiftspec.engine.worker",
                                description="SwiftSpec worker (started by torchrun; one process per rank)")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face layout)")
    p.add_argument("--draft", default="suffix", help="draft model directory, 'suffix' or 'int8'")
    p.add_argument("--no-draft-history", dest="draft_history", action="store_false",
                   help="the suffix drafter forgets earlier conversations (fair benchmarks)")
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
    """Divides this node's cores between its local ranks. The suffix drafter is light Python, so with it
    the draft rank takes one thread and the target ranks share all the cores."""
    total = args.threads or len(os.sched_getaffinity(0))
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    local = range(rank - local_rank, rank - local_rank + local_world)
    is_target = rank < n_target
    if args.draft != "suffix":
        return max(1, total // local_world)
    if not is_target:
        return 1
    return max(1, total // max(1, sum(r < n_target for r in local)))


def setup(args: argparse.Namespace) -> Ctx:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n_target = args.target_procs
    if not 1 <= n_target < world:
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
    ctx.draft_group = dist.new_group(list(groups["draft"].ranks), timeout=INIT_TIMEOUT,
                                     backend=groups["draft"].backend)
    for group in (None, ctx.group):  # all met: from now on, waits while the chat is idle are fine
        dist.distributed_c10d._set_pg_timeout(PG_TIMEOUT, group)
    return ctx


def _barrier() -> None:
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
    from swiftspec.engine.cuda_graphs import GraphedModel
    from swiftspec.engine.decode import DraftState, TargetState
    from swiftspec.engine.draft_head import HeadDrafter, is_head_dir, load_head
    from swiftspec.engine.drafters import ModelDrafter, SuffixDrafter, check_vocab_compatible
    from swiftspec.engine.loader import eos_token_ids, load_model, load_tokenizer

    args = ctx.args
    target_dir = Path(args.target)
    slots = args.max_seq_len + args.bs + 1  # the prefix plus one tree being verified

    def model_for(path: Path, n_slots: int, group, int8: bool = False, batch_invariant: bool | None = False):
        """Our model on this rank's device; on CUDA wrapped in CUDA graphs (one more slot: the graphs'
        scratch slot, hidden from the caller). Drafts skip the batch-invariant mode: their rounding only
        changes what is proposed, never what is output."""
        cuda = ctx.device.type == "cuda"
        model = load_model(path, ctx.device, args.dtype, max_slots=n_slots + cuda, tp_group=group,
                           tp_rank=ctx.tp_rank, tp_world=ctx.tp_world, int8=int8, batch_invariant=batch_invariant)
        return GraphedModel(model) if cuda else model

    if ctx.role == "target":
        invariant = {"auto": None, "on": True, "off": False}[args.batch_invariant]
        model = model_for(target_dir, slots, ctx.target_group, batch_invariant=invariant)
        ctx.target = TargetState(model, slots)
        if ctx.rank == 0:
            ctx.tokenizer = load_tokenizer(target_dir, args.trust_remote_code)
            ctx.eos = set(eos_token_ids(target_dir, ctx.tokenizer))
    else:
        if args.draft == "suffix":
            drafter = SuffixDrafter(history_tokens=SuffixDrafter.HISTORY_TOKENS if args.draft_history else 0)
        elif args.draft == "int8":
            drafter = ModelDrafter(model_for(target_dir, slots + DRAFT_TREE_SLOTS, ctx.draft_group, int8=True))
        elif is_head_dir(Path(args.draft)):
            if ctx.tp_world > 1:
                raise ConfigError("a draft head runs on one draft rank (draft TP is for draft models)")
            # the head reads the target's embedding and lm_head: this rank loads the target once for them
            target = load_model(target_dir, ctx.device, args.dtype, max_slots=1, batch_invariant=False)
            head = load_head(Path(args.draft), target.args, ctx.device, target.tok_embeddings.weight.dtype)
            head.attach_target(target.tok_embeddings.weight, target.output.weight)
            drafter = HeadDrafter(head, slots + DRAFT_TREE_SLOTS)
        else:
            draft_dir = Path(args.draft)
            vocab = check_vocab_compatible(load_tokenizer(target_dir, args.trust_remote_code),
                                           load_tokenizer(draft_dir, args.trust_remote_code))
            drafter = ModelDrafter(model_for(draft_dir, slots + DRAFT_TREE_SLOTS, ctx.draft_group), vocab)
        ctx.draft = DraftState(drafter, TreeParams(args.bs, args.w, args.d))


def profile(ctx: Ctx) -> tuple[float, float]:
    """Times a target verification of bs nodes and a draft expansion (median of 3, after a warm-up);
    returns the slowest rank's figures, the same on every rank."""
    from swiftspec.engine.sampling import Sampler

    bs = ctx.args.bs
    dummy = list(range(1, 9)) * 4  # repetitive, so that the suffix drafter has something to propose
    t_verify = t_expand = 0.0
    if ctx.role == "target":
        sampler = Sampler(SamplingParams(), ctx.device)
        root = ctx.target.prefill(dummy, sampler)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            v = ctx.target.verify([root, *dummy[:bs - 1]], list(range(-1, bs - 1)), sampler)
            times.append(time.perf_counter() - t0)
            root = v.path[-1]
        t_verify = sorted(times[1:])[1] * 1e3
    else:
        ctx.draft.prefill(dummy)
        ctx.draft.start(dummy[-1])
        times = [ctx.draft.expand() for _ in range(4) if ctx.draft.can_expand()]
        t_expand = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else (times or [0.0])[0]
    mine = torch.tensor([t_verify, t_expand], dtype=torch.float64)
    allr = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(allr, mine)
    return max(float(t[0]) for t in allr), max(float(t[1]) for t in allr)


def choose_d(t_verify_ms: float, t_expand_ms: float) -> int:
    """d ~ the number of draft expansions that fit in one target verification."""
    return max(1, min(D_MAX, math.floor(t_verify_ms / max(t_expand_ms, 1e-3))))


# ------------------------------------------------------------------------------------- the leader's IO

class SocketIO:
    """The leader's side of the Engine socket. A reader thread queues incoming messages, so the decode
    loop only ever does a non-blocking check for a cancel between steps."""

    def __init__(self, conn: protocol.Connection):
        self.conn = conn
        self.inbox: queue.Queue[dict] = queue.Queue()
        self.pending: deque[dict] = deque()
        self.cancel_ids: set[int] = set()
        self.shutdown = False
        threading.Thread(target=self._read, daemon=True, name="engine-socket").start()

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put(self.conn.recv())
        except (OSError, protocol.ProtocolError):  # the Engine went away: finish and exit
            self.inbox.put({"type": "shutdown"})

    def _note(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "generate":
            self.pending.append(msg)
        elif kind == "cancel" and isinstance(msg.get("id"), int):
            self.cancel_ids.add(msg["id"])
        elif kind == "shutdown":
            self.shutdown = True

    def next_request(self) -> Request | None:
        while True:
            while not self.pending and not self.shutdown:
                self._note(self.inbox.get())
            if self.shutdown:
                return None
            msg = self.pending.popleft()
            rid = msg.get("id")
            try:
                if not isinstance(rid, int):
                    raise ConfigError("request without an integer id")
                ids = msg.get("token_ids")
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                    raise ConfigError("token_ids must be a non-empty list of integers")
                params = SamplingParams.from_dict(msg.get("params") or {})
            except (ConfigError, TypeError) as e:
                self.conn.send("error", id=rid, message=f"invalid request: {e}", fatal=False)
                continue
            if rid in self.cancel_ids:
                self.cancel_ids.discard(rid)
                self.event(rid, StepEvent([], "", StepStats(), True, "cancelled"))
                continue
            return Request(rid, ids, params)

    def cancelled(self, rid: int) -> bool:
        while True:
            try:
                self._note(self.inbox.get_nowait())
            except queue.Empty:
                break
        return self.shutdown or rid in self.cancel_ids

    def event(self, rid: int, ev: StepEvent) -> None:
        if ev.finished:
            self.cancel_ids.discard(rid)
        try:
            self.conn.send("event", id=rid, event=ev.to_dict())
        except OSError:
            self.shutdown = True

    def progress(self, text: str) -> None:
        self.conn.send("progress", text=text)

    def send(self, type_: str, **fields) -> None:
        self.conn.send(type_, **fields)


class ScriptIO:
    """``--prompt`` without an Engine: one request per mode; prints each answer and compares them."""

    def __init__(self, prompt_ids: list[int], modes: list[str], max_new_tokens: int):
        self.todo = deque(Request(i, prompt_ids, SamplingParams(mode=m, max_new_tokens=max_new_tokens))
                          for i, m in enumerate(modes))
        self.results: list[tuple[str, list[int], str, StepStats]] = []
        self.tokens: list[int] = []
        self.text = ""
        self.mode = ""

    def next_request(self) -> Request | None:
        if not self.todo:
            return None
        req = self.todo.popleft()
        self.mode, self.tokens, self.text = req.params.mode, [], ""
        return req

    def cancelled(self, rid: int) -> bool:
        return False

    def event(self, rid: int, ev: StepEvent) -> None:
        self.tokens += ev.token_ids
        self.text += ev.text
        if ev.finished:
            self.results.append((self.mode, self.tokens, self.text, ev.stats))
            s = ev.stats
            print(f"[{self.mode}] {len(self.tokens)} tokens, {s.tokens_per_s:.1f} tok/s, "
                  f"mean accepted {s.mean_accepted:.2f}, d={s.d}, finish={ev.finish_reason}\n{self.text}\n",
                  flush=True)

    def progress(self, text: str) -> None:
        print(f"-- {text}", flush=True)

    def send(self, type_: str, **fields) -> None:
        if type_ == "ready":
            info = fields["info"]
            print(f"-- ready: d={info['d']} (t_verify {info['t_verify_ms']:.1f} ms, "
                  f"t_expand {info['t_expand_ms']:.2f} ms)", flush=True)
            for r in info["ranks"]:
                print(f"   rank {r['rank']}: {r['role']} tp {r['tp_rank']}/{r['tp_world']} on "
                      f"{r['host']} {r['device']} ({r['threads']} threads)", flush=True)


# ------------------------------------------------------------------------------------ one answer's output

class StopMatcher:
    """Finds stop strings across streamed deltas, holding back text that could still begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        buf = self.held + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Output:
    """The leader's view of one answer: where it must stop, its text, and the running stats."""

    def __init__(self, ctx: Ctx, io, req: Request):
        from swiftspec.engine.detok import IncrementalDetokenizer

        self.io, self.rid = io, req.id
        self.detok = IncrementalDetokenizer(ctx.tokenizer)
        self.stops = StopMatcher(req.params.stop)
        self.eos = set() if req.params.ignore_eos else ctx.eos
        self.budget = min(req.params.max_new_tokens, ctx.args.max_seq_len - len(req.prompt))
        self.cut_reason = "context" if self.budget < req.params.max_new_tokens else "length"
        self.d = 0 if req.params.mode == "ar" else ctx.d
        self.generated = self.verifies = self.accepted = self.verified = self.prefill_tokens = 0
        self.t_first = self.t_last = time.perf_counter()

    def cut(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Trims a step's tokens after EOS (kept, as the in-process loops do) and at the token budget;
        notices a cancel."""
        reason = None
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens, reason = tokens[:i + 1], "eos"
                break
        room = self.budget - self.generated
        if len(tokens) >= room:
            tokens = tokens[:room]
            reason = "eos" if tokens and tokens[-1] in self.eos else self.cut_reason
        if reason is None and self.io.cancelled(self.rid):
            reason = "cancelled"
        return tokens, reason

    def emit(self, tokens: list[int], reason: str | None, accepted: int = 0, tree_size: int = 0,
             draft_ms: float = 0.0, target_ms: float = 0.0) -> str | None:
        """Streams one step to the Engine; returns the finish reason (a stop string may add one)."""
        now = time.perf_counter()
        if self.generated == 0:
            self.t_first = now
        self.generated += len(tokens)
        if tree_size:
            self.verifies += 1
            self.accepted += accepted
            self.verified += tree_size - 1
        text, hit = self.stops.push(self.detok.push(tokens) if tokens else "")
        if hit:
            reason = "stop"
        elif reason is not None:
            tail, hit = self.stops.push(self.detok.flush())
            text += tail if hit else tail + self.stops.flush()
            reason = "stop" if hit else reason
        elapsed = now - self.t_first
        stats = StepStats(
            accepted=accepted, tree_size=tree_size, draft_ms=draft_ms, target_ms=target_ms,
            token_latency_ms=(now - self.t_last) * 1e3 / max(1, len(tokens)),
            acceptance_rate=self.accepted / self.verified if self.verified else 0.0,
            mean_accepted=(self.accepted + self.verifies) / self.verifies if self.verifies else 0.0,
            tokens_per_s=(self.generated - 1) / elapsed if elapsed > 0 else 0.0,
            d=self.d, prefill_tokens=self.prefill_tokens, generated=self.generated)
        self.t_last = now
        self.io.event(self.rid, StepEvent(tokens, text, stats, reason is not None, reason))
        return reason


# ------------------------------------------------------------------------------------------ the loops

def lead_target(ctx: Ctx, io, req: Request) -> None:
    from swiftspec.engine.sampling import Sampler

    wire, mode = ctx.wire, req.params.mode
    sampler = Sampler(req.params, ctx.device)
    out = Output(ctx, io, req)
    t0 = time.perf_counter()
    root = ctx.target.prefill(req.prompt, sampler)
    out.prefill_tokens = ctx.target.prefill_tokens
    tokens, reason = out.cut([root])
    prefill_ms = (time.perf_counter() - t0) * 1e3
    if mode == "ar":
        reason = out.emit(tokens, reason, target_ms=prefill_ms)
        token = root
        while reason is None:
            ctx.tell_followers(wire.pack(OP_DECODE, [token]))
            t0 = time.perf_counter()
            token = ctx.target.decode_step(token, sampler)
            ms = (time.perf_counter() - t0) * 1e3
            tokens, reason = out.cut([token])
            reason = out.emit(tokens, reason, target_ms=ms)
    else:
        draft = ctx.n_target
        dist.send(wire.pack(STOP if reason else START, [root]), dst=draft)
        drafting = reason is None  # the draft is busy on a subtree that we must answer
        reason = out.emit(tokens, reason, target_ms=prefill_ms)
        buf = wire.buffer()
        while reason is None:
            dist.recv(buf, src=draft)
            _, toks, parents, n_exp, draft_us = wire.unpack(buf)
            ctx.tell_followers(wire.pack(OP_VERIFY, toks, parents))
            v = ctx.target.verify(toks, parents, sampler)
            tokens, reason = out.cut(v.path)
            dist.send(wire.pack(STOP if reason else CONT, v.path), dst=draft)
            drafting = reason is None
            reason = out.emit(tokens, reason, v.accepted, v.tree_size,
                              draft_us / 1e3 / n_exp if n_exp else 0.0, v.target_ms)
        if drafting:  # a stop string ended the answer after the draft was told to go on
            dist.recv(buf, src=draft)
            dist.send(wire.pack(STOP), dst=draft)
    ctx.tell_followers(wire.pack(OP_END))


def follow_target(ctx: Ctx, req: Request) -> None:
    from swiftspec.engine.sampling import Sampler

    wire = ctx.wire
    sampler = Sampler(req.params, ctx.device)
    ctx.target.prefill(req.prompt, sampler)
    buf = wire.buffer()
    while True:
        dist.broadcast(buf, src=0, group=ctx.target_group)
        op, toks, parents, _, _ = wire.unpack(buf)
        if op == OP_END:
            return
        if op == OP_DECODE:
            ctx.target.decode_step(toks[0], sampler)
        else:
            ctx.target.verify(toks, parents, sampler)


def lead_draft(ctx: Ctx, req: Request) -> None:
    """The draft group leader's loop for one answer. async: send the subtree, expand d times while the
    target verifies it, then take the verdict (d is sized to fill a verification, as in the paper);
    sync: take the verdict, expand d times, send. Either way the tree is topped up to bs nodes."""
    wire, ds, d, bs = ctx.wire, ctx.draft, ctx.d, ctx.args.bs
    tell = ctx.tell_followers
    ds.prefill(req.prompt)
    buf = wire.buffer()
    dist.recv(buf, src=0)
    kind, path, _, _, _ = wire.unpack(buf)
    if kind == STOP:
        tell(wire.pack(OP_END))
        return
    tell(wire.pack(OP_START, path))
    ds.start(path[0])
    asynchronous = req.params.mode == "async"
    n_exp, exp_ms = 0, 0.0
    while True:
        todo = 0 if asynchronous else d
        while (todo > 0 or ds.size < bs) and ds.can_expand():
            tell(wire.pack(OP_EXPAND))
            exp_ms += ds.expand()
            n_exp += 1
            todo -= 1
        tell(wire.pack(OP_SUBTREE))
        toks, parents = ds.subtree()
        dist.send(wire.pack(SUBTREE, toks, parents, n_exp, round(exp_ms * 1e3)), dst=0)
        n_exp, exp_ms = 0, 0.0
        work = dist.irecv(buf, src=0)
        if asynchronous:  # grow the tree for the next round while the target verifies this one
            for _ in range(d):
                if not ds.can_expand():
                    break
                tell(wire.pack(OP_EXPAND))
                exp_ms += ds.expand()
                n_exp += 1
        work.wait()
        kind, path, _, _, _ = wire.unpack(buf)
        if kind == STOP:
            tell(wire.pack(OP_END))
            return
        tell(wire.pack(OP_REROOT, path))
        ds.reroot(path)


def follow_draft(ctx: Ctx, req: Request) -> None:
    wire, ds = ctx.wire, ctx.draft
    ds.prefill(req.prompt)
    buf = wire.buffer()
    while True:
        dist.broadcast(buf, src=ctx.n_target, group=ctx.draft_group)
        op, toks, _, _, _ = wire.unpack(buf)
        if op == OP_END:
            return
        if op == OP_EXPAND:
            ds.expand()
        elif op == OP_START:
            ds.start(toks[0])
        elif op == OP_REROOT:
            ds.reroot(toks)
        else:
            ds.subtree()


def serve(ctx: Ctx, io) -> None:
    """Every rank: wait for the leader's next request header, run its part of the answer, repeat."""
    while True:
        hdr = torch.zeros(4, dtype=torch.int64)
        req = None
        if ctx.rank == 0:
            req = io.next_request()
            if req is not None:
                if req.params.seed is None:  # TP peers must draw the same random numbers
                    req.params.seed = secrets.randbits(31)
                blob = torch.frombuffer(bytearray(json.dumps(req.params.to_dict()).encode()), dtype=torch.uint8)
                hdr = torch.tensor([CMD_GENERATE, MODES.index(req.params.mode), len(req.prompt), len(blob)])
        dist.broadcast(hdr, src=0)
        cmd, mode, n_prompt, n_blob = hdr.tolist()
        if cmd == CMD_SHUTDOWN:
            return
        if ctx.rank == 0:
            prompt = torch.tensor(req.prompt, dtype=torch.int64)
        else:
            prompt, blob = torch.zeros(n_prompt, dtype=torch.int64), torch.zeros(n_blob, dtype=torch.uint8)
        dist.broadcast(prompt, src=0)
        dist.broadcast(blob, src=0)
        if ctx.rank != 0:
            req = Request(-1, prompt.tolist(), SamplingParams.from_dict(json.loads(bytes(blob.tolist()))))
        if ctx.rank == 0:
            lead_target(ctx, io, req)
        elif ctx.role == "target":
            follow_target(ctx, req)
        elif MODES[mode] != "ar":
            (lead_draft if ctx.rank == ctx.n_target else follow_draft)(ctx, req)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = setup(args)
    io = None
    if ctx.rank == 0:
        if args.prompt is None:
            addr, key = os.environ.get(protocol.ENV_ADDR), os.environ.get(protocol.ENV_KEY)
            if not addr or not key:
                raise SystemExit(f"{protocol.ENV_ADDR} / {protocol.ENV_KEY} are not set: start the workers "
                                 "through swiftspec's Engine, or pass --prompt")
            io = SocketIO(protocol.connect(addr, key))
        else:
            from swiftspec.engine.client import encode_chat
            from swiftspec.engine.loader import load_tokenizer

            tok = load_tokenizer(Path(args.target), args.trust_remote_code)
            prompt_ids = encode_chat(tok, [{"role": "user", "content": args.prompt}])
            io = ScriptIO(prompt_ids, args.modes.split(","), args.max_new_tokens)
    try:
        ranks = gather_ranks(ctx)
        if io is not None:
            io.send("hello", pids=[[r.rank, r.pid] for r in ranks])
            draft = BUILTIN_DRAFTS.get(args.draft) or f"draft {Path(args.draft).name}"
            io.progress(f"loading target {args.target_name or Path(args.target).name} on {ctx.n_target} "
                        f"rank(s) and {draft} on {ctx.world - ctx.n_target} rank(s)")
        load(ctx)
        _barrier()
        if io is not None:
            io.progress("profiling the draft expansion and target verification times")
        t_verify, t_expand = profile(ctx)
        ctx.d = args.d or choose_d(t_verify, t_expand)
        if io is not None:
            info = EngineInfo(
                target=args.target_name or Path(args.target).name,
                draft=args.draft if args.draft in BUILTIN_DRAFTS else Path(args.draft).name,
                ranks=ranks, context_length=args.max_seq_len, backend=ctx.backend, bs=args.bs, w=args.w,
                d=ctx.d, d_auto=args.d is None, t_verify_ms=t_verify, t_expand_ms=t_expand,
                eos_token_ids=sorted(ctx.eos))
            io.send("ready", info=info.to_dict())
        serve(ctx, io)
    except BaseException as e:
        if isinstance(io, SocketIO):
            try:
                io.send("error", id=None, message=f"{type(e).__name__}: {e}", fatal=True)
            except OSError:
                pass
        raise
    if isinstance(io, ScriptIO):
        first = io.results[0]
        for mode, toks, _, _ in io.results[1:]:
            print(f"{mode} == {first[0]}: {toks == first[1]}", flush=True)
    _barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
