"""The HTTP side of `swiftspec serve`: the routes (OpenAI's, ``/health``, ``/metrics`` and two of our own
for ``chat --server``), the key check, the body cap, and the answer responses that watch for a client
that hangs up."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from swiftspec.config import SamplingParams, StepEvent
from swiftspec.engine.answer import AnswerSummary
from swiftspec.server import api
from swiftspec.server.api import APIError, Reply, Request
from swiftspec.server.host import EngineHost, Job

log = logging.getLogger("swiftspec.serve")

MAX_BODY_BYTES = 4 << 20  # a request body beyond this is refused (413) before it is read whole
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
    model_id: str = "swiftspec"  # what /v1/models lists and the answers name


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


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
                await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: HTTPRequest) -> Any:
    """The body as JSON, read up to MAX_BODY_BYTES (413 beyond); malformed JSON is a 400."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


class AnswerResponse(Response):
    """One queued answer, written as it comes (SSE) or whole. A client that hangs up, while its request
    waits or mid-answer, cancels it at once; headers go out with the first event, so a request that fails
    before it (the engine died, the server shuts down) still gets its real status."""

    def __init__(self, host: EngineHost, job: Job, reply: Reply):
        self.host, self.job, self.reply, self.request = host, job, reply, job.request
        self.status_code, self.background = 200, None

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
                await error_response(item)(self.scope, _no_receive, send)
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
                    await error_response(item)(self.scope, _no_receive, send)
                    return
                await _sse(send, item.body())
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
        extra = (api.step_extension(event.token_ids, event.stats, event.finish_reason)
                 if self.request.stream_stats else None)
        if event.text or first or extra:
            await _sse(send, self.reply.chunk(event.text, first=first, extra=extra))
        if event.finished:
            summary = AnswerSummary.of(self.request.params.mode, event)
            await _sse(send, self.reply.last(summary))
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
        job = Job(parsed, ids, loop)
        host.submit(job)
        if settings.log_prompts:
            log.info("request %s: %s", parsed.kind, json.dumps(parsed.messages or parsed.prompt, ensure_ascii=False))
        return AnswerResponse(host, job, Reply(parsed.kind, model))

    async def chat(request: HTTPRequest) -> Response:
        return await answer(request, api.parse_chat)

    async def completions(request: HTTPRequest) -> Response:
        return await answer(request, api.parse_completion)

    async def models(_request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": STARTED, "owned_by": "swiftspec"}]})

    async def health(_request: HTTPRequest) -> Response:
        state = host.state if host.state != "ok" or host.engine.alive else "restarting"
        return JSONResponse({"status": state, "busy": host.busy, "waiting": host.waiting},
                            status_code=200 if state == "ok" else 503)

    async def metrics_text(_request: HTTPRequest) -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def info(_request: HTTPRequest) -> Response:
        return JSONResponse({"engine": host.info.to_dict(), "defaults": dataclasses.asdict(defaults)})

    async def tokenize(request: HTTPRequest) -> Response:
        body = await read_json(request)
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list):
            raise APIError(400, "messages must be an array", param="messages")
        loop = asyncio.get_running_loop()
        return JSONResponse({"count": await loop.run_in_executor(None, host.count_tokens, messages)})

    async def on_api_error(_request: HTTPRequest, error: APIError) -> Response:
        return error_response(error, {"Retry-After": "1"} if error.status == 429 else None)

    async def on_http_error(_request: HTTPRequest, error: HTTPException) -> Response:
        return error_response(APIError(error.status_code, error.detail, code="not_found" if error.status_code == 404
                                       else None), error.headers)

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_text, methods=["GET"]),
              Route("/swiftspec/v1/info", info, methods=["GET"]),
              Route("/swiftspec/v1/tokenize", tokenize, methods=["POST"])]
    middleware = [Middleware(Counted, metrics=metrics, paths={r.path for r in routes})]
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
