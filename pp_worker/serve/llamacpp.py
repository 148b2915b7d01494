"""llama-server's own endpoints, for the scripts written against it: ``POST /completion`` (and ``/completions``,
as llama-server routes it) with its field names and its response, ``POST /apply-template``, and ``/v1/embeddings``
answered with a 501 that says why. The un-prefixed ``/models`` and ``/chat/completions`` are the OpenAI routes'
aliases (in ``app``); ``/props`` is ``page``'s.

A ``/completion`` request is one generation as ``/v1/completions``'s is: the same checks, the same sampler, only the
names and the shapes differ (``n_predict`` for ``max_tokens``, ``repeat_penalty``, ``n_probs``; ``content``,
``tokens_predicted``, ``stop_type``, ``timings``...).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from pp_worker.driver.chat import Format
from pp_worker.driver.service import ServedGeneration
from pp_worker.serve import structured
from pp_worker.serve.api import (
    MAX_LOGPROBS,
    Ask,
    Defaults,
    one_prompt,
    render_messages,
    sampling_fields,
    stop_strings,
)
from pp_worker.serve.feed import Shape, Update
from pp_worker.serve.fields import ApiError, boolean, integer, read_body
from pp_worker.serve.logprobs import Entry

Generate = Callable[[Request, Ask, Shape], Awaitable[Response]]
UNLIMITED = 1 << 30  # n_predict -1: until an EOS or the context's end
STOP_TYPES = {"eos": "eos", "max_tokens": "limit", "length": "limit"}
EMBEDDINGS_WHY = ("embeddings are not served: the last stage computes the next token's logits only, and pooling the "
                  "hidden states would need a forward op that returns them, which the stages do not have")


def llamacpp_routes(defaults: Defaults, fmt: Format, generate: Generate) -> list[BaseRoute]:
    async def completion(request: Request) -> Response:
        body = await read_body(request)
        ask = completion_ask(body, defaults)
        return await generate(request, ask, llama_shape(bool(boolean(body, "return_tokens"))))

    async def apply_template(request: Request) -> Response:
        return JSONResponse({"prompt": render_messages(await read_body(request), fmt)})

    async def embeddings(request: Request) -> Response:
        raise ApiError(501, EMBEDDINGS_WHY, code="not_implemented", kind="not_implemented_error")

    return [Route("/completion", completion, methods=["POST"]), Route("/completions", completion, methods=["POST"]),
            Route("/apply-template", apply_template, methods=["POST"]),
            *(Route(path, embeddings, methods=["POST"]) for path in ("/v1/embeddings", "/embeddings", "/embedding"))]


# --- the request ----------------------------------------------------------------------------------------------------
def completion_ask(body: dict[str, Any], defaults: Defaults) -> Ask:
    """llama-server's names over /v1/completions' checks; the fields it has that change nothing here are ignored."""
    prompt = one_prompt(body)
    n_predict = integer(body, "n_predict", -1, UNLIMITED)
    if n_predict == 0:
        raise ApiError(400, "n_predict: 0 (evaluate the prompt only) is not supported; -1 or at least 1", "n_predict")
    n_probs = integer(body, "n_probs", 0, MAX_LOGPROBS)
    sampling = sampling_fields(body, defaults, repetition_penalty="repeat_penalty",
                               logit_bias=_logit_bias(body.get("logit_bias")))
    max_tokens = UNLIMITED if n_predict == -1 else n_predict or defaults.max_tokens
    return Ask(prompt, max_tokens, replace(sampling, logprobs=n_probs or None), stop_strings(body),
               bool(boolean(body, "stream")), False, False, grammar=structured.llama_grammar(body),
               cache_prompt=boolean(body, "cache_prompt") is not False)


def _logit_bias(value: Any) -> Any:
    """llama-server's ``[[id, bias], ...]`` (``false``: never) in OpenAI's shape; anything else as it came."""
    if not isinstance(value, list):
        return value
    out = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int):
            raise ApiError(400, "logit_bias: expected [[token id, bias], ...] (token strings are not supported)",
                           "logit_bias")
        out[str(pair[0])] = -100.0 if pair[1] is False else pair[1]
    return out


# --- the response -----------------------------------------------------------------------------------------------------
def llama_shape(return_tokens: bool) -> Shape:
    def whole(model: str, ask: Ask, rid: int, updates: list[Update]) -> dict[str, Any]:
        return _final(model, ask, updates, "".join(u.text for u in updates), return_tokens)

    return Shape(whole, lambda model, ask, rid: LlamaStream(model, ask), done_line=False)


class LlamaStream:
    """llama-server's stream: ``{content, tokens, stop: false}`` per piece of text, then the whole answer's fields with
    ``stop: true`` and empty ``content``; no ``[DONE]``."""

    def __init__(self, model: str, ask: Ask):
        self.model, self.ask = model, ask
        self.updates: list[Update] = []

    def events(self, update: Update) -> Iterator[dict[str, Any]]:
        self.updates.append(update)
        if update.text or update.tokens:
            event = {"index": 0, "content": update.text, "tokens": list(update.tokens), "stop": False, "id_slot": -1}
            if self.ask.logprobs is not None:
                event["completion_probabilities"] = _probabilities(update.logprobs)
            yield event
        if update.finish_reason is not None:
            yield _final(self.model, self.ask, self.updates, "", False)  # the ids came with the text


def _final(model: str, ask: Ask, updates: list[Update], content: str, with_tokens: bool) -> dict[str, Any]:
    last = updates[-1]
    g = last.generation
    assert g is not None, "the last update carries its generation"
    text = "".join(u.text for u in updates)
    word = min(((g.text.find(s), s) for s in ask.stop if s in g.text), default=(-1, ""))[1]
    out = {"index": 0, "content": content, "tokens": [t for u in updates for t in u.tokens] if with_tokens else [],
           "id_slot": -1, "stop": True, "model": model, "tokens_predicted": len(g.tokens),
           "tokens_evaluated": len(g.prompt_tokens), "generation_settings": generation_settings(ask),
           "prompt": ask.prompt, "has_new_line": "\n" in text, "truncated": g.stop_reason == "length",
           "stop_type": "word" if word else STOP_TYPES.get(g.stop_reason, "none"), "stopping_word": word,
           "tokens_cached": g.reused, "timings": timings(g)}
    if ask.logprobs is not None and content:
        out["completion_probabilities"] = _probabilities([e for u in updates for e in u.logprobs])
    return out


def generation_settings(ask: Ask) -> dict[str, Any]:
    """What a request ran with, in llama-server's names (``/props``' ``params`` for the server's defaults)."""
    s = ask.sampling
    return {"n_predict": -1 if ask.max_tokens == UNLIMITED else ask.max_tokens,
            "temperature": s.temperature or 0.0, "top_k": s.top_k or 0, "top_p": 1.0 if s.top_p is None else s.top_p,
            "min_p": s.min_p or 0.0, "repeat_penalty": s.repetition_penalty or 1.0, "repeat_last_n": 64,
            "presence_penalty": s.presence_penalty or 0.0, "frequency_penalty": s.frequency_penalty or 0.0,
            "seed": -1 if s.seed is None else s.seed, "stop": list(ask.stop), "stream": ask.stream,
            "n_probs": s.logprobs or 0, "logit_bias": [[t, b] for t, b in s.logit_bias],
            "samplers": ["penalties", "top_k", "temperature", "top_p", "min_p"]}


def timings(g: ServedGeneration) -> dict[str, float]:
    """llama-server's ``timings``: the prompt's from the generation's start to its first token, the rest's after it
    (per second: over the tokens after the first, as pp-serve's own ``decode_tps``); ``cache_n`` the prompt's tokens
    reused from a cached session, ``prompt_n`` those computed."""
    prompt_ms, predicted_ms = (g.t_first - g.t_start) * 1000, (g.t_end - g.t_first) * 1000
    n_prompt, n = len(g.prompt_tokens) - g.reused, len(g.tokens)
    return {"cache_n": g.reused, "prompt_n": n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
            "prompt_per_second": 1000 * n_prompt / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / (n - 1) if n > 1 else 0.0,
            "predicted_per_second": g.decode_tps}


def _probabilities(entries: list[Entry] | tuple[Entry, ...]) -> list[dict[str, Any]]:
    return [{**_token(e), "top_logprobs": [_token(t) for t in e["top"]]} for e in entries]


def _token(e: Entry) -> dict[str, Any]:
    return {"id": e["token_id"], "token": e["text"], "logprob": e["logprob"], "bytes": list(e["text"].encode())}
