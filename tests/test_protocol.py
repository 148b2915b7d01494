"""Request parsing at the edge: strict JSON, the envelope every request shares, each op's fields, the fp16 codec."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pp_worker.events import to_line
from pp_worker.protocol import (
    B64,
    Limits,
    ProtocolError,
    b64_len,
    decode_hidden,
    encode_hidden,
    parse_envelope,
    parse_fields,
    parse_json,
    request_id_of,
)

HIDDEN_DIM = 16  # the stub's, fixed by the contract
STUB = Limits(hidden_dim=HIDDEN_DIM, token_bound=None)
REAL = Limits(hidden_dim=HIDDEN_DIM, token_bound=32)


def hidden_b64(seq_len: int, fill: int = 0x3C) -> str:
    """A valid payload: seq_len * hidden_dim fp16 values, base64."""
    return base64.b64encode(bytes([fill]) * (seq_len * HIDDEN_DIM * 2)).decode()


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
    with pytest.raises(ProtocolError) as info:
        parse_json(line)
    assert info.value.request_id is None  # nothing could be trusted, not even an id


def test_parse_json_message_names_the_problem() -> None:
    with pytest.raises(ProtocolError, match="UTF-8"):
        parse_json(b"\x80")
    with pytest.raises(ProtocolError, match="duplicate key 'op'"):
        parse_json(b'{"op": 1, "op": 2}')
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_json(b"[" * 100_000)


def test_parse_json_accepts_strict_json() -> None:
    assert parse_json(b'{"op": "ping", "request_id": 3, "f": 1.5e3, "u": "\xc3\xa9"}') == {
        "op": "ping", "request_id": 3, "f": 1500.0, "u": "\u00e9"}
    assert parse_json(b' {"a": [1, 2, {"b": null}]}\r') == {"a": [1, 2, {"b": None}]}  # CRLF line ending
    assert parse_json(b"1e308") == 1e308


# --- envelope -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("obj", [[], [1, 2], "ping", 3, 1.5, None, True])
def test_envelope_rejects_non_objects(obj: Any) -> None:
    with pytest.raises(ProtocolError, match="JSON object") as info:
        parse_envelope(obj)
    assert info.value.request_id is None


def test_envelope_missing_op_keeps_the_usable_id() -> None:
    with pytest.raises(ProtocolError, match="'op'") as info:
        parse_envelope({"request_id": 7})
    assert info.value.request_id == 7


@pytest.mark.parametrize("op", [1, None, True, ["ping"], {"op": "ping"}])
def test_envelope_rejects_non_string_op(op: Any) -> None:
    with pytest.raises(ProtocolError, match="'op' must be a string") as info:
        parse_envelope({"op": op, "request_id": 4})
    assert info.value.request_id == 4


@pytest.mark.parametrize("rid", ["missing", None, True, False, -1, 1.0, 2.5, "1", [1], {"id": 1}, 2**53 + 1, 10**30])
def test_envelope_rejects_unusable_request_id(rid: Any) -> None:
    obj = {"op": "ping"} if rid == "missing" else {"op": "ping", "request_id": rid}
    with pytest.raises(ProtocolError, match="request_id") as info:
        parse_envelope(obj)
    assert info.value.request_id is None  # an unusable id is never echoed back
    assert request_id_of(obj) is None


@pytest.mark.parametrize("rid", [0, 1, 12345, 2**53])
def test_envelope_accepts(rid: int) -> None:
    obj = {"op": "tokenize", "request_id": rid, "prompt": "x"}
    assert parse_envelope(obj) == ("tokenize", rid, obj)
    assert request_id_of(obj) == rid


# --- fields of each op -------------------------------------------------------------------------------------

VALID: dict[str, dict[str, Any]] = {
    "tokenize": {"prompt": "hello world"},
    "detokenize": {"tokens": [1, 2, 3]},
    "embed_and_forward": {"tokens": [1, 2, 3], "position": 0},
    "decode_step": {"token_id": 5, "position": 3},
    "forward_range": {"hidden_b64": hidden_b64(2), "position": 4, "seq_len": 2},
    "forward_and_sample": {"hidden_b64": hidden_b64(1), "position": 9, "seq_len": 1},
}

BAD_INTS: list[Any] = [True, False, -1, 1.0, 0.5, "3", None, [3], {"v": 3}, 2**53 + 1]

# (op, field) for every int field; seq_len is also checked for 0 separately
INT_FIELDS = [("embed_and_forward", "position"), ("decode_step", "token_id"), ("decode_step", "position"),
              ("forward_range", "position"), ("forward_range", "seq_len"),
              ("forward_and_sample", "position"), ("forward_and_sample", "seq_len")]


DROP = object()  # as a field value in ``fields(...)``: leave the field out


def fields(op: str, lim: Limits = STUB, **change: Any) -> dict[str, Any]:
    """parse_fields of a valid request of ``op`` with some fields changed (or dropped)."""
    obj = {"op": op, "request_id": 1, **VALID[op], **change}
    return parse_fields(op, {k: v for k, v in obj.items() if v is not DROP}, lim)


@pytest.mark.parametrize("op", sorted(VALID))
def test_valid_fields_parse(op: str) -> None:
    got = fields(op)
    for name in ("prompt", "tokens", "position", "seq_len"):
        if name in VALID[op]:
            assert got[name] == VALID[op][name]


@pytest.mark.parametrize(("op", "name"), INT_FIELDS)
@pytest.mark.parametrize("bad", BAD_INTS, ids=repr)
def test_int_fields_reject_bools_negatives_and_other_types(op: str, name: str, bad: Any) -> None:
    with pytest.raises(ProtocolError, match=f"'{name}'"):
        fields(op, **{name: bad})


@pytest.mark.parametrize(("op", "name"), [f for f in INT_FIELDS if f != ("embed_and_forward", "position")])
def test_int_fields_are_required(op: str, name: str) -> None:
    with pytest.raises(ProtocolError, match=f"'{name}'"):
        fields(op, **{name: DROP})


def test_embed_position_defaults_to_zero() -> None:
    assert fields("embed_and_forward", position=DROP)["position"] == 0


@pytest.mark.parametrize("op", ["forward_range", "forward_and_sample"])
def test_seq_len_zero_is_rejected(op: str) -> None:
    with pytest.raises(ProtocolError, match="'seq_len'"):
        fields(op, seq_len=0, hidden_b64="")


@pytest.mark.parametrize("op", ["embed_and_forward", "detokenize"])
@pytest.mark.parametrize("bad", ["1 2", 3, None, {"0": 1}, True], ids=repr)
def test_tokens_must_be_a_list(op: str, bad: Any) -> None:
    with pytest.raises(ProtocolError, match="'tokens' must be a list"):
        fields(op, tokens=bad)


@pytest.mark.parametrize("op", ["embed_and_forward", "detokenize"])
@pytest.mark.parametrize("bad_item", [True, -1, 1.0, "1", None, [1], 2**53 + 1], ids=repr)
def test_tokens_items_must_be_non_negative_ints(op: str, bad_item: Any) -> None:
    with pytest.raises(ProtocolError, match="'tokens'"):
        fields(op, tokens=[1, bad_item, 2])


def test_embed_needs_tokens_but_detokenize_takes_none() -> None:
    with pytest.raises(ProtocolError, match="non-empty"):
        fields("embed_and_forward", tokens=[])
    assert fields("detokenize", tokens=[])["tokens"] == []
    with pytest.raises(ProtocolError, match="'tokens'"):
        fields("embed_and_forward", tokens=DROP)


def test_token_ids_bounded_by_the_vocab_when_the_engine_asks() -> None:
    assert fields("embed_and_forward", REAL, tokens=[0, 31])["tokens"] == [0, 31]
    assert fields("decode_step", REAL, token_id=31)["tokens"] == [31]
    for op, change in [("embed_and_forward", {"tokens": [32]}), ("detokenize", {"tokens": [0, 32]}),
                       ("decode_step", {"token_id": 32})]:
        with pytest.raises(ProtocolError, match="31"):
            fields(op, REAL, **change)
    assert fields("decode_step", STUB, token_id=1000)["tokens"] == [1000]  # the stub accepts any id


@pytest.mark.parametrize("bad", [None, 1, ["a"], {"a": 1}, True, 1.5], ids=repr)
def test_prompt_must_be_a_string(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="'prompt' must be a string"):
        fields("tokenize", prompt=bad)


def test_extra_fields_are_ignored() -> None:
    extra = {"temperature": "hot", "stream": True, "nested": {"deep": [1, 2]}, "tokens_extra": None}
    for op in VALID:
        assert fields(op, **extra) == fields(op)


def test_ops_without_fields_parse_to_nothing() -> None:
    for op in ("ping", "status", "release", "shutdown", "no_such_op"):
        assert parse_fields(op, {"op": op, "request_id": 1, "junk": [1]}, STUB) == {}


# --- hidden_b64 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["forward_range", "forward_and_sample"])
@pytest.mark.parametrize("seq_len", [1, 2, 3, 7])
def test_hidden_payload_length_must_match_seq_len(op: str, seq_len: int) -> None:
    n_bytes = seq_len * HIDDEN_DIM * 2
    assert len(fields(op, seq_len=seq_len, hidden_b64=hidden_b64(seq_len))["hidden"]) == n_bytes
    for wrong in (seq_len - 1, seq_len + 1):
        payload = base64.b64encode(b"\0" * (wrong * HIDDEN_DIM * 2)).decode()
        with pytest.raises(ProtocolError, match="seq_len"):
            fields(op, seq_len=seq_len, hidden_b64=payload)
    odd = base64.b64encode(b"\0" * (n_bytes - 1)).decode()  # one byte short, same number of base64 chars
    with pytest.raises(ProtocolError, match="seq_len"):
        fields(op, seq_len=seq_len, hidden_b64=odd)


def good_payload() -> str:
    text = hidden_b64(1, fill=0x41)
    assert len(text) == math.ceil(HIDDEN_DIM * 2 / 3) * 4 and text.endswith("=")  # 32 bytes -> 43 chars + "="
    return text


@pytest.mark.parametrize("mutate", [
    lambda t: "*" + t[1:],  # character outside the alphabet
    lambda t: t[:10] + "-" + t[11:],  # urlsafe alphabet is not accepted
    lambda t: t[:10] + " " + t[11:],  # whitespace inside
    lambda t: " " + t[:-1],  # leading whitespace
    lambda t: t[:-1] + "\n",  # a newline instead of the padding
    lambda t: t[:-1] + "A",  # padding missing
    lambda t: t[:-2] + "==",  # too much padding
    lambda t: t[:20] + "=" + t[21:],  # padding in the middle
    lambda t: t[:-1],  # too short
    lambda t: t + "=",  # too long
    lambda t: t.replace("Q", "\u0661"),  # a non-ASCII char
], ids=["bad-char", "urlsafe", "inner-space", "leading-space", "newline", "no-padding", "double-padding",
        "inner-padding", "short", "long", "non-ascii"])
def test_hidden_base64_is_strict(mutate: Any) -> None:
    text = mutate(good_payload())
    assert text != good_payload()
    with pytest.raises(ProtocolError, match="hidden"):
        decode_hidden({"hidden_b64": text}, 1, HIDDEN_DIM)


@pytest.mark.parametrize("bad", [None, 1, ["AAAA"], True])
def test_hidden_must_be_a_string(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="'hidden_b64' must be a string"):
        decode_hidden({"hidden_b64": bad}, 1, HIDDEN_DIM)
    with pytest.raises(ProtocolError, match="'hidden_b64'"):
        decode_hidden({}, 1, HIDDEN_DIM)


def test_oversized_payload_is_refused_without_echoing_it() -> None:
    huge = "A" * 10_000_000
    with pytest.raises(ProtocolError) as info:
        decode_hidden({"hidden_b64": huge}, 1, HIDDEN_DIM)
    assert len(str(info.value)) < 500


@pytest.mark.parametrize("seq_len", [1, 2, 3, 5, 64])
def test_b64_len_matches_the_encoder(seq_len: int) -> None:
    n_bytes = seq_len * HIDDEN_DIM * 2
    assert b64_len(n_bytes) == len(base64.b64encode(b"\0" * n_bytes))


@given(st.integers(1, 40).flatmap(lambda n: st.binary(min_size=n * HIDDEN_DIM * 2, max_size=n * HIDDEN_DIM * 2)))
def test_encode_decode_round_trip(raw: bytes) -> None:
    seq_len = len(raw) // (HIDDEN_DIM * 2)
    text = str(encode_hidden(raw))
    assert text.isascii()
    assert decode_hidden({"hidden_b64": text}, seq_len, HIDDEN_DIM) == raw
    assert encode_hidden(memoryview(raw)) == text  # engines may hand over a buffer


def test_round_trip_of_float16_values() -> None:
    values = np.array([[[0.0, -0.0, 1.0, -2.5, 65504.0, 6e-8, 0.333] + [0.125] * 9]], dtype="<f2")  # (1, 1, 16)
    text = str(encode_hidden(values.tobytes()))
    back = np.frombuffer(decode_hidden({"hidden_b64": text}, 1, HIDDEN_DIM), dtype="<f2").reshape(1, 1, HIDDEN_DIM)
    assert np.array_equal(back, values)


@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=20), st.booleans(), st.none()),
                       max_size=4),
       st.binary(max_size=64))
def test_a_spliced_payload_line_is_exactly_what_json_dumps_writes(fields: dict, payload: bytes) -> None:
    obj = {**fields, "hidden_b64": encode_hidden(payload), "seq_len": 1}
    line = to_line(obj)
    assert line == (json.dumps({k: str(v) if isinstance(v, B64) else v for k, v in obj.items()}) + "\n").encode()
    assert json.loads(line)["hidden_b64"] == base64.b64encode(payload).decode()


@pytest.mark.parametrize("text", ['AAAA", "position": 9, "x": "', "AA\nA", "AAA\u00e9", "AA=A"])
def test_text_from_a_worker_is_checked_before_it_is_spliced(text: str) -> None:
    with pytest.raises(ValueError):
        B64.checked(text)
    assert B64.checked("QUJD") == "QUJD"


# --- the long-line fast path: a payload cut out before JSON sees it must change nothing but speed -------------
def _both_ways(line: bytes) -> tuple[object, object]:
    """(full JSON parse, parse with the payload cut out) as values or the ProtocolError message class."""
    def run(split_from: int) -> object:
        try:
            obj = parse_json(line, split_from=split_from)
        except ProtocolError:
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
