"""Per-generation KV sessions keyed by request_id, with an LRU bound, the position rules, and their KV pages.

A session holds the pages of the stage's KV pool (the engine's ``kvcache.KVPool``) that its positions fill: page
i holds positions [i * page, (i + 1) * page). Pages are taken as its positions grow and go back to the pool when
it is released, evicted or rewound below them. When the pool has no free page, the least recently used other
session is evicted to make room; when even that is not enough, the step is refused with the numbers. A session the
driver left as cache (``release(keep=True)``: a finished generation whose prefix the next request may reuse) is
evicted before every live one, so the cache never costs a running generation its KV. Every rule is
checked in `begin`, before any compute and before any other session is touched, so a refused step leaves every
session as it was. No tinygrad here: these rules are tested with a pool of plain numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from pp_worker.worker.engines.base import EngineError

REMEMBER_EVICTED = 1024  # how many evicted ids we remember, to tell "evicted" from "unknown"


class PagePool(Protocol):
    page: int  # positions per page
    n_pages: int
    page_bytes: int

    @property
    def free(self) -> int:
        """Pages no session holds."""

    def take(self) -> int:
        """A free page (the caller checked `free`; its contents are stale: a session only reads what it wrote)."""

    def give(self, pages: list[int]) -> None:
        """Take back pages no session holds any more."""


@dataclass
class Session:
    """One generation's pages (page i holds positions [i * page, (i + 1) * page)); positions [0, length) are valid."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    cached: bool = False  # left by a finished generation for reuse: evicted before every live session


@dataclass(frozen=True)
class Before:
    """A session as a step found it (`SessionTable.undo`): its pages and length, or None for one the step made; the
    step's position; the id it was adopted from."""

    pages: list[int] | None
    length: int
    position: int
    adopted_from: int | None = None


