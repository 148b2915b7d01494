"""The serving loop in-process: file-like reader and writer, stub engine, every op on every role."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import sys
from typing import Any

import numpy as np
import pytest
from conftest import make_worker, request_line, run_requests, serve_bytes
from documented import status_fields

from pp_worker.worker.dispatch import Worker
from pp_worker.worker.engines.stub import StubEngine
from pp_worker.worker.events import Clock, Events
from pp_worker.worker.loop import OVERLONG, LineReader
from pp_worker.worker.stdout import Out

HIDDEN_DIM, VOCAB = 16, 32  # the stub's sizes, fixed by the contract


def payload(seq_len: int, seed: int = 0) -> str:
    """Valid finite fp16 hidden states (1, seq_len, 16), base64."""
    values = np.random.default_rng(seed).uniform(-1, 1, (1, seq_len, HIDDEN_DIM)).astype("<f2")
    return base64.b64encode(values.tobytes()).decode()


REQUESTS: dict[str, dict[str, Any]] = {
    "tokenize": {"prompt": "the quick brown fox"},
    "embed_and_forward": {"tokens": [1, 2, 3], "position": 0},
    "decode_step": {"token_id": 4, "position": 3},
    "forward_range": {"hidden_b64": payload(3), "position": 0, "seq_len": 3},
    "forward_and_sample": {"hidden_b64": payload(3), "position": 0, "seq_len": 3},
    "detokenize": {"tokens": [1, 2, 3]},
    "status": {},
    "ping": {},
    "release": {},
    "claim": {},
    "fork": {"from": 99, "positions": 3},
    "reset": {},
}
# who may run what (contract: tokenize/embed/decode on the first stage, forward_range on middles, sample and
# detokenize on the last; control ops anywhere)
NEEDS = {"tokenize": "first", "embed_and_forward": "first", "decode_step": "first", "forward_range": "middle",
         "forward_and_sample": "last", "detokenize": "last"}
ROLES = [(0, 2, "first"), (0, 3, "first"), (1, 3, "middle"), (2, 4, "middle"), (1, 2, "last"), (2, 3, "last")]


def req(op: str, rid: int = 1, **change: Any) -> dict[str, Any]:
    return {"op": op, "request_id": rid, **REQUESTS.get(op, {}), **change}


def one(stage: int, num_stages: int, request: dict[str, Any]) -> dict[str, Any]:
    replies = run_requests(stage, num_stages, [request])
    assert len(replies) == 1
    return replies[0]


def decode_fp16(text: str, seq_len: int) -> np.ndarray:
    """Hidden states from the wire as (1, seq_len, 16) float16; the length must be exact."""
    raw = base64.b64decode(text, validate=True)
    assert len(raw) == seq_len * HIDDEN_DIM * 2
    return np.frombuffer(raw, dtype="<f2").reshape(1, seq_len, HIDDEN_DIM)


def assert_reply_shape(op: str, reply: dict[str, Any], request: dict[str, Any]) -> None:
    assert reply["request_id"] == request["request_id"]
    assert not {"error", "event", "status"} & reply.keys(), reply  # the caller would misclassify it
    if op == "tokenize":
        assert isinstance(reply["tokens"], list) and reply["tokens"]
        assert all(type(t) is int and 0 <= t < VOCAB for t in reply["tokens"])
    elif op == "detokenize":
        assert isinstance(reply["text"], str)
    elif op in ("embed_and_forward", "decode_step", "forward_range"):
        seq_len = len(request["tokens"]) if "tokens" in request else request.get("seq_len", 1)
        assert reply["seq_len"] == seq_len
        assert len(reply["hidden_b64"]) == 4 * math.ceil(seq_len * HIDDEN_DIM * 2 / 3)
        assert np.isfinite(decode_fp16(reply["hidden_b64"], seq_len).astype(np.float32)).all()
    elif op == "forward_and_sample":
        assert type(reply["token_id"]) is int and 0 <= reply["token_id"] < VOCAB


# --- every op on every role ------------------------------------------------------------------------------

@pytest.mark.parametrize(("stage", "num_stages", "role"), ROLES)
@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_every_op_on_every_role(stage: int, num_stages: int, role: str, op: str) -> None:
    request = req(op, rid=40 + stage)
    reply = one(stage, num_stages, request)
    if NEEDS.get(op, role) == role:
        assert_reply_shape(op, reply, request)
        return
    message = reply["error"]
    assert reply["request_id"] == request["request_id"]
    assert repr(op) in message or op in message
    assert f"stage {stage}" in message
    assert NEEDS[op] in message  # the role it needs


def test_status_reports_the_shard() -> None:
    for stage, num_stages, role in ROLES:
        total = StubEngine(stage, num_stages).info.total_blocks
        k = total // num_stages  # contract: stage s owns [s*k, (s+1)*k), the last takes the rest
        end = total if stage == num_stages - 1 else (stage + 1) * k
        status = one(stage, num_stages, req("status", rid=5))
        assert (status["stage"], status["num_stages"], status["role"]) == (stage, num_stages, role)
        assert status["layer_range"] == [stage * k, end]
        assert status["pid"] == os.getpid()


def test_status_has_exactly_the_fields_the_protocol_lists() -> None:
    common, _ = status_fields()
    assert set(one(1, 3, req("status", rid=5))) == common


def test_ping_and_request_counter() -> None:
    worker = make_worker(0, 2)
    replies, reason = serve_bytes(worker, request_line(req("ping", 1)) + b"\n" + request_line(req("ping", 2)))
    assert reason == "eof"
    assert [r.get("pong") for r in replies] == [True, True]  # the blank line between them gets no reply
    assert worker.clock.requests_served == 2


def test_release_drops_the_session() -> None:
    replies = run_requests(0, 2, [req("embed_and_forward", 7, tokens=[1, 2, 3, 4], position=0),
                                  req("status", 8), req("release", 7), req("release", 7), req("status", 9)])
    assert replies[0]["seq_len"] == 4
    assert replies[1]["sessions"] == {"7": 4}  # positions held by request 7's session
    assert replies[2] == {"request_id": 7, "released": True}
    assert replies[3] == {"request_id": 7, "released": False}
    assert replies[4]["sessions"] == {}


def test_release_with_keep_leaves_the_session_as_cache_until_claimed() -> None:
    replies = run_requests(0, 2, [req("embed_and_forward", 7, tokens=[1, 2, 3], position=0),
                                  req("release", 7, keep=True), req("status", 8), req("claim", 7), req("claim", 9),
                                  req("status", 10)])
    assert replies[1] == {"request_id": 7, "released": True}
    assert replies[2]["sessions"] == {"7": 3} and replies[2]["cached_sessions"] == [7]
    assert replies[3] == {"request_id": 7, "positions": 3}
    assert replies[4] == {"request_id": 9, "positions": 0}  # not held: a generation under it starts at 0
    assert replies[5]["sessions"] == {"7": 3} and replies[5]["cached_sessions"] == []


def test_fork_copies_a_held_sessions_positions_into_a_new_one() -> None:
    def fork(rid: int, source: int = 99, positions: int = 3) -> dict[str, Any]:
        return req("fork", rid, **{"from": source}, positions=positions)

    replies = run_requests(1, 3, [req("forward_range", 7), req("release", 7, keep=True), fork(8, 7, 2), fork(9, 7, 50),
                                  fork(10, 6), req("status", 11), fork(8, 7), fork(12, 12), fork(12, positions=0)])
    assert [r.get("positions") for r in replies[2:5]] == [2, 3, 0]  # at most what 7 holds; 6 is not held
    assert replies[5]["sessions"] == {"7": 3, "8": 2, "9": 3} and replies[5]["cached_sessions"] == [7]
    assert "session 8 is held already" in replies[6]["error"]
    assert "'from' must name another session" in replies[7]["error"]
    assert "'positions' must be a positive int" in replies[8]["error"]
    assert all(r["request_id"] == rid for r, rid in zip(replies[6:], (8, 12, 12), strict=True))


def test_reset_drops_every_session() -> None:
    replies = run_requests(1, 3, [req("forward_range", 7), req("forward_range", 8), req("reset", 9), req("status", 10),
                                  req("reset", 11)])
    assert replies[2] == {"request_id": 9, "released": 2}
    assert replies[3]["sessions"] == {} and replies[4] == {"request_id": 11, "released": 0}


def test_the_stub_refuses_positions_past_max_context_as_a_real_stage() -> None:
    replies = run_requests(0, 2, [req("embed_and_forward", 1, tokens=[1, 2], position=4095),
                                  req("decode_step", 2, position=1_000_000), req("decode_step", 3, position=4095),
                                  req("status", 4)])
    assert replies[0]["error"] == "position 4095 + seq_len 2 = 4097 exceeds max_context 4096"
    assert replies[1]["error"] == "position 1000000 + seq_len 1 = 1000001 exceeds max_context 4096"
    assert replies[2]["seq_len"] == 1 and replies[3]["sessions"] == {"3": 4096}


def made_up_bytes(seq_len: int) -> str:
    """What the caller's own suite sends a middle stage: bytes (i*37+11) & 0xFF, some of them inf/NaN as float16."""
    raw = bytes((i * 37 + 11) & 0xFF for i in range(seq_len * HIDDEN_DIM * 2))
    rows = np.frombuffer(raw, "<f2").reshape(seq_len, HIDDEN_DIM)
    assert not np.isfinite(rows[0]).all() or not np.isfinite(rows[1]).all()
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize("strict", [False, True])
def test_made_up_bytes_are_computed_on_by_default_and_refused_in_strict_mode(strict: bool) -> None:
    """By default as the seed: a reply, and a `nonfinite_input` event naming the first row (no request_id); with
    PP_STRICT_FINITE=1 an error before the forward, the session left as it was. Either way the next finite step
    is served."""
    events: list[tuple[str, dict[str, Any]]] = []
    worker = Worker(StubEngine(1, 3), Clock(), "stub", strict_finite=strict,
                    emit=lambda kind, **f: events.append((kind, f)))
    bad = req("forward_range", 5, hidden_b64=made_up_bytes(3), seq_len=3, position=0)
    raw = np.frombuffer(base64.b64decode(bad["hidden_b64"]), "<f2").reshape(3, HIDDEN_DIM)
    rows = [t for t in range(3) if not np.isfinite(raw[t]).all()]
    replies, _ = serve_bytes(worker, b"".join(request_line(r) for r in (
        bad, req("status", 6), req("forward_range", 5, hidden_b64=payload(1), seq_len=1, position=0 if strict else 3))))
    if strict:
        assert replies[0] == {"request_id": 5, "error": f"hidden_b64 has inf or NaN in {len(rows)} row(s) (first: "
                                                         f"row {rows[0]}); PP_STRICT_FINITE=1 refuses it"}
        assert replies[1]["sessions"] == {} and events == []
    else:
        assert replies[0]["seq_len"] == 3 and replies[1]["sessions"] == {"5": 3}
        assert events == [("nonfinite_input", {"session": 5, "op": "forward_range", "position": 0,
                                               "rows": len(rows), "first_row": rows[0]})]
    assert replies[2]["seq_len"] == 1 and "error" not in replies[2]


