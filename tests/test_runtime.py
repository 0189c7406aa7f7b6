"""The disaggregated runtime: socket protocol, launcher, worker groups and their loops, the Engine, faults.

The tests that start workers are marked slow (each start is a torchrun group of 2-3 processes); their
greedy outputs are compared with target-only decoding run in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model_dir

from swiftspec.config import ConfigError, EngineConfig, SamplingParams, TreeParams
from swiftspec.engine import launcher, protocol
from swiftspec.engine.answer import StopMatcher
from swiftspec.engine.client import Engine, EngineError, _accept_worker, encode_chat
from swiftspec.engine.failures import WorkerOutput
from swiftspec.engine.worker.profiling import choose_d
from swiftspec.engine.worker.setup import _cpu_threads, parse_args

PROMPTS = [
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise speculative decoding."}],
]


# ------------------------------------------------------------------------------------------- protocol

def _pair():
    a, b = socket.socketpair()
    return protocol.Connection(a), protocol.Connection(b)


def _run(fn, *args):
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


def test_handshake_and_frames():
    server, client = _pair()
    key = protocol.new_key()
    done = _run(protocol.client_handshake, client, key)
    protocol.server_handshake(server, key)
    done()
    server.send("generate", id=1, token_ids=[1, 2, 3], params=SamplingParams().to_dict())
    msg = client.recv(1)
    assert msg["type"] == "generate" and msg["token_ids"] == [1, 2, 3] and msg["v"] == protocol.VERSION
    assert client.recv(0.05) is None  # a timeout keeps the connection usable
    server.send("cancel", id=1)
    assert client.recv(1)["type"] == "cancel"


def test_wrong_key_is_refused_on_both_sides():
    server, client = _pair()
    done = _run(protocol.client_handshake, client, protocol.new_key())
    with pytest.raises(protocol.AuthError, match="wrong key"):
        protocol.server_handshake(server, protocol.new_key())
    with pytest.raises(protocol.AuthError, match="refused"):
        done()


def test_engine_impostor_is_detected_by_the_worker():
    server, client = _pair()
    done = _run(protocol.client_handshake, client, protocol.new_key())
    server.send("challenge", nonce="00")
    assert server.recv(1)["type"] == "auth"
    server.send("welcome", mac="0" * 64)
    with pytest.raises(protocol.AuthError, match="did not prove"):
        done()


def test_handshake_timeouts_are_clear_errors():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never speaks
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(protocol.AuthError, match="handshake timed out"):
        protocol.connect(addr, protocol.new_key(), timeout=0.5)
    assert time.monotonic() - t0 < 3
    listener.close()
    server, _silent = _pair()
    with pytest.raises(protocol.AuthError, match="handshake timed out"):
        protocol.server_handshake(server, protocol.new_key(), timeout=0.3)


def test_bad_frames_are_protocol_errors():
    server, client = _pair()
    client.sock.sendall((protocol.MAX_HANDSHAKE_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        server.recv(1)
    server, client = _pair()
    client.sock.sendall(b"\0\0\0\x02{}")
    with pytest.raises(protocol.ProtocolError, match="malformed"):
        server.recv(1)
    server, client = _pair()
    data = b'{"v": 99, "type": "challenge"}'
    client.sock.sendall(len(data).to_bytes(4, "big") + data)
    with pytest.raises(protocol.ProtocolError, match="version"):
        server.recv(1)
    server, client = _pair()
    client.close()
    with pytest.raises(protocol.ConnectionClosed):
        server.recv(1)


class _Running:
    def poll(self):
        return None


def test_engine_refuses_impostors_and_keeps_waiting_for_its_worker(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    key = protocol.new_key()
    impostor = _run(protocol.connect, addr, protocol.new_key())
    worker = _run(lambda: (time.sleep(0.3), protocol.connect(addr, key))[1])
    r, w = os.pipe()
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=1)
    conn = _accept_worker(listener, key, _Running(), tail, time.monotonic() + 10)
    with pytest.raises(protocol.AuthError, match="refused"):
        impostor()
    conn.send("welcome-check")
    assert worker().recv(1)["type"] == "welcome-check"
    listener.close()


# ------------------------------------------------------------------------------------ launcher, pieces

def test_plan_layout():
    cfg = EngineConfig(target_procs=2)
    assert launcher.plan_layout(cfg, 0) == launcher.Layout(2, 1)
    with pytest.raises(ConfigError, match="one process"):
        launcher.plan_layout(EngineConfig(draft_procs=2), 0)
    assert launcher.plan_layout(EngineConfig(), 4) == launcher.Layout(4, 1, [0, 1, 2, 3], [])
    lay = launcher.plan_layout(EngineConfig(draft="/m", gpus=8), 8)
    assert (lay.n_target, lay.n_draft, lay.draft_devices) == (6, 2, [6, 7])
    lay = launcher.plan_layout(EngineConfig(draft="/m", target_devices=[0, 1, 2], draft_devices=[3]), 4)
    assert (lay.n_target, lay.n_draft, lay.world) == (3, 1, 4)
    with pytest.raises(ConfigError, match="overlap"):
        launcher.plan_layout(EngineConfig(draft="/m", target_devices=[0, 1], draft_devices=[1]), 4)
    with pytest.raises(ConfigError, match="do not exist"):
        launcher.plan_layout(EngineConfig(draft="/m", target_devices=[0, 5], draft_devices=[1]), 4)
    with pytest.raises(ConfigError, match="no CUDA"):
        launcher.plan_layout(EngineConfig(device="cuda"), 0)
    # no draft (--mode ar): no draft ranks, every GPU asked for goes to the target
    assert launcher.plan_layout(EngineConfig(draft="none", target_procs=2), 0) == launcher.Layout(2, 0)
    assert launcher.plan_layout(EngineConfig(draft="none", gpus=1), 4) == launcher.Layout(1, 0, [0], [])


@pytest.mark.parametrize("n_gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["suffix", "/models/draft"])
def test_no_nccl_communicator_holds_two_ranks_of_one_gpu(n_gpus, draft):
    """Every GPU layout the planner makes (with --gpus N, and split by hand): control over gloo alone, NCCL
    only in TP groups of distinct GPUs, and a GPU shared by both groups split into memory shares.
    (A learned draft head, issue 12, will be placed like a draft model.)"""
    configs = [EngineConfig(draft=draft, device="cuda", gpus=n) for n in range(1, n_gpus + 1)]
    if n_gpus > 1:
        configs.append(EngineConfig(draft=draft, target_devices=list(range(n_gpus - 1)), draft_devices=[n_gpus - 1]))
    for config in configs:
        layout = launcher.plan_layout(config, n_gpus)
        devices = launcher.rank_devices(layout)
        groups = launcher.process_groups(devices, layout.n_target)
        assert groups["world"].backend == "gloo"
        for spec in groups.values():
            gpus = [devices[r] for r in spec.ranks]
            if "nccl" in spec.backend:
                assert len(set(gpus)) == len(gpus) > 1 and all(d.startswith("cuda:") for d in gpus), (config, spec)
        shares = {}
        for rank, dev in enumerate(devices):
            share = launcher.memory_fraction(devices, rank, layout.n_target)
            assert (share is None) == (devices.count(dev) == 1 or dev == "cpu")
            shares[dev] = shares.get(dev, 0.0) + (share or 0.0)
        assert all(total <= 1.0 for total in shares.values())
    one_gpu = launcher.rank_devices(launcher.plan_layout(EngineConfig(draft=draft, device="cuda"), 1))
    assert one_gpu == ["cuda:0", "cpu" if draft == "suffix" else "cuda:0"]


def test_process_groups_refuse_a_shared_gpu_inside_one_group():
    with pytest.raises(ConfigError, match="share a GPU"):
        launcher.process_groups(["cuda:0", "cuda:0", "cuda:1"], 2)
    assert launcher.process_groups(["cpu", "cpu", "cpu"], 2)["target"].backend == "gloo"  # CPU TP: gloo
    groups = launcher.process_groups(["cuda", "cuda", "cuda"], 2)  # one GPU per local rank (several nodes)
    assert groups["target"].backend == "cpu:gloo,cuda:nccl" and groups["draft"].backend == "gloo"


def test_build_command():
    cfg = EngineConfig(tree=TreeParams(bs=6, w=4, d=3), threads=2, trust_remote_code=True, verify_cost=True)
    worker = launcher.worker_args(cfg, launcher.Layout(2, 1), "/models/t", "suffix", Path("/c/answers.safetensors"))
    cmd = launcher.build_command(worker, 3, Path("/run/x"))
    assert cmd[1:4] == ["-m", "swiftspec.engine.torchrun", "--nproc-per-node=3"]
    # no --standalone: its TCPStore would listen on every interface
    assert "--standalone" not in cmd and "--rdzv-backend=swiftspec-local" in cmd and "--log-dir=/run/x/logs" in cmd
    tail = cmd[cmd.index("swiftspec.engine.worker") + 1:]
    assert tail[:4] == ["--target=/models/t", "--draft=suffix", "--target-procs", "2"]
    assert {"--tree-bs", "6", "--tree-w", "4", "--tree-d", "3", "--threads", "2"} <= set(tail)
    args = parse_args(worker)  # the worker reads them as meant
    assert (args.bs, args.w, args.d, args.threads, args.verify_cost, args.draft_history) == (6, 4, 3, 2, True, True)
    assert args.draft_corpus == "/c/answers.safetensors"
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(cmd[3:])  # torchrun must hand every worker flag through
    assert parsed.training_script == "swiftspec.engine.worker" and parsed.training_script_args == worker
    multi = launcher.build_command(worker, 1, nnodes=2, rdzv_endpoint="h:29400")
    assert multi[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in multi and "--rdzv-endpoint=h:29400" in multi and "--rdzv-backend=c10d" in multi
    assert "--standalone" not in multi
    with pytest.raises(ConfigError):
        launcher.build_command(worker, 1, nnodes=2)


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["\nUser:", "END"])
    assert m.push("Hello\nUs") == ("Hello", False)
    assert m.push("ual text E") == ("\nUsual text ", False)
    assert m.push("N") == ("", False)
    assert m.push("D and more") == ("", True)
    m = StopMatcher(["aab"])
    assert m.push("xaa") == ("x", False)
    assert m.push("ab") == ("a", True)
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False) and m.flush() == ""


def test_the_engine_resolves_the_models_and_plans_the_layout_without_torch(target_dir):
    """Importing torch costs ~1.5 s of start-up: the Engine's work before it spawns torchrun must not."""
    code = ("import sys; from swiftspec.engine import client, launcher; from swiftspec.engine.model_dir import "
            "read_args, resolve_draft, resolve_model_dir; from swiftspec.config import EngineConfig; "
            f"d = resolve_model_dir({str(target_dir)!r}); resolve_draft('suffix', d); read_args(d); "
            "c = EngineConfig(target=str(d)).validate(); layout = launcher.plan_layout(c, launcher.visible_gpus('auto')); "
            "client._target_name(c); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_gpu_driver_means_no_cuda_devices_without_asking_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "GPU_DRIVER_NODES", (str(tmp_path / "nvidiactl"),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what torch would say on a 3-GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert launcher.visible_gpus("auto") == 0 and launcher.visible_gpus("cpu") == 0
    assert launcher.visible_gpus("cuda") == 3  # asked for: torch decides (and plan_layout words a refusal)
    (tmp_path / "nvidiactl").touch()
    assert launcher.visible_gpus("auto") == 3 and launcher.visible_gpus("cpu") == 0


def test_cpu_threads_never_oversubscribe_the_cores(monkeypatch, tmp_path):
    """One target and one draft rank on a node of 4 cores: the suffix drafter and a head take one core of
    their own, a draft model an even share; without --threads one core stays with the Engine."""
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps({"swiftspec_draft_head": 1}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(4)))
    cases = [  # (--threads, draft, local ranks, threads of each)
        (4, "suffix", 2, [3, 1]), (4, str(tmp_path / "head"), 2, [3, 1]), (4, str(tmp_path), 2, [2, 2]),
        (None, "suffix", 2, [2, 1]), (None, str(tmp_path), 2, [1, 1]), (None, "none", 1, [3]),
    ]
    for threads, draft, world, want in cases:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        got = []
        for rank in range(world):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            got.append(_cpu_threads(argparse.Namespace(threads=threads, draft=draft), rank, n_target=1))
        assert got == want, (threads, draft)


