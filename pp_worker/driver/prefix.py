"""Prefix reuse: the KV sessions finished generations left on the stages, and those of the generations in flight,
by the tokens each holds.

A generation that may reuse (``Generation.cache_prompt``) looks, once its prompt is tokenized, for the session with
the longest common prefix (`PrefixCache.source`). A cached session its prompt continues whole (a conversation's next
turn) is taken: it leaves the cache, so two generations in flight never share one, and is claimed on every stage
(each says what it still holds: a stage may have evicted it meanwhile). Any other (a cached session the prompt parts
from, one system prompt or document behind many requests, or a generation in flight whose prefill is queued: eight
clients sending one prompt at once) is forked: each stage copies the common positions into the generation's own new
session (the worker's ``fork``; the source stays as it was, cache included). Either way the generation prefills only
the rest. When it finishes, its session goes back (`put`), marked as cache on the stages (``release`` with
``keep``), which evict cached sessions before any live one: a running generation never waits for, nor loses its KV
to, the cache. This module is the driver's bookkeeping only (the pipeline thread's; no I/O): which sessions are held
and what they hold.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


def reusable(held: list[int], tokens: list[int]) -> int:
    """Length of the common prefix, leaving at least one token to prefill (its forward yields the next token)."""
    n = 0
    while n < min(len(held), len(tokens) - 1) and held[n] == tokens[n]:
        n += 1
    return n


def similar(common: int, held: list[int], tokens: list[int]) -> bool:
    """Whether a common prefix of ``common`` tokens is worth taking a session for: at least half of the most the
    two could share (what it holds, or the prompt but its last token). llama-server's slot choice has the same
    threshold (``--slot-prompt-similarity`` 0.5)."""
    return common > 0 and 2 * common >= min(len(held), len(tokens) - 1)


FORK_MIN = 16  # tokens in common: a shorter beginning (a BOS, a template's first words) is computed, not copied


@dataclass(frozen=True)
class Source:
    """Where a new generation's prompt begins already (`PrefixCache.source`): a session and the tokens it holds (or
    will hold once the calls already sent have run), ``common`` of them the prompt's; ``take``: a cached session the
    prompt continues whole, taken out of the cache (claimed) instead of copied (forked)."""

    session: int
    held: list[int]
    common: int
    take: bool


class PrefixCache:
    """session id -> the tokens its KV holds on every stage, least recently used first, at most ``limit`` sessions
    (the stages' ``max_sessions``: more could never be held beside a live generation); and the sessions of the
    generations in flight, by the tokens their queued prefills make them hold (`offer`), which a new generation may
    fork too. ``room``: whether the stages hold a cached session beside every live one (a fork of it keeps it; a
    stage never evicts a live session for a fork, nor its source)."""

    def __init__(self, limit: int, room: Callable[[], bool] = lambda: True):
        self.limit, self.room = max(1, limit), room
        self._held: OrderedDict[int, list[int]] = OrderedDict()
        self._live: dict[int, list[int]] = {}

    def source(self, tokens: list[int]) -> Source | None:
        """Where ``tokens`` begins already: the session sharing the longest prefix with it (on a tie one taken
        before one forked, the most recently cached before a live one). A cached session the prompt continues
        whole is taken (out of the cache); any other is forked where it shares at least ``FORK_MIN`` tokens or half
        of what the two could share (`similar`: a short prompt). Without ``room`` to copy a cached session, one that
        shares that half is taken and rewound instead (a live one is always copied: its slot is held already). None
        where none shares enough: an unrelated prompt that shares a BOS or a template's first words starts afresh."""
        best: Source | None = None
        copy = self.room()
        candidates = [*((s, h, True) for s, h in reversed(self._held.items())),
                      *((s, h, False) for s, h in self._live.items())]
        for session, held, cached in candidates:
            k = reusable(held, tokens)
            half = similar(k, held, tokens)
            if cached and (k == len(held) or half and not copy):
                take = True
            elif (copy or not cached) and (k >= FORK_MIN or half):
                take = False
            else:
                continue
            if best is None or k > best.common or k == best.common and take and not best.take:
                best = Source(session, held, k, take)
        if best is not None and best.take:
            del self._held[best.session]
        return best

    def offer(self, session: int, tokens: list[int]) -> None:
        """A generation in flight whose session will hold ``tokens`` once the calls it has sent have run (its
        prefill's): a stage serves its requests in order, so a fork sent after them copies what they wrote."""
        self._live[session] = tokens

    def withdraw(self, session: int) -> None:
        """A generation ended (its session is released or left as cache): no longer a live source."""
        self._live.pop(session, None)

    def put(self, session: int, tokens: list[int]) -> list[int]:
        """Hold a finished generation's session; the sessions dropped to stay within ``limit`` (to release)."""
        self._held[session] = tokens
        self._held.move_to_end(session)
        dropped = []
        while len(self._held) > self.limit:
            dropped.append(self._held.popitem(last=False)[0])
        return dropped

    def drop(self, session: int) -> bool:
        """Forget a session (a stage evicted it); False when it was not held (taken meanwhile, or never)."""
        return self._held.pop(session, None) is not None

    def sizes(self) -> dict[int, int]:
        """session -> tokens held, least recently used first (a copy: other threads read it)."""
        return {session: len(held) for session, held in list(self._held.items())}
