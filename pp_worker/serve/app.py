"""The HTTP app (Starlette): OpenAI's completions and chat completions, streamed (SSE) or not, the model list and
the model, ``/health``; with the routes of ``stages`` (``/stages``, ``/tokenize``, ``/detokenize``), ``page`` (the
chat page, ``/props``), ``metrics`` (``/metrics``), ``slots`` (``/slots``) and ``llamacpp`` (llama-server's
``/completion``, ``/apply-template``...), behind the middleware of ``access`` (API keys, CORS).

A request becomes one ``ServedGeneration`` a choice (``n``), submitted to the pipeline service; each one's ``Feed``
brings its text back to the event loop. A client that disconnects cancels its generations, which then release their
KV sessions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, replace
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
from pp_worker.serve.api import Ask, Defaults, chat_ask, choice_sampling, completion_ask
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
    """Run ``ask``, a generation a choice (``n``: their prompt's KV computed once, the others forking it); the reply
    in ``shape`` (OpenAI's by default; only OpenAI's asks have more than one choice): one JSON body, or an SSE
    stream."""
    shape = shape or OPENAI
    service, loop = api.service, asyncio.get_running_loop()
    feeds = [Feed(loop, ask.stop) for _ in range(ask.n)]
    rids: list[int] = []
    try:
        for i, feed in enumerate(feeds):
            rids.append(service.new_request_id())
            service.submit(_choice(api, ask, rids[-1], i, feed))
    except Unavailable as e:
        for rid in rids[:-1]:
            service.cancel(rid)
        raise unavailable(str(e)) from None
    watch = asyncio.create_task(_cancel_on_disconnect(request, service, rids))
    done = False
    try:
        first = await feeds[0].next()  # before the status line: a request that fails alone still gets its 400
        _raise_for(first)
        if ask.stream:
            body = _events(api, ask, rids, first, feeds, watch, shape)
            watch = None  # the stream owns it now
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        updates: list[list[Update]] = [[] for _ in feeds]
        async with aclosing(_updates(feeds, first)) as each:
            async for i, update in each:
                _raise_for(update)
                updates[i].append(update)
        done = True
        return JSONResponse(_whole(shape, api.service.model, ask, rids[0], updates))
    finally:
        if watch is not None:
            _stop(service, rids, watch, done)


def _choice(api: Api, ask: Ask, rid: int, index: int, feed: Feed) -> ServedGeneration:
    """Choice ``index``'s generation, its text and end to ``feed``, its timing to the metrics."""
    timing = api.metrics.timing()

    def on_end(g: ServedGeneration) -> None:
        timing.on_end(g)  # counted before the client can have its answer (and scrape /metrics)
        feed.on_end(g)

    # per-token text only where it is needed: to stream it, or to find a stop string while generating
    on_text = feed.on_text if ask.stream or ask.stop else None
    return ServedGeneration(0, ask.prompt, rid, ask.max_tokens, choice_sampling(ask.sampling, index), on_text=on_text,
                            on_end=on_end, on_token=timing.on_token, grammar=ask.grammar,
                            cache_prompt=ask.cache_prompt)


async def _updates(feeds: list[Feed], first: Update) -> AsyncIterator[tuple[int, Update]]:
    """(choice, update) as the choices' updates come, ``first`` (choice 0's) first, each choice's up to its last."""
    waiting: dict[asyncio.Future[Update], int] = {}

    def follow(i: int) -> None:
        waiting[asyncio.ensure_future(feeds[i].next())] = i

    yield 0, first
    for i in range(len(feeds)):
        if i or first.finish_reason is None and not first.error:
            follow(i)
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.__getitem__):
                i, update = waiting.pop(task), task.result()
                yield i, update
                if update.finish_reason is None and not update.error:
                    follow(i)
    finally:
        for task in waiting:
            task.cancel()


