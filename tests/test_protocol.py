"""Request validation at the edge: the envelope every request shares, each op's fields, the fp16 payload."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pp_worker.wire import encode_payload
from pp_worker.worker.protocol import (
    MAX_RECENT_TOKENS,
    Limits,
    ProtocolError,
    decode_hidden,
    logprobs_count,
    parse_envelope,
    parse_fields,
    parse_sampling,
    request_id_of,
)
from pp_worker.worker.sampling import SamplingParams

HIDDEN_DIM = 16  # the stub's, fixed by the contract
STUB = Limits(hidden_dim=HIDDEN_DIM, vocab_size=32, check_token_ids=False)
REAL = Limits(hidden_dim=HIDDEN_DIM, vocab_size=32)


def hidden_b64(seq_len: int, fill: int = 0x3C) -> str:
    """A valid payload: seq_len * hidden_dim fp16 values, base64."""
    return base64.b64encode(bytes([fill]) * (seq_len * HIDDEN_DIM * 2)).decode()


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


def test_a_missing_request_id_is_called_missing() -> None:
    with pytest.raises(ProtocolError, match=r"^missing 'request_id' field$"):
        parse_envelope({"op": "ping"})
    with pytest.raises(ProtocolError, match=r"^'request_id' must be a non-negative int, got null$"):
        parse_envelope({"op": "ping", "request_id": None})


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


@pytest.mark.parametrize("op, name, default", [("tokenize", "add_special", True), ("detokenize", "partial", False)])
def test_optional_flags_default_and_must_be_booleans(op: str, name: str, default: bool) -> None:
    assert fields(op)[name] is default  # the seed's requests, without the field, mean what they meant
    assert fields(op, **{name: not default})[name] is (not default)
    for bad in (1, 0, "true", None, [True]):
        with pytest.raises(ProtocolError, match=f"'{name}' must be true or false"):
            fields(op, **{name: bad})


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
    extra = {"colour": "hot", "stream": True, "nested": {"deep": [1, 2]}, "tokens_extra": None}
    for op in VALID:
        assert fields(op, **extra) == fields(op)
        if op != "forward_and_sample":  # the one op that has sampling fields
            assert fields(op, temperature="hot") == fields(op)


def test_ops_without_fields_parse_to_nothing() -> None:
    for op in ("ping", "status", "claim", "shutdown", "no_such_op"):
        assert parse_fields(op, {"op": op, "request_id": 1, "junk": [1]}, STUB) == {}


def test_release_takes_an_optional_keep_flag() -> None:
    assert parse_fields("release", {"op": "release", "request_id": 1}, STUB) == {"keep": False}
    assert parse_fields("release", {"op": "release", "request_id": 1, "keep": True}, STUB) == {"keep": True}
    with pytest.raises(ProtocolError, match="keep"):
        parse_fields("release", {"op": "release", "request_id": 1, "keep": 1}, STUB)


# --- hidden_b64 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["forward_range", "forward_and_sample"])
@pytest.mark.parametrize("seq_len", [1, 2, 3, 7])
def test_hidden_payload_length_must_match_seq_len(op: str, seq_len: int) -> None:
    n_bytes = seq_len * HIDDEN_DIM * 2
    assert len(fields(op, seq_len=seq_len, hidden_b64=hidden_b64(seq_len))["hidden"]) == n_bytes
    for wrong in (seq_len - 1, seq_len + 1):
        payload = base64.b64encode(b"\0" * (wrong * HIDDEN_DIM * 2)).decode()
        if wrong == 2 * seq_len:  # as long as a float32 payload of seq_len rows: the length says f32
            assert len(fields(op, seq_len=seq_len, hidden_b64=payload)["hidden"]) == 2 * n_bytes
            with pytest.raises(ProtocolError, match="seq_len"):  # unless the request says what it sends
                fields(op, seq_len=seq_len, hidden_b64=payload, hidden_dtype="f16")
            continue
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



@given(st.integers(1, 40).flatmap(lambda n: st.binary(min_size=n * HIDDEN_DIM * 2, max_size=n * HIDDEN_DIM * 2)))
def test_encode_decode_round_trip(raw: bytes) -> None:
    seq_len = len(raw) // (HIDDEN_DIM * 2)
    text = str(encode_payload(raw))
    assert text.isascii()
    assert decode_hidden({"hidden_b64": text}, seq_len, HIDDEN_DIM) == raw
    assert encode_payload(memoryview(raw)) == text  # engines may hand over a buffer


def test_round_trip_of_float16_values() -> None:
    values = np.array([[[0.0, -0.0, 1.0, -2.5, 65504.0, 6e-8, 0.333] + [0.125] * 9]], dtype="<f2")  # (1, 1, 16)
    text = str(encode_payload(values.tobytes()))
    back = np.frombuffer(decode_hidden({"hidden_b64": text}, 1, HIDDEN_DIM), dtype="<f2").reshape(1, 1, HIDDEN_DIM)
    assert np.array_equal(back, values)


# --- sampling fields (parse_sampling) ----------------------------------------------------------------------------


SAMPLING_VOCAB = 10


@pytest.mark.parametrize("req", [{}, {"op": "forward_and_sample", "session": "s", "hidden": "AAAA"}])
def test_no_sampling_fields_means_none(req: dict) -> None:
    assert parse_sampling(req, SAMPLING_VOCAB) is None


def test_all_fields_parse_to_typed_params() -> None:
    req = {"temperature": 1, "top_k": 5, "top_p": 1, "min_p": 0, "repetition_penalty": 1.3,
           "recent_tokens": [0, 9, 9], "seed": 2**63 - 1}
    params = parse_sampling(req, SAMPLING_VOCAB)
    assert params == SamplingParams(1.0, 5, 1.0, 0.0, 1.3, (0, 9, 9), 2**63 - 1)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert not params.greedy


@pytest.mark.parametrize("req", [{"seed": 7}, {"temperature": 0}, {"recent_tokens": []}, {"top_k": 0}])
def test_any_single_field_gives_params_with_defaults_elsewhere(req: dict) -> None:
    params = parse_sampling(req, SAMPLING_VOCAB)
    assert params is not None and params.greedy
    assert params.top_p == 1.0 and params.repetition_penalty == 1.0


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 100), ("temperature", 0.0), ("top_p", 1e-9), ("min_p", 0.999), ("repetition_penalty", 100),
     ("repetition_penalty", 1e-6), ("top_k", 10**6), ("seed", 0), ("presence_penalty", -2), ("frequency_penalty", 2.0),
     ("recent_tokens", [SAMPLING_VOCAB - 1] * MAX_RECENT_TOKENS)],
)
def test_values_on_the_edge_of_the_bounds_are_accepted(field: str, value: object) -> None:
    assert parse_sampling({field: value}, SAMPLING_VOCAB) is not None


NUMBER_REJECTS = [
    ("temperature", "[0, 100]", [True, -0.1, 100.5, "1", None, [1.0], math.nan, math.inf]),
    ("top_k", ">= 0", [True, -1, 1.0, "5", None]),
    ("top_p", "(0, 1]", [0, 0.0, 1.5, -0.2, False, True, math.nan, math.inf, "0.9"]),
    ("min_p", "[0, 1)", [1, 1.0, -0.01, True, math.nan, None]),
    ("repetition_penalty", "(0, 100]", [0, -1.0, 100.01, True, math.inf, "1.1"]),
    ("seed", "[0, 2**63)", [True, -1, 2**63, 1.0, "42", None]),
    ("presence_penalty", "[-2, 2]", [2.01, -2.5, True, math.nan, "1", None]),
    ("frequency_penalty", "[-2, 2]", [3, -2.01, False, math.inf, None]),
]


@pytest.mark.parametrize(
    "field, bound, value", [(f, b, v) for f, b, values in NUMBER_REJECTS for v in values], ids=repr
)
def test_bad_numbers_are_rejected_naming_field_and_bound(field: str, bound: str, value: object) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_sampling({"temperature": 0.7, field: value}, SAMPLING_VOCAB)
    assert f"'{field}'" in str(err.value) and bound in str(err.value)


def test_error_message_format() -> None:
    with pytest.raises(ProtocolError, match=r"^'top_p' must be a number in \(0, 1\], got 1\.5$"):
        parse_sampling({"top_p": 1.5}, SAMPLING_VOCAB)


@pytest.mark.parametrize(
    "value, fragment",
    [("1,2", "'recent_tokens'"), (5, "'recent_tokens'"), (None, "'recent_tokens'"), ({1: 2}, "'recent_tokens'"),
     ([0] * (MAX_RECENT_TOKENS + 1), "4097 items"), ([1, True], "'recent_tokens[1]'"), ([-1], "'recent_tokens[0]'"),
     ([3, SAMPLING_VOCAB], "'recent_tokens[1]'"), ([1.0], "'recent_tokens[0]'"), (["3"], "'recent_tokens[0]'")],
    ids=lambda v: repr(v)[:30],
)
def test_bad_recent_tokens_are_rejected(value: object, fragment: str) -> None:
    with pytest.raises(ProtocolError, match="must be") as err:
        parse_sampling({"recent_tokens": value}, SAMPLING_VOCAB)
    assert fragment in str(err.value)


def test_token_bound_follows_the_vocab_size() -> None:
    with pytest.raises(ProtocolError, match=r"\[0, 4\)"):
        parse_sampling({"recent_tokens": [4]}, 4)


def test_logit_bias_parses_to_id_bias_pairs() -> None:
    params = parse_sampling({"logit_bias": {"0": -100, "9": 100, "3": 2.5}}, SAMPLING_VOCAB)
    assert params == SamplingParams(logit_bias=((0, -100.0), (9, 100.0), (3, 2.5))) and params.greedy
    assert parse_sampling({"logit_bias": {}}, SAMPLING_VOCAB) == SamplingParams()


@pytest.mark.parametrize(
    "value, fragment",
    [([1, 2], "'logit_bias' must be an object"), ("{}", "'logit_bias' must be an object"),
     ({"10": 1}, "[0, 10)"), ({"-1": 1}, "keys must be token ids"), ({"01": 1}, "keys must be token ids"),
     ({"a": 1}, "keys must be token ids"), ({"1" * 5000: 1}, "keys must be token ids"),
     ({"\uff11": 1}, "keys must be token ids"), ({"2": 100.5}, "'logit_bias[2]'"), ({"2": -101}, "[-100, 100]"),
     ({"2": True}, "'logit_bias[2]'"), ({"2": "5"}, "'logit_bias[2]'"), ({"2": math.nan}, "'logit_bias[2]'"),
     ({"2": None}, "'logit_bias[2]'")],
    ids=lambda v: repr(v)[:30],
)
def test_bad_logit_bias_is_rejected(value: object, fragment: str) -> None:
    with pytest.raises(ProtocolError, match="must be") as err:
        parse_sampling({"logit_bias": value}, SAMPLING_VOCAB)
    assert fragment in str(err.value)


# --- logprobs (forward_and_sample) --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 20, None])
def test_logprobs_counts_up_to_20_are_accepted(value: int | None) -> None:
    assert logprobs_count({} if value is None else {"logprobs": value}) == value


@pytest.mark.parametrize("value", [21, -1, True, 1.0, "3", [1]], ids=repr)
def test_bad_logprobs_counts_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ProtocolError, match=r"^'logprobs' must be an int in \[0, 20\]"):
        logprobs_count({"logprobs": value})
