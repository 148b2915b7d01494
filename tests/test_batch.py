"""Batched decode on the worker side, with the stub engine: queued one-token steps of distinct sessions share one
forward, the `batch` op, and every reply is what the request would get alone."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from conftest import make_worker, request_line, run_requests, serve_bytes

from pp_worker.driver.generation import Call, Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations, run_pipeline
from pp_worker.driver.stage_proc import Launch
from pp_worker.worker.dispatch import BATCH_ROWS, Worker
from pp_worker.worker.engines.stub import StubEngine
from pp_worker.worker.events import Clock

HIDDEN_DIM = 16


def row(seed: int, seq_len: int = 1) -> str:
    values = np.random.default_rng(seed).uniform(-1, 1, (seq_len, HIDDEN_DIM)).astype("<f2")
    return base64.b64encode(values.tobytes()).decode()


def prefill(stage: int, num_stages: int, rid: int, n: int) -> dict[str, Any]:
    if stage == 0:
        return {"op": "embed_and_forward", "request_id": rid, "tokens": list(range(1, n + 1)), "position": 0}
    op = "forward_and_sample" if stage == num_stages - 1 else "forward_range"
    return {"op": op, "request_id": rid, "hidden_b64": row(rid, n), "position": 0, "seq_len": n}


def step(stage: int, num_stages: int, rid: int, position: int) -> dict[str, Any]:
    if stage == 0:
        return {"op": "decode_step", "request_id": rid, "token_id": rid % 32, "position": position}
    op = "forward_and_sample" if stage == num_stages - 1 else "forward_range"
    return {"op": op, "request_id": rid, "hidden_b64": row(100 + rid + position), "position": position,
            "seq_len": 1}


def alone(stage: int, num_stages: int, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request's reply from a worker serving only that request's session, one line at a time."""
    workers: dict[int, Worker] = {}
    return [workers.setdefault(r["request_id"], make_worker(stage, num_stages)).handle_line(request_line(r))
            for r in requests]


def served(worker: Worker, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    replies, reason = serve_bytes(worker, b"".join(request_line(r) for r in requests))
    assert reason == "eof"
    return replies


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 2), (1, 3), (1, 2)])
def test_queued_steps_of_distinct_sessions_share_one_forward(stage: int, num_stages: int) -> None:
    rids = [3, 5, 8, 13]
    requests = [prefill(stage, num_stages, rid, 2 + i) for i, rid in enumerate(rids)]
    requests += [step(stage, num_stages, rid, 2 + i) for i, rid in enumerate(rids)]
    worker = make_worker(stage, num_stages)
    assert served(worker, requests) == alone(stage, num_stages, requests)
    assert worker.engine.batches == [4]  # type: ignore[attr-defined]


def test_a_run_stops_at_a_repeated_session_and_at_max_batch() -> None:
    requests = [prefill(0, 2, rid, 1) for rid in (1, 2, 3)]
    requests += [step(0, 2, 1, 1), step(0, 2, 2, 1), step(0, 2, 1, 2), step(0, 2, 3, 1)]
    worker = make_worker(0, 2)
    assert served(worker, requests) == alone(0, 2, requests)
    assert worker.engine.batches == [2, 2]  # type: ignore[attr-defined]
    small = Worker(StubEngine(0, 2, max_batch=2), Clock(), "stub")
    requests = [prefill(0, 2, rid, 1) for rid in (1, 2, 3)] + [step(0, 2, rid, 1) for rid in (1, 2, 3)]
    assert served(small, requests) == alone(0, 2, requests)
    assert small.engine.batches == [2]  # type: ignore[attr-defined]  # then session 3 alone


def check(rid: int, position: int, guesses: list[int]) -> dict[str, Any]:
    """The last stage's check of ``guesses`` (2 stages): rows seeded as ``step``'s at those positions."""
    rows = b"".join(base64.b64decode(step(1, 2, rid, position + i)["hidden_b64"]) for i in range(len(guesses) + 1))
    return {"op": "forward_and_sample", "request_id": rid, "hidden_b64": base64.b64encode(rows).decode(),
            "position": position, "seq_len": len(guesses) + 1, "verify": guesses}


