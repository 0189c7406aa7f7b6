"""Placing the worker group: the process layout, the communicators, the torchrun command, the spec the
workers read, their threads, and what a start decides before any process runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swiftspec.engine.config import ConfigError, DraftCorpus, DraftKind, Dtype, EngineConfig, TreeParams
from swiftspec.engine.host import launcher
from swiftspec.engine.host.client import Engine
from swiftspec.engine.host.protocol import RankInfo
from swiftspec.engine.host.worker_spec import WorkerSpec
from swiftspec.engine.spec.draft_spec import DraftSpec
from swiftspec.engine.worker.profiling import choose_d, gpu_names, interleaved_medians
from swiftspec.engine.worker.setup import _cpu_threads, draft_shares_cores, parse_args


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


def test_the_workers_read_the_spec_the_engine_wrote(tmp_path):
    cfg = EngineConfig(tree=TreeParams(bs=6, w=4, d=3), threads=2, trust_remote_code=True, verify_cost=True)
    spec = WorkerSpec(cfg, launcher.Layout(2, 1), "/models/t", "suffix", "/c/answers.safetensors", "T")
    path = spec.write(tmp_path)
    read, hand = parse_args([f"--spec={path}"])  # the worker reads them as meant
    assert read == spec and hand is None
    c = read.config
    assert (c.tree.bs, c.tree.w, c.tree.d, c.threads, c.verify_cost, c.draft_history) == (6, 4, 3, 2, True, True)
    assert (read.corpus, read.layout.n_target, read.name) == ("/c/answers.safetensors", 2, "T")


def test_build_command():
    worker = ["--spec=/run/x/spec.json"]
    cmd = launcher.build_command(worker, 3, Path("/run/x"))
    assert cmd[1:4] == ["-m", "swiftspec.engine.worker.torchrun", "--nproc-per-node=3"]
    # no --standalone: its TCPStore would listen on every interface
    assert "--standalone" not in cmd and "--rdzv-backend=swiftspec-local" in cmd and "--log-dir=/run/x/logs" in cmd
    assert cmd[cmd.index("swiftspec.engine.worker") + 1:] == worker
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(cmd[3:])  # torchrun must hand every worker flag through
    assert parsed.training_script == "swiftspec.engine.worker" and parsed.training_script_args == worker
    # CPU workers are forked from torchrun; CUDA ones never are
    assert parsed.start_method == "fork"
    assert get_args_parser().parse_args(launcher.build_command(worker, 3, Path("/run/x"), cuda=True)[3:]).start_method == "spawn"
    multi = launcher.build_command(worker, 1, nnodes=2, rdzv_endpoint="h:29400")
    assert multi[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in multi and "--rdzv-endpoint=h:29400" in multi and "--rdzv-backend=c10d" in multi
    assert "--standalone" not in multi
    with pytest.raises(ConfigError):
        launcher.build_command(worker, 1, nnodes=2)



def test_the_worker_group_never_imports_from_its_working_directory(tmp_path, monkeypatch):
    """``python -m`` puts the directory it starts in first on sys.path; a folder there named like a library
    (a checkout's kernels/ beside transformers' `kernels`) must not replace that library in a worker."""
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("raise SystemExit('the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    proc = launcher.spawn([sys.executable, "-m", "json.tool", "--help"], {}, tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out

def test_the_engine_resolves_the_models_and_plans_the_layout_without_torch(target_dir):
    """Importing torch costs ~1.5 s of start-up: the Engine's work before it spawns torchrun must not."""
    code = ("import sys; from swiftspec.engine.host import launcher, startup; from swiftspec.engine.model.model_dir import "
            "read_args, resolve_model_dir; from swiftspec.engine.host.startup import resolve_draft; from swiftspec.engine.config import EngineConfig; "
            f"d = resolve_model_dir({str(target_dir)!r}); resolve_draft('suffix', d); read_args(d); "
            "c = EngineConfig(target=str(d)).validate(); layout = launcher.plan_layout(c, launcher.visible_gpus('auto')); "
            "startup.target_name(c); assert 'torch' not in sys.modules, 'torch was imported'")
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
            got.append(_cpu_threads(threads, DraftSpec.of(draft), rank, n_target=1))
        assert got == want, (threads, draft)


