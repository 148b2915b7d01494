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
    prompt continues whole, taken out of the cache (claimed) instead of copied (forked); ``wait``: a generation that
    has not sent its prefill yet (it is choosing where it starts: ``session`` is its request id), whose session will
    be the source once it has (`PrefixCache.offer`)."""

    session: int
    held: list[int]
    common: int
    take: bool
    wait: bool = False


class PrefixCache:
    """session id -> the tokens its KV holds on every stage, least recently used first, at most ``limit`` sessions
    (the stages' ``max_sessions``: more could never be held beside a live generation); and the generations in
    flight: those whose prefill is sent, by the tokens it makes their sessions hold (`offer`), which a new generation
    may fork too, and those still choosing where they start (`expect`), which it may wait for. ``room``: whether the
    stages hold a cached session beside every live one (a fork of it keeps it; a stage never evicts a live session
    for a fork, nor its source). ``ready``: called with a waited-for generation's request id once it has offered its
    session or ended."""

    def __init__(self, limit: int, room: Callable[[], bool] = lambda: True,
                 ready: Callable[[int], None] = lambda rid: None):
        self.limit, self.room, self.ready = max(1, limit), room, ready
        self._held: OrderedDict[int, list[int]] = OrderedDict()
        self._live: dict[int, list[int]] = {}  # session -> tokens, of generations whose prefill is sent
        self._expected: dict[int, list[int]] = {}  # request id -> tokens, of generations choosing where they start

    def source(self, tokens: list[int], wait: bool = True) -> Source | None:
        """Where ``tokens`` begins already: the session sharing the longest prefix with it (on a tie one taken
        before one forked, the most recently cached before a live one, either before one to wait for). A cached
        session the prompt continues whole is taken (out of the cache); any other is forked where it shares at
        least ``FORK_MIN`` tokens or half of what the two could share (`similar`: a short prompt). Without ``room``
        to copy a cached session, one that shares that half is taken and rewound instead (a live one is always
        copied: its slot is held already). ``wait``: a generation still choosing where it starts counts too (eight
        clients sending one document at once: the first computes it, the others wait for its prefill to be sent
        and fork it). None where none shares enough: an unrelated prompt that shares a BOS or a template's first
        words starts afresh."""
        best: Source | None = None
        copy = self.room()
        candidates = [*((s, h, True, False) for s, h in reversed(self._held.items())),
                      *((s, h, False, False) for s, h in self._live.items()),
                      *((r, h, False, True) for r, h in self._expected.items() if wait)]
        for session, held, cached, later in candidates:
            k = reusable(held, tokens)
            half = similar(k, held, tokens)
            if cached and (k == len(held) or half and not copy):
                take = True
            elif (copy or not cached) and (k >= FORK_MIN or half):
                take = False
            else:
                continue
            if best is None or k > best.common or k == best.common and take and not best.take:
                best = Source(session, held, k, take, later)
        if best is not None and best.take:
            del self._held[best.session]
        return best

    def expect(self, rid: int, tokens: list[int]) -> None:
        """Generation ``rid`` is choosing where it starts (a claim or a fork, each stage in turn), then prefills
        ``tokens``: others that begin as it does may wait for it (`source`) rather than compute the same tokens."""
        self._expected[rid] = tokens

    def offer(self, rid: int, session: int, tokens: list[int]) -> None:
        """Generation ``rid``'s session will hold ``tokens`` once the calls it has sent have run (its prefill's, sent
        right after this): a stage serves its requests in order, so a fork sent after them copies what they wrote."""
        self._live[session] = tokens
        if self._expected.pop(rid, None) is not None:
            self.ready(rid)

    def withdraw(self, rid: int, session: int) -> None:
        """Generation ``rid`` ended (its session is released or left as cache): no longer a source."""
        self._live.pop(session, None)
        if self._expected.pop(rid, None) is not None:
            self.ready(rid)

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
