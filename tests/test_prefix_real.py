"""Prefix reuse in pp-serve, real mode (tinygrad stages on the embedded model): greedy answers are the same with
reuse as without (``cache_prompt: false`` prefills everything) for a multi-turn chat, an identical repeat, prompts
sharing part of a prefix and prompts shorter than a cached one, in exact and int8 numerics, and n choices of one
prompt (computed once); live requests evict
cached sessions (max_sessions, and a KV pool of few pages) and never fail; /slots needs the key; a killed stage's
cache goes with it and the next request just prefills."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REPO
from serving import Server

from pp_worker.testing import modelgen

ZEN = REPO / "pp_worker" / "data" / "zen.gguf"
KEY = "prefix-test-key"
ZEN_TEXT = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
            "Complex is better than complicated. Flat is better than nested. Sparse is better than dense.")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Exact numerics (the suite's PP_EXACT=1), two sessions a stage: the cache is under pressure at once."""
    s = Server(["--stages", "2", "--model", str(ZEN), "--restart-backoff", "0.5", "--api-key", KEY],
               env={"PP_MAX_SESSIONS": "2"}, key=KEY, ready_timeout=300)
    yield s
    s.stop()


TINY = modelgen.PRESETS["tiny"][0]
# a KV page of a tiny model's stage: 256 positions of K and V in float16 for each of its 2 blocks (status kv_page_bytes)
TINY_PAGE_BYTES = 256 * (TINY.n_layers // 2) * 2 * TINY.n_kv_heads * TINY.head_dim * 2


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The integer path (the workers' default) on a Q8_0 file (the embedded model is F16, whose products run in float
    whatever the numerics), and a KV pool of 3 pages: cached sessions make room."""
    model = modelgen.generate(tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf", "tiny", dtype="Q8_0")
    s = Server(["--stages", "2", "--model", str(model), "--max-context", "256",
                "--kv-memory", str(3 * TINY_PAGE_BYTES)], env={"PP_EXACT": "0"}, ready_timeout=300)
    stages = s.get("/stages")["stages"]
    assert [(st["kv_pages_free"] + st["kv_pages_used"], st["numerics"]) for st in stages] == [(3, "int8")] * 2
    yield s
    s.stop()


def _reuse(s: Server, kind: str, cache_prompt: bool = True, **ask: Any) -> tuple[str, int]:
    """A greedy answer's text and how many prompt tokens its session already held."""
    text, cached, _ = _answer(s, kind, cache_prompt, **ask)
    return text, cached


def _answer(s: Server, kind: str, cache_prompt: bool = True, **ask: Any) -> tuple[str, int, int]:
    """A greedy answer's text, how many prompt tokens its session already held, and the prompt's tokens."""
    client = s.client()
    extra = {"extra_body": {"cache_prompt": False}} if not cache_prompt else {}
    if kind == "chat":
        r = client.chat.completions.create(model="zen", temperature=0, max_tokens=10, **extra, **ask)
        text = r.choices[0].message.content or ""
    else:
        r = client.completions.create(model="zen", temperature=0, max_tokens=10, **extra, **ask)
        text = r.choices[0].text
    return text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def _same_with_and_without(s: Server, kind: str, **ask: Any) -> int:
    """The answer with reuse equals the answer prefilled whole; the tokens reused."""
    whole, none = _reuse(s, kind, cache_prompt=False, **ask)
    reused_text, reused = _reuse(s, kind, **ask)
    assert none == 0 and reused_text == whole and whole, (reused_text, whole)
    return reused


def _chat(s: Server) -> None:
    messages = [{"role": "system", "content": ZEN_TEXT}, {"role": "user", "content": "Beautiful is"}]
    for turn in range(3):
        reused = _same_with_and_without(s, "chat", messages=messages)
        if turn:  # the conversation so far is in the previous turn's session
            assert reused > 50, (turn, reused)
        answer, _ = _reuse(s, "chat", messages=messages)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Explicit {turn}"}]


def _prompts(s: Server) -> None:
    _reuse(s, "text", prompt=ZEN_TEXT)
    repeat = _same_with_and_without(s, "text", prompt=ZEN_TEXT)
    assert repeat == _answer(s, "text", prompt=ZEN_TEXT)[2] - 1  # an identical repeat: all but the last token
    half = ZEN_TEXT[:len(ZEN_TEXT) // 2]
    assert 0 < _same_with_and_without(s, "text", prompt=half + " Now is better than never.") < repeat
    assert 0 < _same_with_and_without(s, "text", prompt=half) < repeat  # shorter than what the session holds


def test_a_chat_answers_the_same_with_reuse_as_without(server: Server) -> None:
    _chat(server)


def test_repeats_partial_prefixes_and_shorter_prompts_answer_the_same(server: Server) -> None:
    _prompts(server)


def test_int8_answers_the_same_with_reuse_as_without(int8_server: Server) -> None:
    _chat(int8_server)
    _prompts(int8_server)


def test_cache_prompt_false_prefills_everything_and_the_metrics_count_reuse(server: Server) -> None:
    before = server.metrics()[("pp_serve_prompt_tokens_reused_total", ())]
    _reuse(server, "text", prompt=ZEN_TEXT)
    _, none = _reuse(server, "text", cache_prompt=False, prompt=ZEN_TEXT)
    _, reused = _reuse(server, "text", prompt=ZEN_TEXT)
    m = server.metrics()
    assert none == 0 and reused > 0 and m[("pp_serve_prompt_tokens_reused_total", ())] >= before + reused
    assert 1 <= m[("pp_serve_cached_sessions", ())] <= 2
    for st in "01":
        assert 1 <= m[("pp_serve_stage_kv_cached_sessions", (("stage", st),))] <= 2
        assert 1 <= m[("pp_serve_stage_kv_cached_pages", (("stage", st),))] <= m[
            ("pp_serve_stage_kv_pages_used", (("stage", st),))]


def test_n_choices_compute_their_prompt_once_and_answer_as_the_prompt_alone(server: Server) -> None:
    """Greedy choices of one request are each the answer the prompt gets alone; the second copies the first's KV
    (it forks the first's session while that one prefills) instead of computing the prompt again."""
    prompt = "Now is better than never. Although never is often better than right now. If the implementation"
    whole, _ = _reuse(server, "text", cache_prompt=False, prompt=prompt)
    before = server.metrics()[("pp_serve_prompt_tokens_reused_total", ())]
    r = server.client().completions.create(model="zen", temperature=0, max_tokens=10, prompt=prompt, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, whole), (1, whole)] and whole
    reused = server.metrics()[("pp_serve_prompt_tokens_reused_total", ())] - before
    assert reused == r.usage.prompt_tokens_details.cached_tokens + r.usage.prompt_tokens - 1


def test_llama_servers_completion_reuses_and_counts_what_it_reused(server: Server) -> None:
    """/completion takes cache_prompt as /v1/completions does; tokens_cached and timings' cache_n say what was reused,
    prompt_n what was computed, and the answer is the same either way."""
    def complete(cache_prompt: bool) -> dict[str, Any]:
        body = {"prompt": ZEN_TEXT, "n_predict": 8, "cache_prompt": cache_prompt}
        status, reply = server.request("/completion", json.dumps(body).encode())
        assert status == 200, reply
        return reply
    cold, _, warm = complete(False), complete(True), complete(True)
    reused = warm["tokens_cached"]
    assert cold["tokens_cached"] == cold["timings"]["cache_n"] == 0 < reused == warm["timings"]["cache_n"]
    assert warm["timings"]["prompt_n"] + reused == warm["tokens_evaluated"] == cold["timings"]["prompt_n"]
    assert warm["content"] == cold["content"]


def test_slots_need_the_key_and_show_the_cached_sessions(server: Server) -> None:
    _reuse(server, "text", prompt=ZEN_TEXT)
    status, body = server.request("/slots", headers={"Authorization": ""})
    assert status == 401, body
    slots = server.get("/slots")
    cached = [sl for sl in slots if not sl["is_processing"]]
    assert {sl["id"] for sl in cached} == set(server.cached()[0]) == set(server.cached()[1]) and cached
    assert all(sl["n_prompt_tokens"] > 0 and sl["n_ctx"] > 0 and sl["id_task"] == -1 for sl in cached)


def _solo_answers(s: Server, prompts: list[str]) -> list[str]:
    return [_reuse(s, "text", cache_prompt=False, prompt=p)[0] for p in prompts]


def _together(s: Server, prompts: list[str]) -> list[str]:
    out: dict[int, str] = {}

    def one(i: int) -> None:
        out[i] = _reuse(s, "text", prompt=prompts[i])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return [out.get(i, "") for i in range(len(prompts))]


def _live_requests_evict_cached_sessions(s: Server, cached_before: list[str], fresh: list[str]) -> None:
    """Sessions are cached for ``cached_before``; ``fresh`` (no common prefix) then run at once: every stage must
    evict cached sessions to hold them, and every answer equals its solo run."""
    solo = _solo_answers(s, fresh)
    for p in cached_before:
        _reuse(s, "text", prompt=p)
    old = {sl["id"] for sl in s.get("/slots")}
    assert _together(s, fresh) == solo and all(solo)
    assert len(old & {sl["id"] for sl in s.get("/slots")}) <= len(old) - len(fresh)  # one evicted per request
    assert "session_evicted" not in s.stderr  # the driver logs a live session's eviction; none happened
    assert s.get("/health")["status"] == "ok"


CACHED = [ZEN_TEXT, "Errors should never pass silently.", "Unless explicitly silenced."]
FRESH = ["Now is better than never.", "Namespaces are one honking great idea"]


def test_live_requests_evict_cached_sessions_and_never_fail(server: Server) -> None:
    _live_requests_evict_cached_sessions(server, CACHED, FRESH)  # two sessions a stage: both cached ones go


def test_a_kv_pool_short_of_pages_evicts_cached_sessions_first(int8_server: Server) -> None:
    _live_requests_evict_cached_sessions(int8_server, CACHED, FRESH)  # 3 pages, held by 3 cached sessions


def test_a_killed_stage_takes_its_cache_along_and_the_next_request_prefills(server: Server) -> None:
    answer, _ = _reuse(server, "text", prompt=ZEN_TEXT)
    assert server.cached()[1]
    os.kill(server.stage_pids()[1], signal.SIGKILL)
    server.wait_for("the pipeline restarted", lambda: "pipeline restarted" in server.stderr, timeout=300)
    server.wait_for("serving again", lambda: server.request("/health")[1]["status"] == "ok", timeout=60)
    assert server.get("/slots") == [] and server.cached() == [[], []]
    assert _reuse(server, "text", prompt=ZEN_TEXT) == (answer, 0)
