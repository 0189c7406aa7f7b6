"""``swiftspec serve``: the OpenAI API on one warm engine (swiftspec.server does the serving)."""

from __future__ import annotations

from typing import Annotated

import typer

from swiftspec.cli.options import (
    CHAT_SAMPLING,
    DECODING,
    SERVER,
    ApiKeyOpt,
    MaxNewTokensOpt,
    app,
    cli_option,
    complete_choices,
    engine_options,
    exit_with,
    sampling_options,
    sampling_params,
    sources,
)
from swiftspec.cli.usage import choice, number_below, refusal, whole_number
from swiftspec.engine.config import MODES, ConfigError, EngineConfig, SamplingParams
from swiftspec.server import MAX_SHUTDOWN_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, listen


@app.command(epilog=CHAT_SAMPLING.replace("bench stays", "A request's own fields win; bench stays") + "\n\n" + sources())
@engine_options
@sampling_options
def serve(
    ctx: typer.Context,
    config: EngineConfig,  # the engine's options (engine_options)
    sampling: dict,  # the sampling flags given (sampling_options)
    host: Annotated[str, cli_option(
        "--host", panel=SERVER, metavar="ADDRESS",
        help="Address to listen on. Anything but loopback needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, cli_option("--port", parser=whole_number(0, 65535),  panel=SERVER, metavar="N",
                              help="TCP port; 0 takes a free one (printed on stderr).")] = 8080,
    api_key: ApiKeyOpt = None,
    max_queue: Annotated[int, cli_option(
        "--max-queue", parser=whole_number(1), panel=SERVER, metavar="N",
        help="Requests that may wait for the engine (one answers at a time); beyond: 429 with Retry-After.")] = 32,
    cors_origin: Annotated[list[str] | None, cli_option(
        "--cors-origin", panel=SERVER, metavar="ORIGIN",
        help="Allow browser pages from ORIGIN (e.g. http://localhost:3000); repeat for several. Default: no CORS.")
    ] = None,
    allowed_host: Annotated[list[str] | None, cli_option(
        "--allowed-hosts", panel=SERVER, metavar="NAME",
        help="Answer requests whose Host header is NAME too (behind a proxy); repeat for several. Default: "
             "localhost, *.localhost, loopback IPs and the --host address only (a refused Host is a 421).")
    ] = None,
    shutdown_timeout: Annotated[float, cli_option(
        "--shutdown-timeout", parser=number_below(0, MAX_SHUTDOWN_TIMEOUT_S, "seconds"), panel=SERVER, metavar="SECONDS",
        help="On SIGTERM or Ctrl-C, how long the running answer may go on before it is cut (waiting requests "
             "get a 503 at once); a second signal stops at once.")] = SHUTDOWN_TIMEOUT_S,
    log_prompts: Annotated[bool, cli_option(
        "--log-prompts", panel=SERVER, help="Log every request's messages on stderr (never logged otherwise).")] = False,
    mode: Annotated[str, cli_option(
        "--mode", parser=choice(MODES, "mode"), panel=DECODING, metavar="MODE", autocompletion=complete_choices(*MODES),
        help="The answers' decoding mode (a request may ask another in its swiftspec object); ar starts no draft.")
    ] = "async",
    max_new_tokens: MaxNewTokensOpt = SamplingParams().max_new_tokens,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) on one warm engine.

    One answer at a time, the others queued; a client that hangs up is cancelled at once; a failed worker group is started again. /health, and /metrics in Prometheus' format. Binds 127.0.0.1 unless given --host and a key; answers only the Host names localhost, *.localhost, loopback IPs, the --host address and --allowed-hosts (a 421 otherwise: DNS rebinding) and no cross-origin browser request unless --cors-origin names it; every bad request is a JSON error naming its field. SIGTERM or Ctrl-C drains: waiting and new requests get a 503 with Retry-After, the running answer gets --shutdown-timeout to finish (then an error event and [DONE]), the workers end, their temporary files are removed and the exit status is 143 (SIGTERM) or 130 (Ctrl-C); a second signal stops at once. Connections: headers within 10 s, an idle keep-alive connection closed after 5 s, a body within 30 s (408), bodies up to 4 MiB (413), JSON nested at most 200 deep; at 256 open connections a new one closes the longest idle one (a 503 when all are busy).

    Examples: [bold]swiftspec serve[/bold] · [bold]swiftspec serve --port 0 --mode sync[/bold] · [bold]SWIFTSPEC_API_KEY=secret swiftspec serve --host 0.0.0.0[/bold]
    """
    params = sampling_params(ctx, config, None, mode=mode, max_new_tokens=max_new_tokens, **sampling)
    try:
        sock = listen(host, port)  # before the server's imports: a taken port is refused at once
    except ConfigError as e:
        raise exit_with(refusal(ctx, e), 2) from None
    # starlette, uvicorn and the Engine: --help and a taken port import none of them
    from swiftspec.server.app import ServerSettings
    from swiftspec.server.serve import serve as run_server

    config = config.for_mode(params.mode)
    settings = ServerSettings(host, port, api_key, max_queue, tuple(cors_origin or ()), log_prompts,
                              tuple(allowed_host or ()), shutdown_timeout)
    say = lambda line: typer.echo(f"swiftspec: {line}", err=True)
    try:
        code = run_server(config, params, settings, sock, say)
    except (ValueError, FileNotFoundError) as e:  # bad settings, model paths
        raise exit_with(refusal(ctx, e) if isinstance(e, ConfigError) else str(e), 2) from None
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # the workers failed to start: the message says why
        raise exit_with(f"the engine failed to start: {e}", 1) from None
    raise typer.Exit(code)
