"""KV in pages (engines.kvcache, engines.sessions, engines.pool) on real stages: pages grow with a session and come
back on release to be reused; sessions across several pages, their pages scattered through the pool, give the
float64 reference's tokens on 2 and 3 stages; interleaved sessions never see each other's keys (interleaved ==
solo, bit for bit); the cap evicts the least recently used session; a step that finds no page is refused with the
numbers and harms no other session; a cap too small for one session is an error at startup."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pp_worker.testing.chain import Chain, step_batch
from pp_worker.testing.devmem import device_memory
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.engines.base import EngineError
from pp_worker.worker.engines.pool import PoolError
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

PAGE = 128  # the smallest page the C kernel takes: the tiny model's 512 positions are 4 pages
CONTEXT = 512
ATOL_FP64 = 3e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("pages") / "tiny.gguf", "tiny", seed=11)


@pytest.fixture(scope="module")
def ref(model: Path) -> RefModel:
    return RefModel.from_gguf(model)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def pages_of(engine: TinygradEngine) -> tuple[int, int, int]:
    d = engine.describe()
    return d["kv_pages_used"], d["kv_pages_free"], d["kv_pages_touched"]


@pytest.mark.parametrize("stages", [2, 3])
def test_sessions_across_pages_give_the_reference_tokens(model, ref, stages):
    chain = Chain(model, stages, CONTEXT, kv_page=PAGE)
    chain.step(91, [7], 0)  # fillers first, so the session's pages are not the pool's first ones in order
    chain.step(92, prompt(200, 2), 0)  # 2 pages
    chain.step(93, [8], 0)
    chain.release(91)
    chain.release(93)  # the last page given back is the next one out: the session's pages are out of order
    p = prompt(300, 1)  # 3 pages, then decode
    tokens, logits = chain.generate(0, p, 8)
    want = ref.logits(p + tokens[:-1])[len(p) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=ATOL_FP64)
    assert tokens == [int(row.argmax()) for row in want]
    held = chain.engines[-1]._sessions._live[0].pages
    assert len(held) == 3 and held != sorted(held), held


def test_pages_grow_come_back_on_release_and_are_reused(model):
    chain = Chain(model, 2, CONTEXT, kv_page=PAGE, every_size=False)
    last = chain.engines[-1]
    n_pages = last.describe()["kv_bytes"] // last.describe()["kv_page_bytes"]
    p = prompt(126, 3)
    chain.step(1, p, 0)
    assert pages_of(last) == (1, n_pages - 1, 1)
    chain.step(1, [4], 126)
    assert pages_of(last)[0] == 1  # position 126: the first page still
    chain.step(1, [4], 127)
    chain.step(1, [4], 128)  # position 128 opens the second
    assert pages_of(last) == (2, n_pages - 2, 2)
    chain.release(1)
    assert pages_of(last) == (0, n_pages, 2)
    chain.step(2, p + [4, 4, 4], 0)  # two pages again: the two it gave back, no new one touched
    assert pages_of(last) == (2, n_pages - 2, 2)


def test_interleaved_sessions_equal_solo(model):
    chain = Chain(model, 2, CONTEXT, kv_page=PAGE, every_size=False)
    prompts = {1: prompt(140, 4), 2: prompt(9, 5)}

    def run(rids: list[int]) -> dict[int, list[np.ndarray]]:
        """Each of ``rids`` prefilled, then 4 greedy tokens each, the sessions' steps taken in turn."""
        logits = {rid: [chain.step(rid, prompts[rid], 0)] for rid in rids}
        for i in range(4):
            for rid in rids:
                token = int(logits[rid][-1].argmax())
                logits[rid].append(chain.step(rid, [token], len(prompts[rid]) + i))
        for rid in rids:
            chain.release(rid)
        return logits

    solo = {**run([1]), **run([2])}
    together = run([1, 2])
    for rid in (1, 2):
        for a, b in zip(solo[rid], together[rid], strict=True):
            assert np.array_equal(a, b)  # the same kernels on the same keys: bit for bit


def test_the_cap_evicts_the_least_recently_used_session(model, ref):
    events: list[tuple[str, dict]] = []
    page_bytes = TinygradEngine(str(model), 0, 2, max_context=CONTEXT, kv_page=PAGE).describe()["kv_page_bytes"]
    chain = Chain(model, 2, CONTEXT, kv_page=PAGE, kv_bytes=4 * page_bytes, every_size=False,
                  emit=lambda kind, **f: events.append((kind, f)))
    assert [e.describe()["kv_pages_free"] for e in chain.engines] == [4, 4]
    a, b = prompt(200, 6), prompt(100, 7)
    chain.step(1, a, 0)  # 2 pages
    chain.step(2, b, 0)  # 1 page
    la = chain.step(1, [9], 200)  # 1 is the most recent again
    chain.step(3, prompt(150, 8), 0)  # needs 2: only one is free, so 2 goes
    assert chain.engines[0].sessions().keys() == {1, 3}
    evicted = [f for kind, f in events if kind == "session_evicted"]
    assert evicted == [{"session": 2, "positions": 100, "max_sessions": 8, "reason": "kv_pages",
                        "cached": False}] * 2  # each stage
    with pytest.raises(EngineError, match="session 2 was evicted"):
        chain.step(2, [9], 100)
    np.testing.assert_allclose(la, ref.logits(a + [9])[-1], rtol=0, atol=ATOL_FP64)
    np.testing.assert_allclose(chain.step(1, [9], 201), ref.logits(a + [9, 9])[-1], rtol=0, atol=ATOL_FP64)


