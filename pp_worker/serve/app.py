"""The HTTP app (Starlette): OpenAI's completions and chat completions, streamed (SSE) or not, the model list and
the model, ``/health``; with the routes of ``stages`` (``/stages``, ``/tokenize``, ``/detokenize``), ``page`` (the
chat page, ``/props``), ``metrics`` (``/metrics``) and ``slots`` (``/slots``), behind the middleware of ``access``
(API keys, CORS).

A request becomes one ``ServedGeneration`` submitted to the pipeline service; its ``Feed`` brings the text back to
the event loop. A client that disconnects cancels its generation, which then releases its KV sessions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from pp_worker.driver.chat import Format
from pp_worker.driver.service import PipelineService, ServedGeneration, Unavailable
from pp_worker.serve.access import RequireKey, cors
from pp_worker.serve.api import Ask, Defaults, chat_ask, completion_ask
from pp_worker.serve.feed import Feed, Update
from pp_worker.serve.fields import ApiError, read_body, unavailable
from pp_worker.serve.metrics import CountRequests, Metrics, metrics_route
from pp_worker.serve.page import page_routes
from pp_worker.serve.slots import slots_route
from pp_worker.serve.stages import stage_routes


@dataclass(frozen=True)
class Api:
    service: PipelineService
    chat_format: Format
    defaults: Defaults
    created: int  # when the server started: the model's "created"
    metrics: Metrics


def build_app(service: PipelineService, chat_format: Format, defaults: Defaults, *, keys: list[str] | None = None,
              cors_origins: list[str] | None = None) -> Starlette:
    """The app; ``keys``: the API keys a request needs one of (none: open), ``cors_origins``: the origins whose
    pages may call it (``*``: any; none: no CORS headers, no preflight)."""
    api = Api(service, chat_format, defaults, int(time.time()), Metrics())

    async def completions(request: Request) -> Response:
        return await _generate(api, request, completion_ask(await read_body(request), api.defaults))

    async def chat_completions(request: Request) -> Response:
        return await _generate(api, request, chat_ask(await read_body(request), api.defaults, api.chat_format))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model(api)]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != api.service.model:  # completions take any name, but only the served model exists
            raise ApiError(404, f"the model {name!r:.100} does not exist; this server serves {api.service.model!r}",
                           "model", "model_not_found")
        return JSONResponse(_model(api))

    async def health(request: Request) -> Response:
        return _health(api.service)

    routes: list[BaseRoute] = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models), Route("/v1/models/{name:path}", model), Route("/health", health),
        *stage_routes(service, defaults.vocab_size), metrics_route(api.metrics, service),
        *page_routes(service, defaults), slots_route(service)]
    # outermost first: every request is counted, 401s and preflights included; CORS headers go on the 401s too
    middleware = [Middleware(CountRequests, metrics=api.metrics, routes=routes),
                  *([cors(cors_origins)] if cors_origins else []),
                  *([Middleware(RequireKey, keys=keys)] if keys else [])]
    handlers: dict[Any, Any] = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


# --- generating -----------------------------------------------------------------------------------------------
async def _generate(api: Api, request: Request, ask: Ask) -> Response:
    service, feed, timing = api.service, Feed(asyncio.get_running_loop(), ask.stop), api.metrics.timing()
    rid = service.new_request_id()
    # per-token text only where it is needed: to stream it, or to find a stop string while generating
    on_text = feed.on_text if ask.stream or ask.stop else None

    def on_end(g: ServedGeneration) -> None:
        timing.on_end(g)  # counted before the client can have its answer (and scrape /metrics)
        feed.on_end(g)

    g = ServedGeneration(0, ask.prompt, rid, ask.max_tokens, ask.sampling, on_text=on_text, on_end=on_end,
                         on_token=timing.on_token, cache_prompt=ask.cache_prompt)
    try:
        service.submit(g)
    except Unavailable as e:
        raise unavailable(str(e)) from None
    watch = asyncio.create_task(_cancel_on_disconnect(request, service, rid))
    done = False
    try:
        first = await feed.next()  # before the status line: a request that fails alone still gets its 400
        _raise_for(first)
        done = first.finish_reason is not None
        if ask.stream:
            body = _events(api, ask, rid, first, feed, watch)
            watch = None  # the stream owns it now
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        updates = [first]
        while not done:
            updates.append(await feed.next())
            _raise_for(updates[-1])
            done = updates[-1].finish_reason is not None
        return JSONResponse(_completion(api, ask, rid, "".join(u.text for u in updates), updates[-1]))
    finally:
        if watch is not None:
            _stop(service, rid, watch, done)


async def _events(api: Api, ask: Ask, rid: int, first: Update, feed: Feed,
                  watch: asyncio.Task[None]) -> AsyncIterator[str]:
    """The SSE stream: text chunks, the finish reason, the usage if asked for, [DONE]. Cancelled on disconnect."""
    update, done = first, False
    try:
        if ask.chat:
            yield _sse(_chunk(api, ask, rid, {"role": "assistant", "content": ""}, None))
        while True:
            if update.error:  # a stream always ends in [DONE], an error too: clients wait for it
                yield _sse(_error(update).body())
                yield "data: [DONE]\n\n"
                return
            if update.text:
                yield _sse(_chunk(api, ask, rid, {"content": update.text} if ask.chat else update.text, None))
            if update.finish_reason is not None:
                done = True
                yield _sse(_chunk(api, ask, rid, {} if ask.chat else "", update.finish_reason))
                if ask.include_usage:
                    yield _sse({**_chunk(api, ask, rid, "", None), "choices": [], "usage": update.usage})
                yield "data: [DONE]\n\n"
                return
            update = await feed.next()
    finally:
        _stop(api.service, rid, watch, done)


async def _cancel_on_disconnect(request: Request, service: PipelineService, rid: int) -> None:
    """The body is read, so the next ASGI message is the client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    service.cancel(rid)


