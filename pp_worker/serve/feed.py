"""One request's generation as the event loop sees it: the pipeline thread's text and end, as ``Update``s.

The pipeline thread calls ``on_text`` (the text so far) and ``on_end``; they cut the text at the first stop string
(and ask the generation to stop there), hold back the end of the text only where it could still become a stop
string (it begins one) or is half a UTF-8 character, and hand the new text to the event loop with
``call_soon_threadsafe``, with the log-probabilities of the tokens it covers when they were asked for. So a stream
sends whole tokens as they come, stop strings or not (as llama-server's ``find_partial_stop``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from pp_worker.driver.service import ServedGeneration
from pp_worker.serve.api import Ask

FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_tokens": "length", "length": "length"}


@dataclass(frozen=True)
class Update:
    """New text since the last update; the last one has ``finish_reason`` and ``usage``, or ``error``."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str = ""
    unavailable: bool = False  # the error is the pipeline's (503), not the request's (400)
    code: str = ""  # the error's code in OpenAI's shape, if it has one
    tokens: tuple[int, ...] = ()  # the ids of the tokens this text completes
    logprobs: tuple[dict[str, Any], ...] = ()  # and their log-probabilities from the last stage (if asked for)
    generation: ServedGeneration | None = None  # the last update's: the generation, finished (timings, ids...)


class Feed:
    """Pipeline thread -> event loop, for one generation."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stop: tuple[str, ...]):
        self.loop, self.stop = loop, stop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.shown = 0  # characters handed over so far
        self.stopped = False  # a stop string was found
        self.tokens_shown = 0  # tokens whose ids (and log-probabilities) were handed over

    # --- the pipeline thread ---------------------------------------------------------------------------------
    def on_text(self, g: ServedGeneration, text: str, finished: bool) -> None:
        """The text so far (``Generation.on_text``); the final text comes through ``on_end``."""
        cut = self._cut(text)
        if cut != text:
            g.stop_requested = True
        elif not finished:
            cut = cut.rstrip("\ufffd")
            cut = cut[:len(cut) - self._stop_prefix(cut)]
        self._hand_over(cut, g, g.streamed_tokens)

    def on_end(self, g: ServedGeneration) -> None:
        if g.error:
            self._put(Update("", error=g.error, unavailable=g.unavailable, code=g.error_code))
            return
        final = self._cut(g.text)
        reason = "stop" if self.stopped else FINISH_REASONS.get(g.stop_reason, "stop")
        usage = {"prompt_tokens": len(g.prompt_tokens), "completion_tokens": len(g.tokens),
                 "total_tokens": len(g.prompt_tokens) + len(g.tokens),
                 "prompt_tokens_details": {"cached_tokens": g.reused}}  # OpenAI's: prompt tokens not recomputed
        shown = len(g.tokens) - (g.stop_reason == "eos")  # the end-of-generation token has no text
        self._put(Update(final[self.shown:], reason, usage, **self._new_tokens(g, shown), generation=g))

    def _cut(self, text: str) -> str:
        ends = [i for s in self.stop if (i := text.find(s)) >= 0]
        if ends:
            self.stopped = True
            return text[: min(ends)]
        return text

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins a stop string (0: none)."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def _hand_over(self, text: str, g: ServedGeneration, upto: int) -> None:
        if len(text) > self.shown:
            self._put(Update(text[self.shown:], **self._new_tokens(g, upto)))
            self.shown = len(text)

    def _new_tokens(self, g: ServedGeneration, upto: int) -> dict[str, Any]:
        """The ids (and log-probabilities) of the tokens from the last handed over up to ``upto``."""
        start, self.tokens_shown = self.tokens_shown, max(self.tokens_shown, upto)
        return {"tokens": tuple(g.tokens[start:upto]), "logprobs": tuple(g.logprobs[start:upto])}

    def _put(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: the server is gone, and this request with it
            pass

    # --- the event loop -------------------------------------------------------------------------------------
    async def next(self) -> Update:
        return await self.queue.get()


class ShapeStream(Protocol):
    def events(self, update: Update) -> Iterable[dict[str, Any]]:
        """The SSE events (JSON objects) for one update of the stream."""


@dataclass(frozen=True)
class Shape:
    """How an endpoint answers with a generation's updates: ``whole(model, ask, rid, updates)``, the body of an answer
    not streamed; ``stream(model, ask, rid)``, the events of a streamed one; ``done_line``: whether a stream ends with
    ``data: [DONE]`` (OpenAI's do, llama-server's ``/completion`` does not)."""

    whole: Callable[[str, Ask, int, list[Update]], dict[str, Any]]
    stream: Callable[[str, Ask, int], ShapeStream]
    done_line: bool = True
