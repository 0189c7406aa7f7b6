"""Plain dataclasses shared by the CLI, the Engine, the workers and the TUI.

They travel between the Engine and its workers as JSON (``to_dict`` / ``from_dict``), never pickled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Mode = Literal["ar", "sync", "async"]
MODES: tuple[str, ...] = get_args(Mode)
Role = Literal["target", "draft"]  # a worker rank's group
# "eos" | "stop" (a stop string, matched by the Engine) | "length" (max_new_tokens) | "context" |
# "repetition" (the loop guard) | "cancelled"
FinishReason = Literal["eos", "stop", "length", "context", "repetition", "cancelled"]
DTYPES = ("auto", "float32", "bfloat16", "float16", "gguf", "int4")  # --dtype (gguf, int4: CPU only)

# Drafts named by a word rather than a model path. "int8" runs on the CPU only: a copy of the target with
# dynamic-int8 linears, ~1.7x faster per step and ~60 % top-1 agreement on SmolLM2.
BUILTIN_DRAFTS = {
    "suffix": "the model-free suffix drafter",
    "int8": "an int8 copy of the target",
    "none": "no draft (ar only)",
}


class ConfigError(ValueError):
    """A user-supplied setting is invalid; the message says which and why."""


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most 64 bits
MAX_STOP_CHARS = 1000  # stop strings are matched against every streamed token


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    return cls(**data)


@dataclass
class SamplingParams:
    """How one answer is generated. temperature 0 means greedy.

    The penalties (engine/sampling.py) count the tokens in the last ``repeat_last_n`` of the context, the
    prompt included, as llama.cpp does: ``repeat_penalty`` is transformers' multiplicative rule (1 = off),
    ``presence_penalty`` / ``frequency_penalty`` OpenAI's additive ones (0 = off). They apply in greedy
    mode too; ``min_p`` (0 = off) keeps the tokens at least that fraction as likely as the most likely one.
    ``loop_guard`` (0 = off) ends an answer, finish reason "repetition", once its last ``loop_guard``
    tokens are one span repeated ``loop_repeats`` times or more (engine/loop.py, LoopGuard).
    """

    mode: Mode = "async"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    loop_guard: int = 0
    loop_repeats: int = 3

    def validate(self) -> SamplingParams:
        """Every entry point (TUI, CLI, bench, Engine.generate, the worker) checks a request here, before
        anything runs: a value the sampler cannot take (nan, a seed beyond 64 bits) would fail the workers."""
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), not {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], not {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top-k must be an integer >= 0 (0 = off), not {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ConfigError(f"min-p must be in [0, 1] (0 = off), not {self.min_p!r}")
        if not _is_number(self.repeat_penalty) or not 0 < self.repeat_penalty < math.inf:
            raise ConfigError(f"repeat-penalty must be a finite number > 0 (1 = off), not {self.repeat_penalty!r}")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < 1:
            raise ConfigError(f"repeat-last-n must be an integer >= 1, not {self.repeat_last_n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ConfigError(f"{name.replace('_', '-')} must be in [-2, 2] (0 = off), not {value!r}")
        if not _is_int(self.loop_guard) or self.loop_guard < 0:
            raise ConfigError(f"loop-guard must be an integer >= 0 (0 = off), not {self.loop_guard!r}")
        if not _is_int(self.loop_repeats) or self.loop_repeats < 2:
            raise ConfigError(f"loop-repeats must be an integer >= 2, not {self.loop_repeats!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ConfigError(f"seed must be an integer in 0..{MAX_SEED}, not {self.seed!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError("max-new-tokens must be an integer >= 1")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop must be a list of strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ConfigError(f"a stop string may be at most {MAX_STOP_CHARS} characters long")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits (then every tree node needs its own path's counts)."""
        return self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def summary(self) -> str:
        """The settings in force, short, for a title bar or a report: "greedy · repeat 1.1/64"."""
        if self.greedy:
            parts = ["greedy"]
        else:
            parts = [f"temp {self.temperature:g}"]
            parts += [f"top-k {self.top_k}"] if self.top_k else []
            parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
            parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        if self.repeat_penalty != 1:
            parts.append(f"repeat {self.repeat_penalty:g}/{self.repeat_last_n}")
        parts += [f"presence {self.presence_penalty:g}"] if self.presence_penalty else []
        parts += [f"frequency {self.frequency_penalty:g}"] if self.frequency_penalty else []
        parts += [f"loop guard {self.loop_guard}"] if self.loop_guard else []
        return " · ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        return _from_dict(cls, data).validate()


@dataclass
class TreeParams:
    """SwiftSpec's tree policy: bs nodes verified per target forward, w leaves expanded per draft
    forward, d expansions per round (None: chosen from profiled step times at start)."""

    bs: int = 8
    w: int = 8
    d: int | None = None

    def validate(self) -> TreeParams:
        if not 1 <= self.bs <= 64:
            raise ConfigError("bs (nodes verified per target forward) must be in 1..64")
        if not 1 <= self.w <= 64:
            raise ConfigError("w (leaves expanded per draft forward) must be in 1..64")
        if self.d is not None and not 1 <= self.d <= 64:
            raise ConfigError("d (draft expansions per round) must be in 1..64")
        return self