def test_choose_d():
    assert choose_d(70.0, 8.0) == 8
    assert choose_d(70.0, 0.01) == 16
    assert choose_d(5.0, 9.0) == 1


def test_encode_chat_uses_the_template():
    from swiftspec.engine.model_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    ids = encode_chat(tok, PROMPTS[0])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(EngineError, match="messages"):
        encode_chat(tok, [{"role": "user"}])


def test_encode_chat_continues_a_final_answer():
    """/continue: a last assistant message is left open, so the answer goes on where it stopped."""
    from swiftspec.engine.model_dir import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    question = encode_chat(tok, PROMPTS[0])
    partial = encode_chat(tok, PROMPTS[0] + [{"role": "assistant", "content": "The answer is"}])
    assert partial[:len(question)] == question  # the prefix the workers already hold
    assert tok.decode(partial[len(question):]) == "The answer is"


# ------------------------------------------------------------------------------------------- TP logits

def _tp_logits(rank: int, world: int, store_path: str, paths: list, out: dict) -> None:
    import torch.distributed as dist

    from swiftspec.engine.loader import load_model

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    ids = torch.arange(3, 40) % 300
    pos = torch.arange(len(ids))
    mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    for i, path in enumerate(paths):
        model = load_model(path, max_slots=64, tp_group=group, tp_rank=rank, tp_world=world)
        got = model(ids, pos, pos, mask)
        if rank == 0:
            ref = load_model(path, max_slots=64)(ids, pos, pos, mask)
            out[i] = float((got - ref).abs().max())
    dist.destroy_process_group()


