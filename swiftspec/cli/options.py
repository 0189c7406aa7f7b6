"""The ``swiftspec`` command line: ``chat`` (TUI or scripted), ``serve``, ``bench`` and ``history``.

Heavy imports (torch, textual, the engine) happen inside the commands, so ``--help`` and shell completion
stay instant.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from swiftspec.config import (
    BUILTIN_DRAFTS,
    CHAT_DEFAULTS,
    DTYPES,
    MODES,
    ConfigError,
    EngineConfig,
    SamplingParams,
    TreeParams,
)
from swiftspec.settings import config_path, default_map, env_var, read_config

app = typer.Typer(
    name="swiftspec",
    help="Local LLM chat with asynchronous, disaggregated speculative decoding (SwiftSpec).\n\n"
    "With no model flags everything runs on the embedded SmolLM2-135M-Instruct with the suffix drafter.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

MODEL = "Model and device layout"
DECODING = "Decoding"
TREE = "Speculation tree"
SCRIPTED = "Scripted mode"
BENCH = "Benchmark"
SERVER = "Server"


def _whole_number(value) -> int:
    """A count or index; the error says what was expected, not a validator's text."""
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"expected a whole number such as 8, not {value!r}") from None


def _number(value) -> float:
    """A value such as a temperature; the error, like _whole_number's, says what was expected."""
    try:
        return float(value)
    except ValueError:
        raise typer.BadParameter(f"expected a number such as 0.7, not {value!r}") from None


def _complete(*choices: str):
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]


def _device_list(value: str | None) -> list[int] | None:
    """'0,1,2' -> [0, 1, 2]; a ConfigError (exit 2) quotes the bad value."""
    if value is None:
        return None
    try:
        devices = [int(piece) for piece in value.split(",") if piece.strip()]
    except ValueError:
        raise ConfigError(f"GPU indices are numbers like 0,1,2, not {value!r}") from None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise ConfigError(f"GPU indices are distinct numbers like 0,1,2, not {value!r}")
    return devices


def _complete_draft(incomplete: str) -> list[str]:
    """Offers the built-in drafts, then model directories and GGUF files."""
    found = [name for name in BUILTIN_DRAFTS if name.startswith(incomplete)]
    head = incomplete[: incomplete.rfind("/") + 1]
    try:
        entries = sorted(Path(head or ".").expanduser().iterdir())
    except OSError:
        return found
    for entry in entries:
        name = head + entry.name
        if name.startswith(incomplete) and (entry.is_dir() or entry.suffix == ".gguf"):
            found.append(name + ("/" if entry.is_dir() else ""))
    return found


def _opt(*names: str, panel: str, metavar: str | None = None, **kwargs) -> typer.models.OptionInfo:
    """A settable option: its long name also reads SWIFTSPEC_<NAME> from the environment (and the config
    file, see swiftspec.settings); every value takes an upper-case metavar, and a flag (metavar None) none.
    A flag that is on by default is named as a pair, "--flag/--no-flag"."""
    long = next(n for n in names if n.startswith("--")).split("/")[0]
    return typer.Option(*names, envvar=env_var(long), metavar="" if metavar is None else metavar,
                        rich_help_panel=panel, **kwargs)


# The options, defined once and shared by `chat` and `bench`. Ranges are checked by EngineConfig and
# SamplingParams, whose messages say what a value means ("temperature must be a finite number >= 0 (0 = greedy)").
TargetOpt = Annotated[Path | None, _opt(
    "-m", "--model", "--target", panel=MODEL, metavar="PATH",
    help="Target model: a Hugging Face model directory or a .gguf file (--target is the same flag). "
         "Default: the embedded SmolLM2-135M.")]
DraftOpt = Annotated[str, _opt(
    "--draft", panel=MODEL, metavar="DRAFT", autocompletion=_complete_draft,
    help="A draft model PATH sharing the target's tokenizer, 'suffix' for the model-free suffix drafter, "
         "'int8' for a dynamic-int8 copy of the target (CPU), or 'none' (no draft processes: ar only).")]
DraftCorpusOpt = Annotated[str, _opt(
    "--draft-corpus", panel=MODEL, metavar="FILE",
    help="The suffix drafter's corpus of the target's own answers (swiftspec train-draft writes one): a FILE, "
         "'none', or 'auto': the one shipped for the embedded default, none for other targets.")]
DraftHistoryOpt = Annotated[str, _opt(
    "--draft-history", panel=MODEL, metavar="SWITCH", autocompletion=_complete("on", "off"),
    help="on or off. on: the suffix drafter also proposes what the target answered in earlier conversations (the saved "
         "history's answers, newest first up to 1M tokens; an unsaved chat: the session's); off: from this "
         "conversation and the corpus only.")]
TargetDevicesOpt = Annotated[str | None, _opt(
    "--target-devices", panel=MODEL, metavar="GPUS",
    help="GPU indices of the target group, e.g. 0,1 (tensor parallel over them).")]
DraftDevicesOpt = Annotated[str | None, _opt(
    "--draft-devices", panel=MODEL, metavar="GPUS", help="GPU indices of the draft group, e.g. 2.")]
GpusOpt = Annotated[int | None, _opt(
    "--gpus", parser=_whole_number, panel=MODEL, metavar="N",
    help="Use the first N GPUs and let profiling choose the target/draft split.")]
TargetProcsOpt = Annotated[int, _opt(
    "--target-procs", parser=_whole_number, panel=MODEL, metavar="N",
    help="CPU: worker processes in the target group.")]
DraftProcsOpt = Annotated[int, _opt(
    "--draft-procs", parser=_whole_number, panel=MODEL, metavar="N",
    help="CPU: worker processes in the draft group.")]
DeviceOpt = Annotated[str, _opt(
    "--device", panel=MODEL, metavar="DEVICE", autocompletion=_complete("auto", "cpu", "cuda"),
    help="auto, cpu or cuda: where the workers run; auto picks CUDA when present.")]
