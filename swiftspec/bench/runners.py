"""The bench's modes: what answers a prompt in each (transformers, the Engine, a peer's process) and the
interleaved run of them all, timed the same way in every mode. A prompt with a JSON Schema reaches every
runner as its SamplingParams' grammar: the Engine's modes and llama.cpp hold the answer to it (the
Engine's ``-free`` modes drop it), the hf modes cannot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swiftspec.bench.prompts import Prompt, turns_of
from swiftspec.engine.config import Device, DraftKind, EngineConfig, Mode, SamplingParams
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.host.protocol import EngineAPI
from swiftspec.engine.model import model_dir


@dataclass(frozen=True)
class EngineMode:
    """How a bench mode runs the Engine: its decoding ``mode``; whether a prompt's schema holds the answer
    (``constrained``; the ``-free`` modes: the same prompts unconstrained) and whether the draft proposes
    the tokens the schema forces (``draft_forced``; the ``-noforce`` modes: what that gains)."""

    mode: Mode
    constrained: bool = True
    draft_forced: bool = True


HF_MODES = ("hf", "hf-assisted")
PEER_MODES = HF_MODES + ("llama.cpp",)  # other engines: their own kernels, so their tokens may differ
ENGINE_MODES = {  # in the order speedups are taken: a later mode over an earlier one
    "ar-free": EngineMode("ar", constrained=False), "sync-free": EngineMode("sync", constrained=False),
    "async-free": EngineMode("async", constrained=False),
    "ar": EngineMode("ar"),
    "sync-noforce": EngineMode("sync", draft_forced=False), "async-noforce": EngineMode("async", draft_forced=False),
    "sync": EngineMode("sync"), "async": EngineMode("async"),
}
SCHEMA_MODES = tuple(m for m, how in ENGINE_MODES.items() if not how.constrained or not how.draft_forced)
ALL_MODES = PEER_MODES + tuple(ENGINE_MODES)
DEFAULT_MODES = HF_MODES + ("ar", "sync", "async")  # llama.cpp only when asked: it is installed by hand
STRUCTURED_MODES = ("ar", "sync", "async", "sync-noforce", "async-noforce", "async-free")  # schema prompts' default
FORGET = ([{"role": "system", "content": "-"}, {"role": "user", "content": "-"}], [{"role": "user", "content": "-"}])


class PeerCrashed(RuntimeError):
    """A peer's process died or answered nonsense; the message says how."""


@dataclass
class Sample:
    """One mode's answer to one prompt, with what was timed while it streamed."""

    token_ids: list[int]  # generated ids, EOS stripped
    seconds: float  # request to last token
    arrivals: list[tuple[float, int]]  # (seconds since request, tokens) for each streamed chunk
    prefill_tokens: int = 0  # prompt tokens whose KV was computed for this answer
    verifications: int = 0  # target forwards after the prefill: decode steps or verifications
    accepted: int = 0  # draft tokens the target accepted
    proposed: int = 0  # draft tokens the target verified
    draft_ms: list[float] = field(default_factory=list)
    target_ms: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # the nodes of each of target_ms's verifications (engine)
    # each decoded token's latency as the engine reports it: its step's own interval in the target leader,
    # which streams its steps in frames of several (engine runs; empty for the peers)
    token_ms: list[float] = field(default_factory=list)

    def latencies_ms(self) -> list[float]:
        """Per-token decode latency: the engine's own (token_ms), else each gap between arrivals shared by
        the tokens that arrived at its end. The first chunk waits for the prefill, so it counts as time
        to first token instead."""
        if self.token_ms:
            return self.token_ms
        out: list[float] = []
        for (prev, _), (t, n) in zip(self.arrivals, self.arrivals[1:], strict=False):
            out += [(t - prev) * 1000.0 / n] * n
        return out

    @property
    def ttft_ms(self) -> float | None:
        return self.arrivals[0][0] * 1000.0 if self.arrivals else None

    @property
    def step_ms(self) -> float | None:
        """Wall time per target forward after the first token: the target's own time plus whatever the
        critical path adds (draft in sync, communication, Python)."""
        return (self.seconds * 1000.0 - self.ttft_ms) / self.verifications if self.verifications else None


Runner = Callable[[list[dict[str, str]], SamplingParams], Sample]


def strip_eos(ids: list[int], eos: list[int]) -> list[int]:
    while ids and ids[-1] in eos:
        ids = ids[:-1]
    return ids


@contextlib.contextmanager
def timed_forwards(module) -> Iterator[list[tuple[float, int]]]:
    """Records (ms, logits kept) for each forward of ``module``; logits kept = 1 + draft tokens verified.
    On CUDA the forward is synchronised so that its time is the kernels', not the launches'."""
    import torch

    sync = torch.cuda.synchronize if next(module.parameters()).is_cuda else lambda: None
    calls: list[tuple[float, int]] = []
    start: list[float] = []

    def pre(_mod, _args, kwargs):
        sync()
        start.append(time.perf_counter())
        start.append(kwargs.get("logits_to_keep") or 1)

    def post(_mod, _args, _out):
        sync()
        keep = start.pop()
        calls.append(((time.perf_counter() - start.pop()) * 1000.0, int(keep)))

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


