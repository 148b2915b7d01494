"""Tools (function calling) on /v1/chat/completions: ``tools`` and ``tool_choice`` in, ``tool_calls`` out.

The tools reach the model through its own chat template (``tools`` passed as transformers passes them); a model
without one, or whose template fails, gets them in a system message that asks for the call format its template
family uses (`Style`). ``tool_choice``: ``none`` renders the tools and never parses a call; ``auto`` parses the
output for calls in any common format (`parse_calls`); ``required`` and a named function end the prompt with the
style's opening and constrain the output with a grammar (`forced_grammar`): one call, whose arguments validate
against the function's ``parameters``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pp_worker.driver.chat import Format, TemplateFormat
from pp_worker.serve.fields import ApiError, typed
from pp_worker.serve.structured import checked

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class Style:
    """How a model family writes a call: ``opening`` begins it (and ends the prompt when one is forced), then a JSON
    object {"name", ``args_key``} (an array of them when ``listed``)."""

    name: str
    opening: str
    args_key: str = "arguments"
    listed: bool = False
    closing: str = ""

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Calls as this family writes them (for earlier turns in a prompt without the model's template)."""
        objs = [{"name": name, self.args_key: args} for name, args in calls]
        if self.listed:
            return self.opening + json.dumps(objs)
        return "\n".join(self.opening + json.dumps(obj) + self.closing for obj in objs)


HERMES = Style("hermes", "<tool_call>\n", closing="\n</tool_call>")  # Hermes, Qwen 2.5 / 3
MISTRAL = Style("mistral", "[TOOL_CALLS]", listed=True)
LLAMA3 = Style("llama3", "", args_key="parameters")  # Llama 3.1+ JSON tool calling
JSON_CALL = Style("json", "")  # no known family: a bare JSON object


def style_of(template: str | None) -> Style:
    """The call format a chat template's family uses, recognised by its markers."""
    source = template or ""
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or "<|start_header_id|>" in source:
        return LLAMA3
    return JSON_CALL


@dataclass(frozen=True)
class ToolUse:
    """A request's validated tools: ``specs`` as sent (what the template gets), the choice, and the style."""

    specs: tuple[dict[str, Any], ...]
    choice: str  # "none", "auto", "required" or "function" (``named``)
    style: Style
    named: str | None = None

    @property
    def names(self) -> set[str]:
        return {s["function"]["name"] for s in self.specs}

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def tool_use(body: dict[str, Any], style: Style) -> ToolUse | None:
    """The request's ``tools`` and ``tool_choice`` (OpenAI's shapes), or None without tools."""
    tools = typed(body, "tools", list)
    if not tools:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice: a choice other than none or auto needs tools", "tool_choice")
        return None
    specs = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [s["function"]["name"] for s in specs]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be distinct", "tools")
    choice, named = _choice(body.get("tool_choice"), names)
    return ToolUse(specs, choice, style, named)


def _tool(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"{param}: expected {{'type': 'function', 'function': {{...}}}}", param)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApiError(400, f"{param}.function.name: expected a name of 1 to 64 letters, digits, _ or -, got "
                            f"{name!r:.60}", f"{param}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{param}.function.parameters: expected a JSON schema object",
                       f"{param}.function.parameters")
    checked(_schema(parameters, function.get("strict") is True), f"{param}.function.parameters")
    return {"type": "function", "function": {**function, "parameters": parameters}}


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or name not in names:
        raise ApiError(400, f"tool_choice: expected none, auto, required or {{'type': 'function', 'function': "
                            f"{{'name': one of the tools}}}}, got {value!r:.80}", "tool_choice")
    return "function", name


def _declared(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema with only the declared properties (unless it says otherwise), as OpenAI's strict mode
    has it: any output still validates against ``parameters``, and a model cannot wander off into extra keys."""
    return {"additionalProperties": False, **parameters}


def _schema(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    return {"type": "json_schema", "schema": schema, "strict": strict}


def forced_grammar(use: ToolUse) -> dict[str, Any]:
    """The grammar of one call of the named function (or of any tool, for ``required``) in the style's JSON; the
    prompt ends with the style's opening, so the output is the JSON alone."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", use.style.args_key],
              "properties": {"name": {"const": f["name"]}, use.style.args_key: _declared(f["parameters"])}}
             for f in (s["function"] for s in use.specs) if use.named in (None, f["name"])]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": 1} if use.style.listed else call
    strict = all(s["function"].get("strict") is True for s in use.specs)
    return _schema(schema, strict)


# --- the prompt -------------------------------------------------------------------------------------------------