DTypeOpt = Annotated[str, _opt(
    "--dtype", panel=MODEL, metavar="DTYPE", autocompletion=_complete(*DTYPES),
    help="auto, float32, bfloat16, float16, gguf or int4: how the target's weights are held. On the CPU every "
         "choice runs row-invariant kernels (each verified node computes what a one-token step would, so every "
         "mode stays exact) with fp32 activations: float32 / bfloat16 / float16 weights, gguf (a GGUF's own "
         "4- and 8-bit blocks, int16 activations), int4 (any checkpoint packed into 4-bit blocks "
         "at load); auto runs a checkpoint at its own width and, for a GGUF, measures its blocks against fp32 at the "
         "first start on the machine and keeps the faster for speculation (int4 only when asked). On CUDA: auto is bf16.")]
ThreadsOpt = Annotated[int | None, _opt(
    "--threads", parser=_whole_number, panel=MODEL, metavar="N",
    help="CPU threads for all workers together. Default: every core but one, which the chat itself uses.")]
MaxSeqLenOpt = Annotated[int, _opt(
    "--max-seq-len", parser=_whole_number, panel=MODEL, metavar="N",
    help="KV cache length per conversation (tokens).")]
TrustRemoteCodeOpt = Annotated[bool, _opt(
    "--trust-remote-code", panel=MODEL,
    help="Run Python code shipped in the model directory (whatever its auto_map names, and what that "
         "imports) while loading its tokenizer: only for directories you trust. The forward pass always "
         "runs SwiftSpec's own model code.")]
BsOpt = Annotated[int, _opt(
    "--bs", parser=_whole_number, panel=TREE, metavar="N",
    help="Tree nodes verified per target forward (1-64).")]
WOpt = Annotated[int, _opt(
    "--w", parser=_whole_number, panel=TREE, metavar="N",
    help="Leaves expanded per draft forward (1-64).")]
DOpt = Annotated[int | None, _opt(
    "--d", parser=_whole_number, panel=TREE, metavar="N",
    help="Draft expansions per round (1-64). Default: chosen from step times profiled at start.")]
VerifyCostOpt = Annotated[bool, _opt(
    "--verify-cost/--no-verify-cost", panel=TREE,
    help="Verify only as many of the bs best nodes as are worth their profiled target cost; "
         "--no-verify-cost: always bs, as the paper does.")]
MaxNewTokensOpt = Annotated[int, _opt(
    "--max-new-tokens", parser=_whole_number, panel=DECODING, metavar="N",
    help="Most tokens generated per answer.")]
TemperatureOpt = Annotated[float, _opt(
    "--temperature", parser=_number, panel=DECODING, metavar="NUMBER",
    help="0 = greedy; sampling stays lossless.")]
TopPOpt = Annotated[float, _opt(
    "--top-p", parser=_number, panel=DECODING, metavar="NUMBER",
    help="Nucleus sampling, in (0, 1].")]
TopKOpt = Annotated[int, _opt(
    "--top-k", parser=_whole_number, panel=DECODING, metavar="N",
    help="Sample from the k most likely tokens; 0 = off.")]
MinPOpt = Annotated[float, _opt(
    "--min-p", parser=_number, panel=DECODING, metavar="NUMBER",
    help="Keep only the tokens at least this fraction as likely as the most likely one; 0 = off.")]
RepeatPenaltyOpt = Annotated[float, _opt(
    "--repeat-penalty", parser=_number, panel=DECODING, metavar="NUMBER",
    help="Divide the logit of each token seen in the last --repeat-last-n tokens (a negative one: multiply) "
         "by this, as transformers' repetition_penalty does; 1 = off. Applies in greedy mode too.")]
RepeatLastNOpt = Annotated[int, _opt(
    "--repeat-last-n", parser=_whole_number, panel=DECODING, metavar="N",
    help="The penalties look at the last N tokens of the conversation, the prompt included.")]
PresencePenaltyOpt = Annotated[float, _opt(
    "--presence-penalty", parser=_number, panel=DECODING, metavar="NUMBER",
    help="Subtract this from the logit of each token seen in the last --repeat-last-n tokens (OpenAI's "
         "rule), in [-2, 2]; 0 = off.")]
FrequencyPenaltyOpt = Annotated[float, _opt(
    "--frequency-penalty", parser=_number, panel=DECODING, metavar="NUMBER",
    help="Subtract this times its count in the last --repeat-last-n tokens from each token's logit "
         "(OpenAI's rule), in [-2, 2]; 0 = off.")]
LoopGuardOpt = Annotated[int, _opt(
    "--loop-guard", parser=_whole_number, panel=DECODING, metavar="N",
    help="End an answer (finish reason 'repetition') once its last N tokens are one span repeated "
         "--loop-repeats times; 0 = off.")]
LoopRepeatsOpt = Annotated[int, _opt(
    "--loop-repeats", parser=_whole_number, panel=DECODING, metavar="K",
    help="How many repeats of a span the loop guard waits for (>= 2).")]
SeedOpt = Annotated[int | None, _opt(
    "--seed", parser=_whole_number, panel=DECODING, metavar="N",
    help="Seed for sampling, so a run can be reproduced.")]
SystemOpt = Annotated[str | None, _opt("--system", panel=DECODING, metavar="TEXT", help="System prompt.")]
ApiKeyOpt = Annotated[str | None, _opt(
    "--api-key", panel=SERVER, metavar="KEY",
    help="serve: the key every request but /health must carry (Authorization: Bearer KEY); chat --server: the "
         "key to send.")]

