"""The edge of the HTTP API: a request body -> a validated ``Ask``, or an ``ApiError`` in OpenAI's error shape.

Status codes: 422 when the body does not fit the schema (a field of the wrong JSON type, a required field missing),
400 when it fits but a value cannot be served (out of range, a token id outside the vocabulary, a feature not
supported such as ``n`` > 1). ``logit_bias`` goes to the last stage's sampler. Fields the API defines that change
nothing here (``user``, ``n`` = 1, ``response_format`` ``{"type": "text"}``, ``tool_choice`` ``"none"``) are
accepted; unknown fields are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pp_worker.driver.chat import Format
from pp_worker.driver.generation import Sampling
from pp_worker.wire import WireError, parse_json

MAX_PROMPT_CHARS = 1 << 16  # keeps a tokenize line far below the workers' line limit (PP_MAX_LINE_BYTES)
MAX_STOPS = 4  # as OpenAI
MAX_LOGIT_BIAS = 100.0  # as OpenAI (and the workers)
SEED_LIMIT = 1 << 63  # the workers' seed range
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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


@dataclass(frozen=True)
class Ask:
    """What one request asks the pipeline for."""

    prompt: str
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    chat: bool


@dataclass(frozen=True)
class Defaults:
    """The server's defaults for fields a request leaves out (from pp-serve's command line), and the vocabulary size
    that token ids in a request are checked against (from the stages' ready lines)."""

    max_tokens: int
    sampling: Sampling
    vocab_size: int | None = None


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = parse_json(raw)  # strict: no NaN or Infinity (a worker would refuse them), no duplicate keys
    except WireError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def completion_ask(body: dict[str, Any], defaults: Defaults) -> Ask:
    """POST /v1/completions."""
    prompt = _required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise ApiError(400, "prompt: one string only (token-id prompts and batches are not supported)", "prompt")
    if not isinstance(prompt, str):
        raise ApiError(422, "prompt: expected a string", "prompt", "invalid_type")
    _unsupported(body, echo=False, suffix=None, best_of=1)
    return _ask(body, _prompt(prompt), defaults, chat=False, max_tokens_field="max_tokens")


def chat_ask(body: dict[str, Any], defaults: Defaults, fmt: Format) -> Ask:
    """POST /v1/chat/completions: the messages rendered with the model's chat format."""
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise ApiError(422, "messages: expected an array", "messages", "invalid_type")
    if not messages:
        raise ApiError(400, "messages: at least one message is needed", "messages")
    turns = [_turn(m, i) for i, m in enumerate(messages)]
    _unsupported(body, tools=None, functions=None, top_logprobs=None, response_format={"type": "text"},
                 tool_choice="none")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ask = _ask(body, _prompt(fmt.render(turns)), defaults, chat=True, max_tokens_field=field)
    return replace(ask, stop=tuple(dict.fromkeys(ask.stop + fmt.stop)))  # the format's end-of-turn text ends it


def _ask(body: dict[str, Any], prompt: str, defaults: Defaults, *, chat: bool, max_tokens_field: str) -> Ask:
    n = _int(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise ApiError(400, "n: only 1 choice per request is supported", "n")
    _unsupported(body, logprobs=None, presence_penalty=0, frequency_penalty=0)
    stream = _bool(body, "stream") or False
    options = _typed(body, "stream_options", dict)
    include_usage = bool(stream and options and options.get("include_usage") is True)
    max_tokens = _int(body, max_tokens_field, 1, 1 << 30)
    return Ask(prompt, max_tokens or defaults.max_tokens, _sampling(body, defaults), _stop(body), stream,
               include_usage, chat)


def _sampling(body: dict[str, Any], defaults: Defaults) -> Sampling:
    """The request's sampling fields over the server's defaults; ranges as the workers check them."""
    return replace(defaults.sampling, **{k: v for k, v in {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True),
        "top_k": _int(body, "top_k", 0, 1 << 30),
        "min_p": _number(body, "min_p", 0.0, 1.0, high_open=True),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 100.0, low_open=True),
        "seed": _int(body, "seed", 0, SEED_LIMIT - 1),
        "logit_bias": _logit_bias(body, defaults.vocab_size),
    }.items() if v is not None})


def _logit_bias(body: dict[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"token id": bias}``, checked here: a worker's error reply would take the whole pipeline down."""
    value = _typed(body, "logit_bias", dict)
    if value is None:
        return None
    bias = []
    for key, number in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and key == str(int(key))) \
                or vocab_size is not None and int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r:.40}",
                           "logit_bias")
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ApiError(422, f"logit_bias[{key}]: expected a number", "logit_bias", "invalid_type")
        if not abs(number) <= MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias[{key}]: expected a number in [-100, 100], got {number:g}", "logit_bias")
        bias.append((int(key), float(number)))
    return tuple(bias)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(422, "stop: expected a string or an array of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    return tuple(stops)


def _turn(message: Any, i: int) -> tuple[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(422, f"{param}: expected an object", param, "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{param}.role: expected one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(422, f"{param}.content: expected a string or text parts", f"{param}.content", "invalid_type")
    return ROLES[role], content


def _prompt(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape: no tokenizer can take it
        raise ApiError(400, "the prompt is not valid Unicode (a lone surrogate)", "prompt") from None
    if len(text) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"the prompt is {len(text)} characters; at most {MAX_PROMPT_CHARS} are accepted",
                       "prompt", "context_length_exceeded")
    return text


def _unsupported(body: dict[str, Any], **harmless: Any) -> None:
    """Fields accepted only with a value that changes nothing: absent, falsy (null, false, 0, [], {}) or ``ok``."""
    for name, ok in harmless.items():
        value = body.get(name)
        if value and value != ok:
            raise ApiError(400, f"{name}: not supported by this server (got {value!r:.60})", name)


# --- typed fields ---------------------------------------------------------------------------------------------
def _required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise ApiError(422, f"{name}: required", name, "missing")
    return body[name]


def _typed(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise ApiError(422, f"{name}: expected {_KIND_NAMES[kind]}, got {type(value).__name__}", name, "invalid_type")
    return value


_KIND_NAMES = {bool: "a boolean", int: "an integer", dict: "an object", float: "a number"}


def _bool(body: dict[str, Any], name: str) -> bool | None:
    return _typed(body, name, bool)


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if isinstance(value, float) and value.is_integer():  # 8.0 is an integer in JSON's eyes
        value = int(value)
    value = _typed({name: value}, name, int)
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{name}: expected an integer in [{low}, {high}], got {value}", name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False,
            high_open: bool = False) -> float | None:
    value = body.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    value = _typed({name: value}, name, float)
    if value is None:
        return None
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ApiError(400, f"{name}: expected a number in {interval}, got {value:g}", name)
    return value
