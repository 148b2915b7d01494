"""The line codec both ends use: strict JSON, the spliced base64 payload, and the long-line fast path."""

from __future__ import annotations

import base64
import json

import pytest
from conftest import make_worker
from hypothesis import given
from hypothesis import strategies as st

from pp_worker.wire import B64, WireError, b64_len, encode_payload, parse_json, to_line
from pp_worker.worker.protocol import decode_hidden

HIDDEN_DIM = 16


# --- parse_json ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line", [
    b"\xff\xfe{}",  # invalid UTF-8
    b'{"op": "ping", "request_id": 1, "x": "\xc3\x28"}',  # invalid continuation byte inside a string
    b'{"request_id": 1, "op": "ping", "x": NaN}',
    b'{"x": Infinity}',
    b'{"x": -Infinity}',
    b"NaN",
    b'{"x": 1e400}',
    b'{"x": -1e400}',
    b'{"op": "ping", "op": "status", "request_id": 1}',  # duplicate keys
    b'{"a": {"k": 1, "k": 2}}',  # duplicate keys, nested
    b"[" * 100_000,  # 100k deep, unclosed
    b"[" * 100_000 + b"]" * 100_000,  # 100k deep, well-formed
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b"1" * 10_000,  # an int of 10000 digits
    b'{"request_id": ' + b"9" * 10_000 + b"}",
    b"{",
    b"",
    b"{} {}",
    b"'single'",
])
def test_parse_json_rejects(line: bytes) -> None:
    with pytest.raises(WireError):
        parse_json(line)
    reply = make_worker(0, 2).handle_line(line)  # the worker's error reply, under the id where one is unambiguous
    assert "error" in reply
    if line in (b'{"request_id": 1, "op": "ping", "x": NaN}', b'{"op": "ping", "op": "status", "request_id": 1}'):
        assert reply["request_id"] == 1  # JSON but for a NaN or a repeated key: its request is answered
    else:
        assert "request_id" not in reply


def test_parse_json_message_names_the_problem() -> None:
    with pytest.raises(WireError, match="UTF-8"):
        parse_json(b"\x80")
    with pytest.raises(WireError, match="duplicate key 'op'"):
        parse_json(b'{"op": 1, "op": 2}')
    with pytest.raises(WireError, match="nested too deeply"):
        parse_json(b"[" * 100_000)


def test_parse_json_accepts_strict_json() -> None:
    assert parse_json(b'{"op": "ping", "request_id": 3, "f": 1.5e3, "u": "\xc3\xa9"}') == {
        "op": "ping", "request_id": 3, "f": 1500.0, "u": "\u00e9"}
    assert parse_json(b' {"a": [1, 2, {"b": null}]}\r') == {"a": [1, 2, {"b": None}]}  # CRLF line ending
    assert parse_json(b"1e308") == 1e308


@pytest.mark.parametrize("seq_len", [1, 2, 3, 5, 64])
def test_b64_len_matches_the_encoder(seq_len: int) -> None:
    n_bytes = seq_len * HIDDEN_DIM * 2
    assert b64_len(n_bytes) == len(base64.b64encode(b"\0" * n_bytes))



@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=20), st.booleans(), st.none()),
                       max_size=4),
       st.binary(max_size=64))
def test_a_spliced_payload_line_is_exactly_what_json_dumps_writes(fields: dict, payload: bytes) -> None:
    obj = {**fields, "hidden_b64": encode_payload(payload), "seq_len": 1}
    line = to_line(obj)
    assert line == (json.dumps({k: str(v) if isinstance(v, B64) else v for k, v in obj.items()}) + "\n").encode()
    assert json.loads(line)["hidden_b64"] == base64.b64encode(payload).decode()


_SCALARS = st.one_of(st.integers(), st.text(max_size=12), st.booleans(), st.none(),
                     st.floats(allow_nan=False, allow_infinity=False))


