"""The pipeline service in-process (stub stages): generations submitted from another thread, the concurrency cap,
a queued generation cancelled, and every generation's end reported exactly once."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time

from conftest import group_members

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
