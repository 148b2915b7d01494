"""The edge of the completions API: a request body -> a validated ``Ask``, or an ``ApiError`` in OpenAI's error shape
(``fields``): 422 when the body does not fit the schema, 400 when a value cannot be served (out of range, a token id
outside the vocabulary, a feature not supported such as ``n`` > 1). ``logit_bias``, the penalties and the
log-probabilities asked for go to the last stage's sampler; ``seed`` -1 means a fresh random seed (llama-server's).
Fields the API defines that change nothing here (``user``, ``n`` = 1, ``response_format`` ``{"type": "text"}``,
``tool_choice`` ``"none"``) are accepted; unknown fields are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pp_worker.driver.chat import Format, TemplateFormat
from pp_worker.driver.generation import Sampling
from pp_worker.serve import structured, tools
from pp_worker.serve.fields import ApiError, boolean, integer, number, prompt_text, required, typed

MAX_STOPS = 4  # as OpenAI
MAX_LOGIT_BIAS = 100.0  # as OpenAI (and the workers)
SEED_LIMIT = 1 << 63  # the workers' seed range
MAX_CHOICES = 128  # n, as OpenAI's
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI's top_logprobs (and the workers)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


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
    grammar: dict[str, Any] | None = None  # the last stage's grammar field (structured output, a forced tool call)
    tools: tools.ToolUse | None = None  # the chat's tools: its output is parsed for calls (`tools.result`)
    cache_prompt: bool = True  # llama-server's field: reuse a cached session's common prefix (docs/serve.md)
    n: int = 1  # OpenAI's: choices, each a generation of its own from the one prompt (its KV computed once)

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token to report with its log-probability; None: no log-probabilities."""
        return self.sampling.logprobs


@dataclass(frozen=True)
class Defaults:
    """The server's defaults for fields a request leaves out (from pp-serve's command line), and the vocabulary size
    that token ids in a request are checked against (from the stages' ready lines)."""

    max_tokens: int
    sampling: Sampling
    vocab_size: int | None = None


def completion_ask(body: dict[str, Any], defaults: Defaults) -> Ask:
    """POST /v1/completions."""
    prompt = one_prompt(body)
    _unsupported(body, echo=False, suffix=None, best_of=1)
    ask = _ask(body, prompt, defaults, chat=False, max_tokens_field="max_tokens")
    return replace(ask, grammar=structured.llama_grammar(body))


def one_prompt(body: dict[str, Any]) -> str:
    """A completion's ``prompt``: a string, or an array of exactly one (token ids and batches are refused)."""
    prompt = required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise ApiError(400, "prompt: one string only (token-id prompts and batches are not supported)", "prompt")
    if not isinstance(prompt, str):
        raise ApiError(422, "prompt: expected a string", "prompt", "invalid_type")
    return prompt_text(prompt)


def render_messages(body: dict[str, Any], fmt: Format) -> str:
    """The request's ``messages`` rendered with the model's chat format, ready for the assistant's answer."""
    return _chat_prompt(body, fmt)[0]


def _messages(body: dict[str, Any]) -> list[Any]:
    messages = required(body, "messages")
    if not isinstance(messages, list):
        raise ApiError(422, "messages: expected an array", "messages", "invalid_type")
    if not messages:
        raise ApiError(400, "messages: at least one message is needed", "messages")
    return messages


def _chat_prompt(body: dict[str, Any], fmt: Format) -> tuple[str, tools.ToolUse | None, dict[str, Any] | None]:
    """The rendered prompt (tools passed to the template), the chat's tool use and the grammar its output follows."""
    turns = [_turn(m, i) for i, m in enumerate(_messages(body))]
    template = fmt.template.source if isinstance(fmt, TemplateFormat) else None
    use, grammar = tools.tool_use(body, tools.style_of(template)), structured.response_format(body)
    if use is not None and use.forced:
        if grammar is not None:
            raise ApiError(400, "response_format: a json format cannot go with a tool_choice that forces a call",
                           "response_format")
        grammar = tools.forced_grammar(use)
    prompt = tools.render(fmt, turns, use) + (use.style.opening if use is not None and use.forced else "")
    return prompt_text(prompt), use, grammar