# Every engine setting the command line sets, by its EngineConfig field (bs, w, d: TreeParams'): its option
# above. A command that starts an engine takes them all with @engine_options; the defaults are the
# dataclasses' own.
ENGINE_OPTIONS = {
    "target": TargetOpt, "draft": DraftOpt, "draft_corpus": DraftCorpusOpt, "target_devices": TargetDevicesOpt,
    "draft_devices": DraftDevicesOpt, "gpus": GpusOpt, "target_procs": TargetProcsOpt, "draft_procs": DraftProcsOpt,
    "device": DeviceOpt, "dtype": DTypeOpt, "threads": ThreadsOpt, "max_seq_len": MaxSeqLenOpt,
    "trust_remote_code": TrustRemoteCodeOpt, "bs": BsOpt, "w": WOpt, "d": DOpt, "verify_cost": VerifyCostOpt,
}
TREE_FIELDS = {f.name for f in dataclasses.fields(TreeParams)}
# The answers' sampling flags of the commands that answer (chat, serve), by SamplingParams field: left out
# (None), the model's defaults apply (chat_defaults). A command takes them with @sampling_options.
SAMPLING_OPTIONS = {
    "temperature": TemperatureOpt, "top_p": TopPOpt, "top_k": TopKOpt, "min_p": MinPOpt,
    "repeat_penalty": RepeatPenaltyOpt, "repeat_last_n": RepeatLastNOpt, "presence_penalty": PresencePenaltyOpt,
    "frequency_penalty": FrequencyPenaltyOpt, "loop_guard": LoopGuardOpt, "loop_repeats": LoopRepeatsOpt,
}


def engine_config(**given) -> EngineConfig:
    """The EngineConfig of the engine options' values (ConfigError on a bad combination)."""
    target, target_devices, draft_devices = given.pop("target"), given.pop("target_devices"), given.pop("draft_devices")
    if given["gpus"] is not None and (target_devices or draft_devices):
        raise ConfigError("--gpus chooses the split itself; give it or --target-devices/--draft-devices")
    if bool(target_devices) != bool(draft_devices):
        raise ConfigError("--target-devices and --draft-devices go together")
    tree = TreeParams(**{name: given.pop(name) for name in TREE_FIELDS})
    return EngineConfig(target=str(target) if target else None, target_devices=_device_list(target_devices),
                        draft_devices=_device_list(draft_devices), tree=tree, **given).validate()


def _options_in_place_of(name: str, options: dict, defaults: dict, make):
    """A decorator: adds ``options`` (parameter name -> typer option, with ``defaults``) to a command in
    place of its parameter ``name``, and calls it with ``make(ctx, {option: value})`` there."""
    import functools
    import inspect

    def decorate(command):
        params = list(inspect.signature(command, eval_str=True).parameters.values())
        at = [p.name for p in params].index(name)
        keyword = inspect.Parameter.KEYWORD_ONLY
        added = [inspect.Parameter(option, keyword, annotation=annotation, default=defaults[option])
                 for option, annotation in options.items()]
        params = params[:at] + added + [p.replace(kind=keyword) for p in params[at + 1:]]

        @functools.wraps(command)
        def with_options(*args, **kwargs):
            kwargs[name] = make(kwargs["ctx"], {option: kwargs.pop(option) for option in options})
            return command(*args, **kwargs)

        with_options.__signature__ = inspect.Signature(params)
        with_options.__annotations__ = {p.name: p.annotation for p in params}
        return with_options

    return decorate


def _engine_config(ctx: typer.Context, given: dict) -> EngineConfig:
    try:
        return engine_config(**given)
    except ConfigError as e:
        raise _fail(_with_origin(ctx, e), 2) from None


# The engine's options (ENGINE_OPTIONS) in place of a command's ``config`` parameter, which gets the one
# EngineConfig they make; a refused value is a usage error that says where it came from.
_TREE_DEFAULTS, _ENGINE_DEFAULTS = TreeParams(), EngineConfig()
engine_options = _options_in_place_of(
    "config", ENGINE_OPTIONS, {name: getattr(_TREE_DEFAULTS if name in TREE_FIELDS else _ENGINE_DEFAULTS, name)
                               for name in ENGINE_OPTIONS}, _engine_config)


# The sampling flags (SAMPLING_OPTIONS) in place of a command's ``sampling`` parameter, which gets those
# given as a dict (SamplingParams fields; the ones left out are not in it).
sampling_options = _options_in_place_of(
    "sampling", SAMPLING_OPTIONS, dict.fromkeys(SAMPLING_OPTIONS),
    lambda _ctx, given: {name: value for name, value in given.items() if value is not None})


def chat_defaults(target: str | None) -> SamplingParams:
    """The chat's sampling defaults: a model directory's generation_config.json over CHAT_DEFAULTS (measured
    on the embedded model: its loop guard and its penalty window stay), CHAT_DEFAULTS for the embedded
    default, a GGUF file and a directory without the file."""
    from swiftspec.engine.model_dir import generation_defaults

    path = Path(target).expanduser() if target else None
    found = generation_defaults(path) if path is not None and path.is_dir() else None
    try:
        return dataclasses.replace(CHAT_DEFAULTS, **(found or {})).validate()
    except ConfigError as e:
        raise ConfigError(f"{path / 'generation_config.json'}: {e}") from None


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"swiftspec: {message}", err=True)
    return typer.Exit(code)


SOURCES = (f"Every option but -p and --resume can also be set by an environment variable (shown with it) or "
           f"in the config file {config_path()} (TOML, e.g. max-new-tokens = 64, or under \\[chat] / \\[serve] / \\[bench]); "
           "a value is taken from, in order: the flag, the environment variable, the config file, the default.")


CHAT_SAMPLING = (f"Sampling defaults (the flags left out): a model directory's generation_config.json, read as "
                 "transformers reads it, with a loop guard and penalty window as below; for the embedded model, "
                 f"a GGUF file or a directory without that file, the ones measured for a chat: "
                 f"{CHAT_DEFAULTS.summary()} (repeat-last-n {CHAT_DEFAULTS.repeat_last_n}, loop-repeats "
                 f"{CHAT_DEFAULTS.loop_repeats}). bench stays greedy unless asked.")