def test_shutdown_stops_reading() -> None:
    worker = make_worker(1, 3)
    data = b"".join(request_line(r) for r in [req("ping", 1), req("shutdown", 2), req("ping", 3)])
    replies, reason = serve_bytes(worker, data)
    assert reason == "shutdown"
    assert [r["request_id"] for r in replies] == [1, 2]
    assert "error" not in replies[1]


# --- determinism and sensitivity of the stub ---------------------------------------------------------------

def chain_requests() -> list[tuple[int, dict[str, Any]]]:
    """(stage of 3, request) pairs touching every forward op."""
    return [(0, req("embed_and_forward", 1, tokens=[5, 6, 7], position=0)), (0, req("decode_step", 1, position=3)),
            (1, req("forward_range", 1)), (2, req("forward_and_sample", 1)), (0, req("tokenize", 2)),
            (2, req("detokenize", 3))]


def test_stub_is_deterministic_across_worker_instances() -> None:
    first = [one(stage, 3, r) for stage, r in chain_requests()]
    second = [one(stage, 3, r) for stage, r in chain_requests()]
    assert first == second
    assert all("error" not in r for r in first)


def forward_output(stage: int, num_stages: int, request: dict[str, Any]) -> Any:
    reply = one(stage, num_stages, request)
    assert "error" not in reply, reply
    return reply.get("hidden_b64", reply.get("token_id"))


