"""Property tests: whatever a line holds, the loop answers it with exactly one JSON reply and keeps going."""

from __future__ import annotations

import base64
import json
from typing import Any

from conftest import make_worker, serve_bytes
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from pp_worker.worker.dispatch import OPS, Worker

# one worker per role, shared by all examples: a long-lived worker must survive everything thrown at it
WORKERS: dict[tuple[int, int], Worker] = {key: make_worker(*key) for key in [(0, 2), (1, 3), (1, 2)]}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=30)


def check_one_reply(worker: Worker, line: bytes) -> dict[str, Any]:
    """Serve one line (with its newline) through the loop; exactly one reply, a JSON object, comes back."""
    assert b"\n" not in line
    served_before = worker.clock.requests_served
    replies, reason = serve_bytes(worker, line + b"\n")
    assert len(replies) == 1, replies
    assert reason in ("eof", "shutdown")
    assert isinstance(replies[0], dict)
    assert worker.clock.requests_served == served_before + 1
    worker.shutdown_requested = False  # a fuzzed shutdown must not stop the next example's loop early
    return replies[0]


def blank(line: bytes) -> bool:
    """Whitespace only, as the seed's str.strip saw it: such a line gets no reply."""
    try:
        return not line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def check_reply_matches(obj: Any, reply: dict[str, Any]) -> None:
    """An error names no id unless the request had a usable one (a non-negative int at the top of an object, the
    line's NaN and Infinity included: json.dumps writes no repeated key); a success always echoes it."""
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    usable = type(rid) is int and rid >= 0
    if "error" in reply:
        assert isinstance(reply["error"], str) and reply["error"]
        if "request_id" in reply:
            assert usable and reply["request_id"] == rid
        else:  # huge ids may be refused as unusable; small ones must be echoed
            assert not usable or rid > 2**31
    else:
        assert usable and reply["request_id"] == rid
    assert "event" not in reply and "status" not in reply


@FUZZ
@given(value=json_values, key=st.sampled_from(sorted(WORKERS)))
def test_random_json_values(value: Any, key: tuple[int, int]) -> None:
    line = json.dumps(value).encode()  # NaN/Infinity included: json.dumps writes them, the worker must refuse
    check_reply_matches(value, check_one_reply(WORKERS[key], line))


# well-formed payloads of 0..4 positions (16 fp16 values each), so some forward ops get past validation
hidden_texts = st.integers(0, 4).flatmap(lambda n: st.binary(min_size=n * 32, max_size=n * 32)).map(
    lambda b: base64.b64encode(b).decode())

field_values = (json_values | st.integers(0, 40) | st.lists(st.integers(0, 40), max_size=6)
                | st.builds(lambda n: "A" * n, st.integers(0, 200)))


ZEROS = base64.b64encode(bytes(2 * 16 * 2)).decode()  # seq_len 2
TEMPLATES: list[dict[str, Any]] = [  # valid requests, some for the wrong role: mutated below
    {"op": "tokenize", "prompt": "a b c"}, {"op": "detokenize", "tokens": [1, 2]},
    {"op": "embed_and_forward", "tokens": [1, 2], "position": 0}, {"op": "decode_step", "token_id": 3, "position": 2},
    {"op": "forward_range", "hidden_b64": ZEROS, "position": 0, "seq_len": 2},
    {"op": "forward_and_sample", "hidden_b64": ZEROS, "position": 0, "seq_len": 2, "temperature": 0.7, "seed": 1},
    {"op": "status"}, {"op": "ping"}, {"op": "release"}, {"op": "shutdown"},
]


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):  # a valid request with a few fields replaced, dropped or added
        obj = {**draw(st.sampled_from(TEMPLATES)), "request_id": draw(st.integers(0, 1000))}
        for name in draw(st.lists(st.sampled_from(sorted(obj)) | st.text(max_size=8), max_size=2)):
            if draw(st.booleans()):
                obj[name] = draw(field_values)
            else:
                obj.pop(name, None)
        return obj
    obj = {}
    if draw(st.integers(0, 9)):
        obj["op"] = draw(st.sampled_from(sorted(OPS)) | st.text(max_size=12) | scalars)
    if draw(st.integers(0, 9)):
        obj["request_id"] = draw(st.integers(0, 2**53) | st.integers(-(2**60), 2**60) | scalars)
    names = ["tokens", "token_id", "position", "seq_len", "hidden_b64", "prompt", "temperature", "top_k", "top_p",
             "min_p", "repetition_penalty", "seed", "recent_tokens"]
    for name in draw(st.lists(st.sampled_from(names) | st.text(max_size=8), max_size=8)):
        obj[name] = draw(hidden_texts if name == "hidden_b64" and draw(st.booleans()) else field_values)
    return obj


@FUZZ
@given(obj=requests(), key=st.sampled_from(sorted(WORKERS)))
def test_random_requests(obj: dict[str, Any], key: tuple[int, int]) -> None:
    reply = check_one_reply(WORKERS[key], json.dumps(obj).encode())
    check_reply_matches(obj, reply)
    event("served" if "error" not in reply else "refused")  # --hypothesis-show-statistics shows the mix


@FUZZ
@given(lines=st.lists(st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"")), min_size=1, max_size=8),
       key=st.sampled_from(sorted(WORKERS)), final_newline=st.booleans())
def test_random_bytes_lines(lines: list[bytes], key: tuple[int, int], final_newline: bool) -> None:
    # hypothesis mines the code's own strings, so it can write a real shutdown request, after which the worker
    # rightly reads no further (tests of shutdown live elsewhere)
    assume(not any(b"shutdown" in line for line in lines))
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    if not final_newline and lines[-1] == b"":
        lines = lines[:-1]  # nothing after the last newline: no line there
    WORKERS[key].shutdown_requested = False  # examples share the worker: start each from a serving state
    replies, reason = serve_bytes(WORKERS[key], data, cap=128)  # some lines are over the cap
    assert reason == "eof"
    assert len(replies) == len([line for line in lines if len(line) > 128 or not blank(line)])
    assert all(isinstance(r, dict) and ("error" in r or "request_id" in r) for r in replies)


@FUZZ
@given(line=st.binary(max_size=300).filter(lambda b: b"\n" not in b and not blank(b)),
       key=st.sampled_from(sorted(WORKERS)))
def test_random_bytes_single_line(line: bytes, key: tuple[int, int]) -> None:
    reply = check_one_reply(WORKERS[key], line)
    if "error" not in reply:  # only a real request succeeds (hypothesis mines the code's strings and can write one)
        obj = json.loads(line)
        assert isinstance(obj, dict) and obj.get("op") in OPS and reply["request_id"] == obj["request_id"]
