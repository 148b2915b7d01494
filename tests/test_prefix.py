"""Prefix reuse across requests, the driver's side: the cache's choice (pure), then a stub pipeline service - a
finished request leaves its session as cache on every stage, the next one with a common prefix forks it (a copy in
a session of its own: the cached one stays) and prefills the rest, as does one sent while another with the same
prompt prefills; a stage that lost the source makes the next request prefill from 0; an eviction drops it
everywhere. The stub's outputs depend on how a prompt is cut into prefill
calls, so the answers with and without reuse are compared on the real model: tests/test_prefix_real.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from pp_worker.driver.generation import Call, Reply
from pp_worker.driver.prefix import FORK_MIN, PrefixCache, Source, reusable
from pp_worker.driver.service import PipelineService, ServedGeneration
from pp_worker.driver.stage_proc import Launch

STAGES = 3


def test_source_takes_a_session_the_prompt_continues_whole_and_forks_any_other() -> None:
    c = PrefixCache(4)
    c.put(1, [1, 2, 3, 4])
    c.put(2, [1, 2, 9])
    c.put(3, [1, 2])
    assert c.source([1, 2, 3, 7]) == Source(1, [1, 2, 3, 4], 3, take=False)  # 3 in common beats 2; a copy of them
    assert c.sizes() == {1: 4, 2: 3, 3: 2}  # a fork's source stays cached
    assert c.source([1, 2, 9, 5]) == Source(2, [1, 2, 9], 3, take=True)  # continued whole: taken out of the cache
    assert c.source([1, 2, 3, 4, 5]) == Source(1, [1, 2, 3, 4], 4, take=True)
    assert c.sizes() == {3: 2}
    c.put(4, [1, 2, 8])
    assert c.source([1, 2]) == Source(4, [1, 2, 8], 1, take=False)  # one (the last is prefilled); a tie: the newest
    assert c.source([5, 6]) is None and c.sizes() == {3: 2, 4: 3}
    assert reusable([1, 2, 3], [1, 2, 3]) == 2


def test_a_short_common_prefix_is_shared_only_where_it_is_half_of_what_could_be() -> None:
    c = PrefixCache(4)
    c.put(1, list(range(10)))
    assert c.source([0, 1, 2, 3, 50, 51, 52, 53, 54, 55]) is None  # 4 of 9: computed afresh
    assert c.source([0, 1, 2, 3, 4, 50, 51, 52, 53, 54]) == Source(1, list(range(10)), 5, take=False)  # 5 of 9
    c.put(2, list(range(100, 140)))
    long = list(range(100, 100 + FORK_MIN))
    assert c.source([*long, *[7] * 50]) == Source(2, list(range(100, 140)), FORK_MIN, take=False)  # FORK_MIN: a copy
    assert c.source([*long[:-1], *[7] * 50]) is None


def test_a_generation_in_flight_is_forked_until_it_ends() -> None:
    c = PrefixCache(4)
    prompt = list(range(40))
    c.offer(15, 5, prompt)  # generation 15 sent its prefill: session 5 will hold it by the time a fork reaches it
    assert c.source([*prompt, 1]) == Source(5, prompt, 40, take=False)  # never taken: it is in use
    c.put(6, prompt[:30])
    assert c.source([*prompt, 1]).session == 5  # the longest beginning, live or cached
    c.withdraw(15, 5)
    assert c.source([*prompt, 1]) == Source(6, prompt[:30], 30, take=True)
    assert c.source(prompt) is None and c.sizes() == {}


def test_a_generation_choosing_where_it_starts_is_waited_for_where_it_shares_more() -> None:
    ready: list[int] = []
    c = PrefixCache(4, ready=ready.append)
    header, doc = list(range(20)), list(range(100, 160))
    c.put(1, header)
    c.expect(7, [*header, *doc])  # generation 7 forks 1's header, then prefills the document
    assert c.source([*header, *doc, 5]) == Source(7, [*header, *doc], 80, take=False, wait=True)
    assert c.source([*header, *doc, 5], wait=False) == Source(1, header, 20, take=True)  # taken: out of the cache
    c.put(1, header)
    assert c.source([*header, 9, 9]) == Source(1, header, 20, take=True)  # the cache has as much: no wait
    c.offer(7, 3, [*header, *doc])  # sent its prefill, under session 3: the waiting go on, and fork 3
    assert ready == [7] and c.source([*header, *doc, 5]) == Source(3, [*header, *doc], 80, take=False)
    c.expect(8, list(range(200, 240)))
    c.withdraw(8, 8)  # ended before it sent its prefill (a prompt the stages refused): the waiting go on too
    assert ready == [7, 8] and c.source(list(range(200, 241))) is None


def test_without_room_for_a_copy_a_cached_session_is_taken_and_rewound() -> None:
    c = PrefixCache(4, room=lambda: False)  # every session slot but the cache's held by live (or kept) ones
    c.put(1, list(range(40)))
    c.offer(12, 2, list(range(50)))
    assert c.source([*range(20), 7]) == Source(1, list(range(40)), 20, take=True)  # a tie with the live 2
    assert c.source([*range(30), 7]) == Source(2, list(range(50)), 30, take=False)  # a live one holds its slot
    c.withdraw(12, 2)
    assert c.source([*range(5), *[7] * 30]) is None  # 5 of 34: less than half


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


def test_a_request_forks_the_session_with_the_longest_common_prefix(served: Served) -> None:
    (a,) = served.run(["one two three four five"])
    assert served.cached() == [[a.session]] * STAGES
    assert served.status()[0]["sessions"] == {str(a.session): 5 + 5 - 1}  # prompt + every token but the last
    (b,) = served.run(["one two three six"])
    assert (b.session, b.reused) == (b.request_id, 3)  # a copy of where the prompts agree, in a session of its own
    assert served.cached() == [[a.session, b.session]] * STAGES  # a's stays cached, whole
    assert all(r["sessions"][str(a.session)] == 9 for r in served.status())
    (fresh,) = served.run(["one two three six"], cache_prompt=False)
    assert fresh.session == fresh.request_id and fresh.reused == 0
    assert served.cached() == [[a.session, b.session]] * STAGES  # cache_prompt false: released, not left
    (same,) = served.run(["one two three six"])
    assert same.reused == 3  # an identical repeat: all but the last prompt token


def test_requests_in_flight_each_fork_a_session_of_their_own(served: Served) -> None:
    (a,) = served.run(["one two three four"])
    b, c = served.run(["one two three five", "one two three six"])
    assert [b.reused, c.reused] == [3, 3]
    assert [b.session, c.session] == [b.request_id, c.request_id]
    assert sorted(served.cached()[0]) == sorted([a.session, b.session, c.session])


def test_a_prompt_sent_while_the_same_prompt_prefills_forks_its_session(served: Served) -> None:
    prompt = " ".join(["word"] * 40)
    gens = served.run([prompt] * 3)
    # the first computes it; the others fork it, each stage serving their forks after its prefill
    assert [g.reused for g in gens] == [0, 39, 39] and len({g.session for g in gens}) == 3


def test_prompts_sent_while_the_first_forks_a_shorter_beginning_wait_for_its_prefill(served: Served) -> None:
    header = " ".join(f"h{i}" for i in range(20))
    (a,) = served.run([header])  # leaves 20 + 4 tokens cached
    doc = header + " " + " ".join(["doc"] * 40)
    first, *others = served.run([doc] * 3)
    # the first forks the cached header (each stage in turn); the others, sent meanwhile, wait until it has sent its
    # prefill and fork all of it, rather than fork the header too and compute the document each
    assert first.reused == 20 and [g.reused for g in others] == [59, 59]


def test_a_stage_that_lost_the_session_makes_the_next_request_prefill_from_zero(served: Served) -> None:
    (a,) = served.run(["one two three four"])
    p = served.service.pipeline
    served.on_thread(lambda: p._send(a.session, Call(1, "release", {}), None))  # stage 1 drops it, unknown to p
    assert str(a.session) not in served.status()[1]["sessions"] and p.cached_sessions() == {a.session: 4 + 5 - 1}
    (b,) = served.run(["one two three five"])
    assert b.reused == 0  # stage 1 copied nothing: every stage starts it afresh
    assert all(r["sessions"][str(b.session)] == 4 + 5 - 1 for r in served.status())


def test_a_cached_session_evicted_by_one_stage_is_released_on_every_stage(served: Served) -> None:
    (a,) = served.run(["one two three four"])
    p = served.service.pipeline
    # what the pipeline thread does with a stage's event (the stub itself evicts nothing)
    served.on_thread(lambda: p._on_event(p.stages[2], {"event": "session_evicted", "session": a.session,
                                                        "cached": True}))
    assert p.cached_sessions() == {}
    assert [r["sessions"] for r in served.status()] == [{}] * STAGES  # the releases went ahead of the status