@pytest.mark.parametrize(("stage", "op", "changes"), [
    (0, "embed_and_forward", [{"position": 1}, {"position": 100}, {"tokens": [1, 2, 4]}, {"tokens": [3, 2, 1]},
                              {"tokens": [1, 2]}]),
    (0, "decode_step", [{"position": 4}, {"position": 0}, {"token_id": 5}, {"token_id": 0}]),
    (1, "forward_range", [{"position": 1}, {"position": 9}, {"hidden_b64": payload(3, seed=1)},
                          {"hidden_b64": payload(2), "seq_len": 2}]),
])
def test_hidden_output_depends_on_every_input(stage: int, op: str, changes: list[dict[str, Any]]) -> None:
    outputs = [forward_output(stage, 3, req(op))] + [forward_output(stage, 3, req(op, **c)) for c in changes]
    assert len(set(outputs)) == len(outputs)  # each change gives a different output


def test_hidden_input_flip_of_one_bit_changes_the_output() -> None:
    raw = bytearray(base64.b64decode(REQUESTS["forward_range"]["hidden_b64"]))
    raw[-1] ^= 1
    flipped = base64.b64encode(bytes(raw)).decode()
    assert forward_output(1, 3, req("forward_range")) != forward_output(1, 3, req("forward_range", hidden_b64=flipped))


