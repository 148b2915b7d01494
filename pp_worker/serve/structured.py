"""Structured output: the request fields that constrain a completion -> the last stage's ``grammar`` field
(`worker.grammar`), checked here by compiling it, so a bad schema is the request's 400 and never a worker's error.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``strict``) on both endpoints, and
llama-server's ``json_schema`` (a schema) and ``grammar`` (GBNF) body fields, which its ``/completion`` also takes
(`llama_grammar` is what such an endpoint calls).
"""

from __future__ import annotations

from typing import Any

from pp_worker.serve.fields import ApiError, typed
from pp_worker.worker.grammar import Grammar, GrammarError


def checked(grammar: dict[str, Any], param: str) -> dict[str, Any]:
    """``grammar`` when it compiles; a 400 naming ``param`` with llguidance's reason otherwise."""
    try:
        Grammar.parse(grammar)
    except GrammarError as e:
        raise ApiError(400, f"{param}: {e}", param) from None
    return grammar


def response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's ``response_format``: None for text (or absent), else the grammar it asks for. ``strict`` false (or
    absent, as OpenAI's) lets the schema use keywords the grammar library does not implement (ignored); true refuses
    them."""
    value = typed(body, "response_format", dict)
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type: expected text, json_object or json_schema, got {kind!r:.40}",
                       "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(400, "response_format.json_schema: expected an object with a 'schema' object",
                       "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(422, "response_format.json_schema.strict: expected a boolean", "response_format",
                       "invalid_type")
    grammar = {"type": "json_schema", "schema": spec.get("schema", {}), "strict": strict is True}
    return checked(grammar, "response_format")


def llama_grammar(body: dict[str, Any]) -> dict[str, Any] | None:
    """llama-server's ``json_schema`` (a schema object) or ``grammar`` (GBNF text), else ``response_format``; at
    most one of them."""
    given = [name for name in ("json_schema", "grammar", "response_format") if body.get(name) not in (None, "")]
    if len(given) > 1 and not (given[-1] == "response_format" and response_format(body) is None):
        raise ApiError(400, f"{given[1]}: only one of json_schema, grammar and response_format may be given",
                       given[1])
    if body.get("json_schema") is not None:
        schema = typed(body, "json_schema", dict)
        return checked({"type": "json_schema", "schema": schema}, "json_schema")
    if body.get("grammar"):
        return checked({"type": "gbnf", "text": typed(body, "grammar", str)}, "grammar")
    return response_format(body)