TP_CONFIGS = [
    dict(heads=4, kv_heads=2),  # divides
    dict(heads=4, kv_heads=1),  # fewer KV heads than ranks: replicated
    dict(heads=6, kv_heads=3, hidden=96),  # KV heads do not divide: padded
    dict(arch="qwen2", heads=4, kv_heads=2),  # q/k/v biases
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_tp_logits_equal_tp1(world, tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        paths = [tiny_model_dir(**kw) for kw in TP_CONFIGS]  # written here: ranks > 0 would not save
        mp.spawn(_tp_logits, args=(world, str(tmp_path / "store"), paths, out), nprocs=world)
        diffs = dict(out)
    assert len(diffs) == len(TP_CONFIGS)
    assert max(diffs.values()) <= 1e-4, diffs


# ------------------------------------------------------------------------------------ engines (slow)

def reference(model_dir, messages, n: int, params: SamplingParams = SamplingParams()) -> list[int]:
    """Greedy target-only decoding in this process (penalised as ``params`` says), one token per forward
    and no loop code of the engine's: what every mode must reproduce."""
    from swiftspec.engine.decode import TargetState
    from swiftspec.engine.loader import load_model
    from swiftspec.engine.model_dir import load_tokenizer
    from swiftspec.engine.sampling import Sampler

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


ENGINES = {
    # name: (target_procs, draft); "self" = the target as its own draft (deep acceptance),
    # "other" = a different tiny model (mostly rejected)
    "1+1-self": (1, "self"),
    "1+1-suffix": (1, "suffix"),
    "1+1-int8": (1, "int8"),
    "2+1-other": (2, "other"),
    "2+1-suffix": (2, "suffix"),
    "1+1-head": (1, "head"),
}
N_TOKENS = 48


@pytest.fixture(scope="module")
def target_dir():
    return tiny_model_dir(seed=0, layers=2)


PENALISED = SamplingParams(repeat_penalty=1.5, repeat_last_n=24, frequency_penalty=0.5)


@pytest.fixture(scope="module")
def references(target_dir):
    return [reference(target_dir, m, N_TOKENS) for m in PROMPTS]


@pytest.fixture(scope="module")
def penalised_references(target_dir, references):
    out = [reference(target_dir, m, N_TOKENS, PENALISED) for m in PROMPTS]
    assert out != references  # the penalty changes the answers
    return out


def echo_head_dir(target_dir) -> Path:
    """A draft head for the tiny target that outputs its input feature (fc passes the feature through, the
    layer is zero): it proposes the target's own prediction from the position before the root, which only
    the target's features, sent over the workers' 16-bit wire, can give it."""
    from swiftspec.engine.draft_head import DraftHead, HeadArgs, save_head
    from swiftspec.engine.model_dir import read_args

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


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, target_dir):
    procs, draft = ENGINES[request.param]
    eng = start(target_dir, draft, procs)
    yield eng
    eng.close()
    assert no_processes_left(eng)


@pytest.mark.slow
def test_every_mode_equals_target_greedy_penalised(engine, penalised_references):
    """Each tree node penalised by its own path, on every layout (TP 2 included): every mode keeps the
    penalised target's greedy tokens."""
    for messages, ref in zip(PROMPTS, penalised_references, strict=True):
        for mode in ("async", "ar", "sync"):
            tokens, _, _ = answer(engine, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True,
                                  repeat_penalty=PENALISED.repeat_penalty, repeat_last_n=PENALISED.repeat_last_n,
                                  frequency_penalty=PENALISED.frequency_penalty)
            assert tokens == ref, (mode, messages)


@pytest.mark.slow
def test_every_mode_equals_target_greedy(engine, references):
    roles = [r.role for r in engine.info.ranks]
    assert roles[-1] == "draft" and set(roles[:-1]) == {"target"}
    info = engine.info
    assert info.d_auto and info.d == choose_d(info.t_verify_ms, info.t_expand_ms)
    for messages, ref in zip(PROMPTS, references, strict=True):
        for mode in ("async", "ar", "sync"):
            tokens, _, events = answer(engine, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)
            assert tokens == ref, (mode, messages)
            assert events[-1].finish_reason == "length"
            if mode != "ar":
                verified = [e.stats for e in events if e.stats.tree_size]
                assert events[-1].stats.d == engine.info.d and events[-1].stats.mean_accepted == pytest.approx(
                    sum(s.accepted + 1 for s in verified) / len(verified))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_on_the_cpu_every_mode_equals_ar(target_dir, dtype):
    """bf16 off CUDA takes the batch-invariant one-row forwards; float16 on the CPU (fp16 weights, fp32
    math) forwards whole trees, as fp32 does: sync and async give ar's tokens either way."""
    with start(target_dir, "self", dtype=dtype) as eng:
        for messages in PROMPTS:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
            for mode in ("async", "sync"):
                assert answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)[0] == ar, mode
    assert no_processes_left(eng)