@app.command(no_args_is_help=False, epilog=CHAT_SAMPLING + "\n\n" + SOURCES)
@engine_options
@sampling_options
def chat(
    ctx: typer.Context,
    prompt_arg: Annotated[str | None, typer.Argument(
        metavar="PROMPT", show_default=False,
        help="Answer this prompt and exit, as -p PROMPT does.")] = None,
    *,
    config: EngineConfig,  # the engine's options (engine_options)
    draft_history: DraftHistoryOpt = "on",
    mode: Annotated[str, _opt(
        "--mode", panel=DECODING, metavar="MODE", autocompletion=_complete(*MODES),
        help="async: SwiftSpec (draft and target in parallel; the default, also on one GPU, where it measured "
             "at least as fast as sync); sync: draft then verify; ar: target only, and no draft is started "
             "(so that session cannot switch to sync or async: start it again for those).")
    ] = "async",
    sampling: dict,  # the sampling flags given (sampling_options)
    seed: SeedOpt = None,
    max_new_tokens: MaxNewTokensOpt = SamplingParams().max_new_tokens,
    system: SystemOpt = None,
    stop: Annotated[list[str] | None, _opt(
        "--stop", panel=DECODING, metavar="TEXT",
        help="End the answer before this text; repeat for several.")] = None,
    prompt: Annotated[str | None, typer.Option(
        "-p", "--prompt", metavar="TEXT", rich_help_panel=SCRIPTED,
        help="Answer this prompt and exit (scripted mode). Piped stdin, if any, is appended as material.")
    ] = None,
    each_line: Annotated[bool, _opt(
        "--each-line", panel=SCRIPTED,
        help="Scripted mode: each stdin line is its own prompt, answered on its own (as the next turns of the "
             "conversation with --save or --resume); plain answers are separated by a blank line.")
    ] = False,
    jsonl: Annotated[bool, _opt(
        "--jsonl", panel=SCRIPTED,
        help='Scripted mode: stdout is one JSON object per event: {"event":"token","text","token_ids"} '
        '... {"event":"done","stats","finish_reason"}.')
    ] = False,
    resume: Annotated[str | None, typer.Option(
        "--resume", metavar="ID",
        help="Resume saved conversation ID, or the latest one when ID is left out (scripted mode "
        "answers after it and appends the new turns).")] = None,
    save: Annotated[bool, _opt(
        "--save", panel=SCRIPTED,
        help="Scripted mode: save the prompts and answers as a new conversation, as its turns (see `swiftspec "
        "history`; the id is printed on stderr). Scripted runs are not saved otherwise, except the turns that "
        "--resume appends.")] = False,
    server: Annotated[str | None, _opt(
        "--server", panel=SERVER, metavar="URL",
        help="Chat with a running `swiftspec serve` at URL (e.g. http://127.0.0.1:8080) instead of starting an "
             "engine: instant start, one warm engine for the terminal and the editor alike. The model options "
             "are the server's.")] = None,
    api_key: ApiKeyOpt = None,
    quiet: Annotated[bool, _opt(
        "-q", "--quiet", panel=SCRIPTED,
        help="Scripted mode: no start-up progress and no figures on stderr; errors and warnings still.")] = False,
) -> None:
    """Chat with a model. A TUI in a terminal; scripted mode when stdin or stdout is not a terminal, or with a prompt.

    Scripted mode prints only the answer on stdout and its figures on stderr. Exit codes: 0 ok, 1 engine error, 2 usage error (bad flags, model paths or model files, empty or non-UTF-8 input, a prompt longer than the context), 130 interrupted (Ctrl-C).

    Examples: [bold]swiftspec chat[/bold] · [bold]swiftspec chat "Why is the sky blue?"[/bold] · [bold]echo "Explain RoPE" | swiftspec chat > answer.md[/bold] · [bold]swiftspec chat -p "Summarise:" --jsonl < notes.txt[/bold] · [bold]swiftspec chat --resume[/bold]
    """
    if prompt_arg is not None and prompt is not None:
        raise _fail("give the prompt either as an argument or with -p, not both", 2)
    prompt = prompt_arg if prompt is None else prompt
    from swiftspec.conversation import Conversation, Settings
    from swiftspec.history import HistoryError, HistoryStore

    sampling = dict(mode=mode, seed=seed, max_new_tokens=max_new_tokens, stop=stop or [], **sampling)
    remote = None
    if server is not None:  # the server's sampling defaults, under what this command sets
        local = sorted(_given(ctx) & set(ENGINE_OPTIONS))
        if local:
            raise _fail(f"--{local[0].replace('_', '-')} has no effect with --server: the server's engine answers", 2)
        from swiftspec.engine.failures import EngineError
        from swiftspec.server.remote import RemoteEngine

        try:
            remote = RemoteEngine.connect(server, api_key)
        except EngineError as e:
            raise _fail(str(e), 1) from None
        sampling = {name: value for name, value in sampling.items() if _source(ctx, name) != "DEFAULT"}
    params = _sampling(ctx, config, remote.defaults if remote else None, **sampling)
    defaults = Settings(system, params)
    scripted = prompt is not None or each_line or jsonl or not _interactive()
    store = HistoryStore() if resume is not None or save or not scripted else None
    if store is not None and store.notice:
        typer.echo(f"swiftspec: {store.notice}", err=True)
    conversation = None
    if store is not None and resume is not None:
        try:
            conversation_id = store.latest().id if resume == "latest" else int(resume)
            conversation = Conversation.resume(store, conversation_id, defaults, prefer=_given(ctx))
        except ValueError:
            raise _fail(f"--resume takes a conversation id (a number), not {resume!r}", 2) from None
        except HistoryError as e:
            raise _fail(str(e), 2) from None
        for warning in conversation.take_warnings():
            typer.echo(f"swiftspec: #{conversation.id}: {warning}", err=True)
    conversation = conversation or Conversation(store if (save or not scripted) else None, defaults)
    if draft_history not in ("on", "off"):
        raise _fail(_with_origin(ctx, ConfigError("draft-history must be on or off")), 2)
    config = dataclasses.replace(config, draft_history=draft_history == "on")
    kept = conversation.store  # its answers are the drafter's history; unsaved chats draft from the session's
    if kept is not None and kept.available:
        config = dataclasses.replace(config, history_db=str(kept.path))
    if conversation.params.mode == "ar":  # nothing would ever ask the draft for a token
        config = dataclasses.replace(config, draft="none", draft_corpus="none")

    if remote is not None:  # connected once already; the TUI's Restart connects anew
        first = [remote]
        connect = lambda progress: first.pop() if first else type(remote).connect(server, api_key, progress)
    else:
        connect = lambda progress: _start_engine(config, progress)
    if scripted:
        raise typer.Exit(_chat_scripted(config, conversation, prompt, each_line, jsonl, quiet, connect,
                                        local=server is None))

    try:
        if server is None:
            _prepare_models(config)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e), 2) from None
    from swiftspec.tui.app import SwiftSpecApp

    tui = SwiftSpecApp(connect, defaults, store=store, conversation=conversation,
                       model_line=f"server {server}" if server else _model_line(config))
    raise typer.Exit(tui.run() or 0)