async def _events(api: Api, ask: Ask, rids: list[int], first: Update, feeds: list[Feed], watch: asyncio.Task[None],
                  shape: Shape) -> AsyncIterator[str]:
    """The SSE stream: the shape's events for each choice's updates as they come (each chunk names its choice), the
    usage of all of them last where asked, then [DONE] where the shape has it, an error too. Cancelled on
    disconnect."""
    model, done = api.service.model, False
    streams = [shape.stream(model, ask, rids[0])] if len(feeds) == 1 else \
        [OpenAIStream(model, replace(ask, include_usage=False), rids[0], i) for i in range(len(feeds))]
    usages: list[dict[str, Any] | None] = [None] * len(feeds)
    try:
        async with aclosing(_updates(feeds, first)) as each:
            async for i, update in each:
                if update.error:  # an OpenAI stream ends in [DONE] after an error too: clients wait for it
                    yield _sse(_error(update).body())
                    break
                for event in streams[i].events(update):
                    yield _sse(event)
                usages[i] = update.usage
            else:
                done = True
                if len(feeds) > 1 and ask.include_usage:
                    yield _sse({**_chunk(model, ask, rids[0], "", None), "choices": [], "usage": _usage(usages)})
        if shape.done_line:
            yield "data: [DONE]\n\n"
    finally:
        _stop(api.service, rids, watch, done)


async def _cancel_on_disconnect(request: Request, service: PipelineService, rids: list[int]) -> None:
    """The body is read, so the next ASGI message is the client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for rid in rids:
        service.cancel(rid)


def _stop(service: PipelineService, rids: list[int], watch: asyncio.Task[None], done: bool) -> None:
    watch.cancel()
    if not done:  # the client left, or the server is stopping: the generations' sessions go now
        for rid in rids:
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

    def __init__(self, model: str, ask: Ask, rid: int, index: int = 0):
        self.model, self.ask, self.rid, self.index = model, ask, rid, index
        self.offset = 0  # characters of the tokens' texts sent so far (completions' text_offset)
        self.opened = not ask.chat
        self.calls = ask.tools is not None and ask.tools.parses  # the text may be a call: held back until the end
        self.held = ""

    def events(self, update: Update) -> Iterator[dict[str, Any]]:
        model, ask, rid, index = self.model, self.ask, self.rid, self.index
        if not self.opened:
            self.opened = True
            yield _chunk(model, ask, rid, {"role": "assistant", "content": ""}, None, index=index)
        if self.calls:
            self.held += update.text
        elif update.text or update.logprobs:
            yield _chunk(model, ask, rid, {"content": update.text} if ask.chat else update.text, None,
                         _logprobs(ask, update.logprobs, self.offset), index)
            self.offset += sum(len(e["text"]) for e in update.logprobs)
        if update.finish_reason is not None:
            finish = update.finish_reason
            if self.calls:
                deltas, finish = _held_deltas(ask, self.held, finish)
                for delta in deltas:
                    yield _chunk(model, ask, rid, delta, None, index=index)
            yield _chunk(model, ask, rid, {} if ask.chat else "", finish, index=index)
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


def _whole(shape: Shape, model: str, ask: Ask, rid: int, updates: list[list[Update]]) -> dict[str, Any]:
    """The body of an answer not streamed: the shape's, with every choice's (OpenAI's shape where there are several)
    and their usage."""
    bodies = [shape.whole(model, ask, rid, u) for u in updates]
    if len(bodies) == 1:
        return bodies[0]
    return {**bodies[0], "choices": [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)],
            "usage": _usage([u[-1].usage for u in updates])}


def _usage(usages: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Several choices' usage as OpenAI counts it: the prompt once (and what of it was reused: the first choice's,
    which computed it), every choice's tokens."""
    first = usages[0] or {}
    completion = sum((u or {}).get("completion_tokens", 0) for u in usages)
    return {**first, "completion_tokens": completion, "total_tokens": first.get("prompt_tokens", 0) + completion}


def _held_deltas(ask: Ask, text: str, finish: str) -> tuple[list[dict[str, Any]], str]:
    """A held-back text's deltas at the end of a stream with tools: its calls as OpenAI streams them (and the
    reason "tool_calls"), else its content."""
    assert ask.tools is not None
    content, calls = tools.result(text, ask.tools)
    if not calls:
        return ([{"content": text}] if text else []), finish
    return ([{"content": content}] if content else []) + tools.stream_deltas(calls), "tool_calls"


def _chunk(model: str, ask: Ask, rid: int, content: dict[str, Any] | str, finish: str | None,
           logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
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