def test_sampled_token_depends_on_position_and_hidden() -> None:
    # a token is one of only 32 values, so look at many inputs: a stage that ignored one would give one token
    by_position = {forward_output(2, 3, req("forward_and_sample", position=p)) for p in range(12)}
    by_hidden = {forward_output(2, 3, req("forward_and_sample", hidden_b64=payload(3, seed=s))) for s in range(12)}
    assert len(by_position) > 1 and len(by_hidden) > 1


def test_stage_index_matters_for_forward_range() -> None:
    # two middle stages of one pipeline must not compute the same function
    assert forward_output(1, 4, req("forward_range")) != forward_output(2, 4, req("forward_range"))


# --- sampling fields ----------------------------------------------------------------------------------------

def stub_logits(position: int, hidden_b64: str, seq_len: int) -> np.ndarray:
    engine = StubEngine(1, 2)
    return np.asarray(engine.forward_logits(0, base64.b64decode(hidden_b64), position, seq_len), dtype=np.float64)


def test_no_sampling_fields_means_argmax() -> None:
    hidden = payload(2)
    tied = next(p for p in range(1000) if np.sum(stub_logits(p, hidden, 2) == stub_logits(p, hidden, 2).max()) > 1)
    for position in [0, 1, 2, tied]:  # `tied`: several logits share the max, so the tie-break shows
        request = req("forward_and_sample", position=position, hidden_b64=hidden, seq_len=2)
        logits = stub_logits(position, hidden, 2)
        assert logits.shape == (VOCAB,)
        expected = int(np.flatnonzero(logits == logits.max())[0])  # lowest index among the maxima
        assert one(1, 2, request)["token_id"] == expected
        assert one(1, 2, {**request, "temperature": 0})["token_id"] == expected
        assert one(1, 2, {**request, "temperature": 0.8, "top_k": 1, "seed": 3})["token_id"] == expected


def test_seeded_sampling_is_reproducible() -> None:
    request = req("forward_and_sample", temperature=1.5, top_p=0.95, seed=1234)
    tokens = {one(1, 2, request)["token_id"] for _ in range(3)}
    assert len(tokens) == 1 and 0 <= tokens.pop() < VOCAB


