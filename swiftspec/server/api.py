"""The OpenAI API as `swiftspec serve` takes it: request bodies validated by pydantic models into typed
requests (a wrong type, an unknown role or a field we do not support is a 400 naming the field, never a
silent ignore; the ranges are SamplingParams.validate's) and the answers' JSON, OpenAI's shapes plus one
documented ``swiftspec`` object of our own figures.

Sampling fields beyond OpenAI's travel in the request's ``swiftspec`` object (``mode``, ``top_k``,
``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``loop_guard``, ``loop_repeats``, ``ignore_eos``,
``stream_stats``, ``grammar``); vLLM's top-level ``top_k``, ``min_p`` and ``repetition_penalty`` are read
too. An answer's grammar comes from OpenAI's ``response_format`` (``json_object``, ``json_schema``), from
``swiftspec.grammar`` (``{"kind": "lark" | "regex" | "json_schema" | "json", "source": ...}``) or from vLLM's
``guided_json`` / ``guided_regex`` / ``guided_grammar``: one of them, checked by the library here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from swiftspec.engine.config import ConfigError, Grammar, GrammarKind, SamplingParams
from swiftspec.engine.spec.grammar import check
from swiftspec.server.tools import (
    NamedChoice,
    Tool,
    Toolbox,
    ToolCall,
    ToolChoice,
    sent_call,
    tool_result,
)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "user"}
MAX_STOPS = 16
UNSUPPORTED = "unsupported_field"  # the error code of a field, value or content part we do not support


@dataclass
class APIError(Exception):
    """An answer that is an error: its HTTP status and OpenAI's error object (``retry_after``: the
    seconds a client should wait before it asks again, sent as ``Retry-After``)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**error, "request_id": request_id} if request_id else error}


RETRY_AFTER_S = 5  # what a 503 of a server that restarts its engine or shuts down asks a client to wait


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_unavailable", RETRY_AFTER_S)


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
    tools: Toolbox | None = None  # the answer may be tool calls (swiftspec/server/tools.py)


# ------------------------------------------------------------------------------------ the schema
def _only(*allowed: Any):
    """A field of OpenAI's we do not support: taken only with a value that asks for nothing (or null)."""
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise PydanticCustomError(UNSUPPORTED, "not supported by this server (only {allowed} is taken)",
                                      {"allowed": " or ".join(map(repr, allowed))})
        return value
    return Annotated[Any, AfterValidator(check)]


def _text(content: Any) -> Any:
    """A message's content parts (text only) joined into one string."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2
               for p in content):
        raise PydanticCustomError(UNSUPPORTED, "only text parts are supported")
    return "".join(p["text"] for p in content)


def _one_prompt(prompt: Any) -> Any:
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt[0]
    if isinstance(prompt, list):
        raise PydanticCustomError("one_prompt", "one prompt per request: a string or an array of one string")
    return prompt


def _stops(stop: Any) -> Any:
    return [stop] if isinstance(stop, str) else stop


class Schema(BaseModel):
    """Strict: no field beyond the model's, no type coerced ("1" is not 1, 1.0 not an integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Message(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    content: Annotated[str | None, BeforeValidator(_text), Field(validate_default=True)] = None

    @field_validator("content")
    @classmethod
    def _has_content(cls, content: str | None, info: ValidationInfo) -> str | None:
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("missing", "content is required (null only for an assistant's tool calls)")
        return content

    def as_dict(self) -> dict[str, str]:
        """The turn the chat template reads, tool calls and results in the documented format."""
        if self.role == "tool":
            return tool_result(self.content)
        calls = [sent_call(c) for c in self.tool_calls or []]
        return {"role": ROLES[self.role], "content": "\n".join(([self.content] if self.content else []) + calls)}


class StreamOptions(Schema):
    include_usage: bool = False


class GrammarBody(Schema):
    """``swiftspec.grammar``: a Lark grammar, a regex, a JSON Schema (as JSON text) or any JSON object."""

    kind: Literal["lark", "regex", "json_schema", "json"]
    source: str = ""


class JsonSchemaFormat(Schema):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = {}
    strict: bool | None = None  # every answer obeys its schema, strict or not


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Extension(Schema):
    """The request's ``swiftspec`` object: our settings beyond OpenAI's (their ranges: SamplingParams')."""

    mode: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    loop_guard: int | None = None
    loop_repeats: int | None = None
    ignore_eos: bool | None = None
    stream_stats: bool = False
    grammar: GrammarBody | None = None


class Common(Schema):
    """The fields both completion APIs take, those that change nothing an answer could show, and those we
    do not support but with the value that means "not used"."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Annotated[list[str] | None, BeforeValidator(_stops), Field(max_length=MAX_STOPS)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    swiftspec: Extension | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    n: _only(1) = None
    logprobs: _only(False, 0) = None
    top_logprobs: _only(0) = None
    logit_bias: _only({}) = None


class ChatBody(Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    functions: _only([]) = None
    function_call: _only("none") = None
    modalities: _only(["text"]) = None
    audio: _only() = None
    prediction: _only() = None
    reasoning_effort: _only() = None
    web_search_options: _only() = None


class CompletionBody(Common):
    prompt: Annotated[str, Field(min_length=1), BeforeValidator(_one_prompt)]
    echo: _only(False) = None
    best_of: _only(1) = None
    suffix: _only("") = None


S = TypeVar("S", bound=Schema)


class TokenizeBody(Schema):
    """``/swiftspec/v1/tokenize``: the messages whose prompt length ``chat --server`` asks for."""

    messages: Annotated[list[Message], Field(min_length=1)]


def validated(schema: type[S], body: Any) -> S:
    """``body`` (parsed JSON) as ``schema``; APIError 400 naming the first field it refuses."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False, include_input=False)[0]
        param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
        if not param:
            raise APIError(400, "the request body must be a JSON object") from None
        unsupported = error["type"] in (UNSUPPORTED, "extra_forbidden")
        message = (f"unknown field {param!r}" if error["type"] == "extra_forbidden"
                   else f"{param}: {error['msg'][0].lower()}{error['msg'][1:]}")
        raise APIError(400, message, param=param, code=UNSUPPORTED if unsupported else None) from None


