"""PP_WARMUP=background (pp-serve's default): a stage that has only its decode forward runs prefills and batches in
the sizes it has (no request waits on a compile), a child process compiles the rest into the compiled-forward
cache, and the stage then restores each size from there at its next use, with the outputs a stage that compiled
everything before its ready line gives, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import gone
from test_real_process import spawn_real

from pp_worker.testing.chain import Chain, step_batch, wire_rows
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cpu import graph as cpu_graph

PROMPT = list(range(40, 77))  # 37 tokens: 32 + 4 + 1 on a stage that has every size


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("background") / "tiny.gguf", "tiny", seed=6)


def test_a_stage_without_its_other_sizes_runs_what_it_has(model):
    chain = Chain(model, 2, 128, max_batch=4, every_size=False)
    for e in chain.engines:
        e._stage.on_demand = False  # what defer_compiles sets: use only what is compiled or on disk
    ref = RefModel.from_gguf(model)
    logits = chain.step(1, PROMPT, 0)
    np.testing.assert_allclose(logits, ref.logits(PROMPT)[-1], rtol=0, atol=3e-2)
    for rid, p in ((2, [7, 8]), (3, [9])):
        chain.step(rid, p, 0)
    first, last = chain.engines
    sessions, positions, tokens = [1, 2, 3], [37, 2, 1], [5, 6, 7]
    hidden = step_batch(first, sessions, positions, tokens)
    out = step_batch(last, sessions, positions, wire_rows(first, hidden))
    for got, prompt in zip(out, (PROMPT + [5], [7, 8, 6], [9, 7]), strict=True):
        np.testing.assert_allclose(got, ref.logits(prompt)[-1], rtol=0, atol=3e-2)
    for e in chain.engines:  # the decode JIT ran everything: no other size compiled, no request waited on one
        assert e.describe()["jits_compiled"] == 1, e.describe()


@pytest.mark.skipif(not cpu_graph.supported(), reason="the cache keeps native tables (x86-64 Linux)")
def test_a_background_compile_fills_the_cache_and_the_stage_restores_from_it(model, tmp_path):
    cache = {"PP_CACHE": "1", "PP_CACHE_DIR": str(tmp_path / "cache")}
    w = spawn_real(0, 2, model, PP_WARMUP="background", MAX_CONTEXT="128", **cache)
    full = spawn_real(0, 2, model, PP_WARMUP="1", MAX_CONTEXT="128")  # the suite's PP_CACHE=0: compiles it all
    try:
        ready = w.wait_ready(120)
        assert (ready["jits_compiled"], ready["jits_pending"]) == (1, ready["jits"] - 1)
        deadline = time.monotonic() + 600  # the child compiles every other size of the stage
        while (status := w.request({"op": "status", "request_id": 1}))["jits_pending"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        assert full.wait_ready(600)["jits_compiled"] == ready["jits"]
        got = w.request({"op": "embed_and_forward", "request_id": 2, "tokens": PROMPT, "position": 0})
        want = full.request({"op": "embed_and_forward", "request_id": 2, "tokens": PROMPT, "position": 0})
        assert got["hidden_b64"] == want["hidden_b64"]  # sizes 32 and 4 from the cache: the same kernels
        status = w.request({"op": "status", "request_id": 3})
        assert status["jits_cached"] == 2 and status["jits_compiled"] == 3
    finally:
        for p in (w, full):
            p.kill()


def test_the_background_compile_ends_with_its_stage_and_says_whose_it_was(model, tmp_path):
    """The stage is SIGKILLed at its ready line, while its child is still starting: the child exits within seconds
    (its watchdog watches the stage by pid, so a stage gone before the child's watchdog starts counts too), and its
    stderr line - which a driver shows as the dead stage's stderr tail - names it, not the stage."""
    w = spawn_real(1, 2, model, PP_WARMUP="background", MAX_CONTEXT="128", PP_CACHE="1",
                   PP_CACHE_DIR=str(tmp_path / "cache"))
    try:
        w.wait_ready(120)
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(w.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 1, children  # the background compile, started before the ready line
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(10)
        assert gone(children[0], 60), "the background compile outlived its stage"
        assert "stage 1's background compile: the parent process exited while loading; exiting" in w.stderr_text()
    finally:
        w.kill()
