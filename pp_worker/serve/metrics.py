"""``GET /metrics``: what pp-serve has done, in Prometheus' text format (version 0.0.4).

Counted as it happens (``Metrics``; the pipeline thread reports tokens, so a lock guards it): requests by endpoint and
status (``CountRequests``, the outermost middleware, so 401s and CORS preflights count too), prompt and generated
tokens, prompt tokens reused from a cached session (prefix reuse), tokens a draft guessed and the model kept
(speculative decoding), time to first token and inter-token latency (``Timing``, one per generation). Read at each
scrape: the queue, the generations in flight and the sessions left as cache, each stage's busy seconds, restarts and
failures (the service's, across restarts), and its KV sessions, cached sessions, pages and resident memory (from its own
``status`` reply; left out while the stages restart, or when they give no reply within ``STATUS_TIMEOUT_S``, so a scrape
is never a 503).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pp_worker.driver.generation import Generation, Reply
from pp_worker.driver.service import PipelineService
from pp_worker.serve.fields import ApiError
from pp_worker.serve.stages import stage_status

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUS_TIMEOUT_S = 5.0  # a stage busy with a long prefill answers its status after it: a scrape does not wait longer
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
NO_RESPONSE = "499"  # the client left before any response began (nginx's "client closed request")


class Histogram:
    """Observations counted in buckets (each bucket: the values <= its bound), with their sum and count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds, self.counts = tuple(bounds), [0] * len(bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.bounds):
            self.counts[i] += 1

    def samples(self, name: str) -> Iterator[str]:
        total = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            total += n
            yield f'{name}_bucket{{le="{bound}"}} {total}'
        yield f'{name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{name}_sum {self.sum!r}"
        yield f"{name}_count {self.count}"


