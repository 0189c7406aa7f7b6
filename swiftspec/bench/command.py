"""``swiftspec bench`` itself: every option checked before any model loads, then the modes started, warmed
up, run on the prompts and reported (partly, after Ctrl-C).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

from swiftspec.bench import llamacpp
from swiftspec.bench.prompts import (
    TURNS,
    WARMUP,
    WARMUP_TOKENS,
    BenchError,
    Prompt,
    select_prompts,
    turn_rows,
    warm_prompts,
)
from swiftspec.bench.report import (
    engine_threads,
    jsonschema_module,
    load_warning,
    pyplot,
    render_table,
    render_turns,
    report_config,
    summarise,
    write_json,
    write_plot,
)
from swiftspec.bench.runners import (
    ALL_MODES,
    DEFAULT_MODES,
    ENGINE_MODES,
    HF_MODES,
    SCHEMA_MODES,
    STRUCTURED_MODES,
    EngineRunner,
    PeerCrashed,
    Runner,
    Sample,
    finished_prompts,
    hf_assist,
    hf_runners,
    run_interleaved,
)
from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.engine.host.protocol import EngineInfo
from swiftspec.engine.model import embedded, model_dir
from swiftspec.history import HistoryStore


def parse_modes(modes: str) -> list[str]:
    accepted = f"comma-separated modes: {', '.join(ALL_MODES)}"
    out: list[str] = []
    for m in (x.strip() for x in modes.split(",")):
        if not m:
            continue
        if m not in ALL_MODES:
            raise BenchError.refused("modes", accepted, modes, wrong=f"{m!r} is not a mode")
        if m not in out:
            out.append(m)
    if not out:
        raise BenchError.refused("modes", accepted, modes, wrong="no mode given")
    return out


def llamacpp_gguf(config: EngineConfig) -> Path:
    """The GGUF file llama.cpp reads: the embedded default's, or the --target file."""
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
    from swiftspec import Engine  # the engine's client: only for the engine's modes

    config = dataclasses.replace(config, draft_history=history_db is not None,
                                 history_db=None if history_db is None else str(history_db))
    with err.status("starting the engine") as status:
        return Engine.start(config, progress=lambda line: status.update(f"starting the engine: {line}"))


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


def check_schema_modes(mode_list: list[str], selected: list[Prompt]) -> None:
    """Prompts with a schema go to the modes that apply it (the -free ones drop it): never to hf, which
    cannot; the -free and -noforce modes differ from theirs only with a schema."""
    if any(p.schema is not None for p in selected):
        if hf := [m for m in mode_list if m in HF_MODES]:
            raise BenchError(f"--modes {','.join(hf)}: transformers cannot hold an answer to a schema; prompts "
                             f"with one (--set structured) take {', '.join(m for m in ALL_MODES if m not in HF_MODES)}")
        jsonschema_module()
    elif variants := [m for m in mode_list if m in SCHEMA_MODES]:
        raise BenchError(f"--modes {','.join(variants)}: these modes differ from theirs only on prompts with a "
                         "schema (--set structured, or a 'schema' in the prompts file)")


def bench_command(config: EngineConfig, modes: str | None = None, prompts: Path | None = None,
                  prompt_set: str | list[str] | None = None, limit: int | None = None,
                  sampling: SamplingParams | None = None, system: str | None = None, json_path: Path | None = None,
                  plot_path: Path | None = None, console=None, err=None, turns: str = "first",
                  warm: int = 0) -> dict[str, Any]:
    """Runs the benchmark, prints the table, writes the JSON and the plot if asked; returns the report.
    ``turns`` "all" runs each record's turns as one conversation; ``warm`` N answers N prompts of other
    sets first, whose answers (only) the suffix drafter then learns from. ``modes`` None: DEFAULT_MODES,
    or STRUCTURED_MODES where a prompt has a schema.

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
    selected = [dataclasses.replace(p, system=system) for p in select_prompts(prompts, prompt_set, limit)]
    schemas = any(p.schema is not None for p in selected)
    mode_list = parse_modes(modes or ",".join(STRUCTURED_MODES if schemas else DEFAULT_MODES))
    check_schema_modes(mode_list, selected)
    if turns not in TURNS:
        raise BenchError.refused("turns", " or ".join(TURNS), turns)
    if warm < 0:
        raise BenchError.refused("warm", "a whole number >= 0", warm)
    if warm and not any(m in ENGINE_MODES for m in mode_list):
        raise BenchError.refused("warm", "0 unless --modes runs an engine mode (ar, sync, async)", warm,
                                 wrong="teaches the engine's suffix drafter, and no engine mode runs")
    warming = [dataclasses.replace(p, system=system) for p in warm_prompts(selected, warm)] if warm else []
    if plot_path is not None:
        pyplot()
    for setting, out in (("json", json_path), ("plot", plot_path)):
        if out is not None and not Path(out).parent.is_dir():
            raise BenchError.refused(setting, "a file in an existing directory", out,
                                     wrong=f"cannot write {str(out)!r}: {Path(out).parent} is not a directory")
    config.validate()
    assist = hf_assist(config) if "hf-assisted" in mode_list else None
    if "llama.cpp" in mode_list:
        if (why := llamacpp.available()) is not None:
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

    samples: dict[str, list[Sample]] = {}
    crashed: dict[str, str] = {}
    interrupted = False
    with contextlib.ExitStack() as stack:
        info: EngineInfo | None = None
        runners: dict[str, Runner] = {}
        target_dir = model_dir.resolve_model_dir(config.target, say)
        tokenizer = model_dir.load_tokenizer(target_dir, trust_remote_code=config.trust_remote_code)
        eos = model_dir.eos_token_ids(target_dir, config.trust_remote_code)
        threads: dict[str, str] = {}
        if any(m in HF_MODES for m in mode_list):
            say("loading the target into transformers for the hf baselines")
            with err.status("loading the target into transformers for the hf baselines"):
                runners.update(hf_runners(target_dir, tokenizer, eos, config, mode_list, assist))
            import torch

            threads.update({m: str(torch.get_num_threads()) for m in mode_list if m in HF_MODES})
        if "llama.cpp" in mode_list:
            say("starting llama.cpp")
            n = config.threads or llamacpp.default_threads()
            try:
                with err.status("starting llama.cpp"):
                    peer = llamacpp.LlamaCppRunner(gguf, tokenizer, eos, n, config.max_seq_len)
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

                store = HistoryStore(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "history.sqlite3")
                stack.callback(store.close)
            engine = _start_engine(config, err, store and store.path)
            stack.callback(engine.close)
            info = engine.info
            for mode in (m for m in mode_list if m in ENGINE_MODES):
                runners[mode] = EngineRunner(engine, mode, eos)
                threads[mode] = engine_threads(info, ENGINE_MODES[mode].mode)
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
    texts = {m: [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in ss] for m, ss in samples.items()}
    results, speedup = summarise(samples, rows, params.greedy, texts if schemas else None)
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
