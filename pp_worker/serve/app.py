"""The HTTP app (Starlette): OpenAI's completions and chat completions, streamed (SSE) or not, the model list and
the model, ``/health``; with the routes of ``stages`` (``/stages``, ``/tokenize``, ``/detokenize``), ``page`` (the
chat page, ``/props``), ``metrics`` (``/metrics``), ``slots`` (``/slots``) and ``llamacpp`` (llama-server's
``/completion``, ``/apply-template``...), behind the middleware of ``access`` (API keys, CORS).

A request becomes one ``ServedGeneration`` submitted to the pipeline service; its ``Feed`` brings the text back to
the event loop. A client that disconnects cancels its generation, which then releases its KV sessions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from pp_worker.driver.chat import Format
from pp_worker.driver.draft_model import DraftWorker
from pp_worker.driver.service import PipelineService, ServedGeneration, Unavailable
from pp_worker.serve import tools
from pp_worker.serve.access import RequireKey, cors
from pp_worker.serve.api import Ask, Defaults, chat_ask, completion_ask
from pp_worker.serve.feed import Feed, Shape, Update
from pp_worker.serve.fields import ApiError, read_body, unavailable
from pp_worker.serve.llamacpp import llamacpp_routes
from pp_worker.serve.logprobs import Entry, chat_logprobs, completion_logprobs
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
        Route("/models", models), Route("/chat/completions", chat_completions, methods=["POST"]),  # llama-server's
        *llamacpp_routes(defaults, chat_format, lambda request, ask, shape: _generate(api, request, ask, shape)),
        *stage_routes(service, defaults.vocab_size), metrics_route(api.metrics, service),
        *page_routes(service, defaults), slots_route(service)]
    # outermost first: every request is counted, 401s and preflights included; CORS headers go on the 401s too
    middleware = [Middleware(CountRequests, metrics=api.metrics, routes=routes),
                  *([cors(cors_origins)] if cors_origins else []),
                  *([Middleware(RequireKey, keys=keys)] if keys else [])]
    handlers: dict[Any, Any] = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


# --- generating -----------------------------------------------------------------------------------------------
async def _generate(api: Api, request: Request, ask: Ask, shape: Shape | None = None) -> Response:
    """Run ``ask``; the reply in ``shape`` (OpenAI's by default): one JSON body, or an SSE stream."""
    shape = shape or OPENAI
    service, feed, timing = api.service, Feed(asyncio.get_running_loop(), ask.stop), api.metrics.timing()
    rid = service.new_request_id()
    # per-token text only where it is needed: to stream it, or to find a stop string while generating
    on_text = feed.on_text if ask.stream or ask.stop else None

    def on_end(g: ServedGeneration) -> None:
        timing.on_end(g)  # counted before the client can have its answer (and scrape /metrics)
        feed.on_end(g)

    g = ServedGeneration(0, ask.prompt, rid, ask.max_tokens, ask.sampling, on_text=on_text, on_end=on_end,
                         on_token=timing.on_token, grammar=ask.grammar, cache_prompt=ask.cache_prompt)
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
            body = _events(api, ask, rid, first, feed, watch, shape)
            watch = None  # the stream owns it now
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        updates = [first]
        while not done:
            updates.append(await feed.next())
            _raise_for(updates[-1])
            done = updates[-1].finish_reason is not None
        return JSONResponse(shape.whole(api.service.model, ask, rid, updates))
    finally:
        if watch is not None:
            _stop(service, rid, watch, done)


async def _events(api: Api, ask: Ask, rid: int, first: Update, feed: Feed, watch: asyncio.Task[None],
                  shape: Shape) -> AsyncIterator[str]:
    """The SSE stream: the shape's events for each update, then [DONE] where the shape has it, an error too.
    Cancelled on disconnect."""
    update, done, stream = first, False, shape.stream(api.service.model, ask, rid)
    try:
        while True:
            if update.error:  # an OpenAI stream ends in [DONE] after an error too: clients wait for it
                yield _sse(_error(update).body())
                break
            for event in stream.events(update):
                yield _sse(event)
            if update.finish_reason is not None:
                done = True
                break
            update = await feed.next()
        if shape.done_line:
            yield "data: [DONE]\n\n"
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
class OpenAIStream:
    """OpenAI's chunks: chat's opening role chunk, text chunks (with their tokens' log-probabilities if asked), the
    finish reason, the usage if asked for."""

    def __init__(self, model: str, ask: Ask, rid: int):
        self.model, self.ask, self.rid = model, ask, rid
        self.offset = 0  # characters of the tokens' texts sent so far (completions' text_offset)
        self.opened = not ask.chat
        self.calls = ask.tools is not None and ask.tools.parses  # the text may be a call: held back until the end
        self.held = ""

    def events(self, update: Update) -> Iterator[dict[str, Any]]:
        model, ask, rid = self.model, self.ask, self.rid
        if not self.opened:
            self.opened = True
            yield _chunk(model, ask, rid, {"role": "assistant", "content": ""}, None)
        if self.calls:
            self.held += update.text
        elif update.text or update.logprobs:
            yield _chunk(model, ask, rid, {"content": update.text} if ask.chat else update.text, None,
                         _logprobs(ask, update.logprobs, self.offset))
            self.offset += sum(len(e["text"]) for e in update.logprobs)
        if update.finish_reason is not None:
            finish = update.finish_reason
            if self.calls:
                deltas, finish = _held_deltas(ask, self.held, finish)
                for delta in deltas:
                    yield _chunk(model, ask, rid, delta, None)
            yield _chunk(model, ask, rid, {} if ask.chat else "", finish)
            if ask.include_usage:
                yield {**_chunk(model, ask, rid, "", None), "choices": [], "usage": update.usage}


def _completion(model: str, ask: Ask, rid: int, updates: list[Update]) -> dict[str, Any]:
    text, last = "".join(u.text for u in updates), updates[-1]
    logprobs = [e for u in updates for e in u.logprobs]
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason,
                              "logprobs": _logprobs(ask, logprobs, 0)}
    if ask.chat:
        choice["message"] = {"role": "assistant", "content": text}
        if ask.tools is not None and ask.tools.parses:
            content, calls = tools.result(text, ask.tools)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
    else:
        choice["text"] = text
    return {**_head(model, ask, rid, "chat.completion" if ask.chat else "text_completion"), "choices": [choice],
            "usage": last.usage}


