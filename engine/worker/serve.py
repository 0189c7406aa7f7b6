"""What every rank does once set up: wait for the leader's next request, run its part of the answer
(engine/spec/loop.py's loops on the group leaders, the follower loops below on TP followers), repeat."""

from __future__ import annotations

import gc
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from swiftspec.engine.config import BatchInvariance, Dtype, SamplingParams
from swiftspec.engine.host import protocol
from swiftspec.engine.host.frames import Failure, Hello, Ready
from swiftspec.engine.host.launcher import ENV_STORE
from swiftspec.engine.host.protocol import EngineInfo, RankInfo
from swiftspec.engine.host.worker_spec import WorkerSpec
from swiftspec.engine.model.model_dir import load_tokenizer
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.loop import Finisher, Request, lead_draft, lead_target
from swiftspec.engine.spec.messages import Follow, FollowerStep, WireError
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.worker.collectives import Command, RequestHeader, broadcast_values
from swiftspec.engine.worker.leader_io import ScriptIO, SocketIO
from swiftspec.engine.worker.profiling import choose_cpu_backend, choose_d, choose_kernel_threads, profile
from swiftspec.engine.worker.setup import (
    INIT_TIMEOUT,
    Ctx,
    HandRun,
    agree_on_features,
    barrier,
    gather_ranks,
    load,
    parse_args,
    setup,
    target_precision,
    use_kernel_threads,
)
from swiftspec.engine.worker.wire import LEADERS_SOCKET, DistLink, SocketLink, connect_leaders


def follow_target(target: TargetState, req: Request, next_step: Callable[[], FollowerStep]) -> None:
    """A target TP follower's part of one answer: the leader's model calls, mirrored step by step."""
    sampler = Sampler(req.params, target.device, target.vocab)
    target.prefill(req.prompt, sampler)
    while True:
        match next_step():
            case FollowerStep(Follow.END):
                return
            case FollowerStep(Follow.DECODE, [token]):
                target.decode_step(token, sampler)
            case FollowerStep(Follow.VERIFY, tokens, parents) if tokens:
                target.verify(tokens, parents, sampler)
            case step:
                raise WireError(f"a target follower cannot take {step}")


def follow_draft(ds: DraftState, req: Request, next_step: Callable[[], FollowerStep]) -> None:
    """A draft TP follower's part of one answer (the leader's subtree choice needs no model call)."""
    ds.prefill(req.prompt, grammar=req.params.grammar, draft_forced=req.params.draft_forced)
    while True:
        match next_step():
            case FollowerStep(Follow.END):
                return
            case FollowerStep(Follow.EXPAND):
                ds.expand()
            case FollowerStep(Follow.START, [root]):
                ds.start(root)
            case FollowerStep(Follow.REROOT, path) if path:
                ds.reroot(path)
            case step:
                raise WireError(f"a draft follower cannot take {step}")


def _request(ctx: Ctx, io) -> Request | None:
    """The leader's next request, on every rank (None: shut down)."""
    req, header, blob = None, None, None
    if ctx.rank == 0:
        req = io.next_request()
        header = RequestHeader(Command.SHUTDOWN)
        if req is not None:
            if req.params.seed is None:  # TP peers must draw the same random numbers
                req.params.seed = secrets.randbits(31)
            blob = list(json.dumps(req.params.to_dict()).encode())
            header = RequestHeader(Command.GENERATE, len(req.prompt), len(blob))
    header = RequestHeader.broadcast(header)
    if header.command == Command.SHUTDOWN:
        return None
    prompt = broadcast_values(req.prompt if req is not None else None, header.prompt_len, torch.int64)
    params = broadcast_values(blob, header.params_len, torch.uint8)
    if ctx.rank != 0:
        req = Request(-1, prompt, SamplingParams.from_dict(json.loads(bytes(params))))
    return req


def leader_link(ctx: Ctx, ranks: list[RankInfo]) -> SocketLink | DistLink | None:
    """The leaders' Link (None on other ranks and without a draft group): a socket where both leaders
    share a host (a Unix socket in the Engine's run directory where the workers meet through its
    FileStore), gloo otherwise."""
    draft_leader = ctx.n_target
    if ctx.world == ctx.n_target or ctx.rank not in (0, draft_leader):
        return None
    peer = draft_leader if ctx.rank == 0 else 0
    if ranks[0].host == ranks[draft_leader].host:
        store = os.environ.get(ENV_STORE)
        path = str(Path(store).parent / LEADERS_SOCKET) if store else None
        return connect_leaders(ctx.wire, ctx.rank, peer, INIT_TIMEOUT, path)
    return DistLink(ctx.wire, peer)