@pytest.mark.slow
def test_step_times_are_measured_once_then_read_from_the_profile_cache(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path))  # the workers inherit it
    said: list[str] = []
    first = start(target_dir, "self", progress=said.append)
    first.close()
    assert any(line.startswith("profiling") for line in said)
    assert "CPU backend float32 (the checkpoint's own width)" in said  # one candidate: nothing to measure
    more_cores = len(os.sched_getaffinity(0)) > 1  # the target's share is one core less than the machine's
    assert ("measuring the CPU kernels' threads" in said) == more_cores
    (threads,) = [line for line in said if line.startswith("CPU kernel threads: ")] or [None]
    (profile,) = (tmp_path / "profiles").glob("*.json")
    stored = json.loads(profile.read_text())
    assert stored["t_verify_ms"] == first.info.t_verify_ms and stored["t_expand_ms"] == first.info.t_expand_ms
    # figures no measurement would give: the next start must take them from the file, d and tree sizes too
    profile.write_text(json.dumps({"t_verify_ms": 50.0, "t_expand_ms": 10.0, "verify_cost": [1.0] + [99.0] * 7}))
    said.clear()
    with start(target_dir, "self", progress=said.append) as eng:
        assert "step times from the profile cache" in said
        assert any(line.startswith("CPU backend ") for line in said)
        assert "measuring the CPU kernels' threads" not in said and threads in (said if more_cores else [None])
        assert (eng.info.t_verify_ms, eng.info.t_expand_ms, eng.info.d) == (50.0, 10.0, choose_d(50.0, 10.0))
        _, _, events = answer(eng, PROMPTS[0], mode="sync", max_new_tokens=16, ignore_eos=True)
        assert {e.stats.tree_size for e in events if e.stats.tree_size} == {1}  # 2+ nodes "cost" 99 steps
    said.clear()
    with start(target_dir, "self", progress=said.append, tree=TreeParams(bs=4)):  # another setting: measured
        assert any(line.startswith("profiling") for line in said)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2


