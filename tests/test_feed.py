"""The feed between a generation and its HTTP reply: what text it hands over while a stop string may still come."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pp_worker.serve.feed import Feed


def handed_over(stop: tuple[str, ...], texts: list[str]) -> tuple[list[str], bool]:
    """The pieces of text the event loop gets for successive ``on_text`` calls, and whether a stop was asked for."""
    loop = asyncio.new_event_loop()
    try:
        feed = Feed(loop, stop)
        g = SimpleNamespace(stop_requested=False, streamed_tokens=0, tokens=[], logprobs=[])
        for text in texts:
            feed.on_text(g, text, False)  # type: ignore[arg-type]
        loop.run_until_complete(asyncio.sleep(0))  # the call_soon_threadsafe puts
        pieces = []
        while not feed.queue.empty():
            pieces.append(feed.queue.get_nowait().text)
        return pieces, g.stop_requested
    finally:
        loop.close()


def test_only_an_end_that_begins_a_stop_string_is_held_back() -> None:
    assert handed_over(("\nUser:",), [" Hello", " Hello world", " Hello world\nUs"]) == \
        ([" Hello", " world"], False)  # "\nUs" may become the stop string: held
    assert handed_over(("\nUser:",), [" Hello world\nUs", " Hello world\nUsually"]) == \
        ([" Hello world", "\nUsually"], False)  # it did not: sent on
    assert handed_over(("world", "\nUser:"), [" Hello wor", " Hello world!"]) == ([" Hello "], True)


def test_without_stop_strings_everything_goes_at_once() -> None:
    assert handed_over((), [" a", " a b"]) == ([" a", " b"], False)