def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates read them: an assistant's tool calls with their arguments as objects
    (templates write them with ``tojson``), a tool result with its call's id and name."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                 for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def flat_turns(messages: list[dict[str, Any]], use: ToolUse | None) -> list[tuple[str, str]]:
    """The messages as (role, text) turns for a built-in chat format: the tools described in the first system turn,
    earlier calls written in the style, tool results as "tool" turns."""
    turns = []
    for m in template_messages(messages):
        text = m["content"]
        if m.get("tool_calls") and use is not None:
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = "\n".join(t for t in (text, use.style.write(calls)) if t)
        turns.append((m["role"], text))
    if use is None:
        return turns
    if turns and turns[0][0] == "system":
        return [("system", turns[0][1] + "\n\n" + _instructions(use)), *turns[1:]]
    return [("system", _instructions(use)), *turns]


def _instructions(use: ToolUse) -> str:
    functions = "\n".join(json.dumps(s["function"], separators=(",", ":")) for s in use.specs)
    example = use.style.write([("NAME", "ARGUMENTS")]).replace('"ARGUMENTS"', "{...}")
    return f"Functions:\n{functions}\nTo call one, reply with only {example}"


# --- the output -------------------------------------------------------------------------------------------------

def parse_calls(text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """(the text that is not a call, OpenAI's ``tool_calls``) from a model's output, in any of the common formats:
    Hermes/Qwen ``<tool_call>{...}</tool_call>``, Mistral ``[TOOL_CALLS][...]``, Llama 3.x ``{"name", "parameters"}``
    (after ``<|python_tag|>`` or bare, several joined by ';'), or a bare JSON object or array of calls (in a
    ```json fence or not). Calls of functions not in ``names`` are not calls: the text stays content."""
    for parse in (_hermes, _mistral, _bare):
        found = parse(text)
        if found is not None:
            content, objs = found
            calls = [c for obj in objs if (c := _call(obj, names)) is not None]
            if calls and len(calls) == len(objs):
                return content.strip(), calls
    return text, []


def _hermes(text: str) -> tuple[str, list[Any]] | None:
    parts = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL)
    if not parts:
        return None
    objs = [_json_prefix(p) for p in parts]
    return text[:text.index("<tool_call>")], objs


def _mistral(text: str) -> tuple[str, list[Any]] | None:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return None
    rest = text[at + len("[TOOL_CALLS]"):].strip()
    if m := re.match(r"([A-Za-z0-9_-]+)\[ARGS\]", rest):  # v11+: [TOOL_CALLS]name[ARGS]{...}
        return text[:at], [{"name": m.group(1), "arguments": _json_prefix(rest[m.end():])}]
    value = _json_prefix(rest)
    return text[:at], value if isinstance(value, list) else [value]


def _bare(text: str) -> tuple[str, list[Any]] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if fence := re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.DOTALL):
        body = fence.group(1)
    objs, decoder = [], json.JSONDecoder()
    while body:
        try:
            value, end = decoder.raw_decode(body)
        except json.JSONDecodeError:
            return None
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            value = value["tool_calls"]
        objs.extend(value if isinstance(value, list) else [value])
        body = body[end:].strip().removeprefix(";").strip()
    return ("", objs) if objs else None


def _json_prefix(text: str) -> Any:
    try:
        return json.JSONDecoder().raw_decode(text.strip())[0]
    except json.JSONDecodeError:
        return None


def _call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """OpenAI's tool call for one parsed {"name", "arguments" | "parameters"} (also inside "function")."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json_prefix(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def result(text: str, use: ToolUse) -> tuple[str | None, list[dict[str, Any]]]:
    """The assistant message's content and tool calls for a generation's text (a forced call's text follows the
    opening the prompt ended with). Content is None when there are calls and no other text, as OpenAI sends it."""
    if not use.parses:
        return text, []
    content, calls = parse_calls(use.style.opening + text if use.forced else text, use.names)
    return (content or None) if calls else text, calls


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``delta``s OpenAI streams for tool calls: each call's id, type and name with empty arguments, then its
    arguments."""
    deltas = []
    for i, c in enumerate(calls):
        head = {"index": i, "id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                             "arguments": ""}}
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return deltas


def render(fmt: Format, messages: list[dict[str, Any]], use: ToolUse | None) -> str:
    """The chat prompt: through the model's template with ``tools`` (an assistant's calls and the tool results as
    the template reads them); a template that does not mention tools gets them described in a system turn, and a
    model without a template gets the built-in format's turns (`flat_turns`)."""
    if isinstance(fmt, TemplateFormat) and (use is None or "tools" in fmt.template.source):
        try:
            return fmt.template.prompt(template_messages(messages), tools=list(use.specs) if use else None)
        except Exception as e:  # a template raises what it likes; the built-in format still serves the turn
            fmt.log(f"the chat template failed ({type(e).__name__}: {e}); this turn uses the {fmt.fallback.name} "
                    f"format")
            return fmt.fallback.render(flat_turns(messages, use))
    return fmt.render(flat_turns(messages, use))