@pytest.fixture(scope="module")
def self_engine(target_dir):
    eng = start(target_dir, "self", max_seq_len=2048, tree=TreeParams(d=4))
    yield eng
    eng.close()
    assert no_processes_left(eng)


@pytest.mark.slow
def test_self_draft_accepts_deep_paths(self_engine, references):
    tokens, _, events = answer(self_engine, PROMPTS[0], mode="async", max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]
    # a perfect draft (d fixed: profiling gives d = 1, as the draft is as slow as the target)
    assert self_engine.info.d == 4 and not self_engine.info.d_auto
    assert events[-1].stats.mean_accepted > 2.5


@pytest.mark.slow
def test_stop_strings_eos_and_multi_turn_reuse(self_engine):
    messages = PROMPTS[1]
    ref, text, _ = answer(self_engine, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    _, cut, events = answer(self_engine, messages, mode="async", max_new_tokens=N_TOKENS, ignore_eos=True,
                            stop=[stop])
    assert events[-1].finish_reason == "stop" and cut == text[:text.index(stop)]
    tokens, _, events = answer(self_engine, messages, mode="async", max_new_tokens=N_TOKENS)
    if 2 in ref:  # the tiny models' EOS ends the answer, and is its last token
        assert events[-1].finish_reason == "eos" and tokens == ref[:ref.index(2) + 1]
    else:
        assert events[-1].finish_reason == "length" and tokens == ref
    # a follow-up turn prefills only what is new since the committed conversation
    follow = messages + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Again."}]
    first, second = (encode_chat(self_engine.tokenizer, m) for m in (messages, follow))
    assert second[:len(first)] == first
    _, _, events = answer(self_engine, follow, mode="async", max_new_tokens=4)
    assert events[0].stats.prefill_tokens <= len(second) - len(first)


@pytest.mark.slow
def test_cancel_then_generate_again(self_engine, references):
    gen = self_engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    next(gen)
    threading.Thread(target=self_engine.cancel).start()
    events = list(gen)
    assert events[-1].finish_reason == "cancelled" and sum(len(e.token_ids) for e in events) < 1999
    tokens, _, _ = answer(self_engine, PROMPTS[0], max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]
    gen = self_engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    next(gen)
    del gen  # abandoning an answer cancels it
    tokens, _, _ = answer(self_engine, PROMPTS[0], mode="sync", max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]


@pytest.mark.slow
def test_ctrl_c_cancels_and_the_engine_stays_usable(self_engine, references):
    streaming = threading.Event()  # Ctrl-C once tokens flow: mid-answer however fast the engine is

    def ctrl_c():
        streaming.wait(60)
        os.kill(os.getpid(), signal.SIGINT)

    # A shell's background job starts with SIGINT ignored and Python keeps it so: put back the handler a
    # terminal gives, or the Ctrl-C would be dropped.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupter.start()
            for _ in self_engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=2000, ignore_eos=True,
                                                                     mode="ar")):
                streaming.set()
        interrupter.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert self_engine.alive
    tokens, _, _ = answer(self_engine, PROMPTS[0], max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]