def test_queued_checks_and_a_step_share_one_forward() -> None:
    """Checks (speculative decoding's ``verify``) of three sessions, of 2 and 4 rows, and a one-token step of a
    fourth: one batched forward of all their rows. Every reply, and what each session holds after, is its
    request's alone."""
    rids = [3, 5, 8, 13]
    prefills = [prefill(1, 2, rid, 2) for rid in rids]
    plain = {rid: [r["token_id"] for r in run_requests(1, 2, [prefill(1, 2, rid, 2)] + [step(1, 2, rid, 2 + i)
                                                                                      for i in range(4)])[1:]]
             for rid in rids}  # the tokens one-token steps sample at those rows
    guesses = {3: plain[3][:1], 5: [(plain[5][0] + 1) % 32], 8: plain[8][:3]}
    status = {"op": "status", "request_id": 99}
    requests = prefills + [check(rid, 2, guesses[rid]) for rid in (3, 5, 8)] + [step(1, 2, 13, 2)]
    worker = make_worker(1, 2)
    got = served(worker, [*requests, status])
    assert got[:-1] == alone(1, 2, requests)
    assert [r.get("accepted") for r in got[4:7]] == [1, 0, 3]
    assert worker.engine.batches == [4]  # type: ignore[attr-defined]
    assert got[-1]["sessions"] == {"3": 4, "5": 3, "8": 6, "13": 3} and got[-1]["batched_requests"] == 4


def rows(stage: int, num_stages: int, rid: int, position: int, n: int) -> dict[str, Any]:
    """``n`` rows of a session from ``position`` on a stage before the last (a check's, or a short turn's)."""
    if stage == 0:
        return {"op": "embed_and_forward", "request_id": rid, "tokens": [rid + i for i in range(n)],
                "position": position}
    return {"op": "forward_range", "request_id": rid, "hidden_b64": row(200 + rid, n), "position": position,
            "seq_len": n}


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 2), (1, 3)])
def test_short_rows_of_held_sessions_share_one_forward(stage: int, num_stages: int) -> None:
    """Before the last stage, a few rows of a session the stage holds (appended, or after a rewind: a check's rows
    after a guess was not kept) go in one forward with other sessions' rows and steps; a new session's prompt, and
    one longer than BATCH_ROWS, run alone."""
    requests = [prefill(stage, num_stages, rid, 3) for rid in (1, 2, 3, 4)]
    requests += [rows(stage, num_stages, 1, 3, 4), rows(stage, num_stages, 2, 1, 2), step(stage, num_stages, 3, 3),
                 prefill(stage, num_stages, 5, 2), rows(stage, num_stages, 4, 3, BATCH_ROWS + 1)]
    worker = make_worker(stage, num_stages)
    assert served(worker, requests) == alone(stage, num_stages, requests)
    assert worker.engine.batches == [3]  # type: ignore[attr-defined]


def test_a_step_past_max_context_fails_alone_beside_a_batch() -> None:
    worker = Worker(StubEngine(0, 2, max_context=8), Clock(), "stub")
    requests = [prefill(0, 2, 1, 3), prefill(0, 2, 2, 6), rows(0, 2, 1, 3, 2), rows(0, 2, 2, 6, 3)]
    replies = served(worker, requests)
    assert "hidden_b64" in replies[2] and "max_context" in replies[3]["error"]
    assert worker.engine.batches == []  # type: ignore[attr-defined]  # the second would overflow: each alone


def test_rewinding_steps_batch_and_unknown_or_invalid_ones_run_alone() -> None:
    requests = [prefill(0, 2, 1, 3), prefill(0, 2, 2, 3),
                step(0, 2, 1, 1),  # a rewind
                step(0, 2, 2, 3), step(0, 2, 9, 4),  # an append; an unknown session past 0 (refused alone)
                {"op": "decode_step", "request_id": 4, "token_id": "x", "position": 1}]  # invalid
    worker = make_worker(0, 2)
    replies = served(worker, requests)
    assert replies == alone(0, 2, requests)
    assert worker.engine.batches == [2]  # type: ignore[attr-defined]


def test_max_batch_one_never_batches() -> None:
    worker = Worker(StubEngine(1, 2, max_batch=1), Clock(), "stub")
    requests = [prefill(1, 2, rid, 1) for rid in (1, 2)] + [step(1, 2, rid, 1) for rid in (1, 2)]
    assert served(worker, requests) == alone(1, 2, requests)
    assert worker.engine.batches == []  # type: ignore[attr-defined]


