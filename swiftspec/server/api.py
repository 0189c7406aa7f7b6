"""The OpenAI API as `swiftspec serve` takes it: request bodies checked into typed requests (a field we do
not support is a 400 naming it, never a silent ignore) and the answers' JSON, OpenAI's shapes plus one
documented ``swiftspec`` object of our own figures.

Sampling fields beyond OpenAI's travel in the request's ``swiftspec`` object (``mode``, ``top_k``,
``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``loop_guard``, ``loop_repeats``, ``ignore_eos``,
``stream_stats``); vLLM's top-level ``top_k``, ``min_p`` and ``repetition_penalty`` are read too.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from swiftspec.config import ConfigError, SamplingParams, StepStats
from swiftspec.engine.answer import AnswerSummary

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 16


@dataclass
class APIError(Exception):
    """An answer that is an error: its HTTP status and OpenAI's error object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_unavailable")


@dataclass
class Request:
    """One answer asked for: chat ``messages`` or a raw ``prompt`` (the completions API), and how."""

    kind: Literal["chat", "completion"]
    params: SamplingParams
    messages: list[dict] | None = None
    prompt: str | None = None
    stream: bool = False
    include_usage: bool = False
    stream_stats: bool = False  # every streamed chunk carries its token ids and step figures (chat --server)


# Fields of OpenAI's requests we take or may ignore (they change nothing an answer could show), and the
# values of those we do not support that mean "not used".
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "swiftspec", "top_k", "min_p", "repetition_penalty"}
HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
NOT_USED: dict[str, tuple] = {
    "n": (None, 1), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
}
CHAT_FIELDS = COMMON | HARMLESS | {"messages", "max_completion_tokens"} | set(NOT_USED) - {"echo", "best_of", "suffix"}
COMPLETION_FIELDS = COMMON | HARMLESS | {"prompt"} | set(NOT_USED) - {"tools", "tool_choice", "functions",
                                                                      "function_call", "response_format",
                                                                      "modalities", "audio", "prediction",
                                                                      "reasoning_effort", "web_search_options"}
# The request's sampling fields -> SamplingParams fields.
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repeat_penalty"}
EXTENSION = {"mode", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "loop_guard", "loop_repeats",
             "ignore_eos", "stream_stats"}