@pytest.mark.slow
def test_an_engine_without_draft_runs_the_target_alone(target_dir, references):
    with start(target_dir, "none") as eng:
        assert [r.role for r in eng.info.ranks] == ["target"] and eng.info.draft == "none"
        assert answer(eng, PROMPTS[0], mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)[0] == references[0]
        with pytest.raises(EngineError, match="without one"):
            eng.generate(PROMPTS[0], SamplingParams(mode="sync"))
    assert no_processes_left(eng)


@pytest.mark.slow
def test_over_long_prompt_is_refused_before_sending(self_engine):
    with pytest.raises(EngineError, match="context length"):
        self_engine.generate([{"role": "user", "content": "speculative decoding " * 2000}])


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["draft", "target"])
def test_killed_rank_fails_fast_and_leaves_no_process(victim, target_dir):
    eng = start(target_dir, "suffix", max_seq_len=4096)
    try:
        pid = next(r.pid for r in eng.info.ranks if r.role == victim)
        gen = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4000, ignore_eos=True))
        next(gen)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineError) as failure:
            for _ in gen:
                pass
        assert time.monotonic() - t0 < 10
        # in words, which worker and how, then where the workers' whole output is; no torchrun log lines
        rank = next(r.rank for r in eng.info.ranks if r.role == victim)
        first, *rest = str(failure.value).splitlines()
        assert first == f"the {victim} worker (rank {rank}) was killed by signal 9 (SIGKILL)", str(failure.value)
        log = Path(rest[-1].removeprefix("the workers' full output: "))
        assert "exitcode" in log.read_text() and not any("exitcode" in line for line in rest)
        log.unlink()  # kept for the user after a failure; not for the tests' own
        assert no_processes_left(eng, within_s=10 - (time.monotonic() - t0))
        with pytest.raises(EngineError):
            answer(eng, PROMPTS[0], max_new_tokens=4)
    finally:
        eng.close()
    assert no_processes_left(eng)


