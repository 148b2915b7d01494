"""Prefix reuse across requests: the KV sessions finished generations left on the stages, by the tokens each holds.

A generation that may reuse (``Generation.cache_prompt``) takes, once its prompt is tokenized, the held session with
the longest common prefix (`take`): that session leaves the cache, so two generations in flight never share one. It
claims the session on every stage (each says what it still holds: a stage may have evicted it meanwhile), rewinds it
to where the prompts part and prefills only the rest. When it finishes, its session goes back (`put`), marked as
cache on the stages (``release`` with ``keep``), which evict cached sessions before any live one: a running
generation never waits for, nor loses its KV to, the cache. This module is the driver's bookkeeping only (the
pipeline thread's; no I/O): which sessions are held and what they hold.
"""

from __future__ import annotations

from collections import OrderedDict


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


class PrefixCache:
    """session id -> the tokens its KV holds on every stage, least recently used first, at most ``limit`` sessions
    (the stages' ``max_sessions``: more could never be held beside a live generation)."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._held: OrderedDict[int, list[int]] = OrderedDict()

    def take(self, tokens: list[int]) -> tuple[int, list[int]] | None:
        """The held session sharing the longest prefix with ``tokens`` (the most recent on a tie) and what it holds,
        out of the cache (now the caller's alone); None when none shares at least half of what it could (of the
        shorter of the two: `similar`), so that an unrelated prompt that shares a BOS or a system prompt's first
        words with a long conversation leaves that conversation's session alone and starts its own."""
        best, n = None, 0
        for session, held in reversed(self._held.items()):
            if (k := reusable(held, tokens)) > n and similar(k, held, tokens):
                best, n = session, k
        return None if best is None else (best, self._held.pop(best))

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