def serve(ctx: Ctx, io, link: SocketLink | DistLink | None) -> None:
    draft_leader = ctx.n_target
    while (req := _request(ctx, io)) is not None:
        use_kernel_threads(ctx, req.params.mode)
        if ctx.rank == 0:
            fin = Finisher(req, ctx.spec.config.max_seq_len, ctx.eos, lambda rid=req.id: io.cancelled(rid))
            lead_target(ctx.target, link, req, fin, lambda step, rid=req.id: io.step(rid, step), ctx.tell,
                        ctx.features and req.params.mode != "ar", hold_steps=ctx.device.type == "cpu")
        elif ctx.role == "target":
            follow_target(ctx.target, req, ctx.next_step)
        elif req.params.mode == "ar":
            continue
        elif ctx.rank == draft_leader:
            lead_draft(ctx.draft, link, req, ctx.d, ctx.tell)
        else:
            follow_draft(ctx.draft, req, ctx.next_step)


def _io(ctx: Ctx, hand: HandRun | None) -> SocketIO | ScriptIO | None:
    if ctx.rank != 0:
        return None
    if hand is not None:
        tok = load_tokenizer(Path(ctx.spec.target_dir), ctx.spec.config.trust_remote_code)
        ids = tok.apply_chat_template([{"role": "user", "content": hand.prompt}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        return ScriptIO(tok, list(ids), hand.requests)
    addr, key = os.environ.get(protocol.ENV_ADDR), os.environ.get(protocol.ENV_KEY)
    if not addr or not key:
        raise SystemExit(f"{protocol.ENV_ADDR} / {protocol.ENV_KEY} are not set: start the workers "
                         "through swiftspec's Engine, or pass --prompt")
    conn = protocol.connect(addr, key, retry_until=time.monotonic() + ctx.spec.config.startup_timeout_s)
    return SocketIO(conn, speculative=ctx.world > ctx.n_target)


def _draft_name(spec: WorkerSpec) -> str:
    corpus = f" + corpus {Path(spec.corpus).stem}" if spec.corpus else ""
    return spec.draft_spec.name + corpus


def main(argv: list[str] | None = None) -> int:
    spec, hand = parse_args(argv)
    ctx = setup(spec)
    io = _io(ctx, hand)
    say = io.progress if io is not None else lambda _text: None
    try:
        ranks = gather_ranks(ctx)
        if io is not None:
            io.send(Hello([[r.rank, r.pid] for r in ranks]))
            draft = spec.draft_spec.description + (
                f" with the corpus {Path(spec.corpus).stem}" if spec.corpus else "")
            say(f"loading target {spec.name} on {ctx.n_target} rank(s)"
                + (f" and {draft} on {ctx.world - ctx.n_target} rank(s)" if spec.draft_spec.speculative else ", no draft"))
        config = spec.config
        if ctx.role == "target" and ctx.device.type == "cpu" and config.dtype is Dtype.AUTO and config.batch_invariant != BatchInvariance.OFF:
            ctx.dtype = choose_cpu_backend(ctx, say)
        load(ctx)
        gc.freeze()  # the loaded models' objects leave the collector's sight: no collection walks them mid-step
        agree_on_features(ctx)  # a collective over every rank: all have loaded
        choose_kernel_threads(ctx, ranks, say)  # first: the verifications are timed on sync's threads
        t_verify, t_expand = profile(ctx, ranks, say)
        ctx.d = 0 if not spec.draft_spec.speculative else config.tree.d or choose_d(t_verify, t_expand)
        link = leader_link(ctx, ranks)
        if io is not None:
            info = EngineInfo(
                target=f"{spec.name} · {target_precision(ctx)}", draft=_draft_name(spec), ranks=ranks,
                context_length=config.max_seq_len, backend=ctx.backend, bs=config.tree.bs, w=config.tree.w,
                d=ctx.d, d_auto=config.tree.d is None, t_verify_ms=t_verify, t_expand_ms=t_expand,
                eos_token_ids=sorted(ctx.eos), kernel_threads=ctx.kernel_threads)
            io.send(Ready(info))
        serve(ctx, io, link)
    except BaseException as e:
        if isinstance(io, SocketIO):
            io.send(Failure(f"{type(e).__name__}: {e}"))
            io.flush()
        raise
    if io is not None:
        io.flush()
    barrier()
    dist.destroy_process_group()
    return 0