def parse_chat(body: Any, defaults: SamplingParams) -> Request:
    """A /v1/chat/completions body as a Request (APIError 400 naming the field it refuses)."""
    chat = validated(ChatBody, body)
    limit = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    messages = [m.as_dict() for m in chat.messages]
    toolbox = _toolbox(chat)
    if toolbox is not None and toolbox.callable:
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + toolbox.system_prompt()}
        else:
            messages.insert(0, {"role": "system", "content": toolbox.system_prompt()})
    return _request("chat", chat, defaults, limit, toolbox, messages=messages)


def _toolbox(chat: ChatBody) -> Toolbox | None:
    """The request's tools and tool choice (None without tools)."""
    choice = chat.tool_choice
    if not chat.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: there are no tools to choose from", param="tool_choice")
        return None
    names = [t.function.name for t in chat.tools]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: two functions have the same name", param="tools")
    if isinstance(choice, NamedChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool is named {choice.function.name!r}", param="tool_choice")
    return Toolbox(chat.tools, choice or "auto", chat.parallel_tool_calls is not False)


def parse_completion(body: Any, defaults: SamplingParams) -> Request:
    """A /v1/completions body (a raw prompt: one string) as a Request."""
    completion = validated(CompletionBody, body)
    return _request("completion", completion, defaults, completion.max_tokens, None, prompt=completion.prompt)


# The request's sampling fields -> SamplingParams fields.
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repeat_penalty"}
EXTENSION = set(Extension.model_fields) - {"stream_stats", "grammar"}  # plain settings, as they are


def _grammar(body: Common, toolbox: Toolbox | None) -> tuple[str, Grammar] | None:
    """The request's one grammar and the field that asked for it (APIError 400 for two)."""
    ext, fmt = body.swiftspec or Extension(), body.response_format
    asked: list[tuple[str, Grammar]] = []
    if toolbox is not None and (calls := toolbox.grammar()) is not None:
        asked.append(("tools", calls))
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", Grammar(GrammarKind.JSON)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema: required with type json_schema",
                           param="response_format.json_schema")
        asked.append(("response_format.json_schema.schema", Grammar(GrammarKind.JSON_SCHEMA, _json(fmt.json_schema.schema_))))
    if ext.grammar is not None:
        asked.append(("swiftspec.grammar", Grammar(GrammarKind(ext.grammar.kind), ext.grammar.source)))
    if body.guided_json is not None:
        source = body.guided_json if isinstance(body.guided_json, str) else _json(body.guided_json)
        asked.append(("guided_json", Grammar(GrammarKind.JSON_SCHEMA, source)))
    if body.guided_regex is not None:
        asked.append(("guided_regex", Grammar(GrammarKind.REGEX, body.guided_regex)))
    if body.guided_grammar is not None:
        asked.append(("guided_grammar", Grammar(GrammarKind.LARK, body.guided_grammar)))
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: one grammar per request, and {asked[0][0]} gave one already",
                       param=asked[1][0])
    return asked[0] if asked else None


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _request(kind, body: Common, defaults: SamplingParams, limit: int | None, toolbox: Toolbox | None,
             **what) -> Request:
    ext = body.swiftspec or Extension()
    given = [(name, field, getattr(body, name)) for name, field in SAMPLING.items() if getattr(body, name) is not None]
    given += [(f"swiftspec.{name}", name, value) for name, value in ext.model_dump(exclude={"stream_stats", "grammar"}).items()
              if value is not None]
    if limit is not None:
        given.append(("max_tokens", "max_new_tokens", limit))
    if body.stop is not None:
        given.append(("stop", "stop", body.stop))
    if (constraint := _grammar(body, toolbox)) is not None:
        given.append((constraint[0], "grammar", constraint[1]))
    params = defaults
    for name, field, value in given:  # one at a time, so that a refusal names its field
        try:
            params = dataclasses.replace(params, **{field: value}).validate()
        except ConfigError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
    if constraint is not None:
        try:
            check(params.grammar)
        except ConfigError as e:
            raise APIError(400, f"{constraint[0]}: {e}", param=constraint[0]) from None
    options = body.stream_options or StreamOptions()
    return Request(kind, params, stream=body.stream, include_usage=options.include_usage,
                   stream_stats=ext.stream_stats, tools=toolbox if toolbox is not None and toolbox.callable else None,
                   **what)


OPENAI_SAMPLING = [name for name, field in SAMPLING.items() if name == field and name not in EXTENSION]  # OpenAI's own


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """The request fields that ask for exactly ``params`` (what parse_chat reads back): OpenAI's own where
    it has them, the rest in the ``swiftspec`` object."""
    body = {name: getattr(params, name) for name in OPENAI_SAMPLING if getattr(params, name) is not None}
    ext = {name: getattr(params, name) for name in sorted(EXTENSION)}
    if params.grammar is not None:
        ext["grammar"] = {"kind": str(params.grammar.kind), "source": params.grammar.source}
    return {**body, "max_tokens": params.max_new_tokens, "stop": list(params.stop), "swiftspec": ext}
