"""The step times that choose d, and the target's cost of verifying 1..bs nodes: measured at the first
start on a machine, then read from the profile cache.

Measuring takes ~30 forwards (seconds on a CPU), and the figures only change with the machine, the
models and the settings, so they are kept in ``<cache>/profiles`` under a key made of exactly those:
the software versions, the CPU or GPU names, every rank's device and threads (and the CPU kernels'
threads the verifications ran on), the model files' sizes and dates, and the decoding settings. A figure
taken while other work held the cores is timed again, and one that never ran undisturbed serves its run
without being cached (engine/timing.py), so a start on a busy machine does not mis-size every later
answer. ``swiftspec cache clear profiles`` makes the next start measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from swiftspec.engine.config import BatchInvariance, Device, DraftKind, Dtype, SamplingParams
from swiftspec.engine.host.protocol import RankInfo
from swiftspec.engine.model import cpu_backends, cpu_blocks
from swiftspec.engine.model.model_dir import gguf_block_kinds, read_args, stored_float_dtype
from swiftspec.engine.paths import cache_dir
from swiftspec.engine.spec.decode import profile_verify_cost, tree_forward_ms
from swiftspec.engine.spec.draft_io import Features
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.timing import RETRIES, CleanTimer
from swiftspec.engine.worker.collectives import KernelThreads, KernelThreadsPlan, StepTimes, broadcast_choice
from swiftspec.engine.worker.setup import (
    Loaded,
    Placement,
    Profiled,
    Tuned,
    agree_on_features,
    barrier,
    draft_shares_cores,
    free_threads,
    next_phase,
    set_kernel_threads,
    use_kernel_threads,
    uses_cpu_kernels,
)
from swiftspec.kernels import cpu_linear

D_MAX = 16
PROFILE_FORMAT = 5  # bump when what is measured changes (5: the weights and KV cache in 2 MB pages)
MAX_PROFILES = 64  # the least recently written beyond these are removed
# EngineConfig fields that cannot change a step time (the models count by their files' identity); every
# other setting is part of a profile's key, a new one too
NOT_TIMING = {"target", "draft", "startup_timeout_s", "history_db"}


def choose_d(t_verify_ms: float, t_expand_ms: float) -> int:
    """d ~ the number of draft expansions that fit in one target verification."""
    return max(1, min(D_MAX, math.floor(t_verify_ms / max(t_expand_ms, 1e-3))))


def tune(loaded: Loaded, ranks: list[RankInfo], say: Callable[[str], None]) -> Tuned:
    """How this rank runs its models, agreed by every rank: whether the drafter reads features, and the CPU
    kernels' threads (choose_kernel_threads)."""
    features = agree_on_features(loaded)  # a collective over every rank: all have loaded
    return next_phase(Tuned, loaded, features=features, kernel_threads=choose_kernel_threads(loaded, ranks, say))


def profile(tuned: Tuned, ranks: list[RankInfo], say: Callable[[str], None]) -> Profiled:
    """The slowest rank's target verification of bs nodes and draft expansion (ms), the same on every
    rank, and the d they choose (or the config's); ``say`` hears whether they are measured or read. With
    verify_cost the draft also gets the target's cost of verifying 1..bs nodes (DraftState.verify_cost)."""
    config = tuned.spec.config
    if not tuned.spec.draft_spec.speculative:  # plain decoding: no d to choose, no tree to size
        return next_phase(Profiled, tuned, t_verify_ms=0.0, t_expand_ms=0.0, d=0, verify_cost=())
    t_verify, t_expand, cost = _step_times(tuned, ranks, say)
    return next_phase(Profiled, tuned, t_verify_ms=t_verify, t_expand_ms=t_expand,
                      d=config.tree.d or choose_d(t_verify, t_expand),
                      verify_cost=tuple(cost) if config.verify_cost else ())


