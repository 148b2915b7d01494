"""Q8 hidden states on the wire: the codec's error bound and edge rows, the payload checks of a q8 request, and a
stub stage that emits q8 while its f16 replies stay the contract's, byte for byte."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import threading
from typing import Any

import numpy as np
import pytest
from conftest import make_worker, request_line, serve_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pp_worker.wire import b64_len
from pp_worker.worker import cli, q8
from pp_worker.worker.dispatch import Worker
from pp_worker.worker.engines.stub import StubEngine
from pp_worker.worker.events import Clock, Events
from pp_worker.worker.loop import LoopState
from pp_worker.worker.protocol import ProtocolError, decode_hidden
from pp_worker.worker.stdout import Out

D = 16  # the stub's hidden_dim
FP16_MAX = float(np.finfo(np.float16).max)


def roundtrip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(decoded float16 rows, the scales as sent, the payload) of float16 rows x (T, D)."""
    t, d = x.shape
    payload = q8.encode(x.astype("<f2").tobytes(), d)
    scales = np.frombuffer(payload, dtype="<f4", count=t)
    return np.frombuffer(q8.decode(payload, t, d), dtype="<f2").reshape(t, d), scales, payload


def assert_within_half_a_step(x: np.ndarray, y: np.ndarray, scales: np.ndarray) -> None:
    """|x - y| <= scale / 2 per element, plus the rounding of the decoded value to float16 (half an ulp of y,
    at most |y| * 2**-11, or 2**-25 among the subnormals)."""
    x32, y32 = x.astype(np.float64), y.astype(np.float64)
    half_ulp = np.abs(y32) * 2.0**-11 + 2.0**-25
    bound = scales.astype(np.float64)[:, None] / 2 * (1 + 1e-6) + half_ulp
    assert (np.abs(x32 - y32) <= bound).all(), np.max(np.abs(x32 - y32) - bound)


finite_fp16 = st.floats(-FP16_MAX, FP16_MAX, width=16, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float16, hnp.array_shapes(min_dims=2, max_dims=2, max_side=40), elements=finite_fp16))
def test_every_element_comes_back_within_half_a_quantization_step(x: np.ndarray) -> None:
    y, scales, payload = roundtrip(x)
    t, d = x.shape
    assert len(payload) == q8.payload_bytes("q8", t, d) == t * (d + 4)
    assert np.isfinite(y).all()
    absmax = np.abs(x.astype(np.float32)).max(axis=1)
    assert np.allclose(scales, absmax / 127, rtol=1e-6, atol=0)  # symmetric absmax, per row
    assert_within_half_a_step(x, y, scales)