def parse_chat(body: Any, defaults: SamplingParams) -> Request:
    """A /v1/chat/completions body as a Request (APIError 400 naming the field it refuses)."""
    body = _object(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    limit = _first("max_completion_tokens", "max_tokens", body)
    return _request("chat", body, defaults, limit, messages=[_message(m, i) for i, m in enumerate(messages)])


def parse_completion(body: Any, defaults: SamplingParams) -> Request:
    """A /v1/completions body (a raw prompt: one string) as a Request."""
    body = _object(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be a non-empty string (one prompt per request)", param="prompt")
    return _request("completion", body, defaults, body.get("max_tokens"), prompt=prompt)


def _object(body: Any, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name not in known:
            raise APIError(400, f"unknown field {name!r}", param=name, code="unsupported_field")
        if name in NOT_USED and value not in NOT_USED[name]:
            raise APIError(400, f"{name} is not supported by this server (given {value!r})", param=name,
                           code="unsupported_field")
    return body


def _first(a: str, b: str, body: dict) -> Any:
    return body[a] if body.get(a) is not None else body.get(b)


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{where} must be an object with role and content", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}", param=f"{where}.role")
    unknown = set(message) - {"role", "content", "name"}
    if unknown:
        field = sorted(unknown)[0]
        raise APIError(400, f"{where}.{field} is not supported by this server", param=f"{where}.{field}",
                       code="unsupported_field")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(400, f"{where}.content: only text parts are supported", param=f"{where}.content",
                           code="unsupported_field")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string", param=f"{where}.content")
    return {"role": ROLES[role], "content": content}


def _request(kind, body: dict, defaults: SamplingParams, limit: Any, **what) -> Request:
    ext = body.get("swiftspec") or {}
    if not isinstance(ext, dict):
        raise APIError(400, "swiftspec must be an object", param="swiftspec")
    for name in set(ext) - EXTENSION:
        raise APIError(400, f"unknown field swiftspec.{name}", param=f"swiftspec.{name}", code="unsupported_field")
    params = defaults
    given = [(name, field, body[name]) for name, field in SAMPLING.items() if body.get(name) is not None]
    given += [(f"swiftspec.{name}", name, value) for name, value in ext.items() if name != "stream_stats"]
    if limit is not None:
        given.append(("max_tokens", "max_new_tokens", limit))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOPS:
            raise APIError(400, f"stop must be a string or an array of at most {MAX_STOPS} strings", param="stop")
        given.append(("stop", "stop", stops))
    for name, field, value in given:  # one at a time, so that a refusal names its field
        try:
            params = dataclasses.replace(params, **{field: value}).validate()
        except (ConfigError, TypeError) as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(400, "stream_options takes include_usage only", param="stream_options")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", param="stream")
    return Request(kind, params, stream=stream, include_usage=bool(options.get("include_usage")),
                   stream_stats=bool(ext.get("stream_stats")), **what)


# ------------------------------------------------------------------------------------------ answers
FINISH = {"eos": "stop", "stop": "stop", "repetition": "stop", "length": "length", "context": "length",
          "cancelled": "stop"}


@dataclass
class Reply:
    """How one answer is written back: its id, model, the object names of its kind."""

    kind: Literal["chat", "completion"]
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = self.created or int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": name + (".chunk" if chunk and self.kind == "chat" else ""),
                "created": self.created, "model": self.model}

    def _choice(self, text: str, finish: str | None, chunk: bool, role: bool = False) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def whole(self, text: str, summary: AnswerSummary, prompt_tokens: int) -> dict[str, Any]:
        return {**self._head(False), "choices": [self._choice(text, FINISH.get(summary.finish_reason), False)],
                "usage": usage(summary, prompt_tokens), "swiftspec": extension(summary)}

    def chunk(self, text: str, first: bool = False, finish: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self._head(True), "choices": [self._choice(text, finish, True, role=first)], **(extra or {})}

    def last(self, summary: AnswerSummary) -> dict[str, Any]:
        return self.chunk("", finish=FINISH.get(summary.finish_reason), extra={"swiftspec": extension(summary)})

    def usage_chunk(self, summary: AnswerSummary, prompt_tokens: int) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage(summary, prompt_tokens)}


def usage(summary: AnswerSummary, prompt_tokens: int) -> dict[str, int]:
    generated = summary.stats.generated
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def extension(summary: AnswerSummary) -> dict[str, Any]:
    """The ``swiftspec`` object of an answer (README, "The server"): the figures no other server gives."""
    s = summary.stats
    return {"mode": summary.mode, "finish_reason": summary.finish_reason,
            "tokens_per_verification": round(s.mean_accepted, 4), "acceptance_rate": round(s.acceptance_rate, 4),
            "ms_per_token_p50": round(s.ms_per_token_p50, 3), "ms_per_token_p95": round(s.ms_per_token_p95, 3),
            "tokens_per_s": round(s.tokens_per_s, 3), "prefill_tokens": s.prefill_tokens, "d": s.d}


def step_extension(token_ids: list[int], stats: StepStats, finish_reason: str | None) -> dict[str, Any]:
    """A streamed chunk's ``swiftspec`` object when the request asked for ``stream_stats``."""
    return {"swiftspec": {"token_ids": token_ids, "stats": stats.to_dict(), "finish_reason": finish_reason}}


OPENAI_SAMPLING = [name for name, field in SAMPLING.items() if name == field and name not in EXTENSION]  # OpenAI's own


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """The request fields that ask for exactly ``params`` (what parse_chat reads back): OpenAI's own where
    it has them, the rest in the ``swiftspec`` object."""
    body = {name: getattr(params, name) for name in OPENAI_SAMPLING if getattr(params, name) is not None}
    return {**body, "max_tokens": params.max_new_tokens, "stop": list(params.stop),
            "swiftspec": {name: getattr(params, name) for name in sorted(EXTENSION - {"stream_stats"})}}
