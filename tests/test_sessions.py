"""SessionTable rules, without tinygrad: positions, rewind, overflow, LRU eviction and its event, and the pages a
session holds: taken as it grows, given back on release, eviction and rewind, the least recently used session
evicted when the pool runs out, and a clear refusal that leaves every session as it was when even that is not
enough."""

from __future__ import annotations

import pytest

from pp_worker.worker.engines.base import EngineError
from pp_worker.worker.engines.sessions import REMEMBER_EVICTED, SessionTable


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def __call__(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))


class Pages:
    """Pages are numbers; the last one given back goes out first, as the engine's KVPool does."""

    def __init__(self, n_pages: int = 64, page: int = 4) -> None:
        self.page, self.n_pages, self.page_bytes = page, n_pages, 100
        self._free = list(range(n_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, pages: list[int]) -> None:
        assert not set(pages) & set(self._free), "a page given back twice"
        self._free.extend(reversed(pages))


def table(max_sessions: int = 4, max_context: int = 64, n_pages: int = 64) -> tuple[SessionTable, Recorder]:
    rec = Recorder()
    return SessionTable(max_sessions, max_context, Pages(n_pages), emit=rec), rec


def step(t: SessionTable, rid: int, position: int, seq_len: int):
    s = t.begin(rid, position, seq_len)
    t.commit(s, position, seq_len)
    return s


def test_position_zero_creates_and_appends():
    t, _ = table()
    s = step(t, 7, 0, 5)
    assert t.positions() == {7: 5}
    assert step(t, 7, 5, 1) is s
    assert t.positions() == {7: 6}


def test_each_session_gets_its_own_pages():
    t, _ = table()
    assert not set(step(t, 1, 0, 9).pages) & set(step(t, 2, 0, 9).pages)


def test_gap_is_refused_naming_both_numbers():
    t, _ = table()
    step(t, 1, 0, 4)
    with pytest.raises(EngineError, match=r"position 6 .*4 positions"):
        t.begin(1, 6, 1)
    assert t.positions() == {1: 4}


def test_rewind_keeps_the_prefix_and_reuses_the_cache():
    t, _ = table()
    s = step(t, 1, 0, 10)
    assert t.begin(1, 3, 2) is s
    assert s.length == 3  # [3, ...) is about to be overwritten
    t.commit(s, 3, 2)
    assert t.positions() == {1: 5}


def test_failed_compute_after_rewind_leaves_a_consistent_length():
    t, _ = table()
    step(t, 1, 0, 10)
    t.begin(1, 4, 3)  # no commit: the compute failed
    assert t.positions() == {1: 4}
    step(t, 1, 4, 1)


def test_overflow_is_refused_before_anything_changes():
    t, _ = table(max_context=16)
    with pytest.raises(EngineError, match=r"position 0 \+ seq_len 17 = 17 exceeds max_context 16"):
        t.begin(1, 0, 17)
    assert t.positions() == {}
    step(t, 1, 0, 15)
    step(t, 1, 15, 1)
    with pytest.raises(EngineError, match=r"position 16 \+ seq_len 1 = 17 exceeds max_context 16"):
        t.begin(1, 16, 1)
    assert t.positions() == {1: 16}


@pytest.mark.parametrize("position, seq_len, message", [(-1, 1, "position must be >= 0"),
                                                        (0, 0, "seq_len must be >= 1")])
def test_bad_numbers(position, seq_len, message):
    t, _ = table()
    with pytest.raises(EngineError, match=message):
        t.begin(1, position, seq_len)


def test_unknown_session_past_zero():
    t, _ = table()
    with pytest.raises(EngineError, match="unknown session 5 at position 3"):
        t.begin(5, 3, 1)
    assert t.positions() == {}


def test_lru_evicts_the_least_recently_used_and_says_so():
    t, rec = table(max_sessions=2)
    step(t, 1, 0, 4)
    step(t, 2, 0, 2)
    step(t, 1, 4, 1)  # 1 is now the most recent, so 2 goes first
    step(t, 3, 0, 1)
    assert t.positions() == {1: 5, 3: 1}
    assert rec.events == [("session_evicted", {"session": 2, "positions": 2, "max_sessions": 2,
                                               "reason": "max_sessions", "cached": False})]
    assert all("request_id" not in fields for _, fields in rec.events)
    with pytest.raises(EngineError, match="session 2 was evicted"):
        t.begin(2, 2, 1)


def test_evicted_session_can_restart_from_zero():
    t, _ = table(max_sessions=1)
    step(t, 1, 0, 3)
    step(t, 2, 0, 3)
    step(t, 1, 0, 3)  # evicts 2, restarts 1
    with pytest.raises(EngineError, match="session 2 was evicted"):
        t.begin(2, 3, 1)
    step(t, 1, 3, 1)  # 1 is live again, not reported as evicted
    assert t.positions() == {1: 4}


def test_evicted_ids_are_remembered_within_a_bound():
    t, _ = table(max_sessions=1)
    for rid in range(REMEMBER_EVICTED + 2):
        step(t, rid, 0, 1)
    with pytest.raises(EngineError, match="unknown session 0"):  # forgotten: too long ago
        t.begin(0, 2, 1)
    with pytest.raises(EngineError, match="session 1 was evicted"):
        t.begin(1, 1, 1)


def test_refused_step_does_not_touch_lru_order():
    t, rec = table(max_sessions=2)
    step(t, 1, 0, 1)
    step(t, 2, 0, 1)
    with pytest.raises(EngineError):
        t.begin(1, 9, 1)
    step(t, 3, 0, 1)
    assert rec.events[0][1]["session"] == 1


def test_release():
    t, _ = table()
    step(t, 1, 0, 2)
    assert t.release(1) is True
    assert t.release(1) is False
    assert t.positions() == {}
    with pytest.raises(EngineError, match="unknown session 1"):  # released is not evicted
        t.begin(1, 2, 1)


def test_max_sessions_must_be_positive():
    with pytest.raises(ValueError):
        SessionTable(0, 16, Pages())


def test_released_and_evicted_pages_go_back_to_the_pool_and_are_reused():
    t, _ = table(max_sessions=2)
    a, b = step(t, 1, 0, 1).pages, step(t, 2, 0, 1).pages
    assert t.release(1)
    assert step(t, 3, 0, 1).pages == a  # session 1's page, reused
    assert step(t, 4, 0, 1).pages == b  # evicts 2 (the least recently used), reuses its page
    assert t._pool.free == 62


# --- pages ---------------------------------------------------------------------------------------------------------

def test_pages_grow_with_the_positions():
    t, _ = table()  # pages of 4 positions
    s = step(t, 1, 0, 4)
    assert len(s.pages) == 1
    step(t, 1, 4, 1)  # position 4 opens the second page
    assert len(s.pages) == 2
    step(t, 1, 5, 6)  # up to position 10: the third
    assert len(s.pages) == 3 and len(set(s.pages)) == 3 and t._pool.free == 61


def test_a_rewind_gives_back_the_pages_past_the_step():
    t, _ = table()
    s = step(t, 1, 0, 11)
    first, second = s.pages[0], s.pages[1]
    step(t, 1, 2, 1)  # rewound to position 2: positions [0, 3) left, one page
    assert s.pages == [first] and t._pool.free == 63
    assert step(t, 2, 0, 1).pages == [second]  # pages given back go out before the untouched ones


def test_rewind_keeps_the_first_positions_and_gives_back_the_pages_past_them():
    t, _ = table()
    s = step(t, 1, 0, 10)  # pages of 4 positions: 3
    pages = list(s.pages)
    t.rewind(1, 5)  # a check kept 5 positions of the 10 it ran
    assert t.positions() == {1: 5} and s.pages == pages[:2]
    assert step(t, 2, 0, 4).pages == [pages[2]]  # the page given back is the next one out
    t.rewind(1, 8)  # never longer than what it holds
    assert t.positions()[1] == 5


def test_a_full_pool_evicts_the_least_recently_used_session():
    t, rec = table(n_pages=4)
    step(t, 1, 0, 8)  # 2 pages
    step(t, 2, 0, 4)  # 1 page
    step(t, 1, 8, 1)  # 1 is the most recent again, and holds 3 pages: the pool is full
    step(t, 3, 0, 2)  # needs 1: 2 goes
    assert t.positions() == {1: 9, 3: 2}
    assert rec.events == [("session_evicted", {"session": 2, "positions": 4, "max_sessions": 4,
                                               "reason": "kv_pages", "cached": False})]
    with pytest.raises(EngineError, match="session 2 was evicted"):
        t.begin(2, 4, 1)


def test_a_step_that_cannot_get_its_pages_is_refused_with_the_numbers_and_changes_nothing():
    t, rec = table(n_pages=4)
    a = step(t, 1, 0, 8)  # 2 pages
    b = step(t, 2, 0, 8)  # 2 pages: the pool is full
    before = (t.positions(), list(a.pages), list(b.pages))
    with pytest.raises(EngineError, match=r"session 1 needs 1 more page\(s\) of 4 positions .* the pool has 4 pages "
                       r"\(400 bytes, PP_KV_BYTES\), 0 free, 2 held by this session, 2 by the others of this step, "
                       r"0 by sessions it may evict"):
        t.begin(1, 8, 1, keep=[1, 2])  # a batch of both: neither may be evicted for the other
    with pytest.raises(EngineError, match="session 3 needs 5 more page"):
        t.begin(3, 0, 20)  # more than the whole pool: nobody is evicted for nothing
    assert (t.positions(), a.pages, b.pages) == before and t._pool.free == 0 and not rec.events
    step(t, 1, 8, 1)  # alone, it may evict 2
    assert t.positions() == {1: 9}


# --- the seed's callers: one generation, a new request id at every step ------------------------------------------

def test_a_new_id_continues_the_only_session_at_its_length():
    t, rec = table()
    prefill = step(t, 2, 0, 7)
    assert step(t, 4, 7, 1) is prefill  # the same cache, under the new id
    assert step(t, 5, 8, 1) is prefill
    assert t.positions() == {5: 9}
    assert rec.events == [("session_adopted", {"session": 4, "from_session": 2, "positions": 7}),
                          ("session_adopted", {"session": 5, "from_session": 4, "positions": 8})]
    assert all("request_id" not in fields for _, fields in rec.events)


@pytest.mark.parametrize("case", ["two sessions", "shorter", "longer", "evicted id"])
def test_adoption_only_where_it_is_unambiguous(case):
    t, rec = table(max_sessions=1 if case == "evicted id" else 4)
    if case == "evicted id":
        step(t, 9, 0, 3)
        step(t, 1, 0, 3)  # evicts 9
    else:
        step(t, 1, 0, 3)
    if case == "two sessions":
        step(t, 2, 0, 3)
    position = {"shorter": 2, "longer": 4}.get(case, 3)
    before = t.positions()
    with pytest.raises(EngineError, match="session 9 was evicted" if case == "evicted id" else "unknown session 9"):
        t.begin(9, position, 1)
    assert t.positions() == before
    assert not [kind for kind, _ in rec.events if kind == "session_adopted"]


# --- sessions left as cache (release with keep) ------------------------------------------------------------------

def test_a_kept_session_stays_and_a_claim_takes_it_back_with_its_length():
    t, _ = table()
    step(t, 1, 0, 6)
    assert t.release(1, keep=True) and t.cached() == [1] and t.positions() == {1: 6}
    assert t.claim(1) == 6 and t.cached() == []
    assert t.claim(2) == 0 and t.positions() == {1: 6}  # nothing held: nothing created
    assert not t.release(2, keep=True)


def test_a_cached_session_is_evicted_before_an_older_live_one():
    t, rec = table(max_sessions=2)
    step(t, 1, 0, 4)  # live, the least recently used
    step(t, 2, 0, 2)
    t.release(2, keep=True)
    step(t, 3, 0, 1)
    assert t.positions() == {1: 4, 3: 1}
    assert rec.events == [("session_evicted", {"session": 2, "positions": 2, "max_sessions": 2,
                                               "reason": "max_sessions", "cached": True})]


def test_a_full_pool_evicts_cached_sessions_first():
    t, rec = table(n_pages=4)
    step(t, 1, 0, 4)  # 1 page, live, the least recently used
    step(t, 2, 0, 4)
    step(t, 4, 0, 4)
    t.release(2, keep=True)
    t.release(4, keep=True)
    step(t, 3, 0, 8)  # needs 2 pages, 1 free: the older cached session goes, the newer stays
    assert t.positions() == {1: 4, 4: 4, 3: 8} and t.cached() == [4]
    assert [f["session"] for _, f in rec.events] == [2] and rec.events[0][1]["cached"]


def test_a_step_on_a_cached_session_makes_it_live_again():
    t, rec = table(max_sessions=2)
    step(t, 1, 0, 4)
    step(t, 2, 0, 4)
    t.release(1, keep=True)
    step(t, 1, 2, 1)  # a rewind on it: in use again, never evicted as cache
    t.release(2, keep=True)
    step(t, 3, 0, 1)
    assert t.positions() == {1: 3, 3: 1} and t.cached() == []
    assert rec.events[0][1]["session"] == 2


def test_a_cached_session_is_never_adopted():
    t, _ = table()
    step(t, 1, 0, 3)
    t.release(1, keep=True)
    with pytest.raises(EngineError, match="unknown session 9"):
        t.begin(9, 3, 1)


# --- a failed step: `undo` -----------------------------------------------------------------------------------

def failed(t: SessionTable, rid: int, position: int, seq_len: int) -> None:
    """A step that began (its pages taken, its compute run) and then failed."""
    t.new_step()
    t.begin(rid, position, seq_len)
    t.undo(rid)


def test_a_failed_append_leaves_its_session_as_it_was():
    t, _ = table()
    s = step(t, 1, 0, 3)
    pages, free = list(s.pages), t._pool.free
    failed(t, 1, 3, 6)  # needs pages 1 and 2
    assert t.positions() == {1: 3} and s.pages == pages and t._pool.free == free
    assert step(t, 1, 3, 1).length == 4  # and it goes on from there


def test_a_failed_first_step_leaves_no_session():
    t, _ = table()
    free = t._pool.free
    failed(t, 2, 0, 5)
    assert t.positions() == {} and t._pool.free == free


def test_a_failed_adopting_step_leaves_the_session_under_its_old_id():
    t, rec = table()
    step(t, 1, 0, 4)
    failed(t, 2, 4, 1)
    assert rec.events[0][0] == "session_adopted" and t.positions() == {1: 4}


def test_an_adopting_step_refused_for_room_leaves_the_session_under_its_old_id():
    t = SessionTable(4, 64, Pages(n_pages=2))
    step(t, 1, 0, 4)  # one page of 4 positions
    with pytest.raises(EngineError, match="the KV pool is full"):
        t.begin(2, 4, 8)  # would adopt session 1, and needs 2 more pages than the one free
    assert t.positions() == {1: 4}


def test_a_failed_rewind_keeps_the_positions_before_it():
    """Its compute overwrote the cache from its position on: only what lies before it is still what it was."""
    t, _ = table()
    s = step(t, 1, 0, 10)
    failed(t, 1, 6, 8)  # past the pages held: one more taken, and given back
    assert t.positions() == {1: 6} and len(s.pages) == 3


def test_undo_touches_only_what_the_current_step_began():
    t, _ = table()
    step(t, 1, 0, 3)
    t.new_step()
    with pytest.raises(EngineError):
        t.begin(1, 9, 1)  # refused before anything changed: nothing to undo
    t.undo(1)
    t.undo(5)
    assert t.positions() == {1: 3}


def test_reset_drops_every_session_and_gives_their_pages_back():
    t, _ = table()
    for rid in (1, 2, 3):
        step(t, rid, 0, 5)
    assert t.reset() == 3 and t.positions() == {} and t._pool.free == 64
    assert t.reset() == 0


def test_a_fork_takes_pages_of_its_own_for_the_positions_it_copies():
    t, _ = table()  # pages of 4 positions
    src = step(t, 1, 0, 10)  # 3 pages
    t.release(1, keep=True)
    n, pairs = t.fork(2, 1, 6)
    new = t._live[2]
    assert n == 6 and [a for a, _ in pairs] == src.pages[:2] and [b for _, b in pairs] == new.pages
    assert not set(new.pages) & set(src.pages) and new.length == 6 and not new.cached
    assert t.cached() == [1] and t.positions() == {1: 10, 2: 6}  # the source stays as it was, cache included
    assert t.fork(3, 1, 99)[0] == 10  # never more than the source holds
    assert t.fork(4, 9, 5) == (0, []) and 4 not in t.positions()  # an unknown source: nothing made
    step(t, 2, 6, 3)  # the fork goes on as any session does
    assert t.positions()[2] == 9 and t.positions()[1] == 10


def test_a_fork_into_a_held_session_is_refused():
    t, _ = table()
    step(t, 1, 0, 4)
    step(t, 2, 0, 4)
    with pytest.raises(EngineError, match="session 2 is held already"):
        t.fork(2, 1, 4)


def test_a_fork_evicts_cached_sessions_for_room_but_never_a_live_one_nor_its_source():
    t, rec = table(max_sessions=4, n_pages=5)
    for rid in (1, 2, 3):  # 1, the source, 2 pages; 2 and 3 one page each
        step(t, rid, 0, 8 if rid == 1 else 4)
    t.release(1, keep=True)
    t.release(2, keep=True)
    assert t.fork(4, 1, 8)[0] == 8  # 2 pages, 1 free: the cached 2 goes, never the source
    assert t.positions() == {3: 4, 1: 8, 4: 8} and t.cached() == [1]
    assert [(f["session"], f["reason"]) for _, f in rec.events] == [(2, "kv_pages")]
    assert t.fork(5, 1, 8) == (0, [])  # no room but in live sessions (and the source): nothing made, none evicted
    assert t.positions() == {3: 4, 1: 8, 4: 8} and len(rec.events) == 1
    one, _ = table(max_sessions=1)
    step(one, 1, 0, 4)
    one.release(1, keep=True)
    assert one.fork(2, 1, 4) == (0, []) and one.positions() == {1: 4}  # one slot: no room for a copy
    two, rec = table(max_sessions=2)
    for rid in (1, 2):
        step(two, rid, 0, 4)
        two.release(rid, keep=True)
    assert two.fork(3, 2, 4)[0] == 4 and two.positions() == {2: 4, 3: 4}  # a slot: the cached 1 goes
    assert [(f["session"], f["reason"]) for _, f in rec.events] == [(1, "max_sessions")]