class SessionTable:
    """request_id -> Session, least recently used evicted first once ``max_sessions`` are held or the pool's pages
    run out."""

    def __init__(self, max_sessions: int, max_context: int, pool: PagePool,
                 emit: Callable[..., None] = lambda kind, **fields: None):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions, self.max_context = max_sessions, max_context
        self._pool, self._emit = pool, emit
        self._live: OrderedDict[int, Session] = OrderedDict()  # oldest use first
        self._evicted: OrderedDict[int, None] = OrderedDict()  # a bounded ordered set
        self._before: dict[int, Before] = {}  # the sessions the current step began (`new_step`, `undo`)

    def begin(self, rid: int, position: int, seq_len: int, keep: Collection[int] = ()) -> Session:
        """The session to run ``seq_len`` positions from ``position`` on, after checking every rule, with the pages
        those positions need. ``keep``: sessions that must not be evicted to make room (the others of a batch).

        position == length appends; position < length rewinds (positions [0, position) are reused and the
        cache is overwritten from there); position 0 on an unknown id starts a new session.
        Call `commit` once the compute succeeded.
        """
        self._check_bounds(position, seq_len)
        session = self._live.get(rid)
        before = None if session is None else Before(list(session.pages), session.length, position)
        if session is None and position > 0:
            old = next(iter(self._live), None)  # the one session `_adopt` may continue
            session = self._adopt(rid, position)
            if session is None:
                self._refuse_unknown(rid, position)
            before = Before(list(session.pages), session.length, position, old)
        if session is not None and position > session.length:
            raise EngineError(f"position {position} is past the {session.length} positions session {rid} holds")
        need = -(-(position + seq_len) // self._pool.page)  # pages for positions [0, position + seq_len)
        held = len(session.pages) if session is not None else 0
        try:
            self._check_room(rid, need - held, keep, new=session is None)
        except EngineError:
            if before is not None and before.adopted_from is not None:  # refused: nothing changes, adoption included
                self._rename(rid, before.adopted_from)
            raise
        if session is None:
            session = self._create(rid, keep)
        if held > need:  # a rewind below a page boundary: what lies past the step goes back
            self._keep_pages(session, need)
        self._make_room(need - len(session.pages), rid, keep)
        session.pages += [self._pool.take() for _ in range(need - len(session.pages))]
        session.length = position  # rewind (a no-op when appending): [position, ...) is about to be rewritten
        session.cached = False  # in use again
        self._live.move_to_end(rid)
        self._before[rid] = before or Before(None, 0, position)
        return session

    def new_step(self) -> None:
        """A step of the engine starts: what `undo` can undo is what its `begin` calls do from now on."""
        self._before.clear()

    def undo(self, rid: int) -> None:
        """Put ``rid``'s session back as the current step found it, the step having failed (before or after its
        compute): a session the step made is dropped (an adopted one goes back to its old id), an appended one
        gets its length and pages back. A rewind to p < length overwrote the keys and values from p on, so its
        session keeps [0, p) only. Sessions evicted to make room stay evicted. Nothing when the step never began
        ``rid``."""
        before = self._before.pop(rid, None)
        session = self._live.get(rid)
        if before is None or session is None:
            return
        if before.pages is None:
            self.release(rid)
            return
        self._keep_pages(session, len(before.pages))  # begin only cuts or extends the list
        session.length = min(before.length, before.position)
        if before.adopted_from is not None:
            self._rename(rid, before.adopted_from)

    def commit(self, session: Session, position: int, seq_len: int) -> None:
        """Record that positions [position, position + seq_len) are now in the cache."""
        session.length = position + seq_len

    def holds(self, rid: int, position: int, rows: int = 1) -> bool:
        """Whether a step of ``rows`` positions of ``rid`` from ``position`` continues a session held (appends, or
        rewinds to a position it holds: the rows after a check's last kept guess), no new session: what a batched
        step needs of each of its sessions."""
        session = self._live.get(rid)
        return session is not None and position <= session.length and position + rows <= self.max_context

    def rewind(self, rid: int, length: int) -> None:
        """Keep positions [0, length) of ``rid`` (held), giving back the pages past them: what a step computed
        beyond what its caller keeps (the rows of a check after a guess not kept)."""
        session = self._live[rid]
        self._keep_pages(session, -(-length // self._pool.page))
        session.length = min(session.length, length)

    def release(self, rid: int, keep: bool = False) -> bool:
        """Drop a session (its pages go back to the pool); False when there was none. ``keep``: leave it held as
        cache instead, first in line when room is needed."""
        if keep:
            session = self._live.get(rid)
            if session is not None:
                session.cached = True
                self._live.move_to_end(rid)  # its last use: the cache's own order is least recently used first
            return session is not None
        session = self._live.pop(rid, None)
        if session is not None:
            self._pool.give(session.pages)
        return session is not None

    def claim(self, rid: int) -> int:
        """Take a session back for a live generation (a cached one is no longer evicted first); the positions it
        holds, 0 when there is none (the generation then starts at position 0)."""
        session = self._live.get(rid)
        if session is None:
            return 0
        session.cached = False
        self._live.move_to_end(rid)
        return session.length

    def fork(self, rid: int, source: int, positions: int) -> tuple[int, list[tuple[int, int]]]:
        """A new session ``rid`` holding the first ``positions`` positions of ``source`` (fewer where it holds
        fewer): how many, and the (source page, new page) pairs whose contents the caller copies. A copy is an
        optimisation, so it makes room by evicting sessions left as cache only (least recently used first, never
        ``source``), never a live one: (0, []), nothing made, where ``source`` is not held or that is not enough
        (the caller computes the positions itself). ``source`` is touched; its cache mark stays."""
        if rid in self._live:
            raise EngineError(f"session {rid} is held already: a fork makes a new session (release it first)")
        held = self._live.get(source)
        n = 0 if held is None else min(positions, held.length)
        if held is None or n == 0:
            return 0, []
        need = -(-n // self._pool.page)
        free, count, victims = self._pool.free, len(self._live) + 1, []
        for r in (r for r, s in self._live.items() if s.cached and r != source):
            if free >= need and count <= self.max_sessions:
                break
            victims.append((r, "max_sessions" if count > self.max_sessions else "kv_pages"))
            free, count = free + len(self._live[r].pages), count - 1
        if free < need or count > self.max_sessions:
            return 0, []
        for r, reason in victims:
            self._evict(r, reason)
        self._live.move_to_end(source)
        session = self._create(rid, {source})  # the evictions above left it a slot: it evicts nothing
        session.pages, session.length = [self._pool.take() for _ in range(need)], n
        return n, list(zip(held.pages[:need], session.pages, strict=True))

    def cached(self) -> list[int]:
        """The sessions held as cache, least recently used first."""
        return [rid for rid, s in self._live.items() if s.cached]

    def reset(self) -> int:
        """Drop every session (their pages go back to the pool); how many there were."""
        held = list(self._live)
        for rid in held:
            self.release(rid)
        return len(held)

    def positions(self) -> dict[int, int]:
        """request_id -> positions held, least recently used first."""
        return {rid: s.length for rid, s in self._live.items()}

    def __len__(self) -> int:
        return len(self._live)

    def _keep_pages(self, session: Session, n: int) -> None:
        """Give back the session's pages past its first ``n`` (none when it holds n or fewer)."""
        self._pool.give(session.pages[n:])
        del session.pages[n:]

    def _check_bounds(self, position: int, seq_len: int) -> None:
        if position < 0:
            raise EngineError(f"position must be >= 0, got {position}")
        if seq_len < 1:
            raise EngineError(f"seq_len must be >= 1, got {seq_len}")
        if position + seq_len > self.max_context:
            raise EngineError(f"position {position} + seq_len {seq_len} = {position + seq_len} exceeds "
                              f"max_context {self.max_context}")

    def _refuse_unknown(self, rid: int, position: int) -> None:
        if rid in self._evicted:
            raise EngineError(f"session {rid} was evicted (more generations in flight than max_sessions="
                              f"{self.max_sessions} or the KV pool's {self._pool.n_pages} pages hold); restart it "
                              f"from position 0")
        raise EngineError(f"unknown session {rid} at position {position}; a generation starts at position 0")

    def _check_room(self, rid: int, missing: int, keep: Collection[int], new: bool) -> None:
        """Refuse, before anything changes, a step whose pages cannot be found even by evicting every other session
        that may be evicted."""
        if missing <= 0:
            return
        movable = sum(len(s.pages) for r, s in self._live.items() if r != rid and r not in keep)
        if self._pool.free + movable >= missing:
            return
        kept = sum(len(s.pages) for r, s in self._live.items() if r in keep and r != rid)
        own = 0 if new else len(self._live[rid].pages)
        raise EngineError(
            f"the KV pool is full: session {rid} needs {missing} more page(s) of {self._pool.page} positions "
            f"({missing * self._pool.page_bytes} bytes); the pool has {self._pool.n_pages} pages "
            f"({self._pool.n_pages * self._pool.page_bytes} bytes, PP_KV_BYTES), {self._pool.free} free, "
            f"{own} held by this session, {kept} by the others of this step, {movable} by sessions it may evict")

    def _make_room(self, missing: int, rid: int, keep: Collection[int]) -> None:
        while self._pool.free < missing:  # `_check_room` made sure there is enough to evict
            self._evict(self._victim({rid, *keep}), "kv_pages")

    def _create(self, rid: int, keep: Collection[int]) -> Session:
        while len(self._live) >= self.max_sessions:
            self._evict(self._victim(keep), "max_sessions")
        self._evicted.pop(rid, None)
        session = self._live[rid] = Session()
        return session

    def _victim(self, spare: Collection[int]) -> int:
        """The session to evict: the least recently used cached one, else the least recently used live one (never
        one of ``spare``)."""
        others = [r for r in self._live if r not in spare]
        return next((r for r in others if self._live[r].cached), others[0])

    def _adopt(self, rid: int, position: int) -> Session | None:
        """The seed kept one KV cache per stage, so its callers step one generation under a new request id at every
        step (prefill 2, then decode 3, 4, ...). Where that is unambiguous - this stage holds exactly one session,
        of exactly ``position`` positions, and ``rid`` was never seen - that session goes on under ``rid``."""
        if len(self._live) != 1 or rid in self._evicted:
            return None
        ((old, session),) = self._live.items()
        if session.length != position or session.cached:  # a driver that caches sessions knows its ids
            return None
        del self._live[old]
        self._live[rid] = session
        self._emit("session_adopted", session=rid, from_session=old, positions=position)
        return session

    def _rename(self, rid: int, to: int) -> None:
        self._live[to] = self._live.pop(rid)

    def _evict(self, rid: int, reason: str) -> None:
        session = self._live.pop(rid)
        self._pool.give(session.pages)
        self._evicted[rid] = None
        if len(self._evicted) > REMEMBER_EVICTED:
            self._evicted.popitem(last=False)
        # never a field named request_id on an event line: the caller would take it for a reply
        self._emit("session_evicted", session=rid, positions=session.length, max_sessions=self.max_sessions,
                   reason=reason, cached=session.cached)