def test_the_batch_op_answers_each_request_as_its_line_would_be() -> None:
    inner = [prefill(1, 2, rid, 2) for rid in (1, 2, 3)] + [step(1, 2, rid, 2) for rid in (1, 2, 3)]
    worker = make_worker(1, 2)
    (reply,) = served(worker, [{"op": "batch", "request_id": 77, "requests": inner}])
    assert reply["request_id"] == 77 and reply["replies"] == alone(1, 2, inner)
    assert worker.engine.batches == [3]  # type: ignore[attr-defined]


def test_a_batch_answers_each_bad_request_with_its_own_error() -> None:
    inner = [prefill(0, 3, 1, 2), {"op": "decode_step", "request_id": 2, "token_id": -1, "position": 0},
             {"op": "forward_range", "request_id": 3}, prefill(0, 3, 4, 1)]
    (reply,) = run_requests(0, 3, [{"op": "batch", "request_id": 5, "requests": inner}])
    first, bad, wrong_role, last = reply["replies"]
    assert "hidden_b64" in first and "hidden_b64" in last
    assert bad["request_id"] == 2 and "token_id" in bad["error"]
    assert wrong_role["request_id"] == 3 and "needs the middle stage" in wrong_role["error"]


@pytest.mark.parametrize(("requests", "message"), [
    (None, "'requests' must be a list"),
    ([], "'requests' must be a list of 1 to"),
])
def test_a_malformed_batch_is_one_error(requests: Any, message: str) -> None:
    (reply,) = run_requests(0, 2, [{"op": "batch", "request_id": 9, "requests": requests}])
    assert reply["request_id"] == 9 and message in reply["error"]


@pytest.mark.parametrize(("entry", "message"), [
    ({"op": "ping", "request_id": 1}, "a batch holds forward requests (decode_step, embed_and_forward, forward_and_"
                                      "sample, forward_range); got op 'ping'"),
    ({"op": "batch", "request_id": 1, "requests": []}, "a batch holds forward requests"),
    ({"op": "shutdown", "request_id": 1}, "a batch holds forward requests"),
    (7, "request must be a JSON object, got number"),
])
def test_an_entry_that_may_not_be_batched_fails_alone(entry: Any, message: str) -> None:
    """As a bad request does: the entries around it are served (a shutdown inside a batch is not obeyed)."""
    worker = make_worker(0, 2)
    inner = [prefill(0, 2, 3, 2), entry, prefill(0, 2, 4, 2)]
    (reply,) = serve_bytes(worker, request_line({"op": "batch", "request_id": 9, "requests": inner}))[0]
    first, bad, last = reply["replies"]
    assert "hidden_b64" in first and "hidden_b64" in last and message in bad["error"]
    assert bad.get("request_id") == (None if entry == 7 else 1) and not worker.shutdown_requested


def test_nothing_read_after_a_shutdown_is_served() -> None:
    worker = make_worker(0, 2)
    replies, reason = serve_bytes(worker, b"".join(request_line(r) for r in (
        {"op": "ping", "request_id": 1}, {"op": "shutdown", "request_id": 2}, {"op": "ping", "request_id": 3})))
    assert reason == "shutdown" and [r["request_id"] for r in replies] == [1, 2]


def test_ready_line_and_status_report_max_batch() -> None:
    (status,) = run_requests(0, 2, [{"op": "status", "request_id": 1}])
    assert status["max_batch"] == 8
    assert Worker(StubEngine(0, 2, max_sessions=3), Clock(), "stub").engine.max_batch == 3


# --- the driver's side: which steps it groups into batch requests ---------------------------------------------------

class FakeStage:
    def __init__(self, index: int, max_batch: int = 8):
        self.index, self.ready, self.sent = index, {"max_batch": max_batch}, []

    def send(self, obj: dict[str, Any]) -> None:
        self.sent.append(obj)