def chat_ask(body: dict[str, Any], defaults: Defaults, fmt: Format) -> Ask:
    """POST /v1/chat/completions: the messages rendered with the model's chat format (and its tools)."""
    _messages(body)  # the messages' own checks come first
    _unsupported(body, functions=None)
    prompt, use, grammar = _chat_prompt(body, fmt)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ask = _ask(body, prompt, defaults, chat=True, max_tokens_field=field)
    ask = replace(ask, sampling=replace(ask.sampling, logprobs=_chat_logprobs(body)))
    # the format's end-of-turn text ends it
    return replace(ask, stop=tuple(dict.fromkeys(ask.stop + fmt.stop)), grammar=grammar, tools=use)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (how many alternatives; needs ``logprobs``)."""
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not boolean(body, "logprobs"):
        if top:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        return None
    return top or 0


def _ask(body: dict[str, Any], prompt: str, defaults: Defaults, *, chat: bool, max_tokens_field: str) -> Ask:
    n = integer(body, "n", 1, MAX_CHOICES) or 1
    stream = boolean(body, "stream") or False
    options = typed(body, "stream_options", dict)
    include_usage = bool(stream and options and options.get("include_usage") is True)
    max_tokens = integer(body, max_tokens_field, 1, 1 << 30)
    sampling = sampling_fields(body, defaults)
    if not chat:  # the legacy completions' logprobs: how many alternatives (chat's is a boolean)
        sampling = replace(sampling, logprobs=integer(body, "logprobs", 0, MAX_LOGPROBS))
    return Ask(prompt, max_tokens or defaults.max_tokens, sampling, stop_strings(body), stream, include_usage, chat,
               cache_prompt=boolean(body, "cache_prompt") is not False, n=n)


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index``'s sampling: a seed moves by the index (each choice its own draw, the request repeatable)."""
    return sampling if sampling.seed is None else replace(sampling, seed=(sampling.seed + index) % SEED_LIMIT)


def sampling_fields(body: dict[str, Any], defaults: Defaults, repetition_penalty: str = "repetition_penalty",
                    logit_bias: Any = None) -> Sampling:
    """The request's sampling fields over the server's defaults; ranges as the workers check them.
    ``repetition_penalty``: the field's name in this API; ``logit_bias``: the field's value when this API spells it
    otherwise (already in OpenAI's shape)."""
    seed = integer(body, "seed", -1, SEED_LIMIT - 1)
    sampling = replace(defaults.sampling, seed=None) if seed == -1 else defaults.sampling  # -1: a random seed
    return replace(sampling, **{k: v for k, v in {
        "temperature": number(body, "temperature", 0.0, 2.0),
        "top_p": number(body, "top_p", 0.0, 1.0, low_open=True),
        "top_k": integer(body, "top_k", 0, 1 << 30),
        "min_p": number(body, "min_p", 0.0, 1.0, high_open=True),
        "repetition_penalty": number(body, repetition_penalty, 0.0, 100.0, low_open=True),
        "presence_penalty": number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": number(body, "frequency_penalty", -2.0, 2.0),
        "seed": None if seed == -1 else seed,
        "logit_bias": _logit_bias(body if logit_bias is None else {"logit_bias": logit_bias}, defaults.vocab_size),
    }.items() if v is not None})


def _logit_bias(body: dict[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"token id": bias}``, checked here: a worker's error reply would take the whole pipeline down."""
    value = typed(body, "logit_bias", dict)
    if value is None:
        return None
    biases = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and key == str(int(key))) \
                or vocab_size is not None and int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r:.40}",
                           "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ApiError(422, f"logit_bias[{key}]: expected a number", "logit_bias", "invalid_type")
        if not abs(bias) <= MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias[{key}]: expected a number in [-100, 100], got {bias:g}", "logit_bias")
        biases.append((int(key), float(bias)))
    return tuple(biases)


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(422, "stop: expected a string or an array of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    return tuple(stops)


def _turn(message: Any, i: int) -> dict[str, Any]:
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
    calls = message.get("tool_calls") if role == "assistant" else None
    if content is None and calls:  # an assistant turn that only called tools
        content = ""
    if not isinstance(content, str):
        raise ApiError(422, f"{param}.content: expected a string or text parts", f"{param}.content", "invalid_type")
    turn = {**message, "role": ROLES[role], "content": content}
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls)):
        raise ApiError(422, f"{param}.tool_calls: expected calls {{'function': {{'name', 'arguments'}}}}",
                       f"{param}.tool_calls", "invalid_type")
    return turn


def _unsupported(body: dict[str, Any], **harmless: Any) -> None:
    """Fields accepted only with a value that changes nothing: absent, falsy (null, false, 0, [], {}) or ``ok``."""
    for name, ok in harmless.items():
        value = body.get(name)
        if value and value != ok:
            raise ApiError(400, f"{name}: not supported by this server (got {value!r:.60})", name)
