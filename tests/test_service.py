"""The pipeline service in-process (stub stages): generations submitted from another thread, the concurrency cap,
a queued generation cancelled, and every generation's end reported exactly once."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

from conftest import group_members, held_restart, until

from pp_worker.driver.pipeline import run_pipeline
from pp_worker.driver.service import PipelineService, ServedGeneration, Unavailable
from pp_worker.driver.stage_proc import Launch

PROMPTS = ["one two three", "four five", "six seven eight nine"]
PY = shlex.quote(sys.executable)


def test_submitted_generations_run_one_at_a_time_and_a_queued_one_can_be_cancelled() -> None:
    expected = run_pipeline(PROMPTS[:2], stages=2, stub=True, max_tokens=6).generations
    ended: list[ServedGeneration] = []
    all_ended = threading.Event()

    def on_end(g: ServedGeneration) -> None:
        ended.append(g)
        if len(ended) == 3:
            all_ended.set()

    service = PipelineService(Launch(2, stub=True, env={"PP_STUB_DELAY_MS": "20"}), concurrency=1, log=None)
    service.pipeline.trace = []  # (time, stage, request_id, op, send/reply), appended by the pipeline thread
    try:
        gens = [ServedGeneration(i, p, service.new_request_id(), 6, on_end=on_end) for i, p in enumerate(PROMPTS)]
        for g in gens:
            service.submit(g)
        service.cancel(gens[2].request_id)  # still queued behind the first two: it never starts
        assert all_ended.wait(30), [g.request_id for g in ended]
        assert service.load == (0, 0)
    finally:
        service.close()
    # the cancelled one ended at once; the others one at a time, in order; each exactly once
    assert [g.request_id for g in ended] == [gens[2].request_id, gens[0].request_id, gens[1].request_id]
    trace = service.pipeline.trace
    first_of_second = min(i for i, t in enumerate(trace) if t[2] == gens[1].request_id)
    last_forward_of_first = max(i for i, t in enumerate(trace) if t[2] == gens[0].request_id and t[3] != "release")
    assert last_forward_of_first < first_of_second, "concurrency 1, yet the second started before the first ended"
    assert [g.tokens for g in gens[:2]] == [g.tokens for g in expected] and not gens[0].error
    assert gens[2].error == "cancelled before it started" and gens[2].unavailable and not gens[2].prompt_tokens
    try:
        service.submit(ServedGeneration(0, "late", service.new_request_id(), 2))
        raise AssertionError("a closed service took a generation")
    except Unavailable as e:
        assert "shutting down" in str(e)


def test_close_during_a_restart_stops_the_stages_being_started(tmp_path, started_processes) -> None:
    """A stage dies, and the restart's stages never become ready: closing the service (pp-serve's
    SIGTERM) must not wait out --load-timeout, and must stop them too."""
    started = started_processes
    mark = f"{tmp_path}/{{stage}}"  # the second start of each stage echoes its stdin and never says ready
    once = f"sh -c 'test -e {mark} && exec cat; touch {mark}; exec {PY} -m pp_worker'"
    service = PipelineService(Launch(2, stub=True, launcher=once), concurrency=1, log=None, restarts=1, backoff_s=0)
    try:
        os.kill(started[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(started) < 4:  # the restart has started its two stages
            assert time.monotonic() < deadline and not service.failure, "no restart"
            time.sleep(0.05)
        assert service.status == "recovering"
        service.close(timeout=20)
        assert not service._thread.is_alive(), "close waited for the restart's stages to load"
        assert all(p.returncode is not None and not group_members(p.pid) for p in started), "a stage left running"
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _collect(n: int) -> tuple[list[ServedGeneration], threading.Event, Any]:
    """(the generations ended, in order; an event set at the n-th; the on_end that records them)"""
    ended: list[ServedGeneration] = []
    done = threading.Event()

    def on_end(g: ServedGeneration) -> None:
        ended.append(g)
        if len(ended) == n:
            done.set()

    return ended, done, on_end


def test_nothing_accepted_is_lost_with_a_stage(tmp_path, started_processes) -> None:
    """Stage 1 is stopped, then killed, while one generation decodes, a second's prompt waits on it and three are
    queued; the restart is held until one queued is cancelled. On the new stages the first goes on from its last
    token, the second starts again, the queue runs in order: every end reported once and in order, the cancelled
    one never started, what started again and what was queued as without a failure. (The stub's outputs are a
    hash of each call's inputs, so a prefill differs from the steps it replaces: test_driver_real checks that the
    tokens after going on are the model's own.)"""
    started = started_processes
    held, go = held_restart(tmp_path)  # the restart's stages wait for `go`: the service is held in its recovery
    expected = run_pipeline(PROMPTS, stages=2, stub=True, max_tokens=300).generations
    first = len(started)  # run_pipeline's stages came before
    ended, done, on_end = _collect(5)
    service = PipelineService(Launch(2, stub=True, launcher=held, env={"PP_STUB_DELAY_MS": "2"}), concurrency=2,
                              log=None, restarts=1, backoff_s=0)
    service.pipeline.trace = []
    trace = service.pipeline.trace
    try:
        gens = [ServedGeneration(i, p, service.new_request_id(), 300, on_end=on_end)
                for i, p in enumerate([PROMPTS[2], *PROMPTS, PROMPTS[1]])]
        decoding, in_prompt, queued = gens[0], gens[1], gens[2:]
        service.submit(decoding)
        assert until(lambda: decoding.tokens, 30), "the first generation never got a token"
        os.kill(started[first + 1].pid, signal.SIGSTOP)  # from here stage 1 answers nothing: no new token
        for g in gens[1:]:
            service.submit(g)
        assert until(lambda: any(t[1:] == (1, in_prompt.request_id, "forward_and_sample", "send") for t in trace),
                     30), "the second prompt never reached stage 1"
        assert not in_prompt.tokens and len(decoding.tokens) < 300
        os.kill(started[first + 1].pid, signal.SIGKILL)
        assert until(lambda: len(started) == first + 4 and service.status == "recovering", 30), "no restart"
        assert service.load == (0, 5)
        service.cancel(queued[-1].request_id)
        go.touch()
        assert done.wait(60), [g.request_id for g in ended]
    finally:
        service.close()
    assert [g.request_id for g in ended] == [queued[-1].request_id, *[g.request_id for g in gens[:-1]]]
    assert ended[0].error == "cancelled before it started" and not ended[0].prompt_tokens
    assert not any(g.error for g in ended[1:]) and not any(g.ended for g in gens[:2])  # the first tries: no end
    assert [g.again_of for g in ended[1:]] == [1, 1, 0, 0]
    assert [(g.tokens, g.text) for g in ended[2:]] == [(g.tokens, g.text) for g in expected]
    went_on = ended[1]
    assert went_on.tokens[:len(decoding.tokens)] == decoding.tokens and len(went_on.tokens) == 300
    assert went_on.t_start == decoding.t_start and went_on.t_first == decoding.t_first


def test_what_waits_ends_with_the_failure_when_no_restart_comes(started_processes) -> None:
    """With no restart left, what was running and what waited end too (503), naming the failure: none waits for
    ever."""
    started = started_processes
    ended, done, on_end = _collect(3)
    service = PipelineService(Launch(2, stub=True, env={"PP_STUB_DELAY_MS": "20"}), concurrency=1, log=None)
    try:
        gens = [ServedGeneration(i, p, service.new_request_id(), 400 if i == 0 else 6, on_end=on_end)
                for i, p in enumerate(PROMPTS)]
        for g in gens:
            service.submit(g)
        assert until(lambda: gens[0].tokens, 30), "the first generation never got a token"
        os.kill(started[0].pid, signal.SIGKILL)
        assert done.wait(30)
    finally:
        service.close()
    assert service.failure and all(g.unavailable and "stage 0" in g.error for g in ended), [g.error for g in ended]
    assert sorted(g.request_id for g in ended) == [g.request_id for g in gens] and not ended[-1].prompt_tokens


def test_what_cannot_go_on_after_a_failure() -> None:
    """A generation goes on on new stages unless it is over, was asked to stop, went on once before, or has tokens
    under a grammar (the new stages' matcher would start over)."""
    def gen(**fields: Any) -> ServedGeneration:
        g = ServedGeneration(0, "p", 1, 8, grammar=fields.pop("grammar", None))
        for name, value in fields.items():
            setattr(g, name, value)
        return g

    assert gen().can_go_on and gen(tokens=[3]).can_go_on and gen(grammar={"type": "json_object"}).can_go_on
    assert not gen(tokens=[3], grammar={"type": "json_object"}).can_go_on
    assert not gen(stop_requested=True).can_go_on and not gen(ended=True).can_go_on
    assert not gen(tokens=[3]).again().can_go_on and not gen().again().can_go_on
    g = gen(prompt_tokens=[1, 2], tokens=[3, 4], t_start=5.0)
    assert (g.again().prompt_tokens, g.again().tokens, g.again().t_start) == ([1, 2], [3, 4], 5.0)
    assert (gen(prompt_tokens=[1, 2]).again().prompt_tokens, gen(t_start=5.0).again().t_start) == ([], 5.0)


def test_a_prompt_that_brings_a_stage_down_is_tried_again_once_only(tmp_path, started_processes) -> None:
    """Stage 0 dies whenever it reads a poisoned prompt: the request starts again once on the new stages, then
    ends with the failure instead of taking every restart with it, and the service serves the next request."""
    poison = "POISONED"
    # every stage behind a shell that kills its process group on reading the marker (only stage 0 reads prompts)
    launcher = (f"sh -c 'while IFS= read -r l; do case \"$l\" in *{poison}*) kill -9 0;; esac; "
                f"printf \"%s\\n\" \"$l\"; done | {PY} -m pp_worker'")
    ended: list[ServedGeneration] = []
    done = threading.Event()
    service = PipelineService(Launch(2, stub=True, launcher=launcher), concurrency=2, log=None, restarts=3,
                              backoff_s=0)
    try:
        bad = ServedGeneration(0, f"a {poison} prompt", service.new_request_id(), 4,
                               on_end=lambda g: (ended.append(g), done.set()))
        service.submit(bad)
        assert done.wait(60)
        # the third set of stages, ready
        assert until(lambda: service.status == "ok" or service.failure, 60) and not service.failure, service.status
        good = ServedGeneration(1, PROMPTS[0], service.new_request_id(), 4,
                                on_end=lambda g: (ended.append(g), done.set()))
        done.clear()
        service.submit(good)
        assert done.wait(60)
    finally:
        service.close()
    assert len(ended) == 2 and ended[0].again_of == 1 and ended[0].unavailable
    assert ended[0].error.startswith("the pipeline failed: stage 0"), ended[0].error
    assert service.restarted == 2 and not ended[1].error and len(ended[1].tokens) == 4


def test_a_generation_asked_to_stop_keeps_its_text_when_a_stage_dies(started_processes) -> None:
    """pp-serve's stop string found in the streamed text (the generation asked to stop), then the last stage dies
    before the generation's last reply: it ends as stopped with the text streamed so far, not with the failure's
    503; the one beside it, not asked to stop, ends with the failure (no restart here)."""
    started = started_processes
    ended, done, on_end = _collect(2)

    def on_text(g: ServedGeneration, text: str, finished: bool) -> None:
        if text and not finished and not g.stop_requested:
            g.stop_requested = True  # as pp-serve's Feed does on finding a stop string
            os.kill(started[1].pid, signal.SIGKILL)

    service = PipelineService(Launch(2, stub=True, env={"PP_STUB_DELAY_MS": "20"}), concurrency=2, log=None)
    try:
        stopped = ServedGeneration(0, PROMPTS[0], service.new_request_id(), 400, on_text=on_text, on_end=on_end)
        other = ServedGeneration(1, PROMPTS[1], service.new_request_id(), 400, on_end=on_end)
        service.submit(other)
        service.submit(stopped)
        assert done.wait(30), [g.request_id for g in ended]
    finally:
        service.close()
    assert ended[0] is stopped and not stopped.error and stopped.stop_reason == "stop" and stopped.tokens
    assert stopped.text and stopped.text == stopped._streamed
    assert service.failure and ended[1].prompt == other.prompt and ended[1].unavailable  # `other` went on, then
    assert "stage 1" in ended[1].error, ended[1].error  # ended with the failure: no restart came
