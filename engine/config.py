"""What the Engine starts and how it answers, as the Engine, its workers and the app share them:
EngineConfig, TreeParams, SamplingParams, and the vocabularies they use (modes, draft kinds, devices,
dtypes, activations, KV caches, batch invariance), each parsed and checked here.

They travel between the Engine and its workers as JSON (``to_dict`` / ``from_dict``), never pickled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, get_args

Mode = Literal["ar", "sync", "async"]
MODES: tuple[str, ...] = get_args(Mode)
Role = Literal["target", "draft"]  # a worker rank's group


class Device(StrEnum):
    """Where the workers run (--device): ``auto`` is CUDA where a device is visible, else the CPU."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def of(cls, device: object) -> Device:
        """The kind of a torch device or its name ("cuda:1" is CUDA): where a placed device's type is read."""
        return cls(str(device).partition(":")[0])


class Dtype(StrEnum):
    """The width the target runs at (--dtype). On the CPU, ``gguf`` runs a GGUF's own blocks and ``int4``
    blocks made at load; ``auto`` is measured there (engine/worker/profiling.py) and bfloat16 on GPUs."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    GGUF = "gguf"
    INT4 = "int4"

    @property
    def blocks(self) -> bool:
        """Whether it runs from quantised blocks (the CPU's block kernels, one rank)."""
        return self in (Dtype.GGUF, Dtype.INT4)


DTYPES: tuple[str, ...] = tuple(Dtype)
FLOAT_DTYPES = (Dtype.FLOAT32, Dtype.FLOAT16, Dtype.BFLOAT16)  # widths a checkpoint is stored at


class Activations(StrEnum):
    """What the CPU kernels round the activations to before the weights multiply them (--activations): a
    GGUF's blocks take int16 in blocks of 32 (~0.1 % of the logits' range from fp32 on SmolLM2) or llama.cpp's
    int8 (half a row's work, 5-6 %); bfloat16 weights take fp32 (with int16) or bf16, torch's precision at
    bfloat16, half a row's work on AVX512-BF16. Every decoding mode computes the same tokens with any."""

    INT16 = "int16"
    INT8 = "int8"
    BF16 = "bf16"

    @property
    def bits(self) -> int:  # the integer blocks' width
        return 8 if self is Activations.INT8 else 16


ACTIVATIONS: tuple[str, ...] = tuple(Activations)


class KvCache(StrEnum):
    """What the CPU kernels keep the keys and values in (--kv-cache). ``auto``: float16 beside a GGUF's
    blocks (gguf, int4), as llama.cpp does (~0.03 % of the logits' range from float32 on SmolLM2, and a
    decode step 14-19 % faster at 1000-2000 tokens of context, where attention streams the whole cache),
    float32 beside float weights. Every decoding mode computes the same tokens with either."""

    AUTO = "auto"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


KV_CACHES: tuple[str, ...] = tuple(KvCache)


class BatchInvariance(StrEnum):
    """Whether the target's rows are independent of the forward's size (--batch-invariant), which makes
    speculation exact by construction: ``auto`` is on; ``off`` runs torch's own (faster on a GPU,
    inexact) kernels."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @property
    def forced(self) -> bool | None:
        """True or False as asked; None: the model's own choice (on)."""
        return None if self is BatchInvariance.AUTO else self is BatchInvariance.ON


class DraftKind(StrEnum):
    """What drafts. Three are named by a word (``--draft suffix | int8 | none``); a path is a draft head
    or a draft model (engine/spec/draft_spec.py tells which)."""

    SUFFIX = "suffix"  # the model-free suffix drafter
    INT8 = "int8"  # a copy of the target with dynamic-int8 linears (CPU only)
    NONE = "none"  # no draft ranks: ar only
    HEAD = "head"  # a draft head directory (ours or EAGLE's): one layer on the target's features
    MODEL = "model"  # a draft model of the target's family

    @classmethod
    def named(cls, draft: str) -> DraftKind | None:
        """The built-in draft a word names; None for a path."""
        return cls(draft) if draft in BUILTIN_DRAFTS else None


BUILTIN_DRAFTS: dict[str, str] = {
    DraftKind.SUFFIX: "the model-free suffix drafter",
    DraftKind.INT8: "an int8 copy of the target",
    DraftKind.NONE: "no draft (ar only)",
}


class DraftCorpus(StrEnum):
    """The suffix drafter's corpus where a word names it (``--draft-corpus auto | none``); anything else
    is a corpus file (swiftspec train-draft writes one)."""

    AUTO = "auto"  # the one shipped for the embedded default, none for other targets
    NONE = "none"  # no corpus


class GrammarKind(StrEnum):
    """What constrains an answer's text (engine/spec/grammar.py): any JSON object, a JSON Schema, a Lark
    grammar (or llama.cpp's GBNF) or a regular expression."""

    JSON = "json"
    JSON_SCHEMA = "json_schema"
    LARK = "lark"
    REGEX = "regex"


MAX_GRAMMAR_CHARS = 100_000  # a schema, grammar or regex; grammar.LIMITS bound its compile and masks


class ConfigError(ValueError):
    """A user-supplied setting is invalid; the message says which and why. One setting's refused value
    (``refused``) also carries the setting, what it accepts and the value, for a caller that words the
    refusal its own way (the command line names the flag)."""

    setting: str | None = None
    accepted: str = ""
    value: Any = None
    wrong: str = ""  # what is wrong with the value, when more than its range ("'x' cannot be read")

    @classmethod
    def refused(cls, setting: str, accepted: str, value: Any, wrong: str = "") -> ConfigError:
        """``setting`` (named as its flag, without dashes) must be ``accepted``, not ``value`` (of which
        ``wrong`` says what is wrong)."""
        error = cls(f"{setting}: {wrong}; {accepted}" if wrong else f"{setting} must be {accepted}, not {value!r}")
        error.setting, error.accepted, error.value, error.wrong = setting, accepted, value, wrong
        return error


def _parse(vocabulary: type[StrEnum], value: Any, flag: str):
    """``value`` as a member of ``vocabulary``, or the ConfigError naming the flag and every choice."""
    try:
        return vocabulary(value)
    except ValueError:
        names = list(vocabulary)
        accepted = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) <= 3 else f"one of {', '.join(names)}"
        raise ConfigError.refused(flag, accepted, value) from None


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