def _stop(service: PipelineService, rid: int, watch: asyncio.Task[None], done: bool) -> None:
    watch.cancel()
    if not done:  # the client left, or the server is stopping: the generation's sessions go now
        service.cancel(rid)


def _raise_for(update: Update) -> None:
    if update.error:
        raise _error(update)


def _error(update: Update) -> ApiError:
    if update.unavailable:
        return unavailable(update.error)
    return ApiError(400, update.error, "prompt", update.code or None)


# --- response shapes --------------------------------------------------------------------------------------------
def _completion(api: Api, ask: Ask, rid: int, text: str, last: Update) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
    if ask.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**_head(api, ask, rid, "chat.completion" if ask.chat else "text_completion"), "choices": [choice],
            "usage": last.usage}


def _chunk(api: Api, ask: Ask, rid: int, content: dict[str, str] | str, finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    choice["delta" if ask.chat else "text"] = content
    return {**_head(api, ask, rid, "chat.completion.chunk" if ask.chat else "text_completion"), "choices": [choice]}


def _head(api: Api, ask: Ask, rid: int, kind: str) -> dict[str, Any]:
    return {"id": f"{'chatcmpl' if ask.chat else 'cmpl'}-{rid}-{_RUN}", "object": kind, "created": int(time.time()),
            "model": api.service.model}


_RUN = uuid.uuid4().hex[:12]  # ids stay unique across restarts of the server, not only within one run


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _model(api: Api) -> dict[str, Any]:
    return {"id": api.service.model, "object": "model", "created": api.created, "owned_by": "pp_worker"}


# --- the rest ---------------------------------------------------------------------------------------------------
def _health(service: PipelineService) -> Response:
    """200 while requests are taken; 503 while draining (SIGTERM), while the stages restart, and once down."""
    status = service.status
    if status in ("down", "recovering"):
        return JSONResponse({"status": status, "error": service.failure or service.recovering}, 503)
    running, waiting = service.load
    return JSONResponse({"status": status, "model": service.model, "stages": len(service.pipeline.stages),
                         "running": running, "waiting": waiting, "concurrency": service.concurrency},
                        200 if status == "ok" else 503)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), exc.status)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug: still OpenAI's error shape, never Starlette's plain-text 500 (the traceback goes to the log)."""
    return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(), 500)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                 kind=kind).body(), exc.status_code)
