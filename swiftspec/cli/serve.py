"""``swiftspec serve``: the OpenAI API on one warm engine (swiftspec.server does the serving)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from swiftspec.cli.options import (
    CHAT_SAMPLING,
    DECODING,
    SERVER,
    SOURCES,
    ApiKeyOpt,
    MaxNewTokensOpt,
    app,
    cli_option,
    complete_choices,
    engine_options,
    exit_with,
    parse_whole_number,
    sampling_options,
    sampling_params,
    with_origin,
)
from swiftspec.config import MODES, ConfigError, EngineConfig, SamplingParams


@app.command(epilog=CHAT_SAMPLING.replace("bench stays", "A request's own fields win; bench stays") + "\n\n" + SOURCES)
@engine_options
@sampling_options
def serve(
    ctx: typer.Context,
    config: EngineConfig,  # the engine's options (engine_options)
    sampling: dict,  # the sampling flags given (sampling_options)
    host: Annotated[str, cli_option(
        "--host", panel=SERVER, metavar="ADDRESS",
        help="Address to listen on. Anything but loopback needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, cli_option("--port", parser=parse_whole_number, panel=SERVER, metavar="N",
                              help="TCP port; 0 takes a free one (printed on stderr).")] = 8080,
    api_key: ApiKeyOpt = None,
    max_queue: Annotated[int, cli_option(
        "--max-queue", parser=parse_whole_number, panel=SERVER, metavar="N",
        help="Requests that may wait for the engine (one answers at a time); beyond: 429 with Retry-After.")] = 32,
    cors_origin: Annotated[list[str] | None, cli_option(
        "--cors-origin", panel=SERVER, metavar="ORIGIN",
        help="Allow browser pages from ORIGIN (e.g. http://localhost:3000); repeat for several. Default: no CORS.")
    ] = None,
    log_prompts: Annotated[bool, cli_option(
        "--log-prompts", panel=SERVER, help="Log every request's messages on stderr (never logged otherwise).")] = False,
    mode: Annotated[str, cli_option(
        "--mode", panel=DECODING, metavar="MODE", autocompletion=complete_choices(*MODES),
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

    params = sampling_params(ctx, config, None, mode=mode, max_new_tokens=max_new_tokens, **sampling)
    if params.mode == "ar":  # nothing would ever ask the draft for a token
        config = dataclasses.replace(config, draft="none", draft_corpus="none")
    settings = ServerSettings(host, port, api_key, max_queue, tuple(cors_origin or ()), log_prompts)
    say = lambda line: typer.echo(f"swiftspec: {line}", err=True)
    try:
        code = run_server(config, params, settings, say)
    except (ValueError, FileNotFoundError) as e:  # bad settings, model paths, a port in use
        raise exit_with(with_origin(ctx, e) if isinstance(e, ConfigError) else str(e), 2) from None
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # the workers failed to start: the message says why
        raise exit_with(f"the engine failed to start: {e}", 1) from None
    raise typer.Exit(code)
