"""``swiftspec bench``: the decoding modes and their peers measured side by side (swiftspec.bench does
the measuring)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from swiftspec.cli.options import (
    FrequencyPenaltyOpt,
    MaxNewTokensOpt,
    MinPOpt,
    PresencePenaltyOpt,
    RepeatLastNOpt,
    RepeatPenaltyOpt,
    SeedOpt,
    SystemOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    app,
    cli_option,
    complete_choices,
    engine_options,
    exit_with,
    sources,
)
from swiftspec.cli.usage import choice, refusal, whole_number
from swiftspec.engine.config import ConfigError, EngineConfig, SamplingParams
from swiftspec.engine.host.failures import EngineError

BENCH = "Benchmark"


@app.command(epilog=sources())
@engine_options
def bench(
    ctx: typer.Context,
    config: EngineConfig,  # the engine's options (engine_options)
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = SamplingParams().repeat_last_n,
    presence_penalty: PresencePenaltyOpt = 0.0,
    frequency_penalty: FrequencyPenaltyOpt = 0.0,
    seed: SeedOpt = None,
    system: SystemOpt = None,
    max_new_tokens: MaxNewTokensOpt = 128,
    modes: Annotated[str | None, cli_option(
        "--modes", panel=BENCH, metavar="MODES",
        help="Comma-separated: hf, hf-assisted, llama.cpp, ar, sync, async. llama.cpp runs the same GGUF "
             "through llama-cpp-python (installed by hand, see the README) on every core. Prompts with a JSON "
             "Schema (--set structured) are answered held to it (not by hf), and take the modes "
             "sync-noforce, async-noforce (the tokens the schema forces not drafted) and ar-free, sync-free, "
             "async-free (the same prompts without the schema). Default: hf,hf-assisted,ar,sync,async; with "
             "schemas ar,sync,async,sync-noforce,async-noforce,async-free.")] = None,
    prompts: Annotated[Path | None, cli_option(
        "--prompts", panel=BENCH, metavar="FILE",
        help="Prompts from a JSONL file with a 'prompt' field or MT-Bench-style 'turns', and optionally a "
             "'schema' (a JSON Schema the answer is held to).")] = None,
    prompt_set: Annotated[str | None, cli_option(
        "--set", panel=BENCH, metavar="SETS",
        help="Built-in prompt sets, comma-separated: chat, code, math, qa, summarisation, "
        "extraction, fresh (everyday questions no built-in training prompt shares a topic with), multiturn "
        "(two-turn conversations, for --turns all), all (every one of those); structured (extraction "
        "prompts each with a JSON Schema); and humaneval when installed. Default: all.")] = None,
    turns: Annotated[str, cli_option(
        "--turns", parser=choice(("first", "all"), "turns value"), panel=BENCH, metavar="TURNS", autocompletion=complete_choices("first", "all"),
        help="first: each record's first turn; all: every turn of an MT-Bench-style record as one conversation, "
             "each later turn after the mode's own earlier answers (figures per turn in the table and the JSON's "
             "by_turn).")] = "first",
    warm: Annotated[int, cli_option(
        "--warm", parser=whole_number(0), panel=BENCH, metavar="N",
        help="First answer N prompts of the built-in sets not measured, and let the suffix drafter learn from "
             "those answers (and only those): the effect of a history, measured in one run. Default 0: the "
             "drafter's history is off.")] = 0,
    limit: Annotated[int | None, cli_option("--limit", parser=whole_number(1), panel=BENCH, metavar="N", help="At most N prompts per set.")] = None,
    json_path: Annotated[Path | None, cli_option(
        "--json", panel=BENCH, metavar="FILE", help="Write the results as JSON.")] = None,
    plot_path: Annotated[Path | None, cli_option(
        "--plot", panel=BENCH, metavar="FILE", help="Plot tokens/s and per-token latency per mode (a .png).")] = None,
) -> None:
    """Measure decoding modes and peers side by side on the same prompts, interleaved.

    Greedy and unpenalised unless asked (a penalty keeps the "= target" check; a --temperature leaves it out: sampled answers differ by design). Ctrl-C stops the run and still reports the prompts every mode finished, marked partial.

    Example: [bold]swiftspec bench --set chat,code --limit 2 --max-new-tokens 64 --json bench.json[/bold]
    """
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,  # each checked by its parser
                              repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              seed=seed, max_new_tokens=max_new_tokens)
    from swiftspec.bench import bench_command  # the bench and its runners: --help imports none of them

    try:
        report = bench_command(config=config, modes=modes, prompts=prompts, prompt_set=prompt_set, limit=limit,
                               sampling=sampling, system=system, json_path=json_path, plot_path=plot_path,
                               turns=turns, warm=warm)
    except (ValueError, FileNotFoundError) as e:  # bad options, prompts or model paths
        raise exit_with(refusal(ctx, e) if isinstance(e, ConfigError) else str(e), 2) from None
    except EngineError as e:  # the workers could not start, or failed mid-run
        raise exit_with(str(e), 1) from None
    except KeyboardInterrupt:
        raise exit_with("interrupted before every mode had finished a prompt: nothing to report", 130) from None
    if report.get("partial"):
        raise typer.Exit(130)
