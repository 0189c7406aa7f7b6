"""The HTTP side of `swiftspec serve`: the routes (OpenAI's, ``/health``, ``/metrics`` and two of our own
for ``chat --server``), the Host, Origin and key checks, the body's caps, the request ids, and the answer
responses that watch for a client that hangs up. Every error is OpenAI's JSON error object."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pydantic_core
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import StepEvent
from swiftspec.engine.host.answer import AnswerSummary
from swiftspec.server import SHUTDOWN_TIMEOUT_S, api
from swiftspec.server.answers import Reply, step_extension
from swiftspec.server.api import APIError, Request
from swiftspec.server.host import EngineHost, Job, State
from swiftspec.server.tools import CallStream

log = logging.getLogger("swiftspec.serve")

MAX_BODY_BYTES = 4 << 20  # a request body beyond this is refused (413) before it is read whole
BODY_TIMEOUT_S = 30.0  # a body not read whole by then is refused (408): a slow sender holds nothing long
MAX_DEPTH = 200  # the JSON parser's own nesting limit (pydantic_core's jiter): deeper bodies are a 400
OPEN_ROUTES = {"/health"}  # the only route without the key


@dataclass
class ServerSettings:
    """What `swiftspec serve` takes beyond the engine's and the sampling defaults' options."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 32
    cors_origins: tuple[str, ...] = ()
    log_prompts: bool = False
    allowed_hosts: tuple[str, ...] = ()  # Host names answered beyond the loopback ones (behind a proxy)
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S  # how long the running answer may go on after SIGTERM / SIGINT
    model_id: str = "swiftspec"  # what /v1/models lists and the answers name


def request_id(scope: Scope) -> str:
    """The id RequestIds gave this request: in its error bodies, its ``x-request-id`` and the log."""
    return scope.get("state", {}).get("request_id", "")


def error_response(error: APIError, scope: Scope, headers: dict[str, str] | None = None) -> JSONResponse:
    retry = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}
    return JSONResponse(error.body(request_id(scope)), status_code=error.status, headers={**retry, **(headers or {})})


