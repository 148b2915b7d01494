"""One request's generation as the event loop sees it: the pipeline thread's text and end, as ``Update``s.

The pipeline thread calls ``on_text`` (the text so far) and ``on_end``; they cut the text at the first stop string
(and ask the generation to stop there), hold back what could still become a stop string or is half a UTF-8
character, and hand the new text to the event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pp_worker.driver.service import ServedGeneration

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


class Feed:
    """Pipeline thread -> event loop, for one generation."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stop: tuple[str, ...]):
        self.loop, self.stop = loop, stop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.shown = 0  # characters handed over so far
        self.stopped = False  # a stop string was found

    # --- the pipeline thread ---------------------------------------------------------------------------------
    def on_text(self, g: ServedGeneration, text: str, finished: bool) -> None:
        """The text so far (``Generation.on_text``); the final text comes through ``on_end``."""
        cut = self._cut(text)
        if cut != text:
            g.stop_requested = True
        elif not finished:
            cut = cut.rstrip("\ufffd")[: max(0, len(cut) - max((len(s) for s in self.stop), default=0))]
        self._hand_over(cut)

    def on_end(self, g: ServedGeneration) -> None:
        if g.error:
            self._put(Update("", error=g.error, unavailable=g.unavailable, code=g.error_code))
            return
        final = self._cut(g.text)
        reason = "stop" if self.stopped else FINISH_REASONS.get(g.stop_reason, "stop")
        usage = {"prompt_tokens": len(g.prompt_tokens), "completion_tokens": len(g.tokens),
                 "total_tokens": len(g.prompt_tokens) + len(g.tokens),
                 "prompt_tokens_details": {"cached_tokens": g.reused}}  # OpenAI's: prompt tokens not recomputed
        self._put(Update(final[self.shown:], reason, usage))

    def _cut(self, text: str) -> str:
        ends = [i for s in self.stop if (i := text.find(s)) >= 0]
        if ends:
            self.stopped = True
            return text[: min(ends)]
        return text

    def _hand_over(self, text: str) -> None:
        if len(text) > self.shown:
            self._put(Update(text[self.shown:]))
            self.shown = len(text)

    def _put(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: the server is gone, and this request with it
            pass

    # --- the event loop -------------------------------------------------------------------------------------
    async def next(self) -> Update:
        return await self.queue.get()