def test_kernel_threads_are_timed_in_turn_so_a_burst_slows_every_candidate_alike():
    """Two candidates, 1 and 2 threads, 2 truly the faster; a burst of other work on the cores lasts the
    first three timings. Timed one candidate after the other, the burst would fall on 1's three timings
    and make 1 look slow, or on 2's and pick 1; in turn, each candidate's median is its own speed."""
    calls: list[int] = []
    true_ms = {1: (8.0, 30.0), 2: (6.0, 18.0)}

    def time_one(n: int) -> tuple[float, float]:
        calls.append(n)
        step, verify = true_ms[n]
        burst = 3.0 if len(calls) <= 3 else 1.0
        return step * burst, verify * burst

    step, verify = interleaved_medians([1, 2], 5, time_one)
    assert calls == [1, 2] * 5
    assert step == {1: 8.0, 2: 6.0} and verify == {1: 30.0, 2: 18.0}


def test_an_async_draft_shares_cores_where_the_targets_async_threads_leave_it_none(monkeypatch):
    """A 2-core node: the split gives the target and the suffix drafter one core each, and the draft is
    on its own until the target's kernels take both cores for async (a measured choice); a target on
    a GPU, or on another node, leaves the draft its core."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})

    def ranks(target_device="cpu", target_host="a"):
        return [RankInfo(0, "target", target_device, 0, 1, 1, target_host, 10), RankInfo(1, "draft", "cpu", 0, 1, 1, "a", 11)]

    def tuned(**kernel_threads):  # the fields of setup.Tuned it reads
        return SimpleNamespace(n_target=1, kernel_threads=kernel_threads)

    assert not draft_shares_cores(tuned(), ranks())
    assert not draft_shares_cores(tuned(ar=2, sync=2, **{"async": 1}), ranks())
    assert draft_shares_cores(tuned(ar=2, sync=2, **{"async": 2}), ranks())
    assert not draft_shares_cores(tuned(**{"async": 2}), ranks(target_device="cuda:0"))
    assert not draft_shares_cores(tuned(**{"async": 2}), ranks(target_host="b"))


def test_an_ar_session_starts_no_draft_and_a_speculative_one_keeps_its_own():
    """EngineConfig.for_mode, which chat and serve both ask: ar never asks a draft for a token, so its
    config has no draft ranks and no corpus (which would be refused without the suffix drafter)."""
    config = EngineConfig(draft_corpus="/answers.safetensors", target_procs=2).validate()
    ar = config.for_mode("ar").validate()
    assert (ar.draft, ar.draft_corpus, ar.speculative, ar.target_procs) == (DraftKind.NONE, DraftCorpus.NONE, False, 2)
    assert launcher.plan_layout(ar, 0) == launcher.Layout(2, 0)
    for mode in ("sync", "async"):
        assert config.for_mode(mode) is config
    assert launcher.plan_layout(config, 0) == launcher.Layout(2, 1)


def test_a_cpu_setup_keys_its_profile_without_touching_cuda(monkeypatch):
    """On a GPU machine, --device cpu forks its workers after torchrun's CUDA probe, where any CUDA call
    raises ("Cannot re-initialize CUDA in forked subprocess"): a CPU setup's profile key names no GPU."""
    def forked(*_args):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", forked)
    cpu = [RankInfo(0, "target", "cpu", 0, 1, 1, "a", 10), RankInfo(1, "draft", "cpu", 0, 1, 1, "a", 11)]
    assert gpu_names(cpu) == []
    with pytest.raises(RuntimeError, match="forked"):  # a CUDA setup does name its GPUs
        gpu_names([RankInfo(0, "target", "cuda:0", 0, 1, 1, "a", 10), *cpu[1:]])


def test_choose_d():
    assert choose_d(70.0, 8.0) == 8
    assert choose_d(70.0, 0.01) == 16
    assert choose_d(5.0, 9.0) == 1


