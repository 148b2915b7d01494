"""``GET /slots``: llama-server's view of its slots, as far as it fits pp-serve: one entry per KV session the
pipeline holds on its stages, each generation running (``is_processing``) and each session a finished request left
as cache for prefix reuse (docs/serve.md, Prefix reuse). Fields as llama-server names them (``id``, ``id_task``,
``n_ctx``, ``is_processing``, ``next_token``), with the prompt as token counts (never its text: a slot may hold
another client's conversation): ``n_prompt_tokens`` (a running request's prompt, or the tokens a cached session
holds) and ``n_prompt_tokens_cache`` (of a running request's prompt, the tokens its session already held).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pp_worker.driver.service import PipelineService


def slots(service: PipelineService) -> list[dict[str, Any]]:
    """Running generations first (by request id), then cached sessions (least recently used first)."""
    n_ctx = service.pipeline.max_context or 0
    out = [{"id": g.session, "id_task": g.request_id, "n_ctx": n_ctx, "is_processing": True,
            "n_prompt_tokens": len(g.prompt_tokens), "n_prompt_tokens_cache": g.reused,
            "next_token": {"has_next_token": True, "n_decoded": len(g.tokens),
                           "n_remain": max(0, g.max_tokens - len(g.tokens))}}
           for g in service.running()]
    out += [{"id": session, "id_task": -1, "n_ctx": n_ctx, "is_processing": False, "n_prompt_tokens": held,
             "n_prompt_tokens_cache": 0, "next_token": {"has_next_token": False, "n_decoded": 0, "n_remain": 0}}
            for session, held in service.pipeline.cached_sessions().items()]
    return out


def slots_route(service: PipelineService) -> Route:
    async def endpoint(request: Request) -> Response:
        return JSONResponse(slots(service))

    return Route("/slots", endpoint)