OPENAI = Shape(_completion, OpenAIStream)


def _held_deltas(ask: Ask, text: str, finish: str) -> tuple[list[dict[str, Any]], str]:
    """A held-back text's deltas at the end of a stream with tools: its calls as OpenAI streams them (and the
    reason "tool_calls"), else its content."""
    assert ask.tools is not None
    content, calls = tools.result(text, ask.tools)
    if not calls:
        return ([{"content": text}] if text else []), finish
    return ([{"content": content}] if content else []) + tools.stream_deltas(calls), "tool_calls"


def _chunk(model: str, ask: Ask, rid: int, content: dict[str, Any] | str, finish: str | None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
    choice["delta" if ask.chat else "text"] = content
    return {**_head(model, ask, rid, "chat.completion.chunk" if ask.chat else "text_completion"), "choices": [choice]}


def _logprobs(ask: Ask, entries: list[Entry] | tuple[Entry, ...], offset: int) -> dict[str, Any] | None:
    if ask.logprobs is None:
        return None
    return chat_logprobs(entries) if ask.chat else completion_logprobs(entries, offset)


def _head(model: str, ask: Ask, rid: int, kind: str) -> dict[str, Any]:
    return {"id": f"{'chatcmpl' if ask.chat else 'cmpl'}-{rid}-{_RUN}", "object": kind, "created": int(time.time()),
            "model": model}


_RUN = uuid.uuid4().hex[:12]  # ids stay unique across restarts of the server, not only within one run


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _model(api: Api) -> dict[str, Any]:
    return {"id": api.service.model, "object": "model", "created": api.created, "owned_by": "pp_worker"}


# --- the rest ---------------------------------------------------------------------------------------------------
def _health(service: PipelineService) -> Response:
    """200 while requests are taken; 503 while draining (SIGTERM), while the stages restart, and once down."""
    status = service.status
    running, waiting = service.load
    if status == "down":
        return JSONResponse({"status": status, "error": service.failure}, 503)
    if status == "recovering":  # the requests queued then wait for the new stages
        return JSONResponse({"status": status, "error": service.recovering, "waiting": waiting}, 503)
    worker = service.pipeline.draft.worker if service.pipeline.draft else None
    draft = {"draft_model": worker.state()} if isinstance(worker, DraftWorker) else {}  # --draft-model's
    return JSONResponse({"status": status, "model": service.model, "stages": len(service.pipeline.stages),
                         "running": running, "waiting": waiting, "concurrency": service.concurrency, **draft},
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