def _sampling(ctx: typer.Context, config: EngineConfig, base: SamplingParams | None, **given) -> SamplingParams:
    """The answers' sampling: the flags given (None: left out) over ``base`` or chat_defaults (a usage
    error, said with where the refused value came from)."""
    try:
        return dataclasses.replace(base or chat_defaults(config.target),
                                   **{name: value for name, value in given.items() if value is not None}).validate()
    except ConfigError as e:
        raise _fail(_with_origin(ctx, e), 2) from None
    except ValueError as e:  # a generation_config.json that cannot be read
        raise _fail(str(e), 2) from None


def _given(ctx: typer.Context) -> set[str]:
    """The settings given for this run (flag or environment variable), which win over a resumed
    conversation's own; the config file and the defaults do not."""
    return {name for name in ctx.params if _source(ctx, name) in ("COMMANDLINE", "ENVIRONMENT")}


def _source(ctx: typer.Context, name: str) -> str | None:
    """Where a parameter's value came from, by name (typer's own copy of click has its own enum)."""
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else None


def _with_origin(ctx: typer.Context, error: ConfigError) -> str:
    """A value refused by validation, said with where it came from when that was not the command line."""
    import re

    message = str(error)
    subject = message.split(" must")[0]
    for name, value in ctx.params.items():
        flag = name.replace("_", "-")
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", subject):
            continue
        if _source(ctx, name) == "DEFAULT_MAP":
            return f"{config_path()}: {flag} = {value!r}: {message}"
        if _source(ctx, name) == "ENVIRONMENT":
            return f"{env_var('--' + flag)}={value!r}: {message}"
    return message


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _chat_scripted(config, conversation, prompt, each_line, jsonl, quiet, connect, local: bool) -> int:
    """``connect(progress)`` gives the engine: a started one, or a server's (``local`` False: no model
    files here to count a prompt with before it)."""
    from swiftspec import scripted, window

    data = b""
    if not (prompt is not None and sys.stdin.isatty()):
        if sys.stdin.isatty():
            typer.echo("swiftspec: reading the prompt from the terminal; end it with Ctrl-D", err=True)
        data = sys.stdin.buffer.read()
    try:
        prompts = scripted.read_prompts(data, each_line=each_line, prompt=prompt)
    except scripted.InputError as e:
        typer.echo(f"swiftspec: {e}", err=True)
        return scripted.EXIT_USAGE
    say = (lambda line: None) if quiet else (lambda line: typer.echo(f"swiftspec: {line}", err=True))
    try:
        if local and _may_not_fit(prompts, conversation, config):  # then tell now, not after the workers' start
            from swiftspec.engine.client import Engine

            context = window.Context(*Engine.context(config, say))
            for text in prompts:
                conversation.plan("ask", context, text)
        engine = connect(say)
    except window.ContextError as e:
        typer.echo(f"swiftspec: {e}", err=True)
        return scripted.EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:  # bad settings or model paths, found before any worker runs
        typer.echo(f"swiftspec: {e}", err=True)
        return scripted.EXIT_USAGE
    except Exception as e:  # the workers failed: the message says why, with their output's tail
        typer.echo(f"swiftspec: the engine failed to start: {e}", err=True)
        return scripted.EXIT_ENGINE
    with engine:
        try:
            code = scripted.run(engine, prompts, conversation, jsonl=jsonl, quiet=quiet, out=sys.stdout,
                                err=sys.stderr)
            if code == scripted.EXIT_BROKEN_PIPE:  # nothing more can reach the reader, not even at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except KeyboardInterrupt:
            engine.cancel()
            code = 130
    store = conversation.store
    if store is not None and store.problem:
        typer.echo(f"swiftspec: not saved: {store.problem}", err=True)
    elif conversation.id is not None:
        typer.echo(f"swiftspec: saved as conversation #{conversation.id} (swiftspec chat --resume "
                   f"{conversation.id})", err=True)
    return code


def _may_not_fit(prompts: list[str], conversation, config: EngineConfig) -> bool:
    """False when every prompt surely fits: a token is at least one byte, and a chat template adds far
    fewer than TEMPLATE_ROOM tokens."""
    from swiftspec import window

    system = len((conversation.settings.system or "").encode())
    room = window.answer_room(conversation.params.max_new_tokens, config.max_seq_len)
    return any(len(p.encode()) + system + TEMPLATE_ROOM + room > config.max_seq_len for p in prompts)


TEMPLATE_ROOM = 256


