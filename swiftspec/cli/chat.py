"""``swiftspec chat``: the TUI in a terminal, scripted mode otherwise, on an engine of its own or a
server's (--server)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from swiftspec import window
from swiftspec.cli.options import (
    CHAT_SAMPLING,
    DECODING,
    ENGINE_OPTIONS,
    SERVER,
    ApiKeyOpt,
    DraftHistoryOpt,
    MaxNewTokensOpt,
    SeedOpt,
    SystemOpt,
    app,
    cli_option,
    complete_choices,
    engine_options,
    exit_with,
    given_params,
    option_source,
    sampling_options,
    sampling_params,
    sources,
)
from swiftspec.cli.usage import Parser, Refused, choice, typed_name
from swiftspec.engine.config import (
    MODES,
    ConfigError,
    EngineConfig,
    Grammar,
    GrammarKind,
    SamplingParams,
)
from swiftspec.engine.host.failures import EngineError
from swiftspec.engine.spec.draft_spec import DraftSpec

SCRIPTED = "Scripted mode"


def _conversation_id(value: str) -> int | str:
    """--resume's value: a saved conversation's id, or "latest" (what --resume alone means)."""
    if value == "latest":
        return value
    try:
        return int(value)
    except ValueError:
        raise Refused(f"{value!r} is not a conversation id", RESUME_ACCEPTS) from None


RESUME_ACCEPTS = "a number, as swiftspec history list shows them, or none for the latest"


def _grammar_file(kind: GrammarKind, accepted: str) -> Parser:
    """--json-schema / --grammar's parser: the file's text as that kind of grammar, checked by the library."""
    def read(value: str) -> Grammar:
        from swiftspec.engine.spec.grammar import check  # the library: only when a grammar is given

        try:
            grammar = Grammar(kind, Path(value).read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise Refused(f"{value!r} cannot be read ({e.strerror if isinstance(e, OSError) else e})", accepted) from None
        try:
            check(grammar)
        except ConfigError as e:
            raise Refused(f"{value!r}: {e}", accepted) from None
        return grammar
    return Parser(read, accepted)


SCHEMA_ACCEPTS = "a file holding a JSON Schema"
GRAMMAR_ACCEPTS = "a file holding a Lark grammar (or llama.cpp's GBNF)"


@app.command(no_args_is_help=False, epilog=CHAT_SAMPLING + "\n\n" + sources("-p and --resume"))
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
    mode: Annotated[str, cli_option(
        "--mode", parser=choice(MODES, "mode"), panel=DECODING, metavar="MODE", autocompletion=complete_choices(*MODES),
        help="async: SwiftSpec (draft and target in parallel; the default, also on one GPU, where it measured "
             "at least as fast as sync); sync: draft then verify; ar: target only, and no draft is started "
             "(so that session cannot switch to sync or async: start it again for those).")
    ] = "async",
    sampling: dict,  # the sampling flags given (sampling_options)
    seed: SeedOpt = None,
    max_new_tokens: MaxNewTokensOpt = SamplingParams().max_new_tokens,
    system: SystemOpt = None,
    stop: Annotated[list[str] | None, cli_option(
        "--stop", panel=DECODING, metavar="TEXT",
        help="End the answer before this text; repeat for several.")] = None,
    json_mode: Annotated[bool, cli_option(
        "--json", panel=DECODING, help="Answer with one JSON object (a grammar masks every token).")] = False,
    json_schema: Annotated[Grammar | None, cli_option(
        "--json-schema", parser=_grammar_file(GrammarKind.JSON_SCHEMA, SCHEMA_ACCEPTS), panel=DECODING,
        metavar="FILE", help="Answer with JSON valid against the JSON Schema in FILE.")] = None,
    grammar: Annotated[Grammar | None, cli_option(
        "--grammar", parser=_grammar_file(GrammarKind.LARK, GRAMMAR_ACCEPTS), panel=DECODING, metavar="FILE",
        help="Answer in the grammar in FILE (Lark, as llguidance takes it, or llama.cpp's GBNF).")] = None,
    prompt: Annotated[str | None, typer.Option(
        "-p", "--prompt", metavar="TEXT", rich_help_panel=SCRIPTED,
        help="Answer this prompt and exit (scripted mode). Piped stdin, if any, is appended as material.")
    ] = None,
    each_line: Annotated[bool, cli_option(
        "--each-line", panel=SCRIPTED,
        help="Scripted mode: each stdin line is its own prompt, answered on its own (as the next turns of the "
             "conversation with --save or --resume); plain answers are separated by a blank line.")
    ] = False,
    jsonl: Annotated[bool, cli_option(
        "--jsonl", panel=SCRIPTED,
        help='Scripted mode: stdout is one JSON object per event: {"event":"token","text","token_ids"} '
        '... {"event":"done","stats","finish_reason"}.')
    ] = False,
    resume: Annotated[str | None, typer.Option(
        "--resume", parser=Parser(_conversation_id, RESUME_ACCEPTS), metavar="ID",
        help="Resume saved conversation ID, or the latest one when ID is left out (scripted mode "
        "answers after it and appends the new turns).")] = None,
    save: Annotated[bool, cli_option(
        "--save", panel=SCRIPTED,
        help="Scripted mode: save the prompts and answers as a new conversation, as its turns (see `swiftspec "
        "history`; the id is printed on stderr). Scripted runs are not saved otherwise, except the turns that "
        "--resume appends.")] = False,
    server: Annotated[str | None, cli_option(
        "--server", panel=SERVER, metavar="URL",
        help="Chat with a running `swiftspec serve` at URL (e.g. http://127.0.0.1:8080) instead of starting an "
             "engine: instant start, one warm engine for the terminal and the editor alike. The model options "
             "are the server's.")] = None,
    api_key: ApiKeyOpt = None,
    quiet: Annotated[bool, cli_option(
        "-q", "--quiet", panel=SCRIPTED,
        help="Scripted mode: no start-up progress and no figures on stderr; errors and warnings still.")] = False,
) -> None:
    """Chat with a model. A TUI in a terminal; scripted mode when stdin or stdout is not a terminal, or with a prompt.

    Scripted mode prints only the answer on stdout and its figures on stderr. Exit codes: 0 ok, 1 engine error, 2 usage error (bad flags, model paths or model files, empty or non-UTF-8 input, a prompt longer than the context), 130 interrupted (Ctrl-C).

    Examples: [bold]swiftspec chat[/bold] · [bold]swiftspec chat "Why is the sky blue?"[/bold] · [bold]echo "Explain RoPE" | swiftspec chat > answer.md[/bold] · [bold]swiftspec chat -p "Summarise:" --jsonl < notes.txt[/bold] · [bold]swiftspec chat --resume[/bold]
    """
    if prompt_arg is not None and prompt is not None:
        raise exit_with(f"{typed_name(ctx, 'prompt')}: given with a PROMPT argument too; give the prompt one way", 2)
    prompt = prompt_arg if prompt is None else prompt
    # the conversation, its store (sqlite3) and below: --help imports none of them
    from swiftspec.conversation import Conversation, Settings
    from swiftspec.history import HistoryError, HistoryStore

    grammars = [g for g in (Grammar(GrammarKind.JSON) if json_mode else None, json_schema, grammar) if g is not None]
    if len(grammars) > 1:
        raise exit_with("--json, --json-schema and --grammar: give one grammar, not several", 2)
    sampling = dict(mode=mode, seed=seed, max_new_tokens=max_new_tokens, stop=stop or [],
                    grammar=grammars[0] if grammars else None, **sampling)
    remote = None
    if server is not None:  # the server's sampling defaults, under what this command sets
        local = sorted(given_params(ctx) & set(ENGINE_OPTIONS))
        if local:
            raise exit_with(f"{typed_name(ctx, local[0])}: has no effect with --server; leave the model options "
                            "to the server, whose engine answers", 2)
        from swiftspec.server.remote import RemoteEngine  # httpx: only to attach to a server

        try:
            remote = RemoteEngine.connect(server, api_key)
        except EngineError as e:
            raise exit_with(str(e), 1) from None
        sampling = {name: value for name, value in sampling.items() if option_source(ctx, name) != "DEFAULT"}
    params = sampling_params(ctx, config, remote.defaults if remote else None, **sampling)
    defaults = Settings(system, params)
    scripted = prompt is not None or each_line or jsonl or not _interactive()
    store = HistoryStore() if resume is not None or save or not scripted else None
    if store is not None and store.notice:
        typer.echo(f"swiftspec: {store.notice}", err=True)
    conversation = None
    if store is not None and resume is not None:
        try:
            conversation_id = store.latest().id if resume == "latest" else resume
            conversation = Conversation.resume(store, conversation_id, defaults, prefer=given_params(ctx))
        except HistoryError as e:
            raise exit_with(f"{typed_name(ctx, 'resume')}: {e}; {RESUME_ACCEPTS}", 2) from None
        for warning in conversation.take_warnings():
            typer.echo(f"swiftspec: #{conversation.id}: {warning}", err=True)
    conversation = conversation or Conversation(store if (save or not scripted) else None, defaults)
    config = dataclasses.replace(config, draft_history=draft_history == "on")
    kept = conversation.store  # its answers are the drafter's history; unsaved chats draft from the session's
    if kept is not None and kept.available:
        config = dataclasses.replace(config, history_db=str(kept.path))
    config = config.for_mode(conversation.params.mode)

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
        raise exit_with(str(e), 2) from None
    from swiftspec.tui.app import SwiftSpecApp  # textual: only for the chat app

    tui = SwiftSpecApp(connect, defaults, store=store, conversation=conversation,
                       model_line=f"server {server}" if server else _model_line(config))
    raise typer.Exit(tui.run() or 0)


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _chat_scripted(config, conversation, prompt, each_line, jsonl, quiet, connect, local: bool) -> int:
    """``connect(progress)`` gives the engine: a started one, or a server's (``local`` False: no model
    files here to count a prompt with before it)."""
    from swiftspec import scripted  # the conversation and its store: --help imports none of them

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
            from swiftspec.engine.host.client import Engine  # the Engine's modules: not for --help

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
    system = len((conversation.settings.system or "").encode())
    room = window.answer_room(conversation.params.max_new_tokens, config.max_seq_len)
    return any(len(p.encode()) + system + TEMPLATE_ROOM + room > config.max_seq_len for p in prompts)


TEMPLATE_ROOM = 256


def _prepare_models(config: EngineConfig) -> None:
    """Before the TUI takes the terminal: a missing or broken model is a usage error, and a GGUF file (the
    embedded default included) is converted now, once, its stages shown on stderr, rather than unseen."""
    # the model files' modules (transformers' tokenizers, GGUF): --help imports none of them
    from swiftspec.engine.host.startup import resolve_draft
    from swiftspec.engine.model.model_dir import resolve_model_dir

    say = lambda line: typer.echo(f"swiftspec: {line}", err=True)
    resolve_draft(config.draft, resolve_model_dir(config.target, progress=say), say)


def _start_engine(config: EngineConfig, progress):
    from swiftspec import Engine  # the Engine's modules: --help imports none of them

    return Engine.start(config, progress=progress)


def _model_line(config: EngineConfig) -> str:
    target = Path(config.target).name if config.target else "embedded SmolLM2-135M-Instruct"
    draft = DraftSpec.of(config.draft).name
    return f"target {target} · draft {draft}"
