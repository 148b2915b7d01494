"""The pipeline service in-process (stub stages): generations submitted from another thread, the concurrency cap,
a queued generation cancelled, and every generation's end reported exactly once."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time

from conftest import group_members, held_restart

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


def test_queued_generations_outlive_a_stage_failure_and_run_on_the_new_stages(tmp_path, started_processes) -> None:
    """A stage dies while one generation runs and two wait: the running one ends with the failure (503); the queued
    ones never touched the dead stages, so they wait for the restart and run there (one cancelled meanwhile ends
    as cancelled, never started), with the tokens they get without any failure."""
    started = started_processes
    held, go = held_restart(tmp_path)  # the restart's stages wait for `go`: the service is held in its recovery
    expected = run_pipeline(PROMPTS[:2], stages=2, stub=True, max_tokens=6).generations
    ended: list[ServedGeneration] = []
    all_ended = threading.Event()

    def on_end(g: ServedGeneration) -> None:
        ended.append(g)
        if len(ended) == 4:
            all_ended.set()

    first = len(started)  # run_pipeline's stages came before
    service = PipelineService(Launch(2, stub=True, launcher=held, env={"PP_STUB_DELAY_MS": "20"}), concurrency=1,
                              log=None, restarts=1, backoff_s=0)
    try:
        running = ServedGeneration(3, PROMPTS[2], service.new_request_id(), 400, on_end=on_end)  # ~16 s of steps
        queued = [ServedGeneration(i, p, service.new_request_id(), 6, on_end=on_end) for i, p in enumerate(PROMPTS)]
        for g in [running, *queued]:
            service.submit(g)
        deadline = time.monotonic() + 30
        while not running.tokens:  # past its prompt: a failure ends it
            assert time.monotonic() < deadline, "the first generation never got a token"
            time.sleep(0.02)
        os.kill(started[first + 1].pid, signal.SIGKILL)
        while len(started) < first + 4:  # the restart's stages are started (and held)
            assert time.monotonic() < deadline and not service.failure, "no restart"
            time.sleep(0.02)
        assert service.status == "recovering" and service.load == (0, 3)
        service.cancel(queued[2].request_id)
        go.touch()
        assert all_ended.wait(60), [g.request_id for g in ended]
    finally:
        service.close()
    assert running.error.startswith("the pipeline failed: stage 1") and running.unavailable
    assert [g.request_id for g in ended] == [running.request_id, queued[2].request_id, queued[0].request_id,
                                             queued[1].request_id]
    assert queued[2].error == "cancelled before it started" and not queued[2].prompt_tokens
    assert not queued[0].error and not queued[1].error
    assert [g.tokens for g in queued[:2]] == [g.tokens for g in expected]


def test_queued_generations_end_with_the_failure_when_no_restart_comes(started_processes) -> None:
    """With no restart left, what waited ends too (503), naming the failure: none waits for ever."""
    started = started_processes
    ended: list[ServedGeneration] = []
    done = threading.Event()
    service = PipelineService(Launch(2, stub=True, env={"PP_STUB_DELAY_MS": "20"}), concurrency=1, log=None)
    try:
        gens = [ServedGeneration(i, p, service.new_request_id(), 400 if i == 0 else 6,
                                 on_end=lambda g: (ended.append(g), len(ended) == 3 and done.set()))
                for i, p in enumerate(PROMPTS)]
        for g in gens:
            service.submit(g)
        deadline = time.monotonic() + 30
        while not gens[0].tokens:
            assert time.monotonic() < deadline, "the first generation never got a token"
            time.sleep(0.02)
        os.kill(started[0].pid, signal.SIGKILL)
        assert done.wait(30)
    finally:
        service.close()
    assert service.failure and all(g.unavailable and "stage 0" in g.error for g in gens), [g.error for g in gens]
    assert sorted(g.request_id for g in ended) == [g.request_id for g in gens] and not gens[1].prompt_tokens


def test_a_generation_still_in_its_prompt_starts_again_on_the_new_stages(started_processes) -> None:
    """Stage 1 is stopped, then killed, while one generation has tokens and another's prompt waits on it: the first
    ends with the failure, the second (nothing of it handed on) runs from its start on the new stages, with the
    tokens it gets without any failure, its end reported once."""
    started = started_processes
    expected = run_pipeline(PROMPTS[1:2], stages=2, stub=True, max_tokens=6).generations[0]
    first = len(started)
    ended: list[ServedGeneration] = []
    done = threading.Event()
    service = PipelineService(Launch(2, stub=True, env={"PP_STUB_DELAY_MS": "20"}), concurrency=2, log=None,
                              restarts=1, backoff_s=0)
    service.pipeline.trace = []
    trace = service.pipeline.trace
    try:
        on_end = lambda g: (ended.append(g), len(ended) == 2 and done.set())  # noqa: E731
        running = ServedGeneration(0, PROMPTS[0], service.new_request_id(), 400, on_end=on_end)
        prompt = ServedGeneration(1, PROMPTS[1], service.new_request_id(), 6, on_end=on_end)
        service.submit(running)
        deadline = time.monotonic() + 30
        while not running.tokens:
            assert time.monotonic() < deadline, "the first generation never got a token"
            time.sleep(0.02)
        os.kill(started[first + 1].pid, signal.SIGSTOP)  # from here stage 1 answers nothing: no new token
        service.submit(prompt)
        while not any(t[1:] == (1, prompt.request_id, "forward_and_sample", "send") for t in trace):
            assert time.monotonic() < deadline, "the second prompt never reached stage 1"
            time.sleep(0.02)
        assert not prompt.tokens
        os.kill(started[first + 1].pid, signal.SIGKILL)
        assert done.wait(60), [g.request_id for g in ended]
    finally:
        service.close()
    assert running.error.startswith("the pipeline failed: stage 1") and running.unavailable
    again = ended[1]
    assert [g.request_id for g in ended] == [running.request_id, prompt.request_id] and again is not prompt
    assert not again.error and again.tokens == expected.tokens and again.text == expected.text
    assert not prompt.ended  # the first try never reports an end: the request gets one answer


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
        deadline = time.monotonic() + 60
        while service.status != "ok":  # the third set of stages, ready
            assert time.monotonic() < deadline and not service.failure, service.status
            time.sleep(0.05)
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
