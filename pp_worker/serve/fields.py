"""What every endpoint's edge is made of: OpenAI's error shape, the body read and parsed, and typed fields.

Status codes: 422 when the body does not fit the schema (a field of the wrong JSON type, a required field missing),
400 when it fits but a value cannot be served (out of range, a feature not supported).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from pp_worker.wire import WireError, parse_json

MAX_BODY_BYTES = 1 << 22  # far above any prompt we accept (MAX_PROMPT_CHARS)
MAX_PROMPT_CHARS = 1 << 16  # keeps a tokenize line far below the workers' line limit (PP_MAX_LINE_BYTES)
CLIENT_CLOSED = 499  # nginx's status for a client that closed its connection before the reply: logged and counted
# as the client's doing, not as a server error


class ApiError(Exception):
    """An error reply: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, code="pipeline_unavailable", kind="service_unavailable")


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; 413 past ``MAX_BODY_BYTES`` (counted as it arrives, never held whole); 499 when the
    client goes before its body has come (nobody reads that reply: it is for the log and the metrics)."""
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, f"the client closed the connection after {len(raw)} bytes of the body",
                       code="client_closed_request") from None
    return parse_body(bytes(raw))


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = parse_json(raw)  # strict: no NaN or Infinity (a worker would refuse them), no duplicate keys
    except WireError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def prompt_text(text: str, param: str = "prompt") -> str:
    """Text for stage 0's tokenizer: valid Unicode (a worker's error reply would fail the pipeline), not too long."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape: no tokenizer can take it
        raise ApiError(400, f"the {param} is not valid Unicode (a lone surrogate)", param) from None
    if len(text) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"the {param} is {len(text)} characters; at most {MAX_PROMPT_CHARS} are accepted",
                       param, "context_length_exceeded")
    return text


def required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise ApiError(422, f"{name}: required", name, "missing")
    return body[name]


def typed(body: dict[str, Any], name: str, kind: type) -> Any:
    """The field, None when absent or null; 422 when it is not of JSON type ``kind`` (a bool is no number)."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise ApiError(422, f"{name}: expected {_KIND_NAMES[kind]}, got {type(value).__name__}", name, "invalid_type")
    return value


_KIND_NAMES = {bool: "a boolean", int: "an integer", dict: "an object", float: "a number", str: "a string",
               list: "an array"}


def boolean(body: dict[str, Any], name: str) -> bool | None:
    return typed(body, name, bool)


def integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if isinstance(value, float) and value.is_integer():  # 8.0 is an integer in JSON's eyes
        value = int(value)
    value = typed({name: value}, name, int)
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{name}: expected an integer in [{low}, {high}], got {value}", name)
    return value


def number(body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False,
           high_open: bool = False) -> float | None:
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    value = typed({name: value}, name, float)
    if value is None:
        return None
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ApiError(400, f"{name}: expected a number in {interval}, got {value:g}", name)
    return value
