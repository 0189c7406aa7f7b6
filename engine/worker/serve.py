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

from swiftspec.engine.config import Device, SamplingParams
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
from swiftspec.engine.worker.profiling import profile, target_dtype, tune
from swiftspec.engine.worker.setup import (
    INIT_TIMEOUT,
    HandRun,
    Placement,
    Profiled,
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
            case FollowerStep(Follow.ADVANCE, path) if path:
                ds.advance(path)
            case step:
                raise WireError(f"a draft follower cannot take {step}")


def _request(place: Placement, io) -> Request | None:
    """The leader's next request, on every rank (None: shut down)."""
    req, header, blob = None, None, None
    if place.rank == 0:
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
    if place.rank != 0:
        req = Request(-1, prompt, SamplingParams.from_dict(json.loads(bytes(params))))
    return req


def leader_link(place: Placement, ranks: list[RankInfo]) -> SocketLink | DistLink | None:
    """The leaders' Link (None on other ranks and without a draft group): a socket where both leaders
    share a host (a Unix socket in the Engine's run directory where the workers meet through its
    FileStore), gloo otherwise."""
    draft_leader = place.n_target
    if place.world == place.n_target or place.rank not in (0, draft_leader):
        return None
    peer = draft_leader if place.rank == 0 else 0
    if ranks[0].host == ranks[draft_leader].host:
        store = os.environ.get(ENV_STORE)
        path = str(Path(store).parent / LEADERS_SOCKET) if store else None
        return connect_leaders(place.wire, place.rank, peer, INIT_TIMEOUT, path)
    return DistLink(place.wire, peer)


def serve(profiled: Profiled, io, link: SocketLink | DistLink | None) -> None:
    """Runs this rank's part of each request until the leader says to shut down."""
    draft_leader = profiled.n_target
    while (req := _request(profiled, io)) is not None:
        use_kernel_threads(profiled, req.params.mode)
        if profiled.rank == 0:
            fin = Finisher(req, profiled.spec.config.max_seq_len, profiled.eos, lambda rid=req.id: io.cancelled(rid))
            lead_target(profiled.target, link, req, fin, lambda step, rid=req.id: io.step(rid, step),
                        profiled.tell, profiled.features and req.params.mode != "ar",
                        hold_steps=Device.of(profiled.device) is Device.CPU)
        elif profiled.role == "target":
            follow_target(profiled.target, req, profiled.next_step)
        elif req.params.mode == "ar":
            continue
        elif profiled.rank == draft_leader:
            lead_draft(profiled.draft, link, req, profiled.d, profiled.tell)
        else:
            follow_draft(profiled.draft, req, profiled.next_step)


def _io(place: Placement, hand: HandRun | None) -> SocketIO | ScriptIO | None:
    if place.rank != 0:
        return None
    if hand is not None:
        tok = load_tokenizer(Path(place.spec.target_dir), place.spec.config.trust_remote_code)
        ids = tok.apply_chat_template([{"role": "user", "content": hand.prompt}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        return ScriptIO(tok, list(ids), hand.requests)
    addr, key = os.environ.get(protocol.ENV_ADDR), os.environ.get(protocol.ENV_KEY)
    if not addr or not key:
        raise SystemExit(f"{protocol.ENV_ADDR} / {protocol.ENV_KEY} are not set: start the workers "
                         "through swiftspec's Engine, or pass --prompt")
    conn = protocol.connect(addr, key, retry_until=time.monotonic() + place.spec.config.startup_timeout_s)
    return SocketIO(conn, speculative=place.world > place.n_target)


def _draft_name(spec: WorkerSpec) -> str:
    corpus = f" + corpus {Path(spec.corpus).stem}" if spec.corpus else ""
    return spec.draft_spec.name + corpus


def main(argv: list[str] | None = None) -> int:
    spec, hand = parse_args(argv)
    place = setup(spec)
    io = _io(place, hand)
    say = io.progress if io is not None else lambda _text: None
    try:
        ranks = gather_ranks(place)
        if io is not None:
            io.send(Hello([[r.rank, r.pid] for r in ranks]))
            draft = spec.draft_spec.description + (
                f" with the corpus {Path(spec.corpus).stem}" if spec.corpus else "")
            say(f"loading target {spec.name} on {place.n_target} rank(s)"
                + (f" and {draft} on {place.world - place.n_target} rank(s)" if spec.draft_spec.speculative else ", no draft"))
        loaded = load(place, target_dtype(place, say))
        gc.freeze()  # the loaded models' objects leave the collector's sight: no collection walks them mid-step
        tuned = tune(loaded, ranks, say)  # first: the verifications are timed on its kernel threads
        profiled = profile(tuned, ranks, say)
        link = leader_link(profiled, ranks)
        if io is not None:
            config = spec.config
            info = EngineInfo(
                target=f"{spec.name} · {target_precision(profiled)}", draft=_draft_name(spec), ranks=ranks,
                context_length=config.max_seq_len, backend=profiled.backend, bs=config.tree.bs, w=config.tree.w,
                d=profiled.d, d_auto=config.tree.d is None, t_verify_ms=profiled.t_verify_ms,
                t_expand_ms=profiled.t_expand_ms, eos_token_ids=sorted(profiled.eos),
                kernel_threads=profiled.kernel_threads, verify_cost=list(profiled.verify_cost))
            io.send(Ready(info))
        serve(profiled, io, link)
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
