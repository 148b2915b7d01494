"""pp-serve's tools (serve.tools) without a pipeline: calls parsed from each model family's output format, the
request's tools and tool_choice checked, the prompt rendered through a template that takes tools (and without one),
the forced call's grammar and the streamed deltas."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pp_worker.driver.chat import PLAIN_CHAT, chat_format
from pp_worker.serve import structured, tools
from pp_worker.serve.fields import ApiError
from pp_worker.worker.grammar import Grammar

NAMES = {"weather", "add"}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def _calls(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    content, calls = tools.parse_calls(text, NAMES)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Let me look.",
     [("weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "weather", '
     '"arguments": {"city": "Oslo"}}</tool_call>', "", [("add", {"a": 1, "b": 2}), ("weather", {"city": "Oslo"})]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),  # unclosed
    ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}, {"name": "add", "arguments": {"a": 3, '
     '"b": 4}}]', "", [("weather", {"city": "Rome"}), ("add", {"a": 3, "b": 4})]),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Lyon"}', "", [("weather", {"city": "Lyon"})]),  # Mistral v11+
    ('<|python_tag|>{"name": "weather", "parameters": {"city": "Nice"}}', "", [("weather", {"city": "Nice"})]),
    ('{"name": "add", "parameters": {"a": 5, "b": 6}}; {"name": "weather", "parameters": {"city": "Bonn"}}', "",
     [("add", {"a": 5, "b": 6}), ("weather", {"city": "Bonn"})]),  # Llama 3.x, several
    ('```json\n{"name": "weather", "arguments": "{\\"city\\": \\"Kyiv\\"}"}\n```', "",
     [("weather", {"city": "Kyiv"})]),  # fenced, arguments as a JSON string
    ('{"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 0, "b": 1}}}]}', "",
     [("add", {"a": 0, "b": 1})]),
])
def test_calls_are_parsed_from_each_format(text: str, content: str, calls: list[Any]) -> None:
    assert _calls(text) == (content, calls)


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",
    '{"name": "delete_everything", "arguments": {}}',  # not one of the tools
    '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>',  # broken JSON
    '{"city": "Paris"}',  # JSON, but no call
    '[TOOL_CALLS][{"name": "weather", "arguments": 5}]',
])
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    assert tools.parse_calls(text, NAMES) == (text, [])


def test_each_call_has_its_own_id_in_openais_shape() -> None:
    _, calls = tools.parse_calls('[{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "add", "arguments": '
                                 '{"a": 2, "b": 2}}]', NAMES)
    assert [c["type"] for c in calls] == ["function"] * 2 and calls[0]["id"] != calls[1]["id"]
    assert all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize(("template", "style"), [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}<tool_call>", tools.HERMES),
    ("{{ bos_token }}[INST]{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", tools.MISTRAL),
    ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", tools.LLAMA3),
    ("<|im_start|>{{ messages }}", tools.JSON_CALL),
    (None, tools.JSON_CALL),
])
def test_the_style_follows_the_templates_markers(template: str | None, style: tools.Style) -> None:
    assert tools.style_of(template) is style


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        tools.tool_use(body, tools.JSON_CALL)
    assert (e.value.status, e.value.param) == (400, param)


def test_choices() -> None:
    assert tools.tool_use({}, tools.HERMES) is None
    use = tools.tool_use({"tools": [WEATHER, ADD]}, tools.HERMES)
    assert use is not None and (use.choice, use.forced, use.parses) == ("auto", False, True)
    named = tools.tool_use({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}},
                           tools.HERMES)
    assert named is not None and (named.choice, named.named, named.forced) == ("function", "add", True)
    none = tools.tool_use({"tools": [WEATHER], "tool_choice": "none"}, tools.HERMES)
    assert none is not None and not none.parses and tools.result('{"name": "weather", "arguments": {}}', none)[1] == []


# a template in the Hermes/Qwen 2.5 way: tools in the system turn, calls and results as tags
QWENISH = """{%- if tools %}<|im_start|>system
Tools:{% for t in tools %}
{{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% elif m.role == "tool" %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_tools_and_tool_turns_go_through_the_models_template() -> None:
    fmt = chat_format(QWENISH)
    use = tools.tool_use({"tools": [WEATHER]}, tools.style_of(QWENISH))
    prompt = tools.render(fmt, TURNS, use)
    assert json.dumps(WEATHER) in prompt  # the tool as the template writes it
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt  # an object
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_without_a_template_the_tools_are_described_in_a_system_turn() -> None:
    use = tools.tool_use({"tools": [WEATHER]}, tools.JSON_CALL)
    prompt = tools.render(PLAIN_CHAT, [{"role": "system", "content": "Be brief."}, *TURNS], use)
    assert prompt.startswith("System: Be brief.\n\nFunctions:\n" + json.dumps(WEATHER["function"], separators=(",",
                                                                                                                  ":")))
    assert 'Assistant: {"name": "weather", "arguments": {"city": "Paris"}}\nTool: sunny\nAssistant:' in prompt


@pytest.mark.parametrize("style", [tools.HERMES, tools.MISTRAL, tools.LLAMA3, tools.JSON_CALL])
def test_a_forced_calls_grammar_compiles_and_its_output_parses_back(style: tools.Style) -> None:
    use = tools.tool_use({"tools": [WEATHER, ADD], "tool_choice": "required"}, style)
    assert use is not None
    grammar = tools.forced_grammar(use)
    Grammar.parse(grammar)
    call = {"name": "add", style.args_key: {"a": 1, "b": 2}}
    output = json.dumps([call] if style.listed else call)  # what the grammar lets through after the opening
    jsonschema.validate(json.loads(output), grammar["schema"])
    with pytest.raises(jsonschema.ValidationError):  # only declared arguments
        jsonschema.validate({"name": "add", style.args_key: {"a": 1, "b": 2, "c": 3}}, grammar["schema"]
                            if not style.listed else grammar["schema"]["items"])
    content, calls = tools.result(output, use)
    assert content is None and [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_stream_deltas_are_openais() -> None:
    _, calls = tools.parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', NAMES)
    head, args = tools.stream_deltas(calls)
    assert head == {"tool_calls": [{"index": 0, "id": calls[0]["id"], "type": "function",
                                    "function": {"name": "add", "arguments": ""}}]}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": calls[0]["function"]["arguments"]}}]}


def test_response_format_maps_to_the_grammar_field() -> None:
    assert structured.response_format({}) is None
    assert structured.response_format({"response_format": {"type": "text"}}) is None
    assert structured.response_format({"response_format": {"type": "json_object"}}) == {"type": "json_object"}
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}
    assert structured.response_format({"response_format": loose})["strict"] is False  # OpenAI's default: lenient
    with pytest.raises(ApiError) as e:  # strict: what the library lacks is refused
        structured.response_format({"response_format": {**loose, "json_schema": {**loose["json_schema"],
                                                                                  "strict": True}}})
    assert (e.value.status, e.value.param) == (400, "response_format") and "Unimplemented" in e.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"json_schema": {"type": "objec"}}, "json_schema"),
    ({"grammar": "root ::= foo"}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
])
def test_llama_server_fields_are_checked_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        structured.llama_grammar(body)
    assert e.value.param == param


def test_llama_server_fields_map_to_the_grammar_field() -> None:
    assert structured.llama_grammar({"json_schema": {"type": "integer"}}) == {"type": "json_schema",
                                                                                "schema": {"type": "integer"}}
    assert structured.llama_grammar({"grammar": 'root ::= "a"'}) == {"type": "gbnf", "text": 'root ::= "a"'}
    assert structured.llama_grammar({"response_format": {"type": "json_object"}}) == {"type": "json_object"}
    assert structured.llama_grammar({"grammar": "", "response_format": {"type": "text"}}) is None
