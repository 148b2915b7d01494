"""Compiled forwards kept on disk (compiled.jitcache): a second start replays what the first compiled, with the same
results bit for bit; a corrupt entry is ignored, said on stderr and rebuilt; PP_CACHE=0 keeps nothing; two stages
writing one directory at once both find their entries on a restart."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_env

from pp_worker.driver.pipeline import Pipeline, Sampling, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing.chain import Chain, step_batch, wire_rows
from pp_worker.testing.modelgen import generate
from pp_worker.worker.compiled import jitcache
from pp_worker.worker.cpu import graph as cpu_graph

pytestmark = pytest.mark.skipif(not cpu_graph.supported(), reason="the cache keeps native tables (Linux)")
PROMPTS = ([5, 9, 11, 3, 7, 2, 40, 41, 42, 43, 44], [4, 8, 1])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("jitcache") / "tiny-q4_1.gguf", "tiny", seed=4, dtype="Q4_1")


def _run(model: Path) -> tuple[Chain, list[list[int]], list[np.ndarray]]:
    """A 2-stage chain; both prompts, in flight together, then one batched step of both."""
    c = Chain(model, 2, 48, prefill_chunk=8, max_batch=2)
    tokens, logits = [], []
    for rid, prompt in enumerate(PROMPTS):
        t, lg = c.generate(rid, prompt, 5)
        tokens.append(t)
        logits += lg
    first, last = c.engines
    h = step_batch(first, [0, 1], [len(p) + 4 for p in PROMPTS], [t[-1] for t in tokens])
    logits.append(np.array(step_batch(last, [0, 1], [len(p) + 4 for p in PROMPTS], wire_rows(first, h))))
    return c, tokens, logits


def _jits(c: Chain) -> list:
    return [j for e in c.engines for j in e._stage.all_jits if j.ready]


def test_a_second_start_replays_the_first_ones_compiled_forwards(model, tmp_path, monkeypatch):
    monkeypatch.setenv("PP_CACHE", "1")
    monkeypatch.setenv("PP_CACHE_DIR", str(tmp_path))
    c, want_tokens, want_logits = _run(model)
    first = _jits(c)
    assert first and not any(j.restored for j in first)
    entries = sorted((tmp_path / "jits").glob("*.jit"))
    assert len(entries) == len(first)  # prefill sizes 8, 2, 1 and the batch of 2, on each stage
    c, tokens, logits = _run(model)
    again = _jits(c)
    assert len(again) == len(first) and all(j.restored and j.captured is None for j in again)
    assert sum(e.describe()["jits_cached"] for e in c.engines) == len(again)
    assert tokens == want_tokens and all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def test_a_corrupt_entry_is_ignored_said_and_rebuilt(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PP_CACHE", "1")
    monkeypatch.setenv("PP_CACHE_DIR", str(tmp_path))
    _, want_tokens, want_logits = _run(model)
    entries = sorted((tmp_path / "jits").glob("*.jit"))
    entries[0].write_bytes(entries[0].read_bytes()[:100])  # truncated
    entries[1].write_bytes(b"not a pickle at all")
    capsys.readouterr()
    c, tokens, logits = _run(model)
    assert capsys.readouterr().err.count("ignoring the compiled-forward cache entry") == 2
    assert sum(not j.restored for j in _jits(c)) == 2  # those two compiled again, the others restored
    assert tokens == want_tokens and all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))
    c, _, _ = _run(model)
    assert all(j.restored for j in _jits(c))  # rewritten whole


def test_pp_cache_0_keeps_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("PP_CACHE", "0")
    monkeypatch.setenv("PP_CACHE_DIR", str(tmp_path))
    _run(model)
    assert not (tmp_path / "jits").exists()


def test_two_stages_sharing_a_directory_find_their_entries_on_a_restart(model, tmp_path, monkeypatch):
    env = {**clean_env(), "PP_CACHE": "1", "PP_CACHE_DIR": str(tmp_path), "PP_WARMUP": "1", "MAX_CONTEXT": "48",
           "PP_PREFILL_CHUNK": "8", "PP_MAX_BATCH": "2"}
    env.pop("DEV", None)  # tinygrad picks (the first stages write its pick down: device)
    monkeypatch.delenv("DEV", raising=False)  # which this process's tinygrad set, and the stages would inherit
    runs = []
    for _ in range(2):  # the stages start together and compile (then read) at the same time
        with Pipeline(Launch(2, model=str(model), env=env), log=io.StringIO()) as p:
            ready = [st.ready or {} for st in p.stages]
            stats = p.run(make_generations(p, ["Beautiful is better than", "Flat is"], 6, Sampling()), 2)
            runs.append((ready, [g.tokens for g in stats.generations]))
    (first, tokens1), (second, tokens2) = runs
    assert all(r["jits_compiled"] == r["jits"] and r["jits_cached"] == 0 for r in first)
    assert all(r["jits_cached"] == r["jits"] for r in second)  # every forward from the cache, none compiled
    assert tokens1 == tokens2 and len(list((tmp_path / "jits").glob("*.jit"))) == sum(r["jits"] for r in first)
    assert json.loads((tmp_path / "device.json").read_text())["device"] == first[0]["device"] == "CPU"


def test_past_its_budget_the_directory_keeps_the_entries_used_last(tmp_path, monkeypatch, capsys):
    """Every new version, model or setting writes entries of its own: without a budget the directory only grows."""
    monkeypatch.setattr(jitcache, "BUDGET", 4000)
    store = jitcache.Store(tmp_path)
    entry = {"format": jitcache.FORMAT, "pad": bytes(900)}  # ~1 KB a file

    def written(name: str, age_s: float) -> None:
        store.save(name, entry)
        t = time.time() - age_s
        os.utime(tmp_path / f"{name}.jit", (t, t))

    for i, name in enumerate("abcd"):
        written(name, 400 - 100 * i)  # a is the oldest
    assert sorted(p.stem for p in tmp_path.glob("*.jit")) == ["a", "b", "c", "d"]  # ~4 KB: within budget
    assert store.load("a") == entry  # used now: the newest
    leftover = tmp_path / ".x.abandoned"  # a write whose process died before its rename
    leftover.write_bytes(b"half")
    os.utime(leftover, (time.time() - 2 * jitcache.STALE_S,) * 2)
    store.save("e", entry)  # over budget: the least recently used go, down to 3/4 of it
    assert sorted(p.stem for p in tmp_path.glob("*.jit")) == ["a", "d", "e"]
    assert not leftover.exists()
    assert store.load("b") is None and capsys.readouterr().err == ""  # gone: a plain miss, compiled again
