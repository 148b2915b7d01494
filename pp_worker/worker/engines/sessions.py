"""Per-generation KV sessions keyed by request_id, with an LRU bound and the position rules.

A session owns one KV cache, taken from a pool (the engine's ``kvcache.KVPool``) and given back to it when the
session is released or evicted, and the number of positions it holds. Every rule is checked in `begin`, before
any compute, so a refused step leaves the session unchanged. No tinygrad here: these rules are tested with a
pool of plain objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pp_worker.worker.engines.base import EngineError

REMEMBER_EVICTED = 1024  # how many evicted ids we remember, to tell "evicted" from "unknown"


class CachePool(Protocol):
    def acquire(self) -> Any:
        """A cache for a new session (its contents are stale: a session only reads the positions it wrote)."""

    def release(self, cache: Any) -> None:
        """Take back a cache no session uses any more."""


@dataclass
class Session:
    """One generation's cache; ``length`` positions [0, length) of it are valid."""

    cache: Any
    length: int = 0


class SessionTable:
    """request_id -> Session, least recently used evicted first once ``max_sessions`` are held."""

    def __init__(self, max_sessions: int, max_context: int, pool: CachePool,
                 emit: Callable[..., None] = lambda kind, **fields: None):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions, self.max_context = max_sessions, max_context
        self._pool, self._emit = pool, emit
        self._live: OrderedDict[int, Session] = OrderedDict()  # oldest use first
        self._evicted: OrderedDict[int, None] = OrderedDict()  # a bounded ordered set

    def begin(self, rid: int, position: int, seq_len: int) -> Session:
        """The session to run ``seq_len`` positions from ``position`` on, after checking every rule.

        position == length appends; position < length rewinds (positions [0, position) are reused and the
        cache is overwritten from there); position 0 on an unknown id starts a new session.
        Call `commit` once the compute succeeded.
        """
        self._check_bounds(position, seq_len)
        session = self._live.get(rid)
        if session is None:
            return self._create(rid, position)
        if position > session.length:
            raise EngineError(f"position {position} is past the {session.length} positions session {rid} holds")
        session.length = position  # rewind (a no-op when appending): [position, ...) is about to be rewritten
        self._live.move_to_end(rid)
        return session

    def commit(self, session: Session, position: int, seq_len: int) -> None:
        """Record that positions [position, position + seq_len) are now in the cache."""
        session.length = position + seq_len

    def holds(self, rid: int, position: int) -> bool:
        """Whether a one-token step of ``rid`` at ``position`` just appends to a session held (no rewind, no new
        session, no eviction): what a batched step needs of each of its sessions."""
        session = self._live.get(rid)
        return session is not None and session.length == position and position + 1 <= self.max_context

    def release(self, rid: int) -> bool:
        """Drop a session (its cache goes back to the pool); False when there was none."""
        session = self._live.pop(rid, None)
        if session is not None:
            self._pool.release(session.cache)
        return session is not None

    def positions(self) -> dict[int, int]:
        """request_id -> positions held, least recently used first."""
        return {rid: s.length for rid, s in self._live.items()}

    def __len__(self) -> int:
        return len(self._live)

    def _check_bounds(self, position: int, seq_len: int) -> None:
        if position < 0:
            raise EngineError(f"position must be >= 0, got {position}")
        if seq_len < 1:
            raise EngineError(f"seq_len must be >= 1, got {seq_len}")
        if position + seq_len > self.max_context:
            raise EngineError(f"position {position} + seq_len {seq_len} = {position + seq_len} exceeds "
                              f"max_context {self.max_context}")

    def _create(self, rid: int, position: int) -> Session:
        if position > 0:
            adopted = self._adopt(rid, position)
            if adopted is not None:
                return adopted
            if rid in self._evicted:
                raise EngineError(f"session {rid} was evicted (more than max_sessions={self.max_sessions} "
                                  f"generations in flight); restart it from position 0")
            raise EngineError(f"unknown session {rid} at position {position}; a generation starts at position 0")
        while len(self._live) >= self.max_sessions:
            self._evict_oldest()
        self._evicted.pop(rid, None)
        session = self._live[rid] = Session(self._pool.acquire())
        return session

    def _adopt(self, rid: int, position: int) -> Session | None:
        """The seed kept one KV cache per stage, so its callers step one generation under a new request id at every
        step (prefill 2, then decode 3, 4, ...). Where that is unambiguous - this stage holds exactly one session,
        of exactly ``position`` positions, and ``rid`` was never seen - that session goes on under ``rid``."""
        if len(self._live) != 1 or rid in self._evicted:
            return None
        ((old, session),) = self._live.items()
        if session.length != position:
            return None
        del self._live[old]
        self._live[rid] = session
        self._emit("session_adopted", session=rid, from_session=old, positions=position)
        return session

    def _evict_oldest(self) -> None:
        rid, session = self._live.popitem(last=False)
        self._pool.release(session.cache)
        self._evicted[rid] = None
        if len(self._evicted) > REMEMBER_EVICTED:
            self._evicted.popitem(last=False)
        # never a field named request_id on an event line: the caller would take it for a reply
        self._emit("session_evicted", session=rid, positions=session.length, max_sessions=self.max_sessions)