def bare_pipeline(stages: int, in_flight: int, max_batch: int = 8) -> Pipeline:
    """A Pipeline's send path on fake stages that record what they are sent."""
    p = Pipeline.__new__(Pipeline)
    p.stages = [FakeStage(i, max_batch) for i in range(stages)]  # type: ignore[list-item]
    p._pending, p._outbox, p.trace, p.batch, p.schedule, p._stepping = {}, [], None, True, "overlap", set()
    p._group_of, p._drafting = {}, {}
    p._active = dict.fromkeys(range(100, 100 + in_flight))  # type: ignore[arg-type]
    return p


def sent(p: Pipeline, stage: int) -> list[tuple[str, list[int]]]:
    return [(o["op"], [r["request_id"] for r in o["requests"]] if o["op"] == "batch" else [o["request_id"]])
            for o in p.stages[stage].sent]  # type: ignore[attr-defined]


def test_the_driver_sends_a_rounds_steps_for_a_stage_as_one_batch() -> None:
    p = bare_pipeline(2, in_flight=4)
    for rid in (1, 2, 3, 4):
        p._send(rid, Call(0, "decode_step", {"token_id": 1, "position": 5}), rid)
    p._send(5, Call(0, "tokenize", {"prompt": "x"}), 5)
    p._send(6, Call(0, "decode_step", {"token_id": 1, "position": 5}), 6)
    p._send(7, Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 3, "seq_len": 4}), 7)
    p._flush()
    assert sent(p, 0) == [("batch", [1, 2, 3, 4]), ("tokenize", [5]), ("decode_step", [6])]
    assert sent(p, 1) == [("forward_and_sample", [7])]  # a prefill: not a step
    # a batch's entry comes first in its first request's queue: the batch reply arrives before the replies it holds
    assert [q.op for q in p._pending[(0, 1)]] == ["batch", "decode_step"]


def test_lockstep_holds_the_next_tokens_until_no_generation_is_mid_token() -> None:
    p = bare_pipeline(2, in_flight=5)
    p.schedule = "lockstep"
    step = {"token_id": 1, "position": 5}
    after = Call(0, "decode_step", {"token_id": 3, "position": 6})  # generation 9's next token, once this one is done
    hop = Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 5, "seq_len": 1}, on_reply=lambda r: after)
    p._send(9, Call(0, "decode_step", step), lambda reply: hop)
    p._flush()
    assert p._stepping == {9}  # generation 9 is in the middle of a token
    for rid in (1, 2, 3, 4):
        p._send(rid, Call(0, "decode_step", step), None)
    p._send(5, Call(0, "tokenize", {"prompt": "x"}), None)
    p._flush()
    assert sent(p, 0) == [("decode_step", [9]), ("tokenize", [5])]  # the steps wait; anything else goes
    p._on_reply(p.stages[0], {"request_id": 9, "hidden_b64": "AAAA", "seq_len": 1}, counted=False)
    p._flush()
    assert sent(p, 1) == [("forward_and_sample", [9])] and len(sent(p, 0)) == 2  # 9 is mid-token on stage 1
    p._on_reply(p.stages[1], {"request_id": 9, "token_id": 3}, counted=False)
    p._flush()  # nobody mid-token: the held steps go together, with 9's next one
    assert sent(p, 0)[2:] == [("batch", [1, 2, 3, 4, 9])] and p._stepping == {1, 2, 3, 4, 9}


def test_overlap_starts_each_token_as_soon_as_it_can() -> None:
    """The same calls as above without lock-step: the steps go while generation 9 is mid-token."""
    p = bare_pipeline(2, in_flight=5)
    step = {"token_id": 1, "position": 5}
    hop = Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 5, "seq_len": 1})
    p._send(9, Call(0, "decode_step", step), lambda reply: hop)
    p._flush()
    for rid in (1, 2, 3, 4):
        p._send(rid, Call(0, "decode_step", step), None)
    p._flush()
    assert sent(p, 0) == [("decode_step", [9]), ("batch", [1, 2, 3, 4])]