@dataclass(frozen=True)
class Grammar:
    """A constraint on an answer: every token is one the grammar allows after the tokens before it.
    ``source``: the schema as JSON text, the Lark grammar or the regex ("" for any JSON object)."""

    kind: GrammarKind
    source: str = ""

    @classmethod
    def parse(cls, value: Any) -> Grammar:
        """A Grammar from itself or its dict, its kind parsed (the library's check is grammar.check)."""
        if isinstance(value, dict):
            value = _from_dict(cls, value)
        if not isinstance(value, Grammar) or not isinstance(value.source, str):
            raise ConfigError("grammar must be a kind and a source string")
        if len(value.source) > MAX_GRAMMAR_CHARS:
            raise ConfigError(f"a grammar may be at most {MAX_GRAMMAR_CHARS} characters long")
        kind = _parse(GrammarKind, value.kind, "grammar kind")
        if (kind is GrammarKind.JSON) != (value.source == ""):
            raise ConfigError("a json grammar has no source; every other kind needs one")
        return cls(kind, value.source)

    def describe(self) -> str:
        """Short, for a summary: "json schema"."""
        return self.kind.replace("_", " ")


@dataclass
class SamplingParams:
    """How one answer is generated. temperature 0 means greedy.

    The penalties (engine/spec/sampling.py) count the tokens in the last ``repeat_last_n`` of the context, the
    prompt included, as llama.cpp does: ``repeat_penalty`` is transformers' multiplicative rule (1 = off),
    ``presence_penalty`` / ``frequency_penalty`` OpenAI's additive ones (0 = off). They apply in greedy
    mode too; ``min_p`` (0 = off) keeps the tokens at least that fraction as likely as the most likely one.
    ``loop_guard`` (0 = off) ends an answer, finish reason "repetition", once its last ``loop_guard``
    tokens are one span repeated ``loop_repeats`` times or more (engine/spec/loop.py, LoopGuard).
    ``grammar``: the answer's tokens are the ones it allows, each tree node masked by its own path's
    state after the penalties (engine/spec/grammar.py), so that speculation stays exact and lossless.
    ``draft_forced`` False: the draft does not propose the tokens the grammar forces (only to measure what
    proposing them gains: the bench's ``-noforce`` modes).
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
    grammar: Grammar | None = None
    draft_forced: bool = True

    def validate(self) -> SamplingParams:
        """Every entry point (TUI, CLI, bench, Engine.generate, the worker) checks a request here, before
        anything runs: a value the sampler cannot take (nan, a seed beyond 64 bits) would fail the workers."""
        if self.mode not in MODES:
            raise ConfigError.refused("mode", f"one of {', '.join(MODES)}", self.mode)
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ConfigError.refused("temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError.refused("top-p", "a number in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError.refused("top-k", "a whole number >= 0 (0 = off)", self.top_k)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ConfigError.refused("min-p", "a number in [0, 1] (0 = off)", self.min_p)
        if not _is_number(self.repeat_penalty) or not 0 < self.repeat_penalty < math.inf:
            raise ConfigError.refused("repeat-penalty", "a finite number > 0 (1 = off)", self.repeat_penalty)
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < 1:
            raise ConfigError.refused("repeat-last-n", "a whole number >= 1", self.repeat_last_n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ConfigError.refused(name.replace("_", "-"), "a number in [-2, 2] (0 = off)", value)
        if not _is_int(self.loop_guard) or self.loop_guard < 0:
            raise ConfigError.refused("loop-guard", "a whole number >= 0 (0 = off)", self.loop_guard)
        if not _is_int(self.loop_repeats) or self.loop_repeats < 2:
            raise ConfigError.refused("loop-repeats", "a whole number >= 2", self.loop_repeats)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ConfigError.refused("seed", f"a whole number in 0..{MAX_SEED}", self.seed)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError.refused("max-new-tokens", "a whole number >= 1", self.max_new_tokens)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop must be a list of strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ConfigError(f"a stop string may be at most {MAX_STOP_CHARS} characters long")
        if self.grammar is not None:
            self.grammar = Grammar.parse(self.grammar)
        if not isinstance(self.draft_forced, bool):
            raise ConfigError.refused("draft-forced", "true or false", self.draft_forced)
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
        parts += [self.grammar.describe()] if self.grammar else []
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
            raise ConfigError.refused("bs", "a whole number in 1..64 (nodes verified per target forward)", self.bs)
        if not 1 <= self.w <= 64:
            raise ConfigError.refused("w", "a whole number in 1..64 (leaves expanded per draft forward)", self.w)
        if self.d is not None and not 1 <= self.d <= 64:
            raise ConfigError.refused("d", "a whole number in 1..64 (draft expansions per round)", self.d)
        return self


@dataclass
class EngineConfig:
    """What the Engine starts: models, device layout and tree policy.

    target None means the embedded SmolLM2-135M-Instruct. draft is a built-in word (DraftKind) or a path
    to a draft head or model. On CUDA, target_devices/draft_devices name GPU indices; on CPU,
    target_procs/draft_procs say how many worker processes each group gets. ``validate`` parses the
    vocabularies (device, dtype, activations, kv_cache, batch_invariant) into their enums.
    """

    target: str | None = None
    draft: str = "suffix"
    target_devices: list[int] | None = None
    draft_devices: list[int] | None = None
    gpus: int | None = None
    target_procs: int = 1
    draft_procs: int = 1
    device: Device = Device.AUTO
    dtype: Dtype = Dtype.AUTO
    activations: Activations = Activations.INT16
    kv_cache: KvCache = KvCache.AUTO
    batch_invariant: BatchInvariance = BatchInvariance.AUTO
    max_seq_len: int = 4096
    tree: TreeParams = field(default_factory=TreeParams)
    trust_remote_code: bool = False
    # The suffix drafter also drafts from earlier conversations (a model reuses its own phrasing): with
    # history_db, the answers kept in that history database (engine/spec/history_corpus.py: across sessions,
    # newest first up to its token cap, deletions honoured); without, the session's earlier conversations.
    # Off for benchmarks, where the same prompt runs once per mode (bench --warm gives it a history of its own).
    draft_history: bool = True
    history_db: str | None = None
    # The suffix drafter's corpus of the target's own answers (engine/spec/corpus.py): a word (DraftCorpus)
    # or a corpus file from swiftspec train-draft.
    draft_corpus: str = DraftCorpus.AUTO
    # Verify only as many of the bs best nodes as are worth their profiled target cost (DraftState.
    # verify_cost): where extra rows cost a good part of a step (a CPU), a weak draft then degrades to about
    # one row per round instead of being slower than ar (benchmarks/sync_vs_ar.py --cost measures it).
    verify_cost: bool = True
    startup_timeout_s: float = 600.0
    threads: int | None = None  # CPU threads in all; None = every core but one on the Engine's node

    def validate(self) -> EngineConfig:
        self.tree.validate()
        for name in ("target_procs", "draft_procs"):
            if getattr(self, name) < 1:
                raise ConfigError.refused(name.replace("_", "-"), "a whole number >= 1 (each group needs at least one process)",
                                          getattr(self, name))
        if self.gpus is not None and self.gpus < 2 and self.speculative:
            raise ConfigError.refused("gpus", "a whole number >= 2 (one group for the target, one for the draft)", self.gpus)
        if self.threads is not None and self.threads < 1:
            raise ConfigError.refused("threads", "a whole number >= 1", self.threads)
        if self.max_seq_len < 16:
            raise ConfigError.refused("max-seq-len", "a whole number >= 16", self.max_seq_len)
        self.device = _parse(Device, self.device, "device")
        self.dtype = _parse(Dtype, self.dtype, "dtype")
        self.activations = _parse(Activations, self.activations, "activations")
        if self.activations is Activations.INT8 and self.dtype in FLOAT_DTYPES:
            raise ConfigError(f"--activations int8: quantises what a GGUF's integer blocks multiply; --dtype "
                              f"{self.dtype} multiplies in fp32 (use --dtype gguf, int4 or auto)")
        if self.activations is Activations.BF16 and self.dtype not in (Dtype.BFLOAT16, Dtype.AUTO):
            raise ConfigError(f"--activations bf16 is for bfloat16 weights: --dtype bfloat16, not {self.dtype}")
        self.kv_cache = _parse(KvCache, self.kv_cache, "kv-cache")
        self.batch_invariant = _parse(BatchInvariance, self.batch_invariant, "batch-invariant")
        if self.corpus_file is not None and self.builtin_draft is not DraftKind.SUFFIX:
            raise ConfigError("a draft corpus feeds the suffix drafter: give --draft-corpus with --draft suffix")
        return self

    @property
    def builtin_draft(self) -> DraftKind | None:
        """The built-in draft ``draft`` names; None for a path."""
        return DraftKind.named(self.draft)

    @property
    def corpus_file(self) -> str | None:
        """The corpus file ``draft_corpus`` names; None for a word (DraftCorpus)."""
        return None if self.draft_corpus in tuple(DraftCorpus) else self.draft_corpus

    def for_mode(self, mode: Mode) -> EngineConfig:
        """This config for a session whose answers are decoded in ``mode``: for ``ar``, which never asks a
        draft for a token, no draft ranks and so no corpus (nothing is started that would idle); for the
        speculative modes, unchanged."""
        if mode != "ar":
            return self
        return dataclasses.replace(self, draft=DraftKind.NONE, draft_corpus=DraftCorpus.NONE)

    @property
    def speculative(self) -> bool:
        """Whether there is a draft at all (``none``: no draft ranks, ``ar`` only)."""
        return self.builtin_draft is not DraftKind.NONE

    @property
    def drafts_from_store(self) -> bool:
        """Whether the suffix drafter learns from the answers in ``history_db``."""
        return self.builtin_draft is DraftKind.SUFFIX and self.draft_history and self.history_db is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        data = dict(data)
        data["tree"] = _from_dict(TreeParams, data.get("tree") or {})
        return _from_dict(cls, data).validate()