def test_each_row_has_its_own_scale() -> None:
    """A token with small activations keeps its precision next to one with an outlier (per-row, not per-tensor)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    x[0] *= 0.01
    x[1, 7] = 1000.0  # an outlier channel in the other row
    x = x.astype(np.float16)
    y, scales, _ = roundtrip(x)
    assert_within_half_a_step(x, y, scales)
    small = np.abs(x[0]).max()
    assert np.abs(x[0].astype(np.float32) - y[0]).max() <= small / 254 + small * 2**-10


def test_edge_rows() -> None:
    x = np.array([
        [0.0] * 4,  # all zero: scale 0, decodes to zeros (no division by zero)
        [-0.0, 0.0, -0.0, 0.0],
        [3.5] * 4,  # all equal: exact
        [-2.0, -2.0, -2.0, -2.0],
        [FP16_MAX, -FP16_MAX, 1.0, 0.0],  # float16's extremes clamp to themselves, never to inf
        [6e-8, -6e-8, 0.0, 6e-8],  # subnormals: the float32 scale keeps them
        [1.0, 1e-3, -1e-3, 0.0],  # a small value in a row with a large one rounds to 0: within the bound
    ], dtype=np.float16)
    y, scales, _ = roundtrip(x)
    assert (y[0] == 0).all() and scales[0] == 0 and (y[1] == 0).all()
    assert (y[2] == 3.5).all() and (y[3] == -2.0).all()
    assert y[4, 0] == FP16_MAX and y[4, 1] == -FP16_MAX and np.isfinite(y).all()
    assert (np.sign(y[5]) == np.sign(x[5])).all() and y[5, 0] > 0
    assert y[6, 1] == 0 and y[6, 0] == 1.0
    assert_within_half_a_step(x, y, scales)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_input_is_refused_not_encoded(bad: float) -> None:
    x = np.ones((3, 4), dtype=np.float16)
    x[2, 1] = bad
    with pytest.raises(q8.Q8Error, match="inf or NaN in 1 row.*row 2"):
        q8.encode(x.tobytes(), 4)


def _payload(scales: list[float], values: list[list[int]]) -> bytes:
    return np.asarray(scales, dtype="<f4").tobytes() + np.asarray(values, dtype=np.int8).tobytes()


@pytest.mark.parametrize(("scale", "message"), [(-1.0, "scale of row 1"), (np.nan, "scale of row 1"),
                                                (np.inf, "scale of row 1"), (1e6, "scale of row 1")])
def test_decode_refuses_scales_that_would_not_give_finite_float16(scale: float, message: str) -> None:
    with pytest.raises(q8.Q8Error, match=message):
        q8.decode(_payload([1.0, scale], [[1, 2], [3, 4]]), 2, 2)


def test_decode_refuses_minus_128() -> None:
    with pytest.raises(q8.Q8Error, match=r"\[-127, 127\]"):
        q8.decode(_payload([q8.MAX_SCALE], [[1, -128]]), 1, 2)  # -128 * the largest scale is past float16's range


def test_q8_size_differs_from_f16_size() -> None:
    for d in (1, 2, 3, 5, 16, 4096):
        assert q8.payload_bytes("q8", 7, d) != q8.payload_bytes("f16", 7, d)
    assert q8.payload_bytes("q8", 1, 4) == q8.payload_bytes("f16", 1, 4)  # why the worker refuses q8 at D = 4


# --- the request's payload ----------------------------------------------------------------------------------

def q8_b64(seq_len: int, hidden_dim: int = D, seed: int = 0) -> str:
    x = np.random.default_rng(seed).standard_normal((seq_len, hidden_dim)).astype(np.float16)
    return base64.b64encode(q8.encode(x.tobytes(), hidden_dim)).decode()


def test_q8_payload_decodes_to_float16_for_the_engine() -> None:
    text = q8_b64(3)
    data = decode_hidden({"hidden_b64": text, "hidden_dtype": "q8"}, 3, D)
    assert data == q8.decode(base64.b64decode(text), 3, D) and len(data) == 3 * D * 2
    f16 = base64.b64encode(bytes(3 * D * 2)).decode()
    for req in ({"hidden_b64": f16}, {"hidden_b64": f16, "hidden_dtype": "f16"}):
        assert decode_hidden(req, 3, D) == bytes(3 * D * 2)  # no field, or "f16": float16 as the contract has it


def test_a_q8_payload_without_its_dtype_is_known_by_its_length() -> None:
    """A caller that forwards only hidden_b64, seq_len and position (the seed's fields) hands q8 on intact."""
    text = q8_b64(3)
    assert decode_hidden({"hidden_b64": text}, 3, D) == decode_hidden({"hidden_b64": text, "hidden_dtype": "q8"}, 3, D)


def test_an_f16_payload_marked_q8_is_an_error_that_says_so() -> None:
    f16 = base64.b64encode(bytes(3 * D * 2)).decode()
    with pytest.raises(ProtocolError, match=r"got 128 base64 chars; expected for hidden_dtype 'q8' 80 chars "
                                            r"\(q8: 3\*\(16\+4\) = 60 bytes\); that is the size of a f16 payload$"):
        decode_hidden({"hidden_b64": f16, "hidden_dtype": "q8"}, 3, D)


def test_q8_size_mismatch() -> None:
    with pytest.raises(ProtocolError, match=rf"seq_len 3: got {b64_len(40)} base64 chars; expected for hidden_dtype "
                                            r"'q8' 80 chars \(q8: 3\*\(16\+4\) = 60 bytes\)$"):
        decode_hidden({"hidden_b64": q8_b64(2), "hidden_dtype": "q8"}, 3, D)


@pytest.mark.parametrize("dtype", ["Q8", "int8", "fp16", "", None, 8, ["q8"]])
def test_unknown_dtype_is_named(dtype: Any) -> None:
    with pytest.raises(ProtocolError, match=r"'hidden_dtype' must be one of 'f16', 'q8', 'f32', got"):
        decode_hidden({"hidden_b64": q8_b64(1), "hidden_dtype": dtype}, 1, D)


def test_bad_q8_contents_are_protocol_errors() -> None:
    bad = base64.b64encode(_payload([-1.0], [[0] * D])).decode()
    with pytest.raises(ProtocolError, match="invalid q8 hidden_b64: q8 scale of row 0 is -1.0"):
        decode_hidden({"hidden_b64": bad, "hidden_dtype": "q8"}, 1, D)


# --- a stage that emits q8 ----------------------------------------------------------------------------------

def q8_worker(stage: int, num_stages: int) -> Worker:
    return Worker(StubEngine(stage, num_stages), Clock(), "stub", wire_dtype="q8")


def serve_one(worker: Worker, request: dict[str, Any]) -> dict[str, Any]:
    replies, _ = serve_bytes(worker, request_line(request))
    return replies[0]


def test_f16_replies_are_unchanged_and_q8_replies_say_their_dtype() -> None:
    embed = {"op": "embed_and_forward", "request_id": 1, "tokens": [3, 1, 4], "position": 0}
    f16 = serve_one(make_worker(0, 3), embed)
    assert set(f16) == {"request_id", "hidden_b64", "seq_len"}  # the contract's reply, no new field
    reply = serve_one(q8_worker(0, 3), embed)
    assert reply["hidden_dtype"] == "q8" and reply["seq_len"] == 3
    exact = np.frombuffer(base64.b64decode(f16["hidden_b64"]), dtype="<f2").reshape(3, D)
    y, scales, payload = roundtrip(exact)
    assert base64.b64decode(reply["hidden_b64"]) == payload  # the engine's float16 state, quantized
    assert_within_half_a_step(exact, y, scales)


def test_a_q8_stage_accepts_either_dtype_and_emits_q8() -> None:
    w = q8_worker(1, 3)
    f16 = base64.b64encode(bytes(2 * D * 2)).decode()
    hop = {"op": "forward_range", "request_id": 2, "position": 0, "seq_len": 2}
    for extra in ({"hidden_b64": f16}, {"hidden_b64": q8_b64(2), "hidden_dtype": "q8"}):
        reply = serve_one(w, hop | extra)
        assert reply["hidden_dtype"] == "q8" and len(base64.b64decode(reply["hidden_b64"])) == 2 * (D + 4), reply


def test_an_f16_stage_reads_q8_and_the_errors_are_replies() -> None:
    w = make_worker(2, 3)
    hop = {"op": "forward_and_sample", "request_id": 4, "position": 0, "seq_len": 2, "hidden_b64": q8_b64(2)}
    replies, _ = serve_bytes(w, b"".join(request_line(r) for r in (
        hop | {"hidden_dtype": "q8"}, hop, hop | {"hidden_dtype": "bf16"})))
    assert isinstance(replies[0]["token_id"], int)
    assert replies[1] == replies[0]  # without its hidden_dtype: known by its length
    assert replies[2]["request_id"] == 4 and "'hidden_dtype' must be one of" in replies[2]["error"]


def test_a_q8_wire_cannot_carry_a_non_finite_output() -> None:
    engine = StubEngine(0, 2)
    engine.embed_and_forward = lambda session, tokens, position: np.full(len(tokens) * D, np.inf, "<f2").tobytes()
    w = Worker(engine, Clock(), "stub", wire_dtype="q8")
    reply = serve_one(w, {"op": "embed_and_forward", "request_id": 9, "tokens": [1], "position": 0})
    assert reply == {"request_id": 9, "error": "hidden state has inf or NaN in 1 row(s) (first: row 0); q8 cannot "
                                               "carry them"}


def test_status_reports_the_wire_dtype() -> None:
    for w, dtype in ((make_worker(1, 3), "auto"), (q8_worker(1, 3), "q8")):
        assert serve_one(w, {"op": "status", "request_id": 1})["wire_dtype"] == dtype


def test_a_stage_of_hidden_dim_4_refuses_to_emit_q8(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    """At D = 4 a q8 payload is as long as an f16 one: a receiver could not tell a dropped hidden_dtype."""
    engine = StubEngine(0, 2)
    engine.info = dataclasses.replace(engine.info, hidden_dim=4)
    monkeypatch.setattr(cli, "_load", lambda cfg, events: engine)
    cfg = cli.parse_config([], {"STAGE": "0", "NUM_STAGES": "2", "PP_WORKER_STUB": "1", "PP_WIRE_DTYPE": "q8"})
    sink, clock = io.BytesIO(), Clock()
    wake_r, wake_w = os.pipe()
    try:
        assert cli._run(cfg, Out(sink), clock, Events(Out(sink), 0, clock), LoopState(), wake_r,
                        threading.Event()) == 2
    finally:
        os.close(wake_r)
        os.close(wake_w)
    assert b"ready" not in sink.getvalue()
    assert "PP_WIRE_DTYPE=q8 is invalid for hidden_dim 4" in capsys.readouterr().err