def test_groups_step_as_batches_of_their_own_and_each_waits_only_for_its_own_group() -> None:
    """``groups`` on 2 stages: two groups, each in lock-step within itself; a newcomer joins the smaller one."""
    p = bare_pipeline(2, in_flight=5)
    p.schedule = "groups"
    step = {"token_id": 1, "position": 5}
    after = Call(0, "decode_step", {"token_id": 3, "position": 6})
    hop = Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 5, "seq_len": 1}, on_reply=lambda r: after)
    p._send(9, Call(0, "decode_step", step), lambda reply: hop)
    p._flush()  # 9 is group 0's, and in the middle of a token
    for rid in (1, 2, 3, 4):  # in turn to the smaller group (the first on a tie): 1 and 3 to group 1, 2 and 4 to 0
        p._send(rid, Call(0, "decode_step", step), None)
    p._flush()
    assert sent(p, 0) == [("decode_step", [9]), ("batch", [1, 3])]  # group 1 goes; group 0's wait for 9
    p._send(5, Call(0, "tokenize", {"prompt": "x"}), None)
    p._on_reply(p.stages[0], {"request_id": 9, "hidden_b64": "AAAA", "seq_len": 1}, counted=False)
    p._flush()
    assert sent(p, 1) == [("forward_and_sample", [9])] and sent(p, 0)[2:] == [("tokenize", [5])]
    p._on_reply(p.stages[1], {"request_id": 9, "token_id": 3}, counted=False)
    p._flush()  # group 0 is between tokens: its held steps go with 9's next one, while group 1 is still on stage 0
    assert sent(p, 0)[3:] == [("batch", [2, 4, 9])] and p._group_of == {9: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    for rid in (6, 7, 8, 10):  # newcomers alternate (group 1 is the smaller): one batch request per group
        p._send(rid, Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 5, "seq_len": 1}), None)
    p._flush()
    assert sent(p, 1)[1:] == [("batch", [6, 8]), ("batch", [7, 10])]


def test_a_check_of_drafted_tokens_is_held_and_batched_as_a_step() -> None:
    """A check (``Call.check``: the token and its guesses, a multi-token forward) starts a token as a decode step
    does: held while another generation is mid-token, then sent in the same batch request (steps first); its next
    stages' calls batch too. A prefill is no check and goes at once."""
    p = bare_pipeline(2, in_flight=4)
    p.schedule = "lockstep"
    p._send(9, Call(0, "decode_step", {"token_id": 1, "position": 5}), None)
    p._flush()
    p._send(1, Call(0, "embed_and_forward", {"tokens": [1, 2, 3], "position": 5}, check=True), None)
    p._send(2, Call(0, "decode_step", {"token_id": 1, "position": 5}), None)
    p._send(3, Call(0, "embed_and_forward", {"tokens": [4, 5, 6], "position": 0}), None)
    p._flush()
    assert sent(p, 0) == [("decode_step", [9]), ("embed_and_forward", [3])]
    p._on_reply(p.stages[0], {"request_id": 9, "hidden_b64": "AAAA", "seq_len": 1}, counted=False)
    p._flush()
    assert sent(p, 0)[2:] == [("batch", [2, 1])] and p._stepping == {1, 2}
    for rid in (1, 4):
        p._send(rid, Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 5, "seq_len": 3,
                                                    "verify": [2, 3]}, check=True), None)
    p._flush()
    assert sent(p, 1) == [("batch", [1, 4])]


def test_the_driver_never_batches_for_a_stage_that_does_not() -> None:
    p = bare_pipeline(3, in_flight=6, max_batch=1)
    for rid in (1, 2):
        p._send(rid, Call(1, "forward_range", {"hidden_b64": "AAAA", "position": 5, "seq_len": 1}), rid)
    p._flush()
    assert sent(p, 1) == [("forward_range", [1]), ("forward_range", [2])]


def test_without_batching_a_stage_gets_one_one_token_forward_at_a_time() -> None:
    p = bare_pipeline(2, in_flight=4)
    p.batch = False
    for rid in (1, 2):
        p._send(rid, Call(0, "decode_step", {"token_id": 1, "position": 5}), None)
    p._send(3, Call(0, "tokenize", {"prompt": "x"}), None)  # behind a held step: held too, the stage's order kept
    p._send(4, Call(1, "forward_and_sample", {"hidden_b64": "AAAA", "position": 5, "seq_len": 1}), None)
    p._flush()
    # a worker batches one-token forwards it finds queued together: never two on one stage's stdin
    assert sent(p, 0) == [("decode_step", [1])] and sent(p, 1) == [("forward_and_sample", [4])]
    p._flush()
    assert len(sent(p, 0)) == 1
    p._on_reply(p.stages[0], {"request_id": 1, "hidden_b64": "AAAA", "seq_len": 1}, counted=False)
    p._flush()
    assert sent(p, 0)[1:] == [("decode_step", [2]), ("tokenize", [3])]
    p._on_reply(p.stages[0], {"request_id": 2, "hidden_b64": "AAAA", "seq_len": 1}, counted=False)
    p._send(5, Call(0, "embed_and_forward", {"tokens": [7], "position": 0}), None)  # a one-token prefill counts too
    p._send(6, Call(0, "decode_step", {"token_id": 1, "position": 5}), None)
    p._flush()
    assert sent(p, 0)[3:] == [("embed_and_forward", [5])]