def _step_times(tuned: Tuned, ranks: list[RankInfo],
                say: Callable[[str], None]) -> tuple[float, float, list[float]]:
    """profile's figures with a draft (the verification of bs nodes, the expansion, the cost of verifying
    1..bs nodes): read from the cache, or measured (and then cached where no rank was disturbed); the
    draft's DraftState gets its costs here."""
    config = tuned.spec.config
    bs = config.tree.bs
    path = profile_path(tuned, ranks, tuned.kernel_threads) if tuned.rank == 0 else None
    cached = StepTimes.broadcast(_read(path, bs) if path is not None else None, bs)
    say("step times from the profile cache" if cached else "profiling the draft expansion and target verification times")
    if cached:
        t_verify, t_expand, cost = cached.t_verify, cached.t_expand, cached.cost
    else:
        # a TP group's ranks forward together: none may time a call again alone
        timer = CleanTimer(cpu_bound=Device.of(tuned.device) is Device.CPU, retries=RETRIES if tuned.tp_world == 1 else 0)
        if tuned.role == "target":  # the target's forwards first, alone: a draft beside them would slow them
            t_verify, t_expand, cost = _measure(tuned, timer)
        barrier()
        if tuned.role == "draft":
            t_verify, t_expand, cost = _measure(tuned, timer)
        times = StepTimes.gather(StepTimes(t_verify, t_expand, cost, timer.clean))
        t_verify, t_expand = max(t.t_verify for t in times), max(t.t_expand for t in times)
        cost = times[0].cost
        if not all(t.clean for t in times):
            say(BUSY)
        elif path is not None:
            _write(path, t_verify, t_expand, cost)
    if tuned.role == "draft" and config.verify_cost:
        tuned.draft.verify_cost = cost
        tuned.draft.shares_cores = draft_shares_cores(tuned, ranks)
        if config.tree.d is None:  # an explicit d means d expansions a round, whatever they cost
            tuned.draft.step_ms = t_verify / cost[-1]  # a one-node share of the verification
    return t_verify, t_expand, cost


BUSY = "the machine was busy while measuring: these figures serve this run and are not cached"


