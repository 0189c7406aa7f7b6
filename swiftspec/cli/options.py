"""What the commands share: the Typer ``app`` and its root callback (``--version``, the config file read
into click's default_map), the option declarations with their panels, parsers (swiftspec.cli.usage) and
completions, the decorators that add the engine's and the sampling options to a command, and the helpers
that turn their values into an EngineConfig or SamplingParams, a refused combination into a usage error.

Heavy imports (torch, textual, the engine) happen inside the commands, so ``--help`` and shell completion
stay instant.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from swiftspec import __version__
from swiftspec.cli.usage import (
    DEVICES,
    CommandLine,
    Refused,
    choice,
    field_value,
    model_path,
    refusal,
    refused_line,
    typed_name,
    whole_number,
)
from swiftspec.engine.config import (
    ACTIVATIONS,
    BUILTIN_DRAFTS,
    DTYPES,
    KV_CACHES,
    ConfigError,
    Device,
    EngineConfig,
    SamplingParams,
    TreeParams,
)
from swiftspec.settings import CHAT_DEFAULTS, config_path, default_map, env_var, read_config

app = CommandLine(
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
SERVER = "Server"


def complete_choices(*choices: str):
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]


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


def cli_option(*names: str, panel: str, metavar: str | None = None, **kwargs) -> typer.models.OptionInfo:
    """A settable option: its long name also reads SWIFTSPEC_<NAME> from the environment (and the config
    file, see swiftspec.settings); every value takes an upper-case metavar, and a flag (metavar None) none.
    A flag that is on by default is named as a pair, "--flag/--no-flag"."""
    long = next(n for n in names if n.startswith("--")).split("/")[0]
    return typer.Option(*names, envvar=env_var(long), metavar="" if metavar is None else metavar,
                        rich_help_panel=panel, **kwargs)


# The options, defined once and shared by `chat` and `bench`, each with its parser (swiftspec.cli.usage):
# a dataclass field's range is checked by its dataclass (field_value), which says what a value means
# ("a finite number >= 0 (0 = greedy)").
DEVICE_CHOICES = tuple(Device)
TargetOpt = Annotated[str | None, cli_option(
    "-m", "--model", "--target", panel=MODEL, metavar="PATH",
    help="Target model: a Hugging Face model directory or a .gguf file (--target is the same flag). "
         "Default: the embedded SmolLM2-135M.")]
DraftOpt = Annotated[str, cli_option(
    "--draft", panel=MODEL, metavar="DRAFT", autocompletion=_complete_draft,
    help="A draft model PATH sharing the target's tokenizer, 'suffix' for the model-free suffix drafter, "
         "'int8' for a dynamic-int8 copy of the target (CPU), or 'none' (no draft processes: ar only).")]
DraftCorpusOpt = Annotated[str, cli_option(
    "--draft-corpus", panel=MODEL, metavar="FILE",
    help="The suffix drafter's corpus of the target's own answers (swiftspec train-draft writes one): a FILE, "
         "'none', or 'auto': the one shipped for the embedded default, none for other targets.")]
DraftHistoryOpt = Annotated[str, cli_option(
    "--draft-history", parser=choice(("on", "off"), "switch"), panel=MODEL, metavar="SWITCH",
    autocompletion=complete_choices("on", "off"),
    help="on or off. on: the suffix drafter also proposes what the target answered in earlier conversations (the saved "
         "history's answers, newest first up to 1M tokens; an unsaved chat: the session's); off: from this "
         "conversation and the corpus only.")]
TargetDevicesOpt = Annotated[str | None, cli_option(
    "--target-devices", parser=DEVICES, panel=MODEL, metavar="GPUS",
    help="GPU indices of the target group, e.g. 0,1 (tensor parallel over them).")]
DraftDevicesOpt = Annotated[str | None, cli_option(
    "--draft-devices", parser=DEVICES, panel=MODEL, metavar="GPUS", help="GPU indices of the draft group, e.g. 2.")]
GpusOpt = Annotated[int | None, cli_option(
    "--gpus", parser=whole_number(1), panel=MODEL, metavar="N",
    help="Use the first N GPUs and let profiling choose the target/draft split.")]
TargetProcsOpt = Annotated[int, cli_option(
    "--target-procs", parser=field_value(EngineConfig, "target_procs"), panel=MODEL, metavar="N",
    help="CPU: worker processes in the target group.")]
DraftProcsOpt = Annotated[int, cli_option(
    "--draft-procs", parser=field_value(EngineConfig, "draft_procs"), panel=MODEL, metavar="N",
    help="CPU: worker processes in the draft group.")]
DeviceOpt = Annotated[str, cli_option(
    "--device", parser=choice(DEVICE_CHOICES, "device"), panel=MODEL, metavar="DEVICE",
    autocompletion=complete_choices(*DEVICE_CHOICES),
    help="auto, cpu or cuda: where the workers run; auto picks CUDA when present.")]
DTypeOpt = Annotated[str, cli_option(
    "--dtype", parser=choice(DTYPES, "dtype"), panel=MODEL, metavar="DTYPE", autocompletion=complete_choices(*DTYPES),
    help="auto, float32, bfloat16, float16, gguf or int4: how the target's weights are held. On the CPU every "
         "choice runs row-invariant kernels (each verified node computes what a one-token step would, so every "
         "mode stays exact) with fp32 activations: float32 / bfloat16 / float16 weights, gguf (a GGUF's own "
         "4- and 8-bit blocks, int16 or int8 activations: --activations), int4 (any checkpoint packed into 4-bit blocks "
         "at load); auto runs a checkpoint at its own width and, for a GGUF, measures its blocks against fp32 at the "
         "first start on the machine and keeps the faster for speculation (int4 only when asked). On CUDA: auto is bf16.")]
ActivationsOpt = Annotated[str, cli_option(
    "--activations", parser=choice(ACTIVATIONS, "activations"), panel=MODEL, metavar="WIDTH",
    autocompletion=complete_choices(*ACTIVATIONS),
    help="int16, int8 or bf16: what the CPU kernels round the activations to before the weights multiply them. "
         "For gguf and int4 blocks, in blocks of 32: int16 (default) stays within ~0.1 % of fp32's logits; int8 "
         "is llama.cpp's precision (a few % of the logits' range on small models) at about half the arithmetic "
         "a row, which makes steps and verified rows cheaper. For --dtype bfloat16, fp32 (the default) or bf16, "
         "torch's precision at bfloat16, which a CPU with AVX512-BF16 multiplies at twice fp32's rate (slower "
         "without it). Every mode gives the same tokens with any of them.")]
KvCacheOpt = Annotated[str, cli_option(
    "--kv-cache", parser=choice(KV_CACHES, "kv-cache"), panel=MODEL, metavar="DTYPE",
    autocompletion=complete_choices(*KV_CACHES),
    help="auto, float16 or float32: what the CPU kernels keep the keys and values in. auto is float16 beside a "
         "GGUF's blocks (gguf, int4), as llama.cpp does: attention reads the whole cache at every step, and half "
         "the bytes made long contexts' steps 14-19 % faster for ~0.03 % of the logits' range; float32 beside "
         "float weights. Every mode gives the same tokens with either.")]
ThreadsOpt = Annotated[int | None, cli_option(
    "--threads", parser=field_value(EngineConfig, "threads"), panel=MODEL, metavar="N",
    help="CPU threads for all workers together. Default: every core but one, which the chat itself uses.")]
MaxSeqLenOpt = Annotated[int, cli_option(
    "--max-seq-len", parser=field_value(EngineConfig, "max_seq_len"), panel=MODEL, metavar="N",
    help="KV cache length per conversation (tokens).")]
TrustRemoteCodeOpt = Annotated[bool, cli_option(
    "--trust-remote-code", panel=MODEL,
    help="Run Python code shipped in the model directory (whatever its auto_map names, and what that "
         "imports) while loading its tokenizer: only for directories you trust. The forward pass always "
         "runs SwiftSpec's own model code.")]
BsOpt = Annotated[int, cli_option(
    "--bs", parser=field_value(TreeParams, "bs"), panel=TREE, metavar="N",
    help="Tree nodes verified per target forward (1-64).")]
WOpt = Annotated[int, cli_option(
    "--w", parser=field_value(TreeParams, "w"), panel=TREE, metavar="N",
    help="Leaves expanded per draft forward (1-64).")]
DOpt = Annotated[int | None, cli_option(
    "--d", parser=field_value(TreeParams, "d"), panel=TREE, metavar="N",
    help="Draft expansions per round (1-64). Default: chosen from step times profiled at start.")]
VerifyCostOpt = Annotated[bool, cli_option(
    "--verify-cost/--no-verify-cost", panel=TREE,
    help="Verify only as many of the bs best nodes as are worth their profiled target cost; "
         "--no-verify-cost: always bs, as the paper does.")]
MaxNewTokensOpt = Annotated[int, cli_option(
    "--max-new-tokens", parser=field_value(SamplingParams, "max_new_tokens"), panel=DECODING, metavar="N",
    help="Most tokens generated per answer.")]
TemperatureOpt = Annotated[float, cli_option(
    "--temperature", parser=field_value(SamplingParams, "temperature", float), panel=DECODING, metavar="NUMBER",
    help="0 = greedy; sampling stays lossless.")]
TopPOpt = Annotated[float, cli_option(
    "--top-p", parser=field_value(SamplingParams, "top_p", float), panel=DECODING, metavar="NUMBER",
    help="Nucleus sampling, in (0, 1].")]
TopKOpt = Annotated[int, cli_option(
    "--top-k", parser=field_value(SamplingParams, "top_k"), panel=DECODING, metavar="N",
    help="Sample from the k most likely tokens; 0 = off.")]
MinPOpt = Annotated[float, cli_option(
    "--min-p", parser=field_value(SamplingParams, "min_p", float), panel=DECODING, metavar="NUMBER",
    help="Keep only the tokens at least this fraction as likely as the most likely one; 0 = off.")]
RepeatPenaltyOpt = Annotated[float, cli_option(
    "--repeat-penalty", parser=field_value(SamplingParams, "repeat_penalty", float), panel=DECODING, metavar="NUMBER",
    help="Divide the logit of each token seen in the last --repeat-last-n tokens (a negative one: multiply) "
         "by this, as transformers' repetition_penalty does; 1 = off. Applies in greedy mode too.")]
RepeatLastNOpt = Annotated[int, cli_option(
    "--repeat-last-n", parser=field_value(SamplingParams, "repeat_last_n"), panel=DECODING, metavar="N",
    help="The penalties look at the last N tokens of the conversation, the prompt included.")]
PresencePenaltyOpt = Annotated[float, cli_option(
    "--presence-penalty", parser=field_value(SamplingParams, "presence_penalty", float), panel=DECODING, metavar="NUMBER",
    help="Subtract this from the logit of each token seen in the last --repeat-last-n tokens (OpenAI's "
         "rule), in [-2, 2]; 0 = off.")]
FrequencyPenaltyOpt = Annotated[float, cli_option(
    "--frequency-penalty", parser=field_value(SamplingParams, "frequency_penalty", float), panel=DECODING, metavar="NUMBER",
    help="Subtract this times its count in the last --repeat-last-n tokens from each token's logit "
         "(OpenAI's rule), in [-2, 2]; 0 = off.")]
LoopGuardOpt = Annotated[int, cli_option(
    "--loop-guard", parser=field_value(SamplingParams, "loop_guard"), panel=DECODING, metavar="N",
    help="End an answer (finish reason 'repetition') once its last N tokens are one span repeated "
         "--loop-repeats times; 0 = off.")]
LoopRepeatsOpt = Annotated[int, cli_option(
    "--loop-repeats", parser=field_value(SamplingParams, "loop_repeats"), panel=DECODING, metavar="K",
    help="How many repeats of a span the loop guard waits for (>= 2).")]
SeedOpt = Annotated[int | None, cli_option(
    "--seed", parser=field_value(SamplingParams, "seed"), panel=DECODING, metavar="N",
    help="Seed for sampling, so a run can be reproduced.")]
SystemOpt = Annotated[str | None, cli_option("--system", panel=DECODING, metavar="TEXT", help="System prompt.")]
ApiKeyOpt = Annotated[str | None, cli_option(
    "--api-key", panel=SERVER, metavar="KEY",
    help="serve: the key every request but /health must carry (Authorization: Bearer KEY); chat --server: the "
         "key to send.")]

# Every engine setting the command line sets, by its EngineConfig field (bs, w, d: TreeParams'): its option
# above. A command that starts an engine takes them all with @engine_options; the defaults are the
# dataclasses' own.
ENGINE_OPTIONS = {
    "target": TargetOpt, "draft": DraftOpt, "draft_corpus": DraftCorpusOpt, "target_devices": TargetDevicesOpt,
    "draft_devices": DraftDevicesOpt, "gpus": GpusOpt, "target_procs": TargetProcsOpt, "draft_procs": DraftProcsOpt,
    "device": DeviceOpt, "dtype": DTypeOpt, "activations": ActivationsOpt, "kv_cache": KvCacheOpt, "threads": ThreadsOpt, "max_seq_len": MaxSeqLenOpt,
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
        raise ConfigError("--gpus: chooses the split itself; give it or --target-devices with --draft-devices")
    if bool(target_devices) != bool(draft_devices):
        given_one, other = (("--target-devices", "--draft-devices") if target_devices
                            else ("--draft-devices", "--target-devices"))
        raise ConfigError(f"{given_one}: given without {other}; give both, or --gpus")
    tree = TreeParams(**{name: given.pop(name) for name in TREE_FIELDS})
    return EngineConfig(target=target, target_devices=target_devices, draft_devices=draft_devices, tree=tree,
                        **given).validate()


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


MODEL_PATHS = {"target": model_path("model"), "draft": model_path("draft", tuple(BUILTIN_DRAFTS))}


def check_model_paths(ctx: typer.Context, **given: str | None) -> None:
    """The target's and the draft's paths given exist: a usage error naming the flag otherwise, before
    anything loads."""
    for name, value in given.items():
        try:
            MODEL_PATHS[name](value)
        except Refused as e:
            raise exit_with(refused_line(typed_name(ctx, name), e), 2) from None


def _engine_config(ctx: typer.Context, given: dict) -> EngineConfig:
    check_model_paths(ctx, target=given["target"], draft=given["draft"])
    try:
        return engine_config(**given)
    except ConfigError as e:
        raise exit_with(refusal(ctx, e), 2) from None


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
    from swiftspec.engine.model.model_dir import generation_defaults  # model files' modules: not for --help

    path = Path(target).expanduser() if target else None
    found = generation_defaults(path) if path is not None and path.is_dir() else None
    try:
        return dataclasses.replace(CHAT_DEFAULTS, **(found or {})).validate()
    except ConfigError as e:
        raise ConfigError(f"{path / 'generation_config.json'}: {e}") from None


def exit_with(message: str, code: int) -> typer.Exit:
    typer.echo(f"swiftspec: {message}", err=True)
    return typer.Exit(code)


def sources(but: str = "") -> str:
    """A command's footer: where its settable options' values come from. ``but`` names its options that
    are not settable (no environment variable, no config key)."""
    return (f"Every option{' but ' + but if but else ''} can also be set by an environment variable (shown "
            f"with it) or in the config file {config_path()} (TOML, e.g. max-new-tokens = 64, or under "
            "\\[chat] / \\[serve] / \\[bench]); a value is taken from, in order: the flag, the environment "
            "variable, the config file, the default.")


CHAT_SAMPLING = (f"Sampling defaults (the flags left out): a model directory's generation_config.json, read as "
                 "transformers reads it, with a loop guard and penalty window as below; for the embedded model, "
                 f"a GGUF file or a directory without that file, the ones measured for a chat: "
                 f"{CHAT_DEFAULTS.summary()} (repeat-last-n {CHAT_DEFAULTS.repeat_last_n}, loop-repeats "
                 f"{CHAT_DEFAULTS.loop_repeats}). bench stays greedy unless asked.")


def sampling_params(ctx: typer.Context, config: EngineConfig, base: SamplingParams | None, **given) -> SamplingParams:
    """The answers' sampling: the flags given (None: left out) over ``base`` or chat_defaults (a usage
    error, said with where the refused value came from)."""
    try:
        return dataclasses.replace(base or chat_defaults(config.target),
                                   **{name: value for name, value in given.items() if value is not None}).validate()
    except ConfigError as e:
        raise exit_with(refusal(ctx, e), 2) from None
    except ValueError as e:  # a generation_config.json that cannot be read
        raise exit_with(str(e), 2) from None


def given_params(ctx: typer.Context) -> set[str]:
    """The settings given for this run (flag or environment variable), which win over a resumed
    conversation's own; the config file and the defaults do not."""
    return {name for name in ctx.params if option_source(ctx, name) in ("COMMANDLINE", "ENVIRONMENT")}


def option_source(ctx: typer.Context, name: str) -> str | None:
    """Where a parameter's value came from, by name (typer's own copy of click has its own enum)."""
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else None


def _version(value: bool) -> None:
    if value:
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
        raise exit_with(str(e), 2) from None