class RequestIds:
    """Gives every request an id (``x-request-id``), and turns any exception of ours into a JSON 500 that
    names the id, with the traceback in the server log under it: never a plain-text 500."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = "req-" + uuid.uuid4().hex[:20]
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s failed", rid)
            if not started:
                error = APIError(500, f"internal error (request id {rid} in the server log)", "server_error")
                await error_response(error, scope)(scope, receive, send_with_id)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


HOST_HEADER = re.compile(r"(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::[0-9]{1,5})?")  # RFC 9110's Host


@dataclass(frozen=True)
class HostRules:
    """Which ``Host`` a request may name (DNS rebinding: a page whose name now resolves to this machine
    still names its own host): localhost, ``*.localhost``, the loopback IP literals, the address the server
    is bound to (bound to every interface: any IP literal, which no page can rebind), and ``names``."""

    bound: str
    names: tuple[str, ...] = ()

    def allows(self, header: str) -> bool:
        if (match := HOST_HEADER.fullmatch(header)) is None:  # userinfo, a path, a stray character: refused
            return False
        host = (match["ip6"] or match["name"]).lower().rstrip(".")
        bound = self.bound.strip("[]").lower()
        if not host:
            return False
        if is_loopback(host) or host.endswith(".localhost") or host in (bound, *map(str.lower, self.names)):
            return True
        return _is_ip(host) and _is_ip(bound) and ipaddress.ip_address(bound).is_unspecified


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


class BrowserCheck:
    """Refuses a request whose ``Host`` the HostRules do not allow (421), and a browser's cross-origin
    request (an ``Origin`` header) unless ``--cors-origin`` names that origin (403): a web page open in
    the user's browser cannot use the server, even one that rebinds its name to 127.0.0.1."""

    def __init__(self, app: ASGIApp, hosts: HostRules, origins: tuple[str, ...]):
        self.app, self.hosts, self.origins = app, hosts, set(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1")
            origin = headers.get(b"origin")
            error = None
            if not self.hosts.allows(host):
                error = APIError(421, f"this server does not answer for the host {host[:100]!r} (--allowed-hosts "
                                      "adds names)", "invalid_request_error", None, "host_not_allowed")
            elif origin is not None and origin.decode("latin-1") not in self.origins:
                error = APIError(403, "cross-origin requests are refused unless serve --cors-origin names the "
                                      "origin", "invalid_request_error", None, "origin_not_allowed")
            if error is not None:
                await error_response(error, scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class KeyCheck:
    """Every route but OPEN_ROUTES needs ``Authorization: Bearer <key>`` (compared in constant time)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                error = APIError(401, "a valid API key is needed: Authorization: Bearer <key>",
                                 "authentication_error", None, "invalid_api_key")
                await error_response(error, scope, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: HTTPRequest) -> Any:
    """The body as JSON, read up to MAX_BODY_BYTES (413 beyond) within BODY_TIMEOUT_S (408 beyond). Not
    JSON, not UTF-8 (a lone surrogate too), NaN or nested deeper than MAX_DEPTH: a 400."""
    too_big = APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise too_big
    except ValueError:
        raise APIError(400, "the Content-Length header is not a number") from None
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise too_big
    except TimeoutError:
        raise APIError(408, f"the request body was not sent within {BODY_TIMEOUT_S:g} s", code="timeout") from None
    try:
        return pydantic_core.from_json(bytes(body), allow_inf_nan=False)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON in UTF-8 (nested at most {MAX_DEPTH} deep): {e}",
                       code="invalid_json") from None


class AnswerResponse(Response):
    """One queued answer, written as it comes (SSE) or whole. A client that hangs up, while its request
    waits or mid-answer, cancels it at once; headers go out with the first event, so a request that fails
    before it (the engine died, the server shuts down) still gets its real status."""

    def __init__(self, host: EngineHost, job: Job, reply: Reply):
        self.host, self.job, self.reply, self.request = host, job, reply, job.request
        self.status_code, self.background = 200, None
        self.calls = CallStream() if reply.tools else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        self.scope = scope
        try:
            if self.request.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            self.host.cancel(self.job)  # a no-op for a finished answer

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.host.cancel(self.job)
        self.job.events.put_nowait(None)  # wakes the writer, which stops

    async def _whole(self, send: Send) -> None:
        text, last = [], None
        while True:
            item = await self.job.events.get()
            if item is None:
                return
            if isinstance(item, APIError):
                await error_response(item, self.scope)(self.scope, _no_receive, send)
                return
            text.append(item.text)
            if item.finished:
                last = item
                break
        summary = AnswerSummary.of(self.request.params.mode, last)
        body = self.reply.whole("".join(text), summary, len(self.job.ids))
        await JSONResponse(body)(self.scope, _no_receive, send)

    async def _stream(self, send: Send) -> None:
        started = False
        while True:
            item = await self.job.events.get()
            if item is None:
                return
            if isinstance(item, APIError):
                if not started:
                    await error_response(item, self.scope)(self.scope, _no_receive, send)
                    return
                await _sse(send, item.body(request_id(self.scope)))
                break
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no")]})
            await self._event(send, item, first=not started)
            started = True
            if item.finished:
                break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _event(self, send: Send, event: StepEvent, first: bool) -> None:
        extra = (step_extension(event.token_ids, event.stats, event.finish_reason)
                 if self.request.stream_stats else None)
        if self.calls is not None:  # text or tool calls: the deltas as each is known
            if first:
                await _sse(send, self.reply.chunk("", first=True, extra=extra))
            for delta in self.calls.feed(event.text) + (self.calls.finish() if event.finished else []):
                await _sse(send, self.reply.delta_chunk(delta))
        elif event.text or first or extra:
            await _sse(send, self.reply.chunk(event.text, first=first, extra=extra))
        if event.finished:
            summary = AnswerSummary.of(self.request.params.mode, event)
            await _sse(send, self.reply.last(summary, called=self.calls is not None and self.calls.calls > 0))
            if self.request.include_usage:
                await _sse(send, self.reply.usage_chunk(summary, len(self.job.ids)))


async def _sse(send: Send, obj: dict) -> None:
    data = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


def build_app(host: EngineHost, defaults: SamplingParams, settings: ServerSettings) -> Starlette:
    """The ASGI app over a running EngineHost; ``defaults`` fill what a request leaves out."""
    metrics = host.metrics
    model = settings.model_id

    async def answer(request: HTTPRequest, parse) -> Response:
        loop = asyncio.get_running_loop()
        parsed: Request = parse(await read_json(request), defaults)
        ids = await loop.run_in_executor(None, host.prompt_ids, parsed)
        job = Job(parsed, ids, loop, request_id(request.scope))
        host.submit(job)
        if settings.log_prompts:
            log.info("request %s (%s): %s", job.request_id, parsed.kind,
                     json.dumps(parsed.messages or parsed.prompt, ensure_ascii=False))
        return AnswerResponse(host, job, Reply(parsed.kind, model, tools=parsed.tools is not None))

    async def chat(request: HTTPRequest) -> Response:
        return await answer(request, api.parse_chat)

    async def completions(request: HTTPRequest) -> Response:
        return await answer(request, api.parse_completion)

    async def models(_request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": STARTED, "owned_by": "swiftspec"}]})

    async def health(_request: HTTPRequest) -> Response:
        state = host.state if host.state != State.OK or host.engine.alive else State.RESTARTING
        return JSONResponse({"status": state, "busy": host.busy, "waiting": host.waiting},
                            status_code=200 if state == State.OK else 503)

    async def metrics_text(_request: HTTPRequest) -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def info(_request: HTTPRequest) -> Response:
        return JSONResponse({"engine": host.info.to_dict(), "defaults": dataclasses.asdict(defaults)})

    async def tokenize(request: HTTPRequest) -> Response:
        messages = [m.as_dict() for m in api.validated(api.TokenizeBody, await read_json(request)).messages]
        loop = asyncio.get_running_loop()
        return JSONResponse({"count": await loop.run_in_executor(None, host.count_tokens, messages)})

    async def on_api_error(request: HTTPRequest, error: APIError) -> Response:
        return error_response(error, request.scope)

    async def on_http_error(request: HTTPRequest, error: HTTPException) -> Response:
        return error_response(APIError(error.status_code, error.detail, code="not_found" if error.status_code == 404
                                       else None), request.scope, error.headers)

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_text, methods=["GET"]),
              Route("/swiftspec/v1/info", info, methods=["GET"]),
              Route("/swiftspec/v1/tokenize", tokenize, methods=["POST"])]
    middleware = [Middleware(Counted, metrics=metrics, paths={r.path for r in routes}), Middleware(RequestIds),
                  Middleware(BrowserCheck, hosts=HostRules(settings.host, settings.allowed_hosts),
                             origins=settings.cors_origins)]
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    if settings.api_key:
        middleware.append(Middleware(KeyCheck, key=settings.api_key))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={APIError: on_api_error, HTTPException: on_http_error})


STARTED = int(time.time())


class Counted:
    """Counts every answered request by route and status (the outermost layer: 401s count too)."""

    def __init__(self, app: ASGIApp, metrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                route = scope["path"] if scope["path"] in self.paths else "other"
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