def choose_kernel_threads(loaded: Loaded, ranks: list[RankInfo], say: Callable[[str], None]) -> dict[str, int]:
    """The CPU kernels' threads per mode on a one-rank CPU target that could use more cores than its share
    of the split (setup.free_threads): of the share and all the node's cores, ``ar`` takes the one with
    the faster one-row step and ``sync`` (whose drafts and verifications alternate) the faster
    verification of bs nodes. ``async`` drafts beside the target: it takes sync's choice with a light
    drafter (the suffix drafter, a draft head: mostly waiting for a verdict, and the kernels' threads
    claim their work, so the one it delays holds back a unit, not a share), the split with a draft model.
    Measured at the first start of a setup, then read from the cache. Every rank calls this, and gets the
    threads by mode (none where the split stands)."""
    free = free_threads(loaded.spec.config.threads, loaded.rank, loaded.n_target) if loaded.role == "target" else 0
    plan, path = None, None
    if loaded.rank == 0:
        applies = loaded.n_target == 1 and uses_cpu_kernels(loaded) and free > loaded.threads
        cached = None
        # the key of the verifications timed on the split, as none is chosen yet
        if applies and (path := profile_path(loaded, ranks, kernel_threads={})) is not None:
            path = path.parent / "threads" / path.name
            try:
                cached = KernelThreads.from_modes(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                pass  # none yet, or unreadable: measure
        plan = KernelThreadsPlan(applies, cached)
    plan = KernelThreadsPlan.broadcast(plan)
    if not plan.applies:
        return {}
    threads = plan.cached
    if threads is None:
        say("measuring the CPU kernels' threads")
        timer = CleanTimer()
        threads = _measure_threads(loaded, sorted({loaded.threads, free}), timer, say)
        if loaded.rank == 0 and not timer.clean:
            say(BUSY)
        elif loaded.rank == 0 and path is not None:
            _write_json(path, threads.by_mode())
    kernel_threads = threads.by_mode()  # the draft's too
    say("CPU kernel threads: " + ", ".join(f"{m} {n}" for m, n in kernel_threads.items()))
    return kernel_threads


THREAD_ROUNDS = 5


def interleaved_medians(candidates: list[int], rounds: int,
                        time_one: Callable[[int], tuple[float, float]]) -> tuple[dict[int, float], dict[int, float]]:
    """The median over ``rounds`` of each candidate's (step, verification) times, the candidates taken in
    turn within each round: a burst of other work on the cores (another rank finishing its start, the pool
    running alone a while) then slows every candidate alike instead of the one measured during it."""
    times: dict[int, list[tuple[float, float]]] = {n: [] for n in candidates}
    for _ in range(rounds):
        for n in candidates:
            times[n].append(time_one(n))
    return ({n: statistics.median(t[0] for t in ts) for n, ts in times.items()},
            {n: statistics.median(t[1] for t in ts) for n, ts in times.items()})


def _measure_threads(loaded: Loaded, candidates: list[int], timer: CleanTimer,
                     say: Callable[[str], None]) -> KernelThreads:
    """choose_kernel_threads' measurement: the target leader times a one-row step and a verification of
    bs nodes with each candidate, in interleaved rounds, and says what it measured; returns the threads
    for ar, sync and async (on every rank)."""
    bs = loaded.spec.config.tree.bs
    choice = None
    if loaded.rank == 0:
        if loaded.target.cache.prefix_len == 0:
            loaded.target.prefill(DUMMY, Sampler(SamplingParams(), loaded.device))

        def time_one(n: int) -> tuple[float, float]:
            set_kernel_threads(n)
            return tree_forward_ms(loaded.target, 1, 1, timer), tree_forward_ms(loaded.target, bs, 1, timer)

        step, verify = interleaved_medians(candidates, THREAD_ROUNDS, time_one)
        say("CPU kernel threads measured: " + ", ".join(f"{n}: step {step[n]:.2f} ms, verify({bs}) {verify[n]:.2f} ms"
                                                         for n in candidates))
        choice = KernelThreads(min(candidates, key=step.get), min(candidates, key=verify.get),
                               candidates[0] if loaded.spec.draft_spec.own_model else min(candidates, key=verify.get))
        set_kernel_threads(loaded.threads)  # back to this rank's share until tune's choice is in use
    return KernelThreads.broadcast(choice)


DUMMY = list(range(1, 9)) * 4  # repetitive, so that the suffix drafter has something to propose
# The context behind the target's profiled verifications: each row's attention reads it, so a row's
# share of a step grows with it, and an answer's own context is some hundreds of tokens.
PROFILE_CONTEXT = 256


def _measure(tuned: Tuned, timer: CleanTimer) -> tuple[float, float, list[float]]:
    """This rank's part: a target rank times verifications of bs nodes (median of 3, after a warm-up) and,
    with verify_cost, chains of 1..bs nodes, on the kernel threads that speculative answers use (the
    costs size their trees: a row's share of a step differs with the threads); a draft rank times its
    expansions."""
    bs = tuned.spec.config.tree.bs
    dummy = DUMMY
    if tuned.role == "target":
        use_kernel_threads(tuned, "sync")
        sampler = Sampler(SamplingParams(), tuned.device)
        context = (DUMMY * (PROFILE_CONTEXT // len(DUMMY)))[:max(len(DUMMY), tuned.target.room - 5 * bs)]
        roots = [tuned.target.prefill(context, sampler)]

        def verify() -> None:
            roots.append(tuned.target.verify([roots[-1], *dummy[:bs - 1]], list(range(-1, bs - 1)), sampler).path[-1])

        times = [timer.seconds(verify) for _ in range(4)]
        cost = profile_verify_cost(tuned.target, bs, timer=timer) if tuned.spec.config.verify_cost else [0.0] * bs
        return sorted(times[1:])[1] * 1e3, 0.0, cost
    # a drafter that reads features: any of the target's size will do
    tuned.draft.prefill(dummy, Features(0, torch.zeros(len(dummy), read_args(Path(tuned.spec.target_dir)).dim))
                        if tuned.features else None)
    tuned.draft.start(dummy[-1])
    times = [timer.seconds(tuned.draft.expand) * 1e3 for _ in range(4) if tuned.draft.can_expand()]
    t_expand = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else (times or [0.0])[0]
    return 0.0, t_expand, [0.0] * bs


def profile_path(loaded: Loaded, ranks: list[RankInfo], kernel_threads: dict[str, int]) -> Path | None:
    """Where this setup's profile is kept, its verifications timed on ``kernel_threads``; None when it
    cannot be named (a model path that is not a local file or directory)."""
    spec = loaded.spec
    settings = {k: v for k, v in spec.config.to_dict().items() if k not in NOT_TIMING}
    key = {
        **_software_and_machine(),
        "gpus": gpu_names(ranks),
        "ranks": [[r.role, r.device, r.torch_threads, r.host] for r in ranks],
        "kernel_threads": kernel_threads,  # what the verifications were timed on (choose_kernel_threads)
        "target": _files(spec.target_dir), "draft": _files(spec.draft_spec.path) if spec.draft_spec.path else spec.draft,
        "spec": {"config": {**settings, "dtype": loaded.dtype}, "layout": dataclasses.asdict(spec.layout),
                 "corpus": spec.corpus},
    }
    if key["target"] is None or key["draft"] is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "profiles" / f"{digest}.json"


def gpu_names(ranks: list[RankInfo]) -> list[str]:
    """The node's GPUs, where a rank runs on one; none for a CPU setup, which must not touch CUDA: its
    workers are forked, and on a GPU machine the fork follows torchrun's own CUDA probe."""
    if not any(Device.of(r.device) is Device.CUDA for r in ranks):
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _software_and_machine() -> dict:
    """What every cached measurement is keyed by: the code that ran (the C kernels' source included, so a
    change to them is measured afresh) and the machine it ran on."""
    return {"format": PROFILE_FORMAT, "swiftspec": _version("swiftspec"), "torch": torch.__version__,
            "kernels": cpu_linear.source_digest(), "machine": [platform.machine(), _cpu_name(), os.cpu_count()]}


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _files(path: str) -> list | None:
    """A model directory's (or file's) identity: its resolved path and each file's name, size and date."""
    p = Path(path).resolve()
    try:
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        return [str(p), [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]]
    except OSError:
        return None


def _read(path: Path, bs: int) -> StepTimes | None:
    try:
        data = json.loads(path.read_text())
        times = StepTimes(float(data["t_verify_ms"]), float(data["t_expand_ms"]), [*map(float, data["verify_cost"])])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: measure again
    return times if len(times.cost) == bs else None


def _write(path: Path, t_verify: float, t_expand: float, cost: list[float]) -> None:
    _write_json(path, {"t_verify_ms": t_verify, "t_expand_ms": t_expand, "verify_cost": cost})


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a temporary file renamed); the oldest beyond MAX_PROFILES go."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        old = sorted(path.parent.glob("*.json"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
        for f in old[MAX_PROFILES:]:
            f.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only cache: the next start measures again


# Expected acceptance of a proposed node, by drafter, for --dtype auto's choice: the suffix drafter yields
# ~1.4-1.5 tokens a verification on fresh questions (1 + p + p^2 + ... with p ~ 0.35); a learned head or a
# draft model more.
ACCEPTANCE_PRIOR = {DraftKind.NONE: 0.0, DraftKind.SUFFIX: 0.35}
ACCEPTANCE_OTHER = 0.5


def read_backend_costs(path: Path, candidates: list[Dtype]) -> dict[str, list[float]] | None:
    """The backends' costs cached at ``path``; None without a readable cache, or for one of other
    candidates (it is measured again)."""
    try:
        costs = {k: [float(c) for c in v] for k, v in json.loads(path.read_text())["costs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return costs if set(costs) == set(candidates) else None


def expected_rate(costs: list[float], p: float) -> float:
    """Tokens per millisecond at the best subtree size: (1 + p + ... + p^(n-1)) / cost(n)."""
    return max(sum(p ** i for i in range(n)) / c for n, c in enumerate(costs, 1))


def target_dtype(place: Placement, say: Callable[[str], None]) -> Dtype:
    """The dtype this rank loads at (setup.load): the config's, but on a CPU target with --dtype auto and
    batch invariance not off, the backend choose_cpu_backend measures."""
    config = place.spec.config
    if (place.role == "target" and Device.of(place.device) is Device.CPU and config.dtype is Dtype.AUTO
            and config.batch_invariant != BatchInvariance.OFF):
        return choose_cpu_backend(place, say)
    return config.dtype


def choose_cpu_backend(place: Placement, say: Callable[[str], None]) -> Dtype:
    """--dtype auto on the CPU: of the checkpoint's own width and (for a GGUF) its blocks, the backend with the
    best expected throughput, from each candidate's
    measured step and verification costs (cpu_backends.synthetic_costs) and the drafter's expected
    acceptance. Measured once per machine, model shape, threads and drafter, then read from the cache.
    Decided on the target leader and broadcast to the target group."""
    spec = place.spec
    model_args = read_args(Path(spec.target_dir))
    if cpu_backends.kernels_available(model_args, place.tp_world) is not None:
        return Dtype.FLOAT32  # torch's linears, exact through one-row forwards (engine/model/loader.py)
    # the checkpoint as stored, or a GGUF's own blocks: never a narrower width than the file holds
    candidates = [stored_float_dtype(Path(spec.target_dir))]
    if gguf_block_kinds(Path(spec.target_dir)) & set(cpu_blocks.BLOCK_FORMATS) and place.tp_world == 1:
        candidates.insert(0, Dtype.GGUF)
    if len(candidates) == 1:
        say(f"CPU backend {candidates[0]} (the checkpoint's own width)")
        return candidates[0]
    choice = None
    if place.tp_rank == 0:
        key = {**_software_and_machine(), "threads": place.threads,
               "shape": [model_args.dim, model_args.n_layers, model_args.n_heads, model_args.n_kv_heads,
                         model_args.intermediate_size, model_args.vocab_size, place.tp_world],
               "candidates": candidates, "draft": "model" if spec.draft_spec.path else spec.draft,
               "bs": spec.config.tree.bs, "activations": spec.config.activations, "kv_cache": spec.config.kv_cache}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = cache_dir() / "profiles" / "backends" / f"{digest}.json"
        costs = read_backend_costs(path, candidates)
        if costs is None:
            say("measuring the CPU backends (" + ", ".join(candidates) + ")")
            rows = spec.config.tree.bs if spec.draft_spec.speculative else 1  # plain decoding: only the one-row step counts
            timer = CleanTimer()
            costs = {b: cpu_backends.synthetic_costs(model_args, b, rows, timer=timer, activations=spec.config.activations,
                                                     kv_cache=spec.config.kv_cache) for b in candidates}
            if timer.clean:
                _write_json(path, {"costs": costs})
            else:
                say(BUSY)
        p = ACCEPTANCE_PRIOR.get(spec.draft_spec.kind, ACCEPTANCE_OTHER)
        rates = {b: expected_rate(c, p) for b, c in costs.items()}
        best = max(rates, key=rates.get)
        say(f"CPU backend {best} (--dtype auto: the faster for speculation; profiled one-token step: "
            + ", ".join(f"{b} {costs[b][0]:.1f} ms" for b in sorted(rates, key=rates.get, reverse=True)) + ")")
        choice = candidates.index(best)
    if place.tp_world > 1:
        choice = broadcast_choice(choice, place.target_group)
    return candidates[choice]
