"""Prefix reuse across requests, the driver's side: the cache's choice (pure), then a stub pipeline service - a
finished request leaves its session as cache on every stage, the next one with a common prefix takes it (and only
it: two in flight never share one), claims it and prefills the rest; a stage that lost it makes the next request
prefill from 0; an eviction drops it everywhere. The stub's outputs depend on how a prompt is cut into prefill
calls, so the answers with and without reuse are compared on the real model: tests/test_prefix_real.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from pp_worker.driver.generation import Call, Reply
from pp_worker.driver.prefix import PrefixCache, reusable
from pp_worker.driver.service import PipelineService, ServedGeneration
from pp_worker.driver.stage_proc import Launch

STAGES = 3


def test_take_picks_the_longest_common_prefix_and_leaves_one_token_to_prefill() -> None:
    c = PrefixCache(4)
    c.put(1, [1, 2, 3, 4])
    c.put(2, [1, 2, 9])
    c.put(3, [1, 2])
    assert c.take([1, 2, 3, 7]) == (1, [1, 2, 3, 4])  # 3 tokens in common beats 2
    assert c.sizes() == {2: 3, 3: 2}
    assert c.take([1, 2]) == (3, [1, 2])  # one in common (the last is prefilled), a tie: the most recent
    assert c.take([5, 6]) is None and c.sizes() == {2: 3}
    assert reusable([1, 2, 3], [1, 2, 3]) == 2


def test_a_prefix_shorter_than_half_of_what_could_be_shared_takes_nothing() -> None:
    c = PrefixCache(4)
    c.put(1, list(range(10)))
    assert c.take([0, 1, 2, 3, 50, 51, 52, 53, 54, 55]) is None  # 4 of 9: a new session instead
    assert c.take([0, 1, 2, 3, 4, 50, 51, 52, 53, 54]) == (1, list(range(10)))  # 5 of 9
    c.put(1, list(range(10)))
    assert c.take([0, 1, 2, 3]) == (1, list(range(10)))  # shorter than what it holds: 3 of the 3 it could share


def test_put_holds_at_most_limit_sessions_dropping_the_least_recently_used() -> None:
    c = PrefixCache(2)
    assert c.put(1, [1]) == [] and c.put(2, [2]) == []
    assert c.put(3, [3]) == [1]
    assert c.drop(2) and not c.drop(2) and c.sizes() == {3: 1}


class Served:
    """A stub pipeline service (3 stages) and a way to run one generation through it and wait for its end."""

    def __init__(self) -> None:
        self.service = PipelineService(Launch(STAGES, stub=True), concurrency=4, log=None, reuse=True)

    def run(self, prompts: list[str], cache_prompt: bool = True) -> list[ServedGeneration]:
        """The prompts submitted at once; their generations once all have ended."""
        done = threading.Semaphore(0)
        gens = [ServedGeneration(0, p, self.service.new_request_id(), 5, cache_prompt=cache_prompt,
                                 on_end=lambda g: done.release()) for p in prompts]
        for g in gens:
            self.service.submit(g)
        for _ in gens:
            assert done.acquire(timeout=30)
        assert not any(g.error for g in gens), [g.error for g in gens]
        return gens

    def on_thread(self, work: Callable[[], object]) -> None:
        """Run ``work`` on the pipeline thread, between two rounds, and wait for it."""
        done = threading.Event()
        self.service._post(lambda: (work(), done.set()))
        assert done.wait(10)

    def status(self) -> list[Reply]:
        replies: list[Reply] = []
        done = threading.Semaphore(0)
        for s in range(STAGES):
            self.service.ask(s, "status", {}, lambda r: (replies.append(r), done.release()))
            assert done.acquire(timeout=10)
        return replies

    def cached(self) -> list[list[int]]:
        return [r["cached_sessions"] for r in self.status()]


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.service.close()


def test_a_request_takes_the_session_with_the_longest_common_prefix(served: Served) -> None:
    (a,) = served.run(["one two three four five"])
    assert served.cached() == [[a.session]] * STAGES
    assert served.status()[0]["sessions"] == {str(a.session): 5 + 5 - 1}  # prompt + every token but the last
    (b,) = served.run(["one two three six"])
    assert (b.session, b.reused) == (a.session, 3)  # the same session, rewound to where the prompts part
    (fresh,) = served.run(["one two three six"], cache_prompt=False)
    assert fresh.session == fresh.request_id and fresh.reused == 0
    assert served.cached() == [[b.session]] * STAGES  # cache_prompt false: released, not left
    (same,) = served.run(["one two three six"])
    assert same.reused == 3  # an identical repeat: all but the last prompt token


def test_two_requests_in_flight_never_share_a_session(served: Served) -> None:
    (a,) = served.run(["one two three four"])
    b, c = served.run(["one two three five", "one two three six"])
    assert sorted([b.reused, c.reused]) == [0, 3]
    assert len({b.session, c.session}) == 2 and a.session in (b.session, c.session)
    assert sorted(served.cached()[0]) == sorted([b.session, c.session])


def test_a_stage_that_lost_the_session_makes_the_next_request_prefill_from_zero(served: Served) -> None:
    (a,) = served.run(["one two three four"])
    p = served.service.pipeline
    served.on_thread(lambda: p._send(a.session, Call(1, "release", {}), None))  # stage 1 drops it, unknown to p
    assert str(a.session) not in served.status()[1]["sessions"] and p.cached_sessions() == {a.session: 4 + 5 - 1}
    (b,) = served.run(["one two three five"])
    assert b.session == a.session and b.reused == 0  # stage 1 said 0: every stage starts it afresh


def test_a_cached_session_evicted_by_one_stage_is_released_on_every_stage(served: Served) -> None:
    (a,) = served.run(["one two three four"])
    p = served.service.pipeline
    # what the pipeline thread does with a stage's event (the stub itself evicts nothing)
    served.on_thread(lambda: p._on_event(p.stages[2], {"event": "session_evicted", "session": a.session,
                                                        "cached": True}))
    assert p.cached_sessions() == {}
    assert [r["sessions"] for r in served.status()] == [{}] * STAGES  # the releases went ahead of the status
