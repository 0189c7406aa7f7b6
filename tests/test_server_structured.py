"""Structured answers from `swiftspec serve` on the tiny target, through the official `openai` client:
``response_format`` as ``json_object`` and ``json_schema`` (60 requests over schemas with nesting, enums,
arrays, numbers and optional fields, streamed and not, every answer valid), ``beta.chat.completions.parse``
with a pydantic model, ``swiftspec.grammar`` and vLLM's ``guided_regex``, and the 400 naming the field of
a schema the library refuses."""

from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_server import Served

pytestmark = pytest.mark.slow


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pet(Strict):
    kind: str = Field(json_schema_extra={"enum": ["fox", "dog", "cat"]})
    age: int = Field(ge=0, le=30)


class Owner(Strict):
    """Nesting, an enum, an array and an optional number."""

    name: str = Field(max_length=16)
    pets: list[Pet] = Field(max_length=2)
    score: float | None = Field(default=None, ge=0, le=10)


class Item(Strict):
    sku: str = Field(pattern=r"^[A-Z]{2}[0-9]{3}$")
    quantity: int = Field(ge=1, le=99)


class Order(Strict):
    items: list[Item] = Field(min_length=1, max_length=3)
    currency: str = Field(json_schema_extra={"enum": ["EUR", "USD"]})
    paid: bool
    note: str | None = Field(default=None, max_length=20)


class Point(Strict):
    x: int = Field(ge=-100, le=100)
    y: float = Field(ge=-100, le=100, multiple_of=0.5)


class Shape(Strict):
    points: list[Point] = Field(min_length=2, max_length=3)
    closed: bool


class Flags(Strict):
    tags: list[str] = Field(json_schema_extra={"items": {"enum": ["a", "b", "c"]}}, max_length=4)
    level: int = Field(ge=1, le=5)


MODELS = [Owner, Order, Shape, Flags, Pet]
QUESTIONS = ["Describe a pet owner.", "Make an order.", "Draw a shape.", "Pick some flags.", "Tell me about it.",
             "Answer in JSON."]


def schema_format(model: type[BaseModel]) -> dict:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(),
                                                   "strict": True}}


@pytest.fixture(scope="module")
def served(target_dir):
    server = Served(target_dir)
    yield server
    assert server.stop() == 130


def chat(served, content: str, stream: bool = False, **kw) -> tuple[str, str]:
    messages = [{"role": "user", "content": content}]
    if not stream:
        answer = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=200, **kw)
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    chunks = list(served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=200,
                                                        stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_json_schema_answer_validates_streamed_or_not(served, model):
    for question in QUESTIONS:
        for stream in (False, True):
            text, finish = chat(served, question, stream, response_format=schema_format(model))
            assert finish == "stop", text
            model.model_validate_json(text)


def test_json_object_answers_are_json_objects(served):
    """(A random model may write an object it never closes: such an answer is cut by max_tokens.)"""
    for question in QUESTIONS[:3]:
        text, finish = chat(served, question, response_format={"type": "json_object"})
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
    free, _ = chat(served, QUESTIONS[0])
    with pytest.raises(ValueError):
        json.loads(free)


def test_the_clients_parse_fills_a_pydantic_model(served):
    answer = served.client.beta.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Make an order."}], max_tokens=200, response_format=Order)
    order = answer.choices[0].message.parsed
    assert isinstance(order, Order) and 1 <= len(order.items) <= 3


def test_a_grammar_and_a_regex_in_the_extensions(served):
    text, _ = chat(served, "Count.", extra_body={"swiftspec": {"grammar": {
        "kind": "lark", "source": 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,3}/'}}})
    assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", text)
    text, _ = chat(served, "A date?", extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text)


def test_a_cut_structure_ends_with_length_and_the_figures_say_so(served):
    answer = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Make an order."}], max_tokens=5,
        response_format=schema_format(Order))
    assert answer.choices[0].finish_reason == "length"
    assert answer.model_extra["swiftspec"]["structure_complete"] is False
    whole = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Make an order."}], max_tokens=200,
        response_format=schema_format(Order)).model_extra["swiftspec"]
    assert whole["structure_complete"] is True and 0 < whole["forced_share"] < 1 and whole["mask_ms_per_node"] > 0
    with pytest.raises(ValueError):
        Order.model_validate_json(answer.choices[0].message.content)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_schema_the_library_refuses_is_a_400_naming_the_field(served, response_format, param):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, response_format=response_format)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}


class WeatherArgs(Strict):
    city: str
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


def test_a_named_function_is_called_with_valid_arguments_whole_and_streamed(served):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="tiny", messages=messages, max_tokens=120, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    answer = served.client.chat.completions.create(**kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    WeatherArgs.model_validate_json(call.function.arguments)
    chunks = list(served.client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    (streamed,) = [d for ds in deltas for d in ds]
    assert streamed.index == 0 and streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_required_and_auto_choices_give_calls_or_text_and_a_result_goes_back(served):
    messages = [{"role": "user", "content": "What time is it in zone 3?"}]
    answer = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=120,
                                                   tools=[WEATHER, TIME], tool_choice="required",
                                                   parallel_tool_calls=False)
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1 and answer.choices[0].finish_reason == "tool_calls", answer.choices[0].message
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    followed = messages + [answer.choices[0].message.model_dump(exclude_none=True),
                           *({"role": "tool", "tool_call_id": c.id, "content": "12:00"} for c in calls)]
    auto = served.client.chat.completions.create(model="tiny", messages=followed, max_tokens=40, tools=[WEATHER, TIME])
    message = auto.choices[0].message
    assert (message.tool_calls is None) == (auto.choices[0].finish_reason != "tool_calls")
    if message.tool_calls is None:
        assert message.content and not message.content.startswith("<")
    none = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                 tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None


def test_a_tool_choice_naming_no_tool_is_a_400(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    assert e.value.body["param"] == "tool_choice"