def test_a_model_directory_named_like_an_option_reaches_the_worker(tmp_path, monkeypatch):
    spec = WorkerSpec(EngineConfig(target="-model"), launcher.Layout(1, 1), "-model", "-draft", None, "-model")
    read, _ = parse_args([f"--spec={spec.write(tmp_path)}"])
    assert (read.target_dir, read.draft, read.name) == ("-model", "-draft", "-model")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a hand run names its models by flags
    read, hand = parse_args(["--target=-model", "--draft=-draft", "--prompt=-p"])
    assert (read.target_dir, read.draft, hand.prompt, read.layout) == ("-model", "-draft", "-p", launcher.Layout(1, 1))


def test_max_seq_len_beyond_the_model_is_limited_before_any_process_starts(target_dir, monkeypatch):
    class Spawned(Exception):
        pass

    def record(worker, *args, **kwargs):
        raise Spawned(WorkerSpec.read(Path(worker[0].removeprefix("--spec="))))

    said = []
    monkeypatch.setattr(launcher, "build_command", record)
    with pytest.raises(Spawned) as spawned:
        Engine.start(EngineConfig(target=str(target_dir), max_seq_len=10**12), progress=said.append)
    spec = spawned.value.args[0]
    assert spec.config.max_seq_len == 4096  # the tiny model's max_position_embeddings
    assert any("beyond the models' 4096 positions" in line for line in said)


@pytest.mark.parametrize("gguf_type, device, dtype, backend, name", [
    ("Q4_1", "cpu", Dtype.GGUF, "gguf (Q4_1 blocks) · int16 activations · AVX2", "gguf (Q4_1 blocks) · int16 activations · AVX2"),
    ("Q4_1", "cpu", Dtype.FLOAT32, None, "fp32 (from Q4_1 GGUF)"),  # torch's linears: no backend label
    ("Q4_K", "cuda", Dtype.AUTO, None, "bf16 (from Q4_K GGUF)"),
    (None, "cuda", Dtype.FLOAT16, None, "fp16"),
])
def test_title_names_the_precision_the_target_runs_at(gguf_type, device, dtype, backend, name, tmp_path):
    """The CPU backend's own label, else the dtype and, for a GGUF, the type its weights came in."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from swiftspec.engine.host.startup import target_name
    from swiftspec.engine.model.gguf_io import SOURCE_METADATA
    from swiftspec.engine.worker.setup import target_precision

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"),
              metadata={SOURCE_METADATA: gguf_type} if gguf_type else None)
    loaded = SimpleNamespace(target=SimpleNamespace(model=SimpleNamespace(precision=backend)), device=torch.device(device),
                             spec=SimpleNamespace(target_dir=str(tmp_path)), dtype=dtype)  # setup.Loaded's fields it reads
    assert target_precision(loaded) == name
    assert target_name(EngineConfig()) == "SmolLM2-135M-Instruct (embedded)"
    assert target_name(EngineConfig(target="/models/Qwen2.5-7B")) == "Qwen2.5-7B"


def test_a_start_phase_is_the_last_one_and_its_own_fields_and_changes_nothing_after():
    """setup.next_phase carries every field on, the new phase must give all of its own, and none of
    them can be set again later (the dataclasses are frozen)."""
    import dataclasses

    from swiftspec.engine.spec.messages import Wire
    from swiftspec.engine.worker.setup import Loaded, Placement, Tuned, next_phase

    place = Placement(spec=None, rank=1, world=2, n_target=1, role="draft", device=torch.device("cpu"), threads=1,
                      backend="gloo", wire=Wire(4), target_group=None, draft_group=None)
    loaded = next_phase(Loaded, place, dtype=Dtype.FLOAT32, target=None, draft=None, eos=frozenset({2}))
    assert (loaded.rank, loaded.tp_rank, loaded.tp_world, loaded.wire, loaded.eos) == (1, 0, 1, place.wire, {2})
    with pytest.raises(TypeError, match="kernel_threads"):
        next_phase(Tuned, loaded, features=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.dtype = Dtype.BFLOAT16