@pytest.mark.parametrize(("name", "value"), [
    ("temperature", -1), ("temperature", "hot"), ("temperature", True), ("temperature", None),
    ("top_k", -1), ("top_k", 1.5), ("top_k", False), ("top_p", 0), ("top_p", 1.5), ("min_p", 1),
    ("min_p", -0.1), ("repetition_penalty", 0), ("repetition_penalty", [1]), ("seed", -1), ("seed", "x"),
    ("seed", 2**63), ("recent_tokens", "abc"), ("recent_tokens", [VOCAB]), ("recent_tokens", [True]),
    ("recent_tokens", [1, -1]), ("recent_tokens", {"a": 1}),
], ids=lambda v: repr(v)[:20])
def test_invalid_sampling_field_is_an_error_naming_it(name: str, value: Any) -> None:
    reply = one(1, 2, req("forward_and_sample", rid=11, **{name: value}))
    assert reply["request_id"] == 11
    assert name in reply["error"]


# --- line handling ------------------------------------------------------------------------------------------

def test_overlong_line_gets_one_error_and_the_next_line_is_served() -> None:
    cap = 256
    long_line = b'{"op": "ping", "request_id": 2, "pad": "' + b"x" * 5000 + b'"}\n'
    data = request_line(req("ping", 1)) + long_line + request_line(req("ping", 3))
    replies, reason = serve_bytes(make_worker(0, 2), data, cap=cap)
    assert reason == "eof"
    assert len(replies) == 3
    assert replies[0]["request_id"] == 1 and replies[2]["request_id"] == 3
    assert str(cap) in replies[1]["error"] and "request_id" not in replies[1]


def test_line_of_exactly_the_cap_is_served_and_one_more_byte_is_not() -> None:
    cap = 1024
    body = json.dumps(req("ping", 1)).encode()
    exact = body + b" " * (cap - len(body))  # trailing spaces are legal JSON whitespace
    assert len(exact) == cap
    replies, _ = serve_bytes(make_worker(0, 2), exact + b"\n" + exact + b" \n", cap=cap)
    assert replies[0] == {"request_id": 1, "pong": True, "uptime_ms": replies[0]["uptime_ms"]}
    assert "error" in replies[1] and "request_id" not in replies[1]


def test_long_line_memory_is_not_kept() -> None:
    cap, size = 4096, 16 << 20
    sizes: list[int] = []

    class Probe(io.BytesIO):
        def read1(self, n: int = -1) -> bytes:
            sizes.append(sys.getsizeof(reader._buf))  # memory the reader holds before each read
            return super().read1(n)

    ping = request_line(req("ping", 9))
    reader = LineReader(Probe(b"y" * size + b"\n" + ping), cap)
    assert reader.next_line() is OVERLONG
    assert sys.getsizeof(reader._buf) < 64 << 10  # the long line's bytes are gone
    assert max(sizes) < size // 4  # and they never all sat in memory at once
    assert reader.next_line() == ping.rstrip(b"\n")
    assert reader.next_line() is None


def test_overlong_last_line_without_newline() -> None:
    replies, reason = serve_bytes(make_worker(0, 2), request_line(req("ping", 1)) + b"z" * 10_000, cap=1024)
    assert reason == "eof" and len(replies) == 2 and "error" in replies[1]


def test_last_line_without_newline_is_answered() -> None:
    replies, reason = serve_bytes(make_worker(0, 2), request_line(req("ping", 1)) + json.dumps(req("ping", 2)).encode())
    assert reason == "eof"
    assert [r["request_id"] for r in replies] == [1, 2]


BLANK_LINES = [b"", b"   ", b"\t", b"\r", b"\x0b\x0c", b"\x1c\x1f", "\u00a0 \u2028\u3000".encode()]


@pytest.mark.parametrize("line", BLANK_LINES)
def test_blank_lines_get_no_reply(line: bytes) -> None:
    # the seed skipped whitespace-only lines (str.strip); an unsolicited reply would desynchronise a caller that
    # matches replies by order
    worker = make_worker(0, 2)
    replies, _ = serve_bytes(worker, line + b"\n" + request_line(req("ping", 4)) + line)
    assert [r["request_id"] for r in replies] == [4]
    assert worker.clock.requests_served == 1


@pytest.mark.parametrize("line", [b"\xff", "\u00a0x".encode(), b" \x00 ", b"  x  "])
def test_lines_that_only_look_blank_are_answered(line: bytes) -> None:
    replies, _ = serve_bytes(make_worker(0, 2), line + b"\n")
    assert len(replies) == 1 and "error" in replies[0] and "request_id" not in replies[0]