@given(st.recursive(st.dictionaries(st.text(max_size=6), _SCALARS, max_size=4),
                    lambda inner: st.dictionaries(st.one_of(st.text(max_size=6), st.integers()),
                                                  st.one_of(inner, st.lists(_SCALARS, max_size=3)), max_size=3),
                    max_leaves=12))
def test_every_line_is_exactly_what_json_dumps_writes(obj: dict) -> None:
    """Decode steps' lines are built without the encoder when every value is plain; any line, either way, is
    byte for byte the encoder's (lists and integer keys: the encoder takes those)."""
    assert to_line(obj) == (json.dumps(obj) + "\n").encode()


def test_a_line_that_json_refuses_is_refused() -> None:
    with pytest.raises(ValueError):
        to_line({"request_id": 1, "x": {"y": float("nan")}})


@pytest.mark.parametrize("text", ['AAAA", "position": 9, "x": "', "AA\nA", "AAA\u00e9", "AA=A"])
def test_text_from_a_worker_is_checked_before_it_is_spliced(text: str) -> None:
    with pytest.raises(ValueError):
        B64.checked(text)
    assert B64.checked("QUJD") == "QUJD"


# --- the long-line fast path: a payload cut out before JSON sees it must change nothing but speed -------------
def _both_ways(line: bytes) -> tuple[object, object]:
    """(full JSON parse, parse with the payload cut out) as values or the WireError message class."""
    def run(split_from: int) -> object:
        try:
            obj = parse_json(line, split_from=split_from)
        except WireError:
            return "error"
        if isinstance(obj, dict) and isinstance(obj.get("hidden_b64"), B64):
            obj = {**obj, "hidden_b64": str(obj["hidden_b64"])}
        return obj

    return run(len(line) + 1), run(0)


@pytest.mark.parametrize("line", [
    b'{"op": "forward_range", "request_id": 1, "hidden_b64": "QUJD", "position": 0, "seq_len": 1}',
    b'{"hidden_b64"  :\t"QUJD"}',
    b'{"x": {"hidden_b64": "QUJD"}, "hidden_b64": ""}',  # the one occurrence is nested: the top-level is not it
    b'{"x": {"hidden_b64": "QUJD"}}',
    b'{"hidden_b64": "QU\\u004aD"}',  # an escape: JSON must decode it
    b'{"hidden_b64": "QUJD", "hidden\\u005fb64": "QUJD"}',  # a duplicate key spelled with an escape
    b'{"hidden_b64": "QUJD", "hidden_b64": "QUJD"}',
    b'{"hidden_b64": "QU\x01JD"}',  # a control character JSON refuses
    b'{"hidden_b64": "QUJD\xff"}',  # not UTF-8
    b'{"hidden_b64": "QUJD" "x"}',
    b'["hidden_b64", "QUJD"]',
    b'{"hidden_b64": "QUJD"',
    b'{"note": "\\"hidden_b64\\": \\"QUJD\\"", "hidden_b64": "QUJD"}',
    b'{"hidden_b64": 5}',
])
def test_cutting_the_payload_out_gives_what_a_full_parse_gives(line: bytes) -> None:
    full, split = _both_ways(line)
    assert split == full


@given(st.dictionaries(st.sampled_from(["op", "request_id", "hidden_b64", "position", "seq_len", "x"]),
                       st.one_of(st.integers(), st.text(alphabet="AB+/=\"\\ \x01é", max_size=12), st.none()),
                       max_size=5))
def test_cutting_the_payload_out_gives_what_a_full_parse_gives_on_random_requests(obj: dict) -> None:
    full, split = _both_ways(json.dumps(obj).encode())
    assert split == full


def test_a_long_line_hands_its_payload_over_uncut_by_json() -> None:
    payload = base64.b64encode(bytes(3 * 40_000))
    line = b'{"op": "forward_range", "request_id": 1, "hidden_b64": "' + payload + b'", "seq_len": 1}'
    cut = parse_json(line)["hidden_b64"]
    assert isinstance(cut, B64) and cut.data == payload  # JSON never scanned it
    assert decode_hidden(parse_json(line), 1, 60_000) == bytes(3 * 40_000)