def _prepare_models(config: EngineConfig) -> None:
    """Before the TUI takes the terminal: a missing or broken model is a usage error, and a GGUF file (the
    embedded default included) is converted now, once, its stages shown on stderr, rather than unseen."""
    from swiftspec.engine.model_dir import resolve_draft, resolve_model_dir

    say = lambda line: typer.echo(f"swiftspec: {line}", err=True)
    resolve_draft(config.draft, resolve_model_dir(config.target, progress=say), say)


def _start_engine(config: EngineConfig, progress):
    from swiftspec import Engine

    return Engine.start(config, progress=progress)


def _model_line(config: EngineConfig) -> str:
    target = Path(config.target).name if config.target else "embedded SmolLM2-135M-Instruct"
    draft = config.draft if config.draft in BUILTIN_DRAFTS else Path(config.draft).name
    return f"target {target} · draft {draft}"


@app.command(epilog=SOURCES)
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
    modes: Annotated[str, _opt(
        "--modes", panel=BENCH, metavar="MODES",
        help="Comma-separated: hf, hf-assisted, llama.cpp, ar, sync, async. llama.cpp runs the same GGUF "
             "through llama-cpp-python (installed by hand, see the README) on every core.")] = "hf,hf-assisted,ar,sync,async",
    prompts: Annotated[Path | None, _opt(
        "--prompts", panel=BENCH, metavar="FILE",
        help="Prompts from a JSONL file with a 'prompt' field or MT-Bench-style 'turns'.")] = None,
    prompt_set: Annotated[str | None, _opt(
        "--set", panel=BENCH, metavar="SETS",
        help="Built-in prompt sets, comma-separated: chat, code, math, qa, summarisation, "
        "extraction, fresh (everyday questions no built-in training prompt shares a topic with), multiturn "
        "(two-turn conversations, for --turns all); and humaneval when installed. Default: all built-in sets.")] = None,
    turns: Annotated[str, _opt(
        "--turns", panel=BENCH, metavar="TURNS", autocompletion=_complete("first", "all"),
        help="first: each record's first turn; all: every turn of an MT-Bench-style record as one conversation, "
             "each later turn after the mode's own earlier answers (figures per turn in the table and the JSON's "
             "by_turn).")] = "first",
    warm: Annotated[int, _opt(
        "--warm", parser=_whole_number, panel=BENCH, metavar="N",
        help="First answer N prompts of the built-in sets not measured, and let the suffix drafter learn from "
             "those answers (and only those): the effect of a history, measured in one run. Default 0: the "
             "drafter's history is off.")] = 0,
    limit: Annotated[int | None, _opt("--limit", parser=_whole_number, panel=BENCH, metavar="N", help="At most N prompts per set.")] = None,
    json_path: Annotated[Path | None, _opt(
        "--json", panel=BENCH, metavar="FILE", help="Write the results as JSON.")] = None,
    plot_path: Annotated[Path | None, _opt(
        "--plot", panel=BENCH, metavar="FILE", help="Plot tokens/s and per-token latency per mode (a .png).")] = None,
) -> None:
    """Measure decoding modes and peers side by side on the same prompts, interleaved.

    Greedy and unpenalised unless asked (a penalty keeps the "= target" check; a --temperature leaves it out: sampled answers differ by design). Ctrl-C stops the run and still reports the prompts every mode finished, marked partial.

    Example: [bold]swiftspec bench --set chat,code --limit 2 --max-new-tokens 64 --json bench.json[/bold]
    """
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                  repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                  seed=seed, max_new_tokens=max_new_tokens).validate()
    except ConfigError as e:
        raise _fail(str(e), 2) from None
    from swiftspec.bench import bench_command

    try:
        report = bench_command(config=config, modes=modes, prompts=prompts, prompt_set=prompt_set, limit=limit,
                               sampling=sampling, system=system, json_path=json_path, plot_path=plot_path,
                               turns=turns, warm=warm)
    except (ValueError, FileNotFoundError) as e:  # bad options, prompts or model paths
        raise _fail(str(e), 2) from None
    except KeyboardInterrupt:
        raise _fail("interrupted before every mode had finished a prompt: nothing to report", 130) from None
    if report.get("partial"):
        raise typer.Exit(130)


