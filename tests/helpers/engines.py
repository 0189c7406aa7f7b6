"""Set-up shared by the tests that start worker groups or talk the Engine's protocol: the tiny target's
engines, the reference decoding every mode must reproduce, and stand-ins for a worker's process and
socket."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import torch
from tiny_models import tiny_model_dir

from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.host import launcher, protocol
from swiftspec.engine.host.client import Engine
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.host.failures import WorkerOutput

PROMPTS = [
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise speculative decoding."}],
]

N_TOKENS = 48

PENALISED = SamplingParams(repeat_penalty=1.5, repeat_last_n=24, frequency_penalty=0.5)


def reference(model_dir, messages, n: int, params: SamplingParams = SamplingParams()) -> list[int]:
    """Greedy target-only decoding in this process (penalised as ``params`` says), one token per forward
    and no loop code of the engine's: what every mode must reproduce."""
    from swiftspec.engine.model.loader import load_model
    from swiftspec.engine.model.model_dir import load_tokenizer
    from swiftspec.engine.spec.decode import TargetState
    from swiftspec.engine.spec.sampling import Sampler

    ids = encode_chat(load_tokenizer(model_dir), messages)
    target = TargetState(load_model(model_dir, max_slots=len(ids) + n + 16), len(ids) + n + 16)
    sampler = Sampler(params)
    tokens = [target.prefill(ids, sampler)]
    while len(tokens) < n:
        tokens.append(target.decode_step(tokens[-1], sampler))
    return tokens


def answer(engine: Engine, messages, **kw) -> tuple[list[int], str, list]:
    events = list(engine.generate(messages, SamplingParams(**kw)))
    assert events[-1].finished and all(not e.finished for e in events[:-1])
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events


def no_processes_left(engine: Engine, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while launcher.alive_groups(engine.pgids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not launcher.alive_groups(engine.pgids)


def echo_head_dir(target_dir) -> Path:
    """A draft head for the tiny target that outputs its input feature (fc passes the feature through, the
    layer is zero): it proposes the target's own prediction from the position before the root, which only
    the target's features, sent over the workers' 16-bit wire, can give it."""
    from swiftspec.engine.model.model_dir import read_args
    from swiftspec.engine.spec.draft_head import DraftHead, HeadArgs, save_head

    out = Path(target_dir) / "echo-head"
    if not out.is_dir():
        args = HeadArgs.for_target(read_args(Path(target_dir)))
        args.final_norm = False
        head = DraftHead(args)
        with torch.no_grad():
            for p in head.parameters():
                p.zero_()
            head.fc.weight[:, args.dim:] = torch.eye(args.dim)
        save_head(head, out)
    return out


def start(target_dir, draft: str = "suffix", target_procs: int = 1, **kw) -> Engine:
    """An engine on the tiny target; draft "self" is the target itself, "other" a different tiny model,
    "head" the echo draft head."""
    draft = {"self": str(target_dir), "other": str(tiny_model_dir(seed=1, layers=1)),
             "head": str(echo_head_dir(target_dir))}.get(draft, draft)
    progress = kw.pop("progress", None)
    return Engine.start(EngineConfig(target=str(target_dir), draft=draft, target_procs=target_procs,
                                     max_seq_len=kw.pop("max_seq_len", 512), **kw), progress)


def socket_pair() -> tuple[protocol.Connection, protocol.Connection]:
    a, b = socket.socketpair()
    return protocol.Connection(a), protocol.Connection(b)


def in_thread(fn, *args):
    """Runs fn in a thread; returns a callable giving its result or raising its exception."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()

    def result():
        t.join(10)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    return result


class Running:
    """Stands in for torchrun's Popen while it runs."""

    def poll(self):
        return None


class Exited:
    """Stands in for torchrun's Popen once it has exited."""

    def wait(self, timeout=None):
        return 1


def closed_tail(log_dir: Path) -> WorkerOutput:
    """The workers' output when they wrote nothing."""
    r, w = os.pipe()
    os.close(w)
    return WorkerOutput(os.fdopen(r, "rb"), log_dir / "workers.log", n_target=1)
