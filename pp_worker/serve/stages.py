"""Endpoints that ask one stage something outside any generation: ``/stages`` (every stage's ``status`` reply),
``POST /tokenize`` (stage 0's tokenizer) and ``POST /detokenize`` (the last stage's), the last two with
llama-server's shapes: ``{"content": text}`` -> ``{"tokens": [id, ...]}`` and back.

Whatever goes to a stage is checked here first: a stage's error reply would fail the whole pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pp_worker.driver.generation import Reply
from pp_worker.driver.service import PipelineService, Unavailable
from pp_worker.serve.fields import ApiError, boolean, prompt_text, read_body, required, typed, unavailable

MAX_DETOKENIZE = 1 << 16  # ids in one detokenize line: far below the workers' line limit, as MAX_PROMPT_CHARS


async def ask(service: PipelineService, stage: int, op: str, fields: dict[str, Any], timeout: float) -> Reply:
    """One op to one stage (-1: the last), its reply; a 503 when the pipeline is down or restarting, fails or
    closes meanwhile, or gives no reply within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[Reply | None] = loop.create_future()

    def settle(reply: Reply | None) -> None:
        if not answer.done():
            answer.set_result(reply)

    try:
        service.ask(stage, op, fields, lambda reply: loop.call_soon_threadsafe(settle, reply))
        reply = await asyncio.wait_for(answer, timeout)
    except (Unavailable, TimeoutError) as e:
        raise unavailable(service.failure or str(e) or f"stage {stage} gave no reply to {op}") from None
    if reply is None:  # the pipeline failed, or the server is closing
        raise unavailable(service.failure or service.recovering or "the server is shutting down")
    return reply


async def stage_status(service: PipelineService, timeout: float) -> list[Reply]:
    """Every stage's ``status`` reply (pid, KV ``sessions``, ``rss_mb``, ...), in stage order."""
    stages = range(len(service.pipeline.stages))
    return list(await asyncio.gather(*(ask(service, s, "status", {}, timeout) for s in stages)))


def stage_routes(service: PipelineService, vocab_size: int | None) -> list[Route]:
    def asking(stage: int, op: str, fields: dict[str, Any]) -> Any:
        return ask(service, stage, op, fields, service.pipeline.step_timeout)  # the pipeline of now (a restart)

    async def stages(request: Request) -> Response:
        return JSONResponse({"stages": await stage_status(service, service.pipeline.step_timeout)})

    async def tokenize(request: Request) -> Response:
        return JSONResponse(await _tokenize(await read_body(request), asking))

    async def detokenize(request: Request) -> Response:
        reply = await asking(-1, "detokenize", {"tokens": _token_ids(await read_body(request), vocab_size)})
        return JSONResponse({"content": reply["text"]})

    return [Route("/stages", stages), Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]


Asker = Callable[[int, str, dict[str, Any]], Any]  # (stage, op, fields) -> awaitable reply


async def _tokenize(body: dict[str, Any], asking: Asker) -> dict[str, Any]:
    """llama-server's ``/tokenize``: ``add_special`` (a BOS where the model has one) is off unless asked for;
    special tokens' texts are always parsed (``parse_special`` false is refused); ``with_pieces``: each id with its
    text, as the last stage detokenizes it alone (a character split across tokens shows as U+FFFD in each, where
    llama-server gives the bytes)."""
    content = required(body, "content")
    if not isinstance(content, str):
        raise ApiError(422, "content: expected a string", "content", "invalid_type")
    if boolean(body, "parse_special") is False:
        raise ApiError(400, "parse_special: false is not supported (special tokens' texts are always parsed)",
                       "parse_special")
    fields = {"prompt": prompt_text(content, "content"), "add_special": boolean(body, "add_special") or False}
    tokens = (await asking(0, "tokenize", fields))["tokens"]
    if not boolean(body, "with_pieces"):
        return {"tokens": tokens}
    pieces = await asyncio.gather(*(asking(-1, "detokenize", {"tokens": [t]}) for t in tokens))
    return {"tokens": [{"id": t, "piece": p["text"]} for t, p in zip(tokens, pieces, strict=True)]}


def _token_ids(body: dict[str, Any], vocab_size: int | None) -> list[int]:
    """``/detokenize``'s ``tokens``: ids in the vocabulary (a worker's error would take the pipeline down)."""
    tokens = required(body, "tokens")
    if typed(body, "tokens", list) is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(422, "tokens: expected an array of integers", "tokens", "invalid_type")
    if len(tokens) > MAX_DETOKENIZE:
        raise ApiError(400, f"tokens: at most {MAX_DETOKENIZE} ids, got {len(tokens)}", "tokens")
    bad = [t for t in tokens if t < 0 or vocab_size is not None and t >= vocab_size]
    if bad:
        raise ApiError(400, f"tokens: ids must be in [0, {vocab_size}), got {bad[0]}", "tokens")
    return tokens