@pytest.mark.slow
def test_worker_start_up_failure_carries_the_cause(tmp_path, target_dir):
    """A draft whose weights do not fit its config passes the start-up checks and fails in its worker: the
    error names that worker, the worker's own exception, and the log of everything the workers wrote."""
    bad = tmp_path / "wrong-shapes"
    shutil.copytree(target_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(EngineError) as failure:
        start(target_dir, str(bad))
    message = str(failure.value)
    assert message.startswith("the draft worker (rank 1) exited with code 1 during start-up"), message
    assert "LoadError" in message and "weights do not match the config" in message
    log = Path(message.splitlines()[-1].removeprefix("the workers' full output: "))
    assert "Traceback" in log.read_text()
    log.unlink()


def _corpus(path: Path, model_dir: Path, sequences: list[tuple[list[int], int]] | None = None) -> Path:
    from swiftspec.engine.corpus import save_corpus
    from swiftspec.engine.model_dir import load_tokenizer

    save_corpus(path, sequences or [([1, 2, 3, 4], 2)], load_tokenizer(Path(model_dir)))
    return path


@pytest.mark.slow
def test_a_corpus_of_the_targets_answers_drafts_them_and_every_mode_stays_exact(target_dir, references, tmp_path):
    """The suffix drafter with a corpus of the target's own answers to these prompts (session history off:
    an earlier mode's answer must not be what drafts): the first round of each answer, which has nothing
    of its own to copy yet, is drafted from the corpus and accepted; the tokens are ar's."""
    from swiftspec.engine.model_dir import load_tokenizer

    tok = load_tokenizer(Path(target_dir))
    prompts = [encode_chat(tok, m) for m in PROMPTS]
    corpus = _corpus(tmp_path / "answers.safetensors", target_dir,
                     [(p + ref, len(p)) for p, ref in zip(prompts, references, strict=True)])
    with start(target_dir, "suffix", draft_corpus=str(corpus), draft_history=False) as eng:
        assert eng.info.draft == "suffix + corpus answers"
        for messages, ref in zip(PROMPTS, references, strict=True):
            for mode in ("sync", "async"):
                tokens, _, events = answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)
                assert tokens == ref, mode
                rounds = [e.stats for e in events if e.stats.tree_size]
                assert rounds[0].accepted >= 1, mode
                assert sum(s.accepted + 1 for s in rounds) / len(rounds) >= 1.5, mode
    assert no_processes_left(eng)


def test_a_bad_draft_corpus_is_refused_at_start(target_dir, tmp_path):
    from swiftspec.engine.model_dir import LoadError

    with pytest.raises(ConfigError, match="suffix drafter"):
        start(target_dir, "int8", draft_corpus=str(tmp_path / "answers.safetensors"))
    with pytest.raises(LoadError, match="not a file"):
        start(target_dir, draft_corpus=str(tmp_path / "missing.safetensors"))
    other = _corpus(tmp_path / "other.safetensors", tiny_model_dir(vocab=320))
    with pytest.raises(LoadError, match="another tokenizer"):
        start(target_dir, draft_corpus=str(other))
    with pytest.raises(LoadError, match="not a SwiftSpec draft corpus"):
        start(target_dir, draft_corpus=str(Path(target_dir) / "model.safetensors"))


