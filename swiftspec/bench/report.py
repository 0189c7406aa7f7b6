"""The bench's report, computed from one run's samples only: the figures per mode and the speedups, the
tables, the JSON, the plot and the run's configuration.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from swiftspec.bench.prompts import WARMUP_TOKENS, BenchError, Prompt
from swiftspec.bench.runners import ALL_MODES, ENGINE_MODES, PEER_MODES, Sample, hf_device
from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.host.protocol import EngineInfo

SPEEDUP_BASELINES = ("hf", "llama.cpp", "ar", "async-free")
TOKENS_PER_S = "total generated tokens / total wall time (request to last token), over all prompts"
SPEEDUP = "this mode's tok/s / the other mode's tok/s (the tok/s column's ratio)"
STEP_MS = ("draft/target ms: median over forwards (prefill excluded); step ms: wall time per target forward "
           "after the first token, median over prompts")
VALID = ("valid: the answers that parse as JSON and validate against their prompt's schema (jsonschema; one cut "
         "by --max-new-tokens is incomplete, so not valid); -free modes answer without the schema, -noforce ones "
         "do not draft the tokens it forces")


def jsonschema_module():
    try:
        import jsonschema
    except ImportError:
        raise BenchError("prompts with a schema need jsonschema to check the answers: pip install jsonschema "
                         "(or pip install 'swiftspec[dev]')") from None
    return jsonschema


def validates(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON valid against ``schema``."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema_module().Draft202012Validator(schema).is_valid(value)


def applies_schema(mode: str) -> bool:
    """Whether a mode holds its answers to their prompts' schemas: the constrained engine modes and llama.cpp."""
    return mode == "llama.cpp" or mode in ENGINE_MODES and ENGINE_MODES[mode].constrained


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_mode(modes: list[str], mode: str | None = None) -> str | None:
    """The target-only greedy output that every mode (or ``mode``) must equal: ``ar`` if run, else ``hf``;
    for a ``-free`` mode (answers without their schemas), ``ar-free`` if run."""
    if mode in ENGINE_MODES and not ENGINE_MODES[mode].constrained:
        return "ar-free" if "ar-free" in modes else None
    return next((m for m in ("ar", "hf") if m in modes), None)


def summarise(samples: dict[str, list[Sample]], prompts: list[Prompt], greedy: bool = True,
              texts: dict[str, list[str]] | None = None) -> tuple[list[dict], dict[str, float]]:
    """Per-mode results and speedups, all computed from this run's samples. Sampled answers differ by
    design, so without ``greedy`` no mode is compared with the target's tokens. ``texts``: each mode's
    answers as text, checked against their prompts' schemas where the mode applies them."""
    import numpy as np

    modes = list(samples)
    hf = "hf" if greedy and "hf" in samples else None
    schemas = any(p.schema is not None for p in prompts)
    results = []
    for mode in modes:
        ss = samples[mode]
        ref = reference_mode(modes, mode) if greedy else None
        lat = [x for s in ss for x in s.latencies_ms()]
        ttft = [s.ttft_ms for s in ss if s.ttft_ms is not None]
        p50, p95 = (float(v) for v in np.percentile(lat, [50, 95])) if lat else (None, None)
        per_prompt = []
        for i, (p, s) in enumerate(zip(prompts, ss, strict=True)):
            row: dict[str, Any] = {"set": p.source, "id": p.id, "turn": p.turn, "tokens": len(s.token_ids),
                                   "seconds": round(s.seconds, 4),
                                   "tokens_per_s": len(s.token_ids) / s.seconds if s.seconds else None,
                                   "verifications": s.verifications, "step_ms": s.step_ms}
            if schemas and texts is not None and applies_schema(mode) and p.schema is not None:
                row["valid"] = validates(texts[mode][i], p.schema)
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
            "valid": sum(r["valid"] for r in per_prompt if "valid" in r) if any("valid" in r for r in per_prompt)
            else None,
            "checked": sum("valid" in r for r in per_prompt),
            "prompts": len(ss),
            "prefill_tokens": sum(s.prefill_tokens for s in ss),
            "tokens": figures["tokens"],
            "seconds": figures["seconds"],
            "by_turn": {str(t): _figures([s for p, s in zip(prompts, ss, strict=True) if p.turn == t])
                        for t in sorted({p.turn for p in prompts})},
            "per_prompt": per_prompt,
        })
    step = next((r["target_ms"] for r in results if r["mode"] == "ar"), None)
    for r in results:
        r["verify_steps"] = verify_steps(samples[r["mode"]], step) if step else {}
    tps = {r["mode"]: r["tokens_per_s"] for r in results}
    speedup = {f"{m}/{b}": tps[m] / tps[b] for m in modes for b in modes
               if m != b and (b in SPEEDUP_BASELINES or ALL_MODES.index(m) > ALL_MODES.index(b)) and tps[m]
               and tps[b]}
    return results, speedup