def test_crlf_line_endings_are_served() -> None:
    replies, _ = serve_bytes(make_worker(0, 2), json.dumps(req("ping", 5)).encode() + b"\r\n")
    assert replies[0]["request_id"] == 5 and replies[0]["pong"] is True


def test_no_input_means_no_replies() -> None:
    assert serve_bytes(make_worker(0, 2), b"") == ([], "eof")


# --- request_id on replies, never on events ----------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    {"op": "no_such_op", "request_id": 3},
    {"request_id": 3},
    {"op": 7, "request_id": 3},
    {"op": "forward_range", "request_id": 3},  # wrong role on stage 0
    {"op": "embed_and_forward", "request_id": 3, "tokens": []},
    {"op": "embed_and_forward", "request_id": 3, "tokens": [1], "position": -1},
    {"op": "decode_step", "request_id": 3, "token_id": True, "position": 0},
    {"op": "tokenize", "request_id": 3, "prompt": None},
], ids=lambda r: json.dumps(r)[:50])
def test_error_replies_carry_a_usable_request_id(bad: dict[str, Any]) -> None:
    reply = one(0, 2, bad)
    assert reply["request_id"] == 3 and isinstance(reply["error"], str) and reply["error"]


@pytest.mark.parametrize("line", [
    b'{"op": "ping", "request_id": true}',
    b'{"op": "ping", "request_id": -3}',
    b'{"op": "ping", "request_id": 3.0}',
    b'{"op": "ping", "request_id": "3"}',
    b'{"op": "ping"}',
    b'[{"op": "ping", "request_id": 3}]',
    b'{"op": "ping", "request_id": 3',
    b'{"op": "ping", "request_id": 3, "request_id": 4}',
    b'{"op": "ping", "x": NaN}',
    b'{"op": "ping", "request_id": NaN}',
])
def test_error_replies_without_a_usable_request_id_carry_none(line: bytes) -> None:
    replies, _ = serve_bytes(make_worker(0, 2), line + b"\n")
    assert len(replies) == 1
    assert "request_id" not in replies[0] and replies[0]["error"]


@pytest.mark.parametrize("line", [
    b'{"op": "ping", "request_id": 3, "x": NaN}',  # json.dumps of a Python caller's float("nan")
    b'{"op": "decode_step", "request_id": 3, "position": 1, "token_id": 5, "temperature": Infinity}',
    b'{"op": "ping", "request_id": 3, "x": 1e999}',
    b'{"op": "ping", "op": "status", "request_id": 3}',
])
def test_a_line_strict_json_refuses_still_gets_its_error_under_its_request_id(line: bytes) -> None:
    """Not strict JSON, but its request is plain: the error names it, so a caller waiting on it is answered."""
    replies, _ = serve_bytes(make_worker(0, 2), line + b"\n")
    assert len(replies) == 1 and replies[0]["request_id"] == 3
    assert "invalid JSON" in replies[0]["error"] or "duplicate key" in replies[0]["error"]


def test_unknown_op_error_does_not_echo_a_huge_op() -> None:
    reply = one(0, 2, {"op": "x" * 100_000, "request_id": 8})
    assert reply["request_id"] == 8 and len(reply["error"]) < 1000


def test_events_never_carry_request_id() -> None:
    sink = io.BytesIO()
    events = Events(Out(sink), 2, Clock())
    events.emit("custom", request_id=5, detail="x")
    events.heartbeat()
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert lines[0] == {"event": "custom", "stage_index": 2, "detail": "x"}
    assert lines[1]["event"] == "heartbeat" and lines[1]["stage_index"] == 2 and "request_id" not in lines[1]
    assert {"uptime_ms", "rss_mb", "requests_served"} <= lines[1].keys()


def test_lone_surrogate_in_prompt_is_a_field_error() -> None:
    reply = one(0, 2, {"op": "tokenize", "request_id": 1, "prompt": "a \ud800 b"})
    assert reply["request_id"] == 1
    assert "'prompt'" in reply["error"] and not reply["error"].startswith("internal error")