@dataclass
class EngineConfig:
    """What the Engine starts: models, device layout and tree policy.

    target None means the embedded SmolLM2-135M-Instruct. draft is a model path, "suffix" (the
    model-free suffix drafter), "int8", or "none" (no draft ranks: the engine answers in ``ar`` only). On CUDA, target_devices/draft_devices name GPU indices; on CPU,
    target_procs/draft_procs say how many worker processes each group gets.
    """

    target: str | None = None
    draft: str = "suffix"
    target_devices: list[int] | None = None
    draft_devices: list[int] | None = None
    gpus: int | None = None
    target_procs: int = 1
    draft_procs: int = 1
    device: str = "auto"  # auto | cpu | cuda
    # auto | float32 | bfloat16 | float16, and on the CPU gguf (a GGUF's own blocks) | int4 (blocks made at
    # load); on the CPU auto is measured (engine/worker/profiling.py, choose_cpu_backend)
    dtype: str = "auto"
    # auto | on | off: the target's rows independent of the forward's size, so that speculation is exact
    # by construction (engine/model.py, Transformer.make_batch_invariant; on the CPU engine/cpu_backends.py);
    # auto = on. off: torch's own (faster on a GPU, inexact) kernels.
    batch_invariant: str = "auto"
    max_seq_len: int = 4096
    tree: TreeParams = field(default_factory=TreeParams)
    trust_remote_code: bool = False
    # The suffix drafter also drafts from earlier conversations (a model reuses its own phrasing): with
    # history_db, the answers kept in that history database (engine/history_corpus.py: across sessions,
    # newest first up to its token cap, deletions honoured); without, the session's earlier conversations.
    # Off for benchmarks, where the same prompt runs once per mode (bench --warm gives it a history of its own).
    draft_history: bool = True
    history_db: str | None = None
    # The suffix drafter's corpus of the target's own answers (engine/corpus.py): "auto" = the shipped one
    # for the embedded default, none for other targets; "none"; or a corpus file from swiftspec train-draft.
    draft_corpus: str = "auto"
    # Verify only as many of the bs best nodes as are worth their profiled target cost (DraftState.
    # verify_cost): where extra rows cost a good part of a step (a 2-core CPU: 2 to 8 rows cost 1.7 to 3
    # steps) a weak draft then degrades to ~one row per round instead of being
    # slower than ar (benchmarks/sync_vs_ar.py --cost: suffix sync 0.76x -> 0.97x of ar on fresh questions).
    verify_cost: bool = True
    startup_timeout_s: float = 600.0
    threads: int | None = None  # CPU threads in all; None = every core but one on the Engine's node

    def validate(self) -> EngineConfig:
        self.tree.validate()
        if self.target_procs < 1 or self.draft_procs < 1:
            raise ConfigError("each group needs at least one process")
        if self.gpus is not None and self.gpus < 2 and self.draft != "none":
            raise ConfigError("gpus must be >= 2 (one group for the target, one for the draft)")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be >= 1")
        if self.max_seq_len < 16:
            raise ConfigError("max-seq-len must be >= 16")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device must be auto, cpu or cuda")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.batch_invariant not in ("auto", "on", "off"):
            raise ConfigError("batch-invariant must be auto, on or off")
        if self.draft_corpus not in ("auto", "none") and self.draft != "suffix":
            raise ConfigError("a draft corpus feeds the suffix drafter: give --draft-corpus with --draft suffix")
        return self

    @property
    def drafts_from_store(self) -> bool:
        """Whether the suffix drafter learns from the answers in ``history_db``."""
        return self.draft == "suffix" and self.draft_history and self.history_db is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        data = dict(data)
        data["tree"] = _from_dict(TreeParams, data.get("tree") or {})
        return _from_dict(cls, data).validate()


@dataclass
class StepStats:
    """Live figures after one decoding step (one verification, or one token in ``ar`` mode)."""

    accepted: int = 0  # draft tokens the target accepted this step (the bonus token not counted)
    tree_size: int = 0  # nodes verified this step
    draft_ms: float = 0.0  # mean draft forward time (ms)
    target_ms: float = 0.0  # this step's target forward time (ms)
    token_latency_ms: float = 0.0  # wall time of this step / tokens it produced
    acceptance_rate: float = 0.0  # running: accepted draft tokens / verified draft tokens
    mean_accepted: float = 0.0  # running: tokens produced per verification (accepted + bonus)
    tokens_per_s: float = 0.0  # running, since the first new token
    d: int = 0  # draft expansions per round in use
    prefill_tokens: int = 0  # tokens prefilled for this turn (after KV reuse)
    generated: int = 0  # tokens generated so far this turn
    ms_per_token_p50: float = 0.0  # running: the median of every token's latency this turn
    ms_per_token_p95: float = 0.0  # running: the 95th percentile of the same

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepEvent:
    """One streamed update of an answer: new token ids, the text they complete, and live stats."""

    token_ids: list[int]
    text: str
    stats: StepStats
    finished: bool = False
    finish_reason: FinishReason | None = None


# The chat's sampling defaults (TUI and chat -p) for the embedded model and GGUF files; a model directory's
# generation_config.json replaces the sampling ones. Chosen by benchmarks/loop_rate.py (loop rate and speed
# on the fresh set and its dev questions; docs/ARCHITECTURE.md has the figures). bench stays greedy.
CHAT_DEFAULTS = SamplingParams(temperature=0.7, min_p=0.05, repeat_penalty=1.1, loop_guard=64)