@app.command(epilog=CHAT_SAMPLING.replace("bench stays", "A request's own fields win; bench stays") + "\n\n" + SOURCES)
@engine_options
@sampling_options
def serve(
    ctx: typer.Context,
    config: EngineConfig,  # the engine's options (engine_options)
    sampling: dict,  # the sampling flags given (sampling_options)
    host: Annotated[str, _opt(
        "--host", panel=SERVER, metavar="ADDRESS",
        help="Address to listen on. Anything but loopback needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, _opt("--port", parser=_whole_number, panel=SERVER, metavar="N",
                              help="TCP port; 0 takes a free one (printed on stderr).")] = 8080,
    api_key: ApiKeyOpt = None,
    max_queue: Annotated[int, _opt(
        "--max-queue", parser=_whole_number, panel=SERVER, metavar="N",
        help="Requests that may wait for the engine (one answers at a time); beyond: 429 with Retry-After.")] = 32,
    cors_origin: Annotated[list[str] | None, _opt(
        "--cors-origin", panel=SERVER, metavar="ORIGIN",
        help="Allow browser pages from ORIGIN (e.g. http://localhost:3000); repeat for several. Default: no CORS.")
    ] = None,
    log_prompts: Annotated[bool, _opt(
        "--log-prompts", panel=SERVER, help="Log every request's messages on stderr (never logged otherwise).")] = False,
    mode: Annotated[str, _opt(
        "--mode", panel=DECODING, metavar="MODE", autocompletion=_complete(*MODES),
        help="The answers' decoding mode (a request may ask another in its swiftspec object); ar starts no draft.")
    ] = "async",
    max_new_tokens: MaxNewTokensOpt = SamplingParams().max_new_tokens,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) on one warm engine.

    One answer at a time, the others queued; a client that hangs up is cancelled at once; a failed worker group is started again. /health, and /metrics in Prometheus' format. Binds 127.0.0.1 unless given --host and a key.

    Examples: [bold]swiftspec serve[/bold] · [bold]swiftspec serve --port 0 --mode sync[/bold] · [bold]SWIFTSPEC_API_KEY=secret swiftspec serve --host 0.0.0.0[/bold]
    """
    from swiftspec.server.app import ServerSettings
    from swiftspec.server.serve import serve as run_server

    params = _sampling(ctx, config, None, mode=mode, max_new_tokens=max_new_tokens, **sampling)
    if params.mode == "ar":  # nothing would ever ask the draft for a token
        config = dataclasses.replace(config, draft="none", draft_corpus="none")
    settings = ServerSettings(host, port, api_key, max_queue, tuple(cors_origin or ()), log_prompts)
    say = lambda line: typer.echo(f"swiftspec: {line}", err=True)
    try:
        code = run_server(config, params, settings, say)
    except (ValueError, FileNotFoundError) as e:  # bad settings, model paths, a port in use
        raise _fail(_with_origin(ctx, e) if isinstance(e, ConfigError) else str(e), 2) from None
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # the workers failed to start: the message says why
        raise _fail(f"the engine failed to start: {e}", 1) from None
    raise typer.Exit(code)


TRAIN = "Training"


@app.command("train-draft", epilog=SOURCES)
def train_draft(
    out: Annotated[Path, _opt("--out", panel=TRAIN, metavar="DIR",
                              help="Where the head goes (config.json + model.safetensors), with its data "
                                   "and training state: rerun the same command to resume.")],
    target: TargetOpt = None,
    prompts: Annotated[Path | None, _opt(
        "--prompts", panel=TRAIN, metavar="FILE",
        help="Training prompts, JSONL with a 'prompt' field. Default: SwiftSpec's own generated chat "
             "requests (topic x task).")] = None,
    n_prompts: Annotated[int, _opt("--n-prompts", parser=_whole_number, panel=TRAIN, metavar="N",
                                   help="Prompts to answer (the first N).")] = 800,
    max_new_tokens: MaxNewTokensOpt = 256,
    temperature: TemperatureOpt = 0.0,
    draft_vocab: Annotated[int, _opt("--draft-vocab", parser=_whole_number, panel=TRAIN, metavar="N",
                                     help="Tokens the head can propose: the target's N most frequent in "
                                          "its answers.")] = 8192,
    steps: Annotated[int, _opt("--steps", parser=_whole_number, panel=TRAIN, metavar="N",
                               help="Tree depths trained for (unrolled steps).")] = 3,
    epochs: Annotated[int, _opt("--epochs", parser=_whole_number, panel=TRAIN, metavar="N",
                                help="Passes over the data.")] = 6,
    lr: Annotated[float, _opt("--lr", parser=_number, panel=TRAIN, metavar="NUMBER",
                              help="Peak learning rate (AdamW, warm-up then cosine).")] = 1e-3,
    seed: Annotated[int, _opt("--seed", parser=_whole_number, panel=TRAIN, metavar="N",
                              help="Seed of everything random: the run is repeatable.")] = 0,
    corpus_only: Annotated[bool, _opt(
        "--corpus-only", panel=TRAIN,
        help="Stop after the answers: write OUT/corpus.safetensors for --draft-corpus, train no head.")] = False,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
) -> None:
    """Train an EAGLE-style draft head for a target, on the target's own answers.

    The target answers the prompts (captured: its final hidden states), then a one-layer head learns to
    predict its next feature and token from them. Use the result with [bold]--draft DIR[/bold]. Prints the
    held-out agreement with the target per epoch and tree depth. The answers also make a corpus for the
    suffix drafter, OUT/corpus.safetensors: use it with [bold]--draft suffix --draft-corpus FILE[/bold].

    Example: [bold]swiftspec train-draft --out heads/smollm2 --n-prompts 64 --epochs 1[/bold]
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning threads crawl when a core is busy elsewhere
    import torch

    from swiftspec.bench import parse_jsonl
    from swiftspec.engine.model_dir import resolve_model_dir
    from swiftspec.train_draft import TrainConfig, train
    from swiftspec.train_prompts import training_prompts

    if temperature < 0 or lr <= 0 or not 1 <= steps <= 8 or n_prompts < 2 or epochs < 1 or draft_vocab < 2:
        raise _fail("need temperature >= 0, lr > 0, 1 <= steps <= 8, n-prompts >= 2, epochs >= 1, "
                    "draft-vocab >= 2", 2)
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    try:
        target_dir = resolve_model_dir(str(target) if target else None)
        if prompts is None:
            texts = training_prompts(n_prompts)
        else:
            texts = [p.text for p in parse_jsonl(prompts.read_text(encoding="utf-8"), prompts.stem)][:n_prompts]
        cfg = TrainConfig(n_prompts=len(texts), max_new_tokens=max_new_tokens, temperature=temperature,
                          draft_vocab=draft_vocab, steps=steps, epochs=epochs, lr=lr, seed=seed)
        from rich.console import Console

        train(target_dir, out, cfg, texts, dev, Console(stderr=True), corpus_only=corpus_only)
    except (ValueError, OSError) as e:
        raise _fail(str(e), 2) from None
    if not corpus_only:
        typer.echo(f"swiftspec: the head is in {out}; use it with --draft {out}", err=True)