def test_stub_pipeline_batches_k_generations_and_gives_their_solo_tokens() -> None:
    prompts = ["one two three", "four five", "six seven eight nine", "ten"]
    alone = [run_pipeline([q], stages=3, stub=True, max_tokens=5).generations[0].tokens for q in prompts]
    launch = Launch(3, stub=True)
    with Pipeline(launch, log=None) as p:
        together = p.run(make_generations(p, prompts, 5, Sampling()), concurrency=4)
        got: dict[int, dict[str, Any]] = {}
        for s in range(3):
            p.ask(s, "status", 1000 + s, lambda r, s=s: got.__setitem__(s, r))
        while len(got) < 3:
            p.pump()
    assert [g.tokens for g in together.generations] == alone
    # which stages find steps queued together depends on how the processes are scheduled (a loaded CI machine left
    # one stage without a batch): the pipeline batched, somewhere
    assert sum(got[s]["batched_requests"] for s in range(3)) > 0


def test_batched_steps_of_a_q8_stage_are_q8_as_its_single_steps() -> None:
    rids = [1, 2, 3]
    requests = [prefill(1, 3, rid, 2) for rid in rids] + [step(1, 3, rid, 2) for rid in rids]
    batched = Worker(StubEngine(1, 3), Clock(), "stub", wire_dtype="q8")
    got = served(batched, requests)
    want = [Worker(StubEngine(1, 3), Clock(), "stub", wire_dtype="q8").handle_line(request_line(r)) for r in requests]
    assert batched.engine.batches == [3]  # type: ignore[attr-defined]
    assert got == want and all(r["hidden_dtype"] == "q8" for r in got)


def test_logprobs_come_with_the_token_alone_or_batched() -> None:
    """The last stage's log-probabilities are the stub's raw logits' log-softmax, the same in a batched step."""
    rids = [3, 5, 8]
    requests = [prefill(1, 2, rid, 2) for rid in rids]
    requests += [{**step(1, 2, rid, 2), "logprobs": 3, "temperature": 0.8, "seed": rid} for rid in rids]
    worker = make_worker(1, 2)
    replies = served(worker, requests)
    assert replies == alone(1, 2, requests) and worker.engine.batches == [3]  # type: ignore[attr-defined]
    for r, reply in zip(requests[3:], replies[3:], strict=True):
        hidden = base64.b64decode(r["hidden_b64"])
        logits = np.array(StubEngine(1, 2).forward_logits(0, hidden, r["position"], 1), dtype=np.float64)
        ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        got = reply["logprobs"]
        assert (got["token_id"], got["text"]) == (reply["token_id"], f" {reply['token_id']}")  # the stub's text
        assert got["logprob"] == pytest.approx(ref[reply["token_id"]], abs=1e-7)
        best = sorted(range(len(ref)), key=lambda i: (-ref[i], i))[:3]
        assert [t["token_id"] for t in got["top"]] == best
        assert [t["logprob"] for t in got["top"]] == pytest.approx(ref[best].tolist(), abs=1e-7)
        assert [t["text"] for t in got["top"]] == [f" {i}" for i in best]
    assert all("logprobs" not in r for r in replies[:3])  # not asked for, not sent


def test_a_bad_logprobs_count_is_an_error_reply_and_the_stage_goes_on() -> None:
    replies = run_requests(1, 2, [{**prefill(1, 2, 1, 2), "logprobs": 21}, prefill(1, 2, 2, 2)])
    assert "'logprobs'" in replies[0]["error"] and "token_id" in replies[1]