def test_draft_with_another_vocabulary_is_refused_at_start(target_dir):
    from swiftspec.engine.drafters import VocabMismatch

    with pytest.raises(VocabMismatch, match="tokenizer"):
        start(target_dir, str(tiny_model_dir(vocab=320)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft", ["self", "suffix"])
def test_cuda_async_equals_ar(target_dir, draft, dtype):
    """One GPU: gloo for control, a model draft shares GPU 0 with the target, the suffix drafter's rank
    stays on the CPU; bit-exact in bf16 too (the batch-invariant kernels)."""
    with start(target_dir, draft, device="cuda", dtype=dtype) as eng:
        assert eng.info.backend == "gloo" and eng.info.ranks[0].device == "cuda:0"  # one target rank: no NCCL
        for messages in PROMPTS:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
            for mode in ("async", "sync"):
                assert answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)[0] == ar
    assert no_processes_left(eng)


@pytest.mark.slow
def test_embedded_model_async_equals_ar():
    with Engine.start(EngineConfig()) as eng:
        assert eng.info.draft == "suffix + corpus smollm2-135m-instruct"  # the shipped corpus, by default
        for messages in PROMPTS[:2]:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=32)
            for mode in ("async", "sync"):
                tokens, _, _ = answer(eng, messages, mode=mode, max_new_tokens=32)
                assert tokens == ar, mode
    assert no_processes_left(eng)


TORCHRUN_REPORT = """\
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17334: Connection reset by peer
E1130 18:08:20.559000 1 api.py:882] failed (exitcode: 1) local_rank: 0 (pid: 11) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
swiftspec.engine.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_18:08:20
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  traceback : Signal 9 (SIGKILL) received by PID 12
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_18:08:20
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
============================================================
"""


@pytest.mark.parametrize("output, n_target, said", [
    # the killed draft is the cause, though torchrun saw the target's exit first
    (TORCHRUN_REPORT, 1, "the draft worker (rank 1) was killed by signal 9 (SIGKILL)\nthe workers' full output: "),
    # with two target ranks, rank 1 is the target's
    (TORCHRUN_REPORT, 2, "the target worker (rank 1) was killed by signal 9 (SIGKILL)\n"),
    # a worker's own exception wins over a peer's broken connection, and its exception line is given
    ("[rank1]: LoadError: weights do not match the config\n[rank0]: RuntimeError: gloo Connection closed by peer\n"
     "failed (exitcode: 1) local_rank: 0 (pid: 11)\nfailed (exitcode: 1) local_rank: 1 (pid: 12)\n", 1,
     "the draft worker (rank 1) exited with code 1\nLoadError: weights do not match the config\n"),
    # nothing from torchrun: what was noticed, and the log
    ("[rank0]: hello\n", 1, "lost the connection to the workers\nthe workers' full output: "),
])
def test_failure_report_names_the_worker_and_the_log(tmp_path, output, n_target, said):
    r, w = os.pipe()
    os.write(w, output.encode())
    os.close(w)
    tail = WorkerOutput(os.fdopen(r, "rb"), tmp_path / "workers.log", n_target=n_target)
    message = tail.report("lost the connection to the workers", _Exited())
    assert message.startswith(said), message
    assert message.endswith(str(tmp_path / "workers.log")) and "exitcode" not in message
    assert (tmp_path / "workers.log").read_text() == output


class _Exited:
    def wait(self, timeout=None):
        return 1


@pytest.mark.parametrize("gguf_type, device, dtype, backend, name", [
    ("Q4_1", "cpu", "gguf", "int4 (Q4_1 blocks) · int16 activations · AVX2", "int4 (Q4_1 blocks) · int16 activations · AVX2"),
    ("Q4_1", "cpu", "float32", None, "fp32 (from Q4_1 GGUF)"),  # torch's linears: no backend label
    ("Q4_K", "cuda", "auto", None, "bf16 (from Q4_K GGUF)"),
    (None, "cuda", "float16", None, "fp16"),
])
def test_title_names_the_precision_the_target_runs_at(gguf_type, device, dtype, backend, name, tmp_path):
    """The CPU backend's own label, else the dtype and, for a GGUF, the type its weights came in."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from swiftspec.embedded import SOURCE_METADATA
    from swiftspec.engine.client import _target_name
    from swiftspec.engine.worker.setup import target_precision

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"),
              metadata={SOURCE_METADATA: gguf_type} if gguf_type else None)
    ctx = SimpleNamespace(target=SimpleNamespace(model=SimpleNamespace(precision=backend)), device=torch.device(device),
                          args=SimpleNamespace(target=str(tmp_path), dtype=dtype))
    assert target_precision(ctx) == name
    assert _target_name(EngineConfig()) == "SmolLM2-135M-Instruct (embedded)"
    assert _target_name(EngineConfig(target="/models/Qwen2.5-7B")) == "Qwen2.5-7B"
