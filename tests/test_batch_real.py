"""Batched decode and pipelined prefill in real mode (tinygrad on CPU): the engine's batched step against its single
steps, and the driver batching K generations and pipelining a long prompt through real stage workers. Expected
values come from runs without the feature (each session stepped alone, the prompt sent whole)."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pp_worker.driver.generation import Call, Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing.chain import Chain, step_batch, wire_rows
from pp_worker.testing.modelgen import generate

MAX_CONTEXT = 64
LOGIT_ATOL = 1e-4  # a batched matmul may sum in another order than a one-row one
PROMPTS = ["Beautiful is better than", "Flat is better", "Errors should never", "Now is better than never"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("batch") / "tiny.gguf", "tiny", seed=11)


def test_a_batched_step_is_each_sessions_own_step(model: Path) -> None:
    # float32 KV pages: with float16 ones a key the batched matmul rounds to the other side of an fp16 step moves
    # the logits by up to ~1e-3, the pages' own rounding (bench/NOTES.md)
    chain = Chain(model, 3, MAX_CONTEXT, max_sessions=4, max_batch=4, kv_dtype="float32")
    first, middle, last = chain.engines
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15]]  # different lengths: different positions per row
    alone = [chain.generate(100 + i, p, 5) for i, p in enumerate(prompts)]
    got = [[int(chain.step(i, p, 0).argmax())] for i, p in enumerate(prompts)]
    for ids in ([0, 1, 2, 3], [0, 1, 2], [3, 1], [0, 1, 2, 3]):  # batch sizes 4, 3 (= 2 + 1 on the ladder), 2
        at = [len(prompts[i]) + len(got[i]) - 1 for i in ids]
        hidden = step_batch(first, ids, at, [got[i][-1] for i in ids])
        hidden = step_batch(middle, ids, at, wire_rows(first, hidden))
        logits = step_batch(last, ids, at, wire_rows(middle, hidden)).copy()
        for b, i in enumerate(ids):
            np.testing.assert_allclose(logits[b], alone[i][1][len(got[i])], rtol=0, atol=LOGIT_ATOL)
            got[i].append(int(logits[b].argmax()))
    assert got == [tokens[:len(g)] for g, (tokens, _) in zip(got, alone, strict=True)]
    assert [len(g) for g in got] == [4, 5, 4, 4]


def test_a_mixed_forward_gives_each_row_its_one_token_step(model: Path) -> None:
    """Several rows of several sessions in one forward (checks of drafted tokens, with one-token steps among them,
    and a session rewound to a position it holds: a check that kept one guess): each row's logits are those of the
    one-token step at its position; the sessions then hold what their rows wrote."""
    chain = Chain(model, 3, MAX_CONTEXT, max_sessions=4, max_batch=4, kv_dtype="float32", wire="f32")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15]]
    alone = [chain.generate(100 + i, p, 7) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        chain.step(i, p, 0)

    def mixed(ids: list[int], starts: list[int], rows: list[int]) -> None:
        logits = chain.batch(ids, [alone[i][0][s:s + n] for i, s, n in zip(ids, starts, rows, strict=True)],
                             [len(prompts[i]) + s for i, s in zip(ids, starts, strict=True)])
        want = [alone[i][1][s + j + 1] for i, s, n in zip(ids, starts, rows, strict=True) for j in range(n)]
        np.testing.assert_allclose(logits, np.stack(want), rtol=0, atol=LOGIT_ATOL)

    mixed([0, 1, 2, 3], [0, 0, 0, 0], [4, 1, 3, 2])  # 10 rows: calls of 8 and 2
    mixed([2, 0, 3], [3, 1, 2], [1, 5, 3])  # session 0 rewinds from 4 tokens to 1
    assert [chain.engines[-1].sessions()[i] for i in range(4)] == [len(p) + n for p, n in zip(prompts, [6, 1, 4, 5],
                                                                                              strict=True)]


def test_on_tinygrads_kernels_a_batch_is_one_token_steps(model: Path) -> None:
    """Off the C kernels (a GPU's path, here on the CPU) a batch is B sessions' one-token steps, each session's own
    step; several rows of a session do not batch (the worker then runs them alone)."""
    chain = Chain(model, 2, MAX_CONTEXT, max_sessions=3, max_batch=4, kv_dtype="float32", kernels="tinygrad",
                  every_size=False)
    first, last = chain.engines
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    alone = [chain.generate(100 + i, p, 2) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        chain.step(i, p, 0)
    at = [len(p) for p in prompts]
    assert all(e.can_batch(0, at[0]) and not e.can_batch(0, at[0], 2) for e in chain.engines)
    hidden = step_batch(first, [0, 1, 2], at, [tokens[0] for tokens, _ in alone])
    logits = step_batch(last, [0, 1, 2], at, wire_rows(first, hidden))
    np.testing.assert_allclose(logits, np.stack([steps[1] for _, steps in alone]), rtol=0, atol=LOGIT_ATOL)


@pytest.fixture(scope="module")
def pipeline(model: Path):
    env = {"MAX_CONTEXT": str(MAX_CONTEXT), "PP_MAX_SESSIONS": "4", "PP_PREFILL_CHUNK": "8"}
    with Pipeline(Launch(3, model=str(model), env=env), log=io.StringIO()) as p:
        yield p


def statuses(p: Pipeline) -> list[dict]:
    got: dict[int, dict] = {}
    for s in range(len(p.stages)):
        p.ask(s, "status", 10_000 + s, lambda r, s=s: got.__setitem__(s, r))
    while len(got) < len(p.stages):
        p.pump()
    return [got[s] for s in range(len(p.stages))]


def test_k_generations_are_batched_and_each_is_its_solo_run(pipeline: Pipeline) -> None:
    alone = [pipeline.run(make_generations(pipeline, [prompt], 8, Sampling())).generations[0].tokens
             for prompt in PROMPTS]
    before = [s["batched_requests"] for s in statuses(pipeline)]
    together = pipeline.run(make_generations(pipeline, PROMPTS, 8, Sampling()), concurrency=4)
    after = [s["batched_requests"] for s in statuses(pipeline)]
    assert [g.tokens for g in together.generations] == alone
    # the steps that reach a stage together go as one batch, and stay together: every stage batched
    assert all(a - b >= 4 for a, b in zip(after, before, strict=True)), (before, after)


def test_without_batching_nothing_is_batched(pipeline: Pipeline) -> None:
    alone = [pipeline.run(make_generations(pipeline, [prompt], 4, Sampling())).generations[0].tokens
             for prompt in PROMPTS[:2]]
    pipeline.batch, pipeline.trace = False, []
    try:
        before = [s["batched_requests"] for s in statuses(pipeline)]
        together = pipeline.run(make_generations(pipeline, PROMPTS[:2], 4, Sampling()), concurrency=2)
        after = [s["batched_requests"] for s in statuses(pipeline)]
        steps = [rid for _, stage, rid, op, d in pipeline.trace if (stage, op, d) == (0, "decode_step", "send")]
    finally:
        pipeline.batch, pipeline.trace = True, None
    assert [g.tokens for g in together.generations] == alone
    # both were decoding at once (their steps interleave), yet no stage ran a batched forward: the driver sent no
    # batch, nor two one-token steps a worker could find queued together
    assert len(steps) == 6 and sum(a != b for a, b in zip(steps, steps[1:], strict=False)) > 1, steps
    assert after == before


def test_a_long_prompt_is_pipelined_and_gives_what_the_whole_prompt_gives(pipeline: Pipeline,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = " ".join(PROMPTS * 2)  # 48 tokens: 6 chunks of 8
    assert pipeline.prefill_chunk == 8
    pipeline._chunk_override = 0  # sent whole
    whole = pipeline.run(make_generations(pipeline, [prompt], 6, Sampling())).generations[0]
    pipeline._chunk_override = None
    pipeline.drop_cache()  # else the same prompt would fork what the first run left instead of computing it
    pipeline.trace = []
    send = pipeline._send

    def queue(rid: int, call: Call, waiter: Any) -> None:  # each call traced also when queued (see below)
        pipeline.trace.append((time.monotonic(), call.stage, rid, call.op, "queued"))
        send(rid, call, waiter)

    monkeypatch.setattr(pipeline, "_send", queue)
    chunked = pipeline.run(make_generations(pipeline, [prompt], 6, Sampling())).generations[0]
    trace, pipeline.trace = pipeline.trace, None
    assert len(chunked.prompt_tokens) > 4 * 8
    assert chunked.tokens == whole.tokens
    rid = chunked.request_id
    prefill = [(stage, op, d) for _, stage, r, op, d in trace if r == rid and op != "tokenize"]
    stage0_sends = [i for i, (s, op, d) in enumerate(prefill) if s == 0 and d == "send" and op == "embed_and_forward"]
    assert len(stage0_sends) == -(-len(chunked.prompt_tokens) // 8)  # one call per chunk
    last_chunk_done = max(i for i, (s, op, d) in enumerate(prefill)
                          if s == 0 and d == "reply" and op == "embed_and_forward")
    # stage 1 is given a chunk as soon as stage 0's reply for it is read, before stage 0's later chunks are: by the
    # order the driver handles replies in, not by how the OS timed them (stage 0 may finish every chunk before the
    # driver reads one, and the replies read in one round are all traced before that round's sends are written)
    first_hop = min(i for i, (s, _, d) in enumerate(prefill) if s == 1 and d == "queued")
    assert first_hop < last_chunk_done


def stage0_decode_groups(trace: list) -> list[list[int]]:
    """The request ids of each write of decode steps to stage 0 (a batch, or one request), in order."""
    groups: list[list[int]] = []
    last = None
    for i, (_, stage, rid, op, direction) in enumerate(trace):
        if stage == 0 and op == "decode_step" and direction == "send":
            if last == i - 1:
                groups[-1].append(rid)
            else:
                groups.append([rid])
            last = i
    return groups


def test_lockstep_passes_one_batch_of_k_around_and_groups_and_overlap_give_the_same_tokens(
        pipeline: Pipeline) -> None:
    """Real stages in every schedule. How far overlap's generations drift apart depends on when each prefill ends
    (they rejoin once they meet in a batch), and which group's batch a stage gets first on when the processes run,
    so those are held in test_batch with scripted replies, not here."""
    assert pipeline.schedule == "lockstep", "auto: local stages on the CPU share its cores, so they run in lock-step"
    n = 8
    alone = [pipeline.run(make_generations(pipeline, [prompt], n, Sampling())).generations[0].tokens
             for prompt in PROMPTS]
    groups = {}
    for schedule in ("lockstep", "groups", "overlap"):
        pipeline.schedule, pipeline.trace = schedule, []
        try:
            together = pipeline.run(make_generations(pipeline, PROMPTS, n, Sampling()), concurrency=4)
            groups[schedule] = stage0_decode_groups(pipeline.trace)
        finally:
            pipeline.schedule, pipeline.trace = "lockstep", None
        assert [g.tokens for g in together.generations] == alone, schedule
    steps = sum(len(g.tokens) - 1 for g in together.generations)  # decode steps (after each prefill's token)
    assert all(sum(map(len, writes)) == steps for writes in groups.values())
    # lock-step: one write per token of all four (after a ramp while the prefills finish one after the other)
    assert max(map(len, groups["lockstep"])) == 4 and len(groups["lockstep"]) <= (n - 1) + 3, groups["lockstep"]