def test_a_step_without_a_page_is_refused_and_harms_no_other_session(model, ref):
    first = TinygradEngine(str(model), 0, 2, max_context=CONTEXT, kv_page=PAGE)
    page_bytes = first.describe()["kv_page_bytes"]
    chain = Chain(model, 2, 2 * PAGE, kv_page=PAGE, kv_bytes=2 * page_bytes, max_batch=2, every_size=False)
    a, b = prompt(128, 9), prompt(128, 10)  # each fills one page: the pool's two are taken
    la, lb = chain.step(1, a, 0), chain.step(2, b, 0)
    h = chain.engines[0]
    with pytest.raises(EngineError, match=r"session 1 needs 1 more page\(s\) of 128 positions .* the pool has 2 pages "
                       r".* 0 free, 1 held by this session, 1 by the others of this step, 0 by sessions it may evict"):
        step_batch(h, [1, 2], [128, 128], [int(la.argmax()), int(lb.argmax())])  # a batch of both at a new page
    assert h.sessions() == {1: 128, 2: 128} and h.describe()["kv_pages_free"] == 0
    for rid, p, logits in ((1, a, la), (2, b, lb)):  # both go on, each on its own keys, one page left each
        np.testing.assert_allclose(logits, ref.logits(p)[-1], rtol=0, atol=ATOL_FP64)
        chain.step(rid, [5], 127)  # a rewind to its page's last position still fits
        np.testing.assert_allclose(chain.step(rid, [6], 127), ref.logits(p[:127] + [6])[-1], rtol=0, atol=ATOL_FP64)


def test_the_context_is_the_models_own_up_to_what_the_pool_holds(model):
    e = TinygradEngine(str(model), 1, 2, kv_page=PAGE)
    assert e.info.max_context == CONTEXT  # the tiny model's own context_length
    page_bytes = e.describe()["kv_page_bytes"]
    small = TinygradEngine(str(model), 1, 2, kv_page=PAGE, kv_bytes=3 * page_bytes)
    assert small.info.max_context == 3 * PAGE  # lowered to what the pool holds
    with pytest.raises(PoolError, match=rf"holds {3 * PAGE} positions .* less than one session at max_context 512"):
        TinygradEngine(str(model), 1, 2, max_context=CONTEXT, kv_page=PAGE, kv_bytes=3 * page_bytes)
    with pytest.raises(PoolError, match=rf"a KV pool of {page_bytes - 1} bytes \(PP_KV_BYTES\) holds no page"):
        TinygradEngine(str(model), 1, 2, kv_page=PAGE, kv_bytes=page_bytes - 1)


def _forked_equals_computed(chain: Chain) -> None:
    """Session 3, forked from session 1's first 200 positions after 1 went on past them with other tokens (into
    the page the fork copies last), then prefilled and decoded on its own, gives session 2's logits bit for bit:
    2 computed the same 200 positions itself. A fork of all 260 of 1's positions answers as 1 did, after 1 was
    released and a session took its pages and wrote over them. The chain compiles every prefill size at its first use
    (Chain's default): where a size is used only once it pays (timed), or once another process left it on disk, two
    prefills of the same rows could run in different calls and round apart."""
    p, other = prompt(260, 12), prompt(60, 13)
    chain.step(1, p[:200], 0)
    chain.step(1, other, 200)
    assert chain.fork(3, 1, 200) == [200] * len(chain.engines)
    assert chain.fork(4, 1, 400) == [260] * len(chain.engines)  # no more than the source holds
    assert chain.fork(5, 77, 10) == [0] * len(chain.engines)  # an unknown source: nothing made
    assert all(e.sessions() == {1: 260, 3: 200, 4: 260} for e in chain.engines)
    one = chain.step(1, [9], 260)
    chain.release(1)
    chain.step(6, prompt(300, 14), 0)  # 1's pages, rewritten
    want = [chain.step(2, p[:200], 0), chain.step(2, p[200:], 200)]
    assert chain.fork(7, 2, 100) == [100] * len(chain.engines)  # another fork changes nothing for 2 nor 3
    got = [chain.step(3, p[200:], 200)]
    for i in range(4):
        token = int(want[-1].argmax())
        want.append(chain.step(2, [token], 260 + i))
        got.append(chain.step(3, [token], 260 + i))
    assert all(np.array_equal(a, b) for a, b in zip(want[1:], got, strict=True))
    assert np.array_equal(chain.step(4, [9], 260), one)  # 4's copy of all 260 positions outlived 1's pages


@pytest.mark.parametrize("kernels", ["c", "tinygrad"])
def test_a_fork_holds_the_sources_keys(model, kernels):
    _forked_equals_computed(Chain(model, 2, CONTEXT, kv_page=PAGE, kernels=kernels))


def test_a_fork_copies_device_memory_through_the_host(model):
    with device_memory():
        _forked_equals_computed(Chain(model, 2, CONTEXT, kv_page=PAGE))