cache_app = typer.Typer(help="What the cache holds (converted GGUF models, profiled step times, logs of "
                        "failed workers) and its size; clear it to free the space.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
def cache_list() -> None:
    """List the cache's entries with their sizes."""
    from swiftspec.cache import entries, human_size
    from swiftspec.engine.embedded import cache_dir

    found = entries()
    typer.echo(f"{cache_dir()} (SWIFTSPEC_CACHE moves it)")
    width = max((len(e.name) for e in found), default=0)
    for e in found:
        typer.echo(f"  {human_size(e.size):>9}  {e.name:<{width}}  {e.what}")
    typer.echo(f"  {human_size(sum(e.size for e in found)):>9}  in all")


@cache_app.command("clear")
def cache_clear(
    name: Annotated[str | None, typer.Argument(
        metavar="NAME", show_default=False, help="The entry to remove, as cache list names it. Default: all.")] = None,
) -> None:
    """Remove one cache entry, or all of them. A converted model is converted again when next used."""
    from swiftspec.cache import CacheError, clear, human_size

    try:
        removed = clear(name)
    except CacheError as e:
        raise _fail(str(e), 2) from None
    for e in removed:
        typer.echo(f"removed {e.name} ({human_size(e.size)})")
    typer.echo(f"freed {human_size(sum(e.size for e in removed))}")


history_app = typer.Typer(
    help="Saved conversations (kept in SWIFTSPEC_DATA_DIR, default the user data dir; "
    "`swiftspec history list` prints where).",
    no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(history_app, name="history")


def _history_store():
    """The store, or exit 1 saying why it cannot be read."""
    from swiftspec.history import HistoryStore

    store = HistoryStore()
    if store.notice:
        typer.echo(f"swiftspec: {store.notice}", err=True)
    if store.problem:
        raise _fail(store.problem, 1)
    return store


def _conversation(store, conversation_id: str):
    """The conversation an ID argument names (taken as text, so that a bad one gets our one-line error)."""
    from swiftspec.history import HistoryError

    try:
        return store.get(int(conversation_id))
    except ValueError:
        raise _fail(f"a conversation id is a number (swiftspec history list shows them), not {conversation_id!r}",
                    2) from None
    except HistoryError as e:
        raise _fail(str(e), 2) from None


IdArg = Annotated[str, typer.Argument(metavar="ID", show_default=False, help="The conversation's id.")]


@history_app.command("list")
def history_list(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most N, newest first.")] = 50,
) -> None:
    """List saved conversations: id, date, turns, tokens generated, title."""
    from swiftspec.history import local_time

    store = _history_store()
    conversations = store.list(limit)
    if not conversations:
        typer.echo(f"No saved conversations in {store.path}")
        return
    typer.echo(f"{'ID':>5}  {'UPDATED':<16}  {'TURNS':>5}  {'TOKENS':>6}  TITLE")
    for c in conversations:
        typer.echo(f"{c.id:>5}  {local_time(c.updated):<16}  {c.turns:>5}  {c.tokens:>6}  {c.title}")
    typer.echo(f"({store.path})", err=True)


@history_app.command("show")
def history_show(conversation_id: IdArg) -> None:
    """Print a conversation as Markdown."""
    store = _history_store()
    typer.echo(store.export_markdown(_conversation(store, conversation_id).id), nl=False)


@history_app.command("delete")
def history_delete(
    conversation_id: IdArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete a conversation and its messages (asks first, unless --yes; declining keeps it, exit 0)."""
    store = _history_store()
    conv = _conversation(store, conversation_id)
    if not yes and not typer.confirm(f"Delete #{conv.id} “{conv.title}” ({conv.turns} turns)?", err=True):
        typer.echo(f"Kept #{conv.id}: {conv.title}", err=True)
        return
    store.delete(conv.id)
    if store.problem:
        raise _fail(store.problem, 1)
    typer.echo(f"Deleted #{conv.id}: {conv.title}", err=True)


@history_app.command("export")
def history_export(
    conversation_id: IdArg,
    format_: Annotated[str, typer.Option(
        "--format", "-f", metavar="FORMAT", autocompletion=_complete("md", "json"),
        help="md (Markdown) or json.")] = "md",
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="Write to FILE instead of stdout.")] = None,
) -> None:
    """Export a conversation as Markdown or JSON (with each answer's figures)."""
    store = _history_store()
    conversation_id = _conversation(store, conversation_id).id
    if format_ not in ("md", "json"):
        raise _fail(f"format must be md or json, not {format_!r}", 2)
    text = store.export_json(conversation_id) if format_ == "json" else store.export_markdown(conversation_id)
    if output is None:
        typer.echo(text, nl=False)
        return
    path = output.expanduser().resolve()
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise _fail(f"cannot write {path}: {e}", 1) from None
    typer.echo(f"Exported #{conversation_id} to {path}", err=True)


def _version(value: bool) -> None:
    if value:
        from swiftspec import __version__

        typer.echo(f"swiftspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("-V", "--version", callback=_version, is_eager=True, metavar="",
                                          help="Print the version and exit.")] = False,
) -> None:
    """Reads the config file into click's default_map before the command parses its flags, so that a
    flag and its environment variable both win over the file."""
    path = config_path()
    try:
        ctx.default_map = default_map(read_config(path), ctx.command.commands, path)
    except ConfigError as e:
        raise _fail(str(e), 2) from None


def normalise_argv(argv: list[str]) -> list[str]:
    """`--resume` without an id means the latest conversation (click has no optional option values)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("latest")
    return out


def main(argv: list[str] | None = None) -> None:
    app(args=normalise_argv(sys.argv[1:] if argv is None else argv), prog_name="swiftspec")


def run() -> NoReturn:
    """The ``swiftspec`` program: main(), then what Python's own exit does (wait for non-daemon threads,
    run the atexit handlers, which close an Engine still open), flushed output, and an exit that skips the
    interpreter's teardown of the ~2,000 modules torch and transformers bring (about a second at the end
    of every command). Nothing is left half-written: the history database commits each write."""
    try:
        main()
        code: object = 0
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # sys.exit("message"), as Python itself would report it
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code if isinstance(code, int) else 0)
