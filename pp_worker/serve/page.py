"""The chat page at ``GET /`` (as llama-server's): one HTML file with its script and style under ``/static/``, all
shipped in the package (``static/``, with the two libraries it uses vendored there: ``static/VENDORED.md``), nothing
fetched from anywhere else; and ``GET /props``, what the page reads of the server (llama-server's endpoint of that
name, a subset of its fields).

The page's own Content-Security-Policy allows nothing but this server, so a change that pulled in an outside
resource would fail in the browser test rather than pass unnoticed.
"""

from __future__ import annotations

import os
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from pp_worker import __version__
from pp_worker.driver.service import PipelineService
from pp_worker.serve.api import Ask, Defaults
from pp_worker.serve.llamacpp import generation_settings

STATIC = Path(__file__).resolve().parent / "static"
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new server version's page, not a stale one
}


def page_routes(service: PipelineService, defaults: Defaults) -> list[BaseRoute]:
    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    async def props(request: Request) -> Response:
        return JSONResponse(server_props(service, defaults))

    return [Route("/", index), Route("/props", props), Mount("/static", PageFiles(directory=STATIC), name="static")]


class PageFiles(StaticFiles):
    """The page's files, with its headers: nosniff (a script is run only when served as one) and no-cache."""

    def file_response(self, full_path: str | os.PathLike[str], stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(PAGE_HEADERS)
        return response


def server_props(service: PipelineService, defaults: Defaults) -> dict[str, object]:
    """llama-server's ``/props`` shape where it applies: ``n_ctx`` (positions a KV session holds, the context),
    ``total_slots`` (generations at once), the defaults a request leaves out (``params``, in ``/completion``'s
    names; temperature, top_k, top_p, min_p and seed null where the server has no default: greedy, off, random),
    the BOS and EOS texts, ``modalities``, ``build_info``, plus ``model`` (the served model's id, as ``/v1/models``
    names it) and ``stages``."""
    sampling = defaults.sampling
    unset = Ask("", defaults.max_tokens, sampling, (), stream=False, include_usage=False, chat=False)
    params = {**generation_settings(unset), "n_predict": defaults.max_tokens, "temperature": sampling.temperature,
              "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed}
    pipeline = service.pipeline
    ready = pipeline.stages[-1].ready or {}
    return {"model": service.model, "n_ctx": pipeline.max_context, "model_alias": service.model,
            "total_slots": service.concurrency, "stages": len(pipeline.stages), "chat_template": pipeline.chat_template,
            "bos_token": ready.get("bos_token"), "eos_token": ready.get("eos_token"),
            "modalities": {"vision": False, "audio": False}, "build_info": f"pp_worker {__version__}",
            "is_sleeping": False,
            "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": pipeline.max_context,
                                            "speculative": False, "is_processing": False, "params": params}}
