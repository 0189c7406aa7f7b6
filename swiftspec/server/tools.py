"""OpenAI tools as `swiftspec serve` takes them, in one documented prompt format for every model (README,
"Tool calls"): the tools described in a system message, each call written as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one line per call, and a tool's result sent back as a user turn ``<tool_response>...</tool_response>``.
The grammar (``Toolbox.grammar``: Lark with each function's parameter schema embedded) keeps the calls
well-formed: ``auto`` is text (not starting with ``<``) or calls, ``required`` calls, a named function one
call of it. The answer is read back as OpenAI ``tool_calls``, whole or streamed (``CallStream``: each call
as one ``delta.tool_calls`` once it closes).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from swiftspec.engine.config import Grammar, GrammarKind
from swiftspec.engine.spec.grammar import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.DOTALL)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Function(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] = {"type": "object"}
    strict: bool | None = None  # the grammar holds every call to its schema, strict or not


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class Named(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: Named


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    """A call in an earlier assistant message, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def call_text(name: str, arguments: Any) -> str:
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def sent_call(call: ToolCall) -> str:
    """An earlier call as the model wrote it (its arguments as JSON where they parse)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return call_text(call.function.name, arguments)


def tool_result(content: str) -> dict[str, str]:
    """A tool's result as the turn the model reads."""
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


@dataclass
class Toolbox:
    """A request's tools and how it lets the model call them."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool = True

    @property
    def callable(self) -> list[Function]:
        """The functions the model may call (none with ``tool_choice`` none)."""
        if self.choice == "none":
            return []
        if isinstance(self.choice, NamedChoice):
            return [t.function for t in self.tools if t.function.name == self.choice.function.name]
        return [t.function for t in self.tools]

    def system_prompt(self) -> str:
        described = "\n".join(json.dumps({"name": f.name, "description": f.description or "",
                                          "parameters": f.parameters}, ensure_ascii=False) for f in self.callable)
        must = ("You must call a function." if self.choice == "required"
                else f"You must call {self.choice.function.name}." if isinstance(self.choice, NamedChoice)
                else "Call one only when it helps; otherwise answer in text.")
        return ("You can call functions. To call one, answer with nothing but\n"
                f'{OPEN}{{"name": "<function name>", "arguments": <its arguments as a JSON object>}}{CLOSE}\n'
                "(one line per call). " + must + " The functions:\n" + described)

    def grammar(self) -> Grammar | None:
        """The Lark grammar of the answers it allows (None: no calls)."""
        functions = self.callable
        if not functions:
            return None
        bodies = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                   "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}), "x-guidance": JSON_OPTIONS}
        calls = 'call ("\\n" call)*' if self.parallel and not isinstance(self.choice, NamedChoice) else "call"
        start = "TEXT | calls" if self.choice == "auto" else "calls"
        return Grammar(GrammarKind.LARK, f"start: {start}\ncalls: {calls}\n"
                       f'call: "{OPEN}" body "{CLOSE}"\nbody: %json {json.dumps(schema)}\n'
                       "TEXT: /(.|\\n)+/ & ~/<(.|\\n)*/\n")


def new_call(body: str) -> dict[str, Any]:
    """A call the model wrote (the JSON between the tags, which the grammar made well-formed) as OpenAI's."""
    call = json.loads(body)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def read_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls an answer is made of; None for a text answer or one cut before its calls closed."""
    calls, at = [], 0
    while (m := CALL.match(text, at)) is not None:
        calls.append(new_call(m.group(1)))
        at = m.end()
    return calls if calls and not text[at:].strip() else None


class CallStream:
    """An answer's streamed text as chat deltas: ``{"content": ...}`` once it is text (it does not start
    with ``<``), else each call as ``{"tool_calls": [...]}`` once it closes."""

    def __init__(self):
        self.buffer, self.text, self.calls = "", None, 0

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.buffer += piece
        if self.text is None and self.buffer:
            self.text = not self.buffer.startswith("<")
        if self.text:
            out, self.buffer = self.buffer, ""
            return [{"content": out}] if out else []
        deltas = []
        while (m := CALL.match(self.buffer)) is not None:
            deltas.append({"tool_calls": [{"index": self.calls, **new_call(m.group(1))}]})
            self.calls += 1
            self.buffer = self.buffer[m.end():]
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        """What is left when the answer ends (a call cut by max_tokens) as content."""
        out, self.buffer = self.buffer, ""
        return [{"content": out}] if out.strip() else []