MIN_VERIFICATIONS = 10  # of one node count, for its cost to be reported


def verify_steps(ss: list[Sample], step_ms: float) -> dict[str, float]:
    """What a mode's verifications of each node count cost in these answers, in ``step_ms`` (ar's median
    step): the median of their target ms over it, for the counts verified MIN_VERIFICATIONS times or more."""
    by_nodes: dict[int, list[float]] = {}
    for s in ss:
        for n, ms in zip(s.tree_sizes, s.target_ms, strict=False):  # none for the peers, which verify no trees
            if n:
                by_nodes.setdefault(n, []).append(ms)
    return {str(n): statistics.median(v) / step_ms for n, v in sorted(by_nodes.items()) if len(v) >= MIN_VERIFICATIONS}


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
    schemas = any(r["valid"] is not None for r in results)
    ref += "; -free modes: as ar-free" if any(m in ENGINE_MODES and not ENGINE_MODES[m].constrained
                                              for m in modes) else ""
    caption = [f"tok/s = {TOKENS_PER_S}; {cfg['decoding']}.", f"× = {SPEEDUP}.",
               f"{STEP_MS}.", f"= target: same tokens as {ref} on every prompt (peers, with kernels of their "
                              "own, show how many prompts agree).",
               "threads: " + ", ".join(f"{m} {t}" for m, t in cfg.get("threads", {}).items()) + "."]
    cost = (cfg.get("engine") or {}).get("verify_cost") or []
    if len(cost) > 1:
        caption.append("profiled verification cost, in one-node target forwards: "
                       + ", ".join(f"{n} nodes {c:.2f}" for n, c in enumerate(cost, 1) if n > 1) + ".")
    measured = [f"{r['mode']} " + ", ".join(f"{n}: {c:.2f}" for n, c in r["verify_steps"].items())
                for r in results if r.get("verify_steps")]
    if measured:
        caption.append("verification cost in these answers, in ar's steps (median target ms by nodes verified ÷ "
                       "ar's): " + "; ".join(measured) + ".")
    caption += [f"{VALID}."] if schemas else []
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
    if schemas:
        table.add_column("valid", justify="right")
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
        if schemas:
            valid = r["valid"]
            cells.append("–" if valid is None else f"[{'green' if valid == r['checked'] else 'red'}]"
                                                   f"{valid}/{r['checked']}[/]")
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


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or pip install 'swiftspec[dev]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(report: dict[str, Any], samples: dict[str, list[Sample]], path: Path) -> None:
    plt = pyplot()
    fig = plot_figure(report, samples)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_figure(report: dict[str, Any], samples: dict[str, list[Sample]]):
    """Two panels: tokens/s per mode (each bar labelled with the report's speedup over hf, else ar: the
    ratio of the bars' heights), and the per-token latency distribution per mode (box = p25..p75,
    whiskers = p5..p95)."""
    plt = pyplot()
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
            parts.append(f"{role} {len(ranks)} × {each or max(r.torch_threads for r in ranks)}")
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
        "schemas": sum(p.schema is not None for p in prompts),
        "valid": VALID if any(p.schema is not None for p in prompts) else None,
        "hf_assisted": assist,
        "hf_device": "/".join(hf_device(config)),
        "hf_threads": torch.get_num_threads(),
        "threads": threads or {},
        "warnings": warnings or [],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "machine": f"{platform.system()} {platform.machine()}",
    }