class Metrics:
    """The counters and histograms of one server's life."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (endpoint, method, status)
        self.prompt_tokens = self.generated_tokens = 0
        self.reused_tokens = 0  # prompt tokens a cached session already held (prefix reuse): not recomputed
        self.drafted_tokens = self.kept_tokens = 0  # speculative decoding (--draft): guessed, and kept by the model
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self._busy_shown: list[float] = []  # never less than the last scrape showed: a counter only grows

    def count_request(self, endpoint: str, method: str, status: str) -> None:
        with self.lock:
            self.requests[(endpoint, method, status)] += 1

    def timing(self) -> Timing:
        """The hooks of one generation submitted now (``time to first token`` counts from here)."""
        return Timing(self, time.monotonic())

    def busy_seconds(self, busy: list[float]) -> list[float]:
        with self.lock:
            shown = self._busy_shown + busy[len(self._busy_shown):]
            self._busy_shown = [max(a, b) for a, b in zip(shown, busy, strict=True)]
            return list(self._busy_shown)


class Timing:
    """One generation's hooks: ``on_token`` (each token: the gap since the last one, or since the request came for
    the first) and ``on_end`` (its tokens in and out), both called from the pipeline thread."""

    def __init__(self, metrics: Metrics, submitted: float):
        self.metrics, self.last, self.first = metrics, submitted, True

    def on_token(self, g: Generation) -> None:
        gap, self.last = g.t_end - self.last, g.t_end
        with self.metrics.lock:
            (self.metrics.ttft if self.first else self.metrics.itl).observe(gap)
        self.first = False

    def on_end(self, g: Generation) -> None:
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(g.prompt_tokens)
            self.metrics.reused_tokens += g.reused
            self.metrics.generated_tokens += len(g.tokens)
            if g.draft is not None:
                self.metrics.drafted_tokens += g.draft.proposed
                self.metrics.kept_tokens += g.draft.accepted


class CountRequests:
    """ASGI middleware: each HTTP request counted by endpoint (its route's path, ``other`` for none), method and
    status, as its response begins (so a client that reads the response and then scrapes sees it counted)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        def count(status: str) -> None:
            nonlocal counted
            if not counted:
                counted = True
                # a series per known method, not one per string a client can make up
                method = scope["method"] if scope["method"] in METHODS else "other"
                self.metrics.count_request(self._endpoint(scope), method, status)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                count(str(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            count("500")  # a bug: the server's error handler answers 500 after this
            raise
        finally:
            count(NO_RESPONSE)

    def _endpoint(self, scope: Scope) -> str:
        route = next((r for r in self.routes if r.matches(scope)[0] != Match.NONE), None)
        return str(getattr(route, "path", "other")) if route is not None else "other"


def metrics_route(metrics: Metrics, service: PipelineService) -> Route:
    async def endpoint(request: Request) -> Response:
        try:
            stages: list[Reply] | None = await stage_status(service, STATUS_TIMEOUT_S)
        except ApiError:  # restarting, or a stage is busy or frozen: the rest is still worth a scrape
            stages = None
        return Response("\n".join(render(metrics, service, stages)) + "\n", media_type=CONTENT_TYPE)

    return Route("/metrics", endpoint)


def render(metrics: Metrics, service: PipelineService, stages: list[Reply] | None) -> Iterator[str]:
    """The exposition's lines: ``# HELP`` and ``# TYPE``, then the samples, for each metric."""
    running, waiting = service.load
    with metrics.lock:
        requests = sorted(metrics.requests.items())
        tokens = metrics.prompt_tokens, metrics.generated_tokens, metrics.reused_tokens
        drafted = metrics.drafted_tokens, metrics.kept_tokens
        histograms = [(name, list(h.samples(name))) for name, h in
                      (("pp_serve_time_to_first_token_seconds", metrics.ttft),
                       ("pp_serve_inter_token_latency_seconds", metrics.itl))]
    yield from _family("pp_serve_requests_total", "counter", "HTTP requests by endpoint (route), method and status",
                       [(f'{{endpoint="{_label(e)}",method="{_label(m)}",status="{s}"}}', n)
                        for (e, m, s), n in requests])
    yield from _family("pp_serve_prompt_tokens_total", "counter", "prompt tokens taken in by generations",
                       [("", tokens[0])])
    yield from _family("pp_serve_prompt_tokens_reused_total", "counter", "prompt tokens a cached session already "
                       "held (prefix reuse): not recomputed", [("", tokens[2])])
    yield from _family("pp_serve_generation_tokens_total", "counter", "tokens generated", [("", tokens[1])])
    yield from _family("pp_serve_draft_tokens_total", "counter", "tokens a draft guessed (--draft, --draft-model)",
                       [("", drafted[0])])
    yield from _family("pp_serve_draft_tokens_kept_total", "counter", "guessed tokens the model kept",
                       [("", drafted[1])])
    for (name, samples), what in zip(histograms, ("time from a request to its first token",
                                                 "time between two tokens of a generation"), strict=True):
        yield from (f"# HELP {name} {what}, seconds", f"# TYPE {name} histogram", *samples)
    yield from _family("pp_serve_queue_depth", "gauge", "generations waiting for a place", [("", waiting)])
    yield from _family("pp_serve_generations_in_flight", "gauge", "generations running", [("", running)])
    yield from _family("pp_serve_cached_sessions", "gauge", "KV sessions finished requests left on the stages for "
                       "prefix reuse", [("", len(service.pipeline.cached_sessions()))])
    yield from _family("pp_serve_pipeline_up", "gauge", "1 while the stages run (status ok or draining)",
                       [("", int(service.status in ("ok", "draining")))])
    yield from _stage_lines(metrics, service, stages)
    yield from _llamacpp_lines(tokens, running, waiting)


def _llamacpp_lines(tokens: tuple[int, int], running: int, waiting: int) -> Iterator[str]:
    """llama-server's names for the series that mean the same here, so its dashboards read pp-serve too (the others
    have no counterpart: docs/serve.md maps them)."""
    yield from _family("llamacpp:prompt_tokens_total", "counter", "prompt tokens processed", [("", tokens[0])])
    yield from _family("llamacpp:tokens_predicted_total", "counter", "tokens generated", [("", tokens[1])])
    yield from _family("llamacpp:requests_processing", "gauge", "requests processing", [("", running)])
    yield from _family("llamacpp:requests_deferred", "gauge", "requests waiting for a place", [("", waiting)])


def _stage_lines(metrics: Metrics, service: PipelineService, stages: list[Reply] | None) -> Iterator[str]:
    busy = metrics.busy_seconds(service.stage_busy_s())
    n = range(len(busy))
    yield from _family("pp_serve_stage_busy_seconds_total", "counter", "seconds a stage had a request outstanding",
                       [(_stage(s), busy[s]) for s in n])
    yield from _family("pp_serve_stage_restarts_total", "counter", "times a stage was started again (all restart "
                       "together when one fails)", [(_stage(s), service.restarted) for s in n])
    yield from _family("pp_serve_stage_failures_total", "counter", "times a stage died, froze or answered an error",
                       [(_stage(s), service.failures[s]) for s in n])
    if stages is None:
        return
    yield from _family("pp_serve_stage_kv_sessions", "gauge", "KV sessions a stage holds",
                       [(_stage(s), len(r.get("sessions") or {})) for s, r in enumerate(stages)])
    yield from _family("pp_serve_stage_kv_cached_sessions", "gauge", "KV sessions a stage holds as cache",
                       [(_stage(s), len(r.get("cached_sessions") or [])) for s, r in enumerate(stages)])
    pages = [(s, r) for s, r in enumerate(stages) if isinstance(r.get("kv_page_positions"), int)]  # real mode
    yield from _family("pp_serve_stage_kv_pages_used", "gauge", "KV pages a stage's sessions hold",
                       [(_stage(s), r.get("kv_pages_used", 0)) for s, r in pages])
    yield from _family("pp_serve_stage_kv_cached_pages", "gauge", "KV pages a stage's cached sessions hold",
                       [(_stage(s), _cached_pages(r)) for s, r in pages])
    yield from _family("pp_serve_stage_resident_memory_bytes", "gauge", "a stage worker's resident memory",
                       [(_stage(s), int(r["rss_mb"] * 2**20)) for s, r in enumerate(stages)
                        if isinstance(r.get("rss_mb"), int | float)])


def _cached_pages(status: Reply) -> int:
    """Pages of the sessions a stage holds as cache (page i holds positions [i * page, (i + 1) * page))."""
    page, held = status["kv_page_positions"], status.get("sessions") or {}
    return sum(-(-held.get(str(s), 0) // page) for s in status.get("cached_sessions") or [])


def _family(name: str, kind: str, what: str, samples: list[tuple[str, Any]]) -> Iterator[str]:
    yield f"# HELP {name} {what}"
    yield f"# TYPE {name} {kind}"
    for labels, value in samples:
        yield f"{name}{labels} {value!r}"


def _stage(s: int) -> str:
    return f'{{stage="{s}"}}'


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
