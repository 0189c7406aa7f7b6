"""The ``swiftspec`` command line: ``chat`` (TUI or scripted) and ``bench``.

Heavy imports (torch, textual, the engine) happen inside the commands, so ``--help`` and shell completion
stay instant.
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from swiftspec.config import BUILTIN_DRAFTS, ConfigError, EngineConfig, SamplingParams, TreeParams

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


class Mode(str, Enum):
    ar = "ar"
    sync = "sync"
    async_ = "async"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _device_list(value: str | None) -> list[int] | None:
    """'0,1,2' -> [0, 1, 2]; a usage error (exit 2) names the bad piece."""
    if value is None:
        return None
    try:
        devices = [int(piece) for piece in value.split(",") if piece.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected GPU indices like 0,1,2 — got {value!r}") from None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise typer.BadParameter(f"expected distinct GPU indices like 0,1,2 — got {value!r}")
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


# The model/layout options, defined once and shared by `chat` and `bench`.
TargetOpt = Annotated[Path | None, typer.Option(
    "--target", metavar="PATH", rich_help_panel=MODEL,
    help="Target model: a Hugging Face model directory or a .gguf file. Default: the embedded SmolLM2-135M.")]
DraftOpt = Annotated[str, typer.Option(
    "--draft", metavar="PATH|suffix|int8", rich_help_panel=MODEL, autocompletion=_complete_draft,
    help="Draft model sharing the target's tokenizer, 'suffix' for the model-free suffix drafter, or "
         "'int8' for a dynamic-int8 copy of the target (CPU).")]
TargetDevicesOpt = Annotated[str | None, typer.Option(
    "--target-devices", metavar="0,1", rich_help_panel=MODEL,
    help="GPU indices of the target group (tensor parallel over them).")]
DraftDevicesOpt = Annotated[str | None, typer.Option(
    "--draft-devices", metavar="2", rich_help_panel=MODEL, help="GPU indices of the draft group.")]
GpusOpt = Annotated[int | None, typer.Option(
    "--gpus", min=2, rich_help_panel=MODEL,
    help="Use the first N GPUs and let profiling choose the target/draft split.")]
TargetProcsOpt = Annotated[int, typer.Option(
    "--target-procs", min=1, rich_help_panel=MODEL, help="CPU: worker processes in the target group.")]
DraftProcsOpt = Annotated[int, typer.Option(
    "--draft-procs", min=1, rich_help_panel=MODEL, help="CPU: worker processes in the draft group.")]
DeviceOpt = Annotated[Device, typer.Option(
    "--device", rich_help_panel=MODEL, help="Where the workers run; auto picks CUDA when present.")]
DTypeOpt = Annotated[DType, typer.Option(
    "--dtype", rich_help_panel=MODEL, help="Weights dtype; auto is fp32 on CPU, bf16 on CUDA.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", min=1, rich_help_panel=MODEL, help="CPU threads for all workers together. Default: every core.")]
MaxSeqLenOpt = Annotated[int, typer.Option(
    "--max-seq-len", min=16, rich_help_panel=MODEL, help="KV cache length per conversation (tokens).")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", rich_help_panel=MODEL,
    help="Run Python code shipped in the model directory (whatever its auto_map names, and what that "
         "imports) while loading its tokenizer: only for directories you trust. The forward pass always "
         "runs SwiftSpec's own model code.")]
BsOpt = Annotated[int, typer.Option(
    "--bs", min=1, max=64, rich_help_panel=TREE, help="Tree nodes verified per target forward.")]
WOpt = Annotated[int, typer.Option(
    "--w", min=1, max=64, rich_help_panel=TREE, help="Leaves expanded per draft forward.")]
DOpt = Annotated[int | None, typer.Option(
    "--d", min=1, max=64, rich_help_panel=TREE,
    help="Draft expansions per round. Default: chosen from step times profiled at start.")]
MaxNewTokensOpt = Annotated[int, typer.Option(
    "--max-new-tokens", min=1, rich_help_panel=DECODING, help="Most tokens generated per answer.")]

_TREE_DEFAULTS = TreeParams()
_ENGINE_DEFAULTS = EngineConfig()


def engine_config(
    target: Path | None, draft: str, target_devices: str | None, draft_devices: str | None, gpus: int | None,
    target_procs: int, draft_procs: int, device: Device, dtype: DType, threads: int | None, max_seq_len: int,
    trust_remote_code: bool, bs: int, w: int, d: int | None,
) -> EngineConfig:
    """Builds and validates the EngineConfig from the shared flags (ConfigError on a bad combination)."""
    if gpus is not None and (target_devices or draft_devices):
        raise ConfigError("--gpus chooses the split itself; give it or --target-devices/--draft-devices")
    if bool(target_devices) != bool(draft_devices):
        raise ConfigError("--target-devices and --draft-devices go together")
    return EngineConfig(
        target=str(target) if target else None, draft=draft,
        target_devices=_device_list(target_devices), draft_devices=_device_list(draft_devices), gpus=gpus,
        target_procs=target_procs, draft_procs=draft_procs, device=device.value, dtype=dtype.value,
        threads=threads, max_seq_len=max_seq_len, trust_remote_code=trust_remote_code, tree=TreeParams(bs=bs, w=w, d=d),
    ).validate()


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"swiftspec: {message}", err=True)
    return typer.Exit(code)


@app.command(no_args_is_help=False)
def chat(
    target: TargetOpt = None,
    draft: DraftOpt = "suffix",
    target_devices: TargetDevicesOpt = None,
    draft_devices: DraftDevicesOpt = None,
    gpus: GpusOpt = None,
    target_procs: TargetProcsOpt = _ENGINE_DEFAULTS.target_procs,
    draft_procs: DraftProcsOpt = _ENGINE_DEFAULTS.draft_procs,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    threads: ThreadsOpt = None,
    max_seq_len: MaxSeqLenOpt = _ENGINE_DEFAULTS.max_seq_len,
    trust_remote_code: TrustRemoteCodeOpt = False,
    mode: Annotated[Mode, typer.Option(
        "--mode", rich_help_panel=DECODING,
        help="async: SwiftSpec (draft and target in parallel); sync: draft then verify; ar: target only.")
    ] = Mode.async_,
    temperature: Annotated[float, typer.Option(
        "--temperature", min=0.0, rich_help_panel=DECODING, help="0 = greedy; sampling stays lossless.")] = 0.0,
    top_p: Annotated[float, typer.Option(
        "--top-p", min=0.0, max=1.0, rich_help_panel=DECODING, help="Nucleus sampling, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(
        "--top-k", min=0, rich_help_panel=DECODING, help="Sample from the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(
        "--seed", rich_help_panel=DECODING, help="Seed for sampling, so a run can be reproduced.")] = None,
    max_new_tokens: MaxNewTokensOpt = SamplingParams().max_new_tokens,
    system: Annotated[str | None, typer.Option(
        "--system", rich_help_panel=DECODING, help="System prompt.")] = None,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", metavar="TEXT", rich_help_panel=DECODING,
        help="End the answer before this text; repeat for several.")] = None,
    bs: BsOpt = _TREE_DEFAULTS.bs,
    w: WOpt = _TREE_DEFAULTS.w,
    d: DOpt = None,
    prompt: Annotated[str | None, typer.Option(
        "-p", "--prompt", rich_help_panel=SCRIPTED,
        help="Answer this prompt and exit (scripted mode). Piped stdin, if any, is appended as material.")
    ] = None,
    each_line: Annotated[bool, typer.Option(
        "--each-line", rich_help_panel=SCRIPTED, help="Scripted mode: each stdin line is its own prompt.")
    ] = False,
    jsonl: Annotated[bool, typer.Option(
        "--jsonl", rich_help_panel=SCRIPTED,
        help='Scripted mode: stdout is one JSON object per event: {"event":"token","text","token_ids"} '
        '... {"event":"done","stats","finish_reason"}.')
    ] = False,
    resume: Annotated[str | None, typer.Option(
        "--resume", metavar="[ID]",
        help="Resume saved conversation ID, or the latest one when ID is left out (scripted mode "
        "answers after it and appends the new turns).")] = None,
) -> None:
    """Chat with a model. A TUI in a terminal; scripted mode when stdin or stdout is not a terminal, or with -p.

    Scripted mode prints only the answer on stdout and its figures on stderr. Exit codes: 0 ok, 1 engine error, 2 usage error (bad flags or model paths, empty or non-UTF-8 input).

    Examples: [bold]swiftspec chat[/bold] · [bold]echo "Explain RoPE" | swiftspec chat > answer.md[/bold] · [bold]swiftspec chat -p "Summarise:" --jsonl < notes.txt[/bold] · [bold]swiftspec chat --resume[/bold]
    """
    from swiftspec.history import HistoryError, HistoryStore

    try:
        config = engine_config(target, draft, target_devices, draft_devices, gpus, target_procs, draft_procs,
                               device, dtype, threads, max_seq_len, trust_remote_code, bs, w, d)
        params = SamplingParams(mode=mode.value, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_new_tokens=max_new_tokens, stop=stop or []).validate()
    except ConfigError as e:
        raise _fail(str(e), 2) from None

    scripted = prompt is not None or each_line or jsonl or not _interactive()
    store = HistoryStore() if resume is not None or not scripted else None
    conversation = None
    if store is not None and resume is not None:
        try:
            conversation = store.latest() if resume == "latest" else store.get(int(resume))
        except ValueError:
            raise _fail(f"--resume takes a conversation id (a number), not {resume!r}", 2) from None
        except HistoryError as e:
            raise _fail(str(e), 2) from None
    if scripted:
        record = partial(_append_turn, store, conversation.id) if conversation else None
        context = store.messages(conversation.id) if conversation else []
        system = system or (conversation.system if conversation else None)
        raise typer.Exit(_chat_scripted(config, params, system, context, prompt, each_line, jsonl, record))

    try:
        _prepare_models(config)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e), 2) from None
    from swiftspec.tui.app import SwiftSpecApp

    tui = SwiftSpecApp(engine_factory=lambda progress: _start_engine(config, progress), params=params,
                       system=system, store=store, resume=conversation.id if conversation else None,
                       model_line=_model_line(config))
    raise typer.Exit(tui.run() or 0)


def _append_turn(store, conversation_id: int, prompt: str, answer: str, figures: dict) -> None:
    store.add(conversation_id, "user", prompt)
    store.add(conversation_id, "assistant", answer, figures)


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _chat_scripted(config, params, system, context, prompt, each_line, jsonl, record) -> int:
    from swiftspec import scripted

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
    try:
        engine = _start_engine(config, lambda line: typer.echo(f"swiftspec: {line}", err=True))
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
            code = scripted.run(engine, prompts, params, system=system,
                                context=[{"role": m.role, "content": m.content} for m in context],
                                jsonl=jsonl, out=sys.stdout, err=sys.stderr, record=record)
            if code == scripted.EXIT_BROKEN_PIPE:  # nothing more can reach the reader, not even at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return code
        except KeyboardInterrupt:
            engine.cancel()
            return 130


def _prepare_models(config: EngineConfig) -> None:
    """Before the TUI takes the terminal: a missing model path is a usage error, and a GGUF file (the
    embedded default included) is converted now, once, with its progress bar, rather than unseen."""
    from swiftspec import embedded

    for spec in [config.target] + ([config.draft] if config.draft not in BUILTIN_DRAFTS else []):
        path = embedded.embedded_gguf_path() if spec is None else Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {spec!r} does not exist (expected a Hugging Face model "
                                    "directory or a .gguf file)")
        if path.suffix.lower() == ".gguf" and path.is_file():
            embedded.ensure_converted(path)


def _start_engine(config: EngineConfig, progress):
    from swiftspec import Engine

    return Engine.start(config, progress=progress)


def _model_line(config: EngineConfig) -> str:
    target = Path(config.target).name if config.target else "embedded SmolLM2-135M-Instruct"
    draft = config.draft if config.draft in BUILTIN_DRAFTS else Path(config.draft).name
    return f"target {target} · draft {draft}"


@app.command()
def bench(
    target: TargetOpt = None,
    draft: DraftOpt = "suffix",
    target_devices: TargetDevicesOpt = None,
    draft_devices: DraftDevicesOpt = None,
    gpus: GpusOpt = None,
    target_procs: TargetProcsOpt = _ENGINE_DEFAULTS.target_procs,
    draft_procs: DraftProcsOpt = _ENGINE_DEFAULTS.draft_procs,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    threads: ThreadsOpt = None,
    max_seq_len: MaxSeqLenOpt = _ENGINE_DEFAULTS.max_seq_len,
    trust_remote_code: TrustRemoteCodeOpt = False,
    bs: BsOpt = _TREE_DEFAULTS.bs,
    w: WOpt = _TREE_DEFAULTS.w,
    d: DOpt = None,
    modes: Annotated[str, typer.Option(
        "--modes", help="Comma-separated: hf, hf-assisted, ar, sync, async.")] = "hf,hf-assisted,ar,sync,async",
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", metavar="FILE.jsonl", exists=True, dir_okay=False,
        help="Prompts from a JSONL file with a 'prompt' field or MT-Bench-style 'turns'.")] = None,
    prompt_set: Annotated[str | None, typer.Option(
        "--set", help="Built-in prompt sets, comma-separated: chat, code, math, qa, summarisation, "
        "extraction (and humaneval when installed). Default: all built-in sets.")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most N prompts per set.")] = None,
    max_new_tokens: MaxNewTokensOpt = 128,
    json_path: Annotated[Path | None, typer.Option(
        "--json", metavar="FILE", help="Write the results as JSON.")] = None,
    plot_path: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png", help="Plot tokens/s and per-token latency per mode.")] = None,
) -> None:
    """Measure decoding modes and peers side by side on the same prompts, interleaved."""
    try:
        config = engine_config(target, draft, target_devices, draft_devices, gpus, target_procs, draft_procs,
                               device, dtype, threads, max_seq_len, trust_remote_code, bs, w, d)
    except ConfigError as e:
        raise _fail(str(e), 2) from None
    from swiftspec.bench import bench_command

    try:
        bench_command(config=config, modes=modes, prompts=prompts, prompt_set=prompt_set, limit=limit,
                      max_new_tokens=max_new_tokens, json_path=json_path, plot_path=plot_path)
    except (ValueError, FileNotFoundError) as e:  # bad options, prompts or model paths
        raise _fail(str(e), 2) from None


def _version(value: bool) -> None:
    if value:
        from swiftspec import __version__

        typer.echo(f"swiftspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    pass


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