class _Arrivals:
    """A transformers streamer that timestamps each chunk of new tokens (the first put is the prompt)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.chunks: list[tuple[float, int]] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.chunks.append((time.perf_counter() - self.t0, int(value.numel())))
        self.prompt_seen = True

    def end(self) -> None:
        pass


@dataclass
class HFRunner:
    """Hugging Face ``generate``: greedy, dynamic cache (the default), optionally assisted.

    ``assist`` holds the extra generate() arguments: ``assistant_model`` or ``prompt_lookup_num_tokens``.
    """

    model: Any
    tokenizer: Any
    eos: list[int]
    assist: dict[str, Any] = field(default_factory=dict)

    def __call__(self, messages: list[dict[str, str]], params: SamplingParams) -> Sample:
        import torch
        from transformers import GenerationConfig

        from swiftspec.engine.spec.sampling import Sampler  # torch: only for the hf modes

        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p,
                                             "top_k": params.top_k, "min_p": params.min_p or None}
        if params.penalised and not params.greedy:  # the processor below does it all, in our order
            sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        gen = GenerationConfig(do_sample=not params.greedy, max_new_tokens=params.max_new_tokens,
                               eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None,
                               **sampling, **self.assist_config())
        if params.seed is not None:
            torch.manual_seed(params.seed)
        draft_model = self.assist.get("assistant_model")
        with timed_forwards(self.model) as target, \
                (timed_forwards(draft_model) if draft_model is not None else contextlib.nullcontext([])) as draft, \
                torch.inference_mode():
            t0 = time.perf_counter()
            ids = encode_chat(self.tokenizer, messages)
            x = torch.tensor([ids], device=self.model.device)
            streamer = _Arrivals(t0)
            kwargs = {"assistant_model": draft_model} if draft_model is not None else {}
            if params.penalised:  # our penalty window, not transformers' whole-context repetition_penalty
                kwargs["logits_processor"] = [PenaltyProcessor(Sampler(params))]
            out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen,
                                      streamer=streamer, **kwargs)
        chunks = streamer.chunks
        return Sample(
            token_ids=strip_eos(out[0, len(ids):].tolist(), self.eos),
            seconds=chunks[-1][0] if chunks else 0.0,
            arrivals=chunks,
            prefill_tokens=len(ids),
            # the first forward is the prefill (in hf-assisted, with the first candidates)
            verifications=max(len(chunks) - 1, 0),
            accepted=sum(n - 1 for _, n in chunks[1:]),
            proposed=sum(keep - 1 for _, keep in target[1:]),
            draft_ms=[ms for ms, _ in draft[1:]],
            target_ms=[ms for ms, _ in target[1:]],
        )

    def assist_config(self) -> dict[str, Any]:
        return {k: v for k, v in self.assist.items() if k != "assistant_model"}


@dataclass
class PenaltyProcessor:
    """A transformers logits processor that penalises each row from its ids as our Sampler does (and, when
    sampling, applies the rest of our distribution too, as log-probabilities: transformers would run its
    temperature and top-k/p before a processor of ours)."""

    sampler: Any

    def __call__(self, input_ids, scores):
        import torch

        one, s = torch.ones(1, 1, dtype=torch.bool), self.sampler
        rows = torch.cat([s.logits(row[None], ids[:-1].tolist(), ids[-1:].tolist(), one)
                          for ids, row in zip(input_ids, scores, strict=True)])
        return (rows if s.greedy else s.probs(rows).log()).to(scores.dtype)


@dataclass
class EngineRunner:
    """One of the Engine's modes (a name of ENGINE_MODES). The Engine streams one event per step: the
    first is the prefill, each later one a verification (or, in ``ar``, one decode step) with its own
    accepted count and timings. A final EOS is streamed too, and stripped here as in ``hf``."""

    engine: EngineAPI
    mode: str
    eos: list[int]

    def __call__(self, messages: list[dict[str, str]], params: SamplingParams) -> Sample:
        self.forget()
        how = ENGINE_MODES[self.mode]
        params = dataclasses.replace(params, mode=how.mode, draft_forced=how.draft_forced,
                                     grammar=params.grammar if how.constrained else None)
        s = Sample([], 0.0, [])
        prefill = True
        t0 = time.perf_counter()
        for ev in self.engine.generate(messages, params):
            if ev.token_ids:
                s.arrivals.append((time.perf_counter() - t0, len(ev.token_ids)))
                s.token_ids += ev.token_ids
            if prefill:
                prefill = False
                s.prefill_tokens = ev.stats.prefill_tokens
                continue
            st = ev.stats
            s.token_ms += [st.token_latency_ms] * len(ev.token_ids)
            s.verifications += 1
            s.accepted += st.accepted
            s.proposed += max(st.tree_size - 1, 0)
            s.target_ms.append(st.target_ms)
            s.tree_sizes.append(st.tree_size)
            if st.draft_ms:
                s.draft_ms.append(st.draft_ms)
        s.token_ids = strip_eos(s.token_ids, self.eos)
        s.seconds = s.arrivals[-1][0] if s.arrivals else 0.0
        return s

    def forget(self) -> None:
        """The Engine keeps the KV of the last conversation for a follow-up turn, so a prompt would skip
        the prefill of the part it shares with the previous one (the template's system header). A
        one-token answer to a conversation that diverges at once (at the system turn, where the template
        allows one) makes every timed prompt prefill in full, as in ``hf``."""
        params = SamplingParams(mode="ar", temperature=0.0, max_new_tokens=1)
        for messages in FORGET:
            try:
                for _ in self.engine.generate(messages, params):
                    pass
                return
            except Exception:  # a template that rejects a system turn: try the next conversation
                if messages is FORGET[-1]:
                    raise


def run_interleaved(runners: dict[str, Runner], prompts: list[Prompt], params: SamplingParams,
                    samples: dict[str, list[Sample]], on_step: Callable[[int, str], None] | None = None,
                    on_prompt: Callable[[int], None] | None = None, crashed: dict[str, str] | None = None,
                    turns: str = "first", decode: Callable[[list[int]], str] | None = None) -> None:
    """Every mode on prompt i before prompt i+1; the mode order rotates by one per prompt. With ``turns``
    "all" a mode answers every turn of a record in turn, each after its own earlier answers (``decode``
    makes their text). Each prompt's schema, if any, goes in its ``params`` (Prompt.params). ``samples``
    is filled as answers finish, one per turn, so that an interrupted run still holds every finished one. A peer that crashes (PeerCrashed) leaves the run: its samples go,
    ``crashed`` says why."""
    modes = list(runners)
    for i, prompt in enumerate(prompts):
        k = i % len(modes)
        for mode in modes[k:] + modes[:k]:
            if mode not in runners:
                continue
            if on_step:
                on_step(i, mode)
            try:
                messages = prompt.messages
                for n, text in enumerate(turns_of(prompt, turns)):
                    if n:
                        earlier = decode(samples[mode][-1].token_ids)
                        messages = messages + [{"role": "assistant", "content": earlier},
                                               {"role": "user", "content": text}]
                    samples.setdefault(mode, []).append(runners[mode](messages, prompt.params(params)))
            except PeerCrashed as e:
                if crashed is None:
                    raise
                crashed[mode] = str(e)
                del runners[mode]
                samples.pop(mode, None)
        if on_prompt:
            on_prompt(i)


def finished_prompts(samples: dict[str, list[Sample]], modes: list[str]) -> int:
    """How many answers (rows: prompts, or turns with --turns all) every mode has given (the rest of an
    interrupted run is left out)."""
    return min(len(samples.get(m, [])) for m in modes)


def hf_assist(config: EngineConfig) -> dict[str, Any]:
    """What hf-assisted uses as its draft: the same draft model, or prompt lookup for the suffix drafter
    (chains of bs-1 tokens, so both verify bs tokens per target forward)."""
    if config.builtin_draft is DraftKind.SUFFIX:
        return {"prompt_lookup_num_tokens": max(1, config.tree.bs - 1)}
    return {"assistant_model": str(model_dir.resolve_model_dir(config.draft))}


def hf_device(config: EngineConfig) -> tuple[str, str]:
    """Where the hf baselines run, and in which dtype: where and how the Engine's target runs (fp32 on
    CPU, bf16 on CUDA unless --dtype says otherwise). A CPU float16 target (fp16 weights, fp32 math) is
    compared with transformers in fp32: the same math on weights that were not rounded."""
    import torch

    from swiftspec.engine.model.loader import default_dtype  # torch: only for the hf modes

    device = "cuda" if config.device != Device.CPU and torch.cuda.is_available() else "cpu"
    return device, str(default_dtype(torch.device(device), config.dtype)).removeprefix("torch.")


def hf_runners(target_dir: Path, tokenizer, eos: list[int], config: EngineConfig, modes: list[str],
               assist: dict[str, Any] | None) -> dict[str, Runner]:
    import torch
    import transformers

    from swiftspec.engine.model.loader import load_hf_model  # torch: only for the hf modes

    transformers.utils.logging.disable_progress_bar()
    if config.threads:
        torch.set_num_threads(config.threads)
    device, dtype = hf_device(config)

    def load(path) -> Any:
        model = load_hf_model(Path(path), getattr(torch, dtype), config.trust_remote_code)
        return model.to(device).eval()

    model = load(target_dir)
    runners: dict[str, Runner] = {}
    if "hf" in modes:
        runners["hf"] = HFRunner(model, tokenizer, eos)
    if assist is not None:
        if "assistant_model" in assist:
            assist = {"assistant_model": load(assist["assistant_model"])}
        runners["hf-assisted"] = HFRunner(model, tokenizer, eos, assist)
    return runners
