"""One request's generation as the event loop sees it: the pipeline thread's text and end, as ``Update``s.

The pipeline thread calls ``on_text`` (the text so far) and ``on_end``; they cut the text at the first stop string
(and ask the generation to stop there), hold back the end of the text only where it could still become a stop
string (it begins one) or is half a UTF-8 character, and hand the new text to the event loop with
``call_soon_threadsafe``, with the log-probabilities of the tokens it covers when they were asked for. So a stream
sends whole tokens as they come, stop strings or not (as llama-server's ``find_partial_stop``).
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
    usage: dict[str, int] | None = None
    error: str = ""
    unavailable: bool = False  # the error is the pipeline's (503), not the request's (400)
    code: str = ""  # the error's code in OpenAI's shape, if it has one
    logprobs: tuple[dict[str, Any], ...] = ()  # the last stage's, for the tokens this text completes (if asked)


class Feed:
    """Pipeline thread -> event loop, for one generation."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stop: tuple[str, ...]):
        self.loop, self.stop = loop, stop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.shown = 0  # characters handed over so far
        self.stopped = False  # a stop string was found
        self.logprobs_shown = 0  # tokens whose log-probabilities were handed over

    # --- the pipeline thread ---------------------------------------------------------------------------------
    def on_text(self, g: ServedGeneration, text: str, finished: bool) -> None:
        """The text so far (``Generation.on_text``); the final text comes through ``on_end``."""
        cut = self._cut(text)
        if cut != text:
            g.stop_requested = True
        elif not finished:
            cut = cut.rstrip("\ufffd")
            cut = cut[:len(cut) - self._stop_prefix(cut)]
        self._hand_over(cut, g.logprobs[:g.streamed_tokens])

    def on_end(self, g: ServedGeneration) -> None:
        if g.error:
            self._put(Update("", error=g.error, unavailable=g.unavailable, code=g.error_code))
            return
        final = self._cut(g.text)
        reason = "stop" if self.stopped else FINISH_REASONS.get(g.stop_reason, "stop")
        usage = {"prompt_tokens": len(g.prompt_tokens), "completion_tokens": len(g.tokens),
                 "total_tokens": len(g.prompt_tokens) + len(g.tokens)}
        shown = len(g.tokens) - (g.stop_reason == "eos")  # the end-of-generation token has no text
        self._put(Update(final[self.shown:], reason, usage, logprobs=self._new_logprobs(g.logprobs[:shown])))

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

    def _hand_over(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        if len(text) > self.shown:
            self._put(Update(text[self.shown:], logprobs=self._new_logprobs(logprobs)))
            self.shown = len(text)

    def _new_logprobs(self, logprobs: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        new = tuple(logprobs[self.logprobs_shown:])
        self.logprobs_shown = max(self.logprobs_shown, len(logprobs))
        return new

    def _put(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: the server is gone, and this request with it
            pass

    # --- the event loop -------------------------------------------------------------------------------------
    async def next(self) -> Update:
        return await self.queue.get()
