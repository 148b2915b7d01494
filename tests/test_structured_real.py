"""Structured output and tools end to end: pp-serve on the embedded model (real tinygrad stages), the official
``openai`` client. The model cannot choose tools or write good JSON on its own; the grammar makes every answer fit.
One server serves the whole module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from conftest import REPO
from serving import Server

ZEN = REPO / "pp_worker" / "data" / "zen.gguf"
MAX_TOKENS = 96


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 10}
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": NAME}),
    _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"size": {"type": "string", "enum": ["S", "M", "L", "XL"]}, "count": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}}),
    _obj({"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                         "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _obj({"user": _obj({"name": NAME, "admin": {"type": "boolean"}}), "id": {"type": "integer", "minimum": 0,
                                                                              "maximum": 999}}),
    _obj({"name": NAME, "nick": NAME}, required=["name"]),  # an optional property
    _obj({"a": {"type": "integer", "minimum": 0, "maximum": 5}, "b": NAME, "c": {"type": "boolean"}},
         required=["c"]),
    _obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}}),
    _obj({"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 9}}),
    _obj({"shape": {"anyOf": [_obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                              _obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    _obj({"matrix": {"type": "array", "maxItems": 2,
                     "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}}}),
    _obj({"items": {"type": "array", "maxItems": 2, "items": _obj({"sku": NAME, "qty": {"type": "integer",
                                                                                          "minimum": 1,
                                                                                          "maximum": 9}})}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}}),
    _obj({"meta": _obj({"version": {"type": "integer", "minimum": 1, "maximum": 3},
                        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}})}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "m": {"type": "boolean"}}, "required": ["n"]}}}
TOOLS = [WEATHER, ADD]  # the embedded model's context (256) holds the prompt with one of them described
ASK = [{"role": "user", "content": "Beautiful is better"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(["--stages", "2", "--model", str(ZEN)], ready_timeout=300)
    yield s
    s.stop()


def _chat(server: Server, **kw: Any) -> Any:
    return server.client().chat.completions.create(model="zen", messages=kw.pop("messages", ASK),
                                                   max_tokens=MAX_TOKENS, **kw)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_json_schema_answer_validates(server: Server, i: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
    r = _chat(server, response_format=fmt, temperature=0.8, seed=i)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])


def test_json_object_and_the_llama_server_fields_on_completions(server: Server) -> None:
    r = _chat(server, response_format={"type": "json_object"}, logit_bias={"125": 5})  # "}" favoured: it ends
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    client = server.client()
    got = client.completions.create(model="zen", prompt="Flat is", max_tokens=MAX_TOKENS,
                                    extra_body={"json_schema": SCHEMAS[3]})
    jsonschema.validate(json.loads(got.choices[0].text), SCHEMAS[3])
    got = client.completions.create(model="zen", prompt="Flat is", max_tokens=MAX_TOKENS,
                                    extra_body={"grammar": 'root ::= ("yes" | "no") "!"'})
    assert got.choices[0].text in ("yes!", "no!") and got.choices[0].finish_reason == "stop"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    size: Literal["S", "M", "L"]
    ok: bool


def test_the_openai_clients_parse_round_trip(server: Server) -> None:
    r = server.client().chat.completions.parse(model="zen", messages=ASK, max_tokens=MAX_TOKENS,
                                                response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.size in ("S", "M", "L")


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t["function"]["name"])
def test_a_named_tool_choice_always_yields_a_valid_call(server: Server, tool: dict[str, Any]) -> None:
    name = tool["function"]["name"]
    for seed in range(3):
        r = _chat(server, tools=[tool], tool_choice={"type": "function", "function": {"name": name}},
                  temperature=0.9, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == name and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_streams_the_call_as_openai_does(server: Server) -> None:
    chunks = list(_chat(server, tools=[ADD], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert not any(d.content for d in deltas)
    assert calls[0].id and calls[0].type == "function" and calls[0].function.arguments == ""
    name = calls[0].function.name
    arguments = "".join(c.function.arguments for c in calls)
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_parses_a_call_shaped_answer_and_a_tool_result_is_the_next_turn(server: Server) -> None:
    # the model would not choose a tool by itself: a schema shaped like a call makes it write one
    shape = _obj({"name": {"const": "weather"}, "arguments": _obj({"city": NAME})})
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": shape}}
    r = _chat(server, tools=[WEATHER], tool_choice="auto", response_format=fmt)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    plain = _chat(server, tools=[WEATHER], tool_choice="none", response_format=fmt)  # none: never a call
    assert plain.choices[0].message.tool_calls is None and json.loads(plain.choices[0].message.content)
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = _chat(server, messages=turn, tools=[WEATHER], max_completion_tokens=8)
    assert answer.choices[0].message.role == "assistant"


@pytest.mark.parametrize(("kw", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}, "strict": True}}},
     "response_format", "Unimplemented"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters", "Invalid type"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_goes_on(server: Server, kw: dict[str, Any], param: str,
                                                                     words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, **kw)
    assert e.value.param == param and words in e.value.message
    assert _chat(server, max_completion_tokens=2).choices[0].message.content is not None
