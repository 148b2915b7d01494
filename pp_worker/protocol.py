"""The wire protocol: JSON line -> typed request (or ProtocolError), and the hidden-state codec.

Every check lives here so handlers can trust their inputs. Messages name the field and what was expected.
"""

from __future__ import annotations

import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import pybase64  # SIMD base64: the stdlib's is ~30x slower on a multi-MB prefill payload

BYTES_PER_ELEM = 2  # float16 on the wire
MAX_INT = 2**53  # ints beyond this are not portable JSON numbers; nothing legal needs them


class ProtocolError(Exception):
    """A request that cannot be served; becomes ``{"request_id": ..., "error": ...}``."""

    def __init__(self, message: str, request_id: int | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the engine."""

    hidden_dim: int
    token_bound: int | None  # token ids must be < this; None: any non-negative int (stub mode)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:  # which of two values the caller meant is a guess we refuse to make
            raise ValueError(f"duplicate key {key[:60]!r}")
        obj[key] = value
    return obj


# built once: json.loads with hooks would build a new decoder for every line
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)


PAYLOAD_KEY = b'"hidden_b64"'
SPLIT_PAYLOAD_FROM = 1 << 16  # lines this long have their payload cut out before JSON sees them
_STRING_VALUE = re.compile(rb'[ \t\r]*:[ \t\r]*"')


def split_payload(line: bytes) -> tuple[bytes, B64] | None:
    """(the line with its hidden_b64 string emptied, that string as checked B64), so that JSON never scans megabytes
    of base64 (~1 ms per MB). Only where the result is provably what a full parse gives: the key occurs once and
    its value is a string of base64 characters only (no escapes, nothing JSON would refuse). None otherwise;
    ``parse_json`` then also checks that the key was at the top level."""
    if line.count(PAYLOAD_KEY) != 1:
        return None
    m = _STRING_VALUE.match(line, line.index(PAYLOAD_KEY) + len(PAYLOAD_KEY))
    end = -1 if m is None else line.find(b'"', m.end())
    if m is None or end < 0:
        return None
    try:
        payload = B64.checked(line[m.end():end])
    except ValueError:
        return None
    return line[: m.end()] + line[end:], payload


def parse_json(line: bytes, split_from: int = SPLIT_PAYLOAD_FROM) -> Any:
    """Strict JSON: UTF-8 only, no NaN/Infinity, no overflowing numbers, no duplicate keys.
    Never raises anything but ProtocolError (deep nesting included). On a long line, a top-level hidden_b64
    string comes back as a ``B64`` (already checked, spliced onward as is) instead of a str."""
    split = split_payload(line) if len(line) >= split_from else None
    if split is not None:
        obj = _strict_json(split[0])
        if isinstance(obj, dict) and obj.get("hidden_b64") == "":
            obj["hidden_b64"] = split[1]
            return obj
    return _strict_json(line)


def _strict_json(line: bytes) -> Any:
    try:
        return _DECODER.decode(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ProtocolError(f"line is not valid UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise ProtocolError("invalid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, our hooks, int digit limit
        raise ProtocolError(f"invalid JSON: {e}") from None


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def nonneg_int(req: dict[str, Any], name: str, *, positive: bool = False, default: int | None = None) -> int:
    value = req.get(name, default)
    low = 1 if positive else 0
    if not is_int(value) or not low <= value <= MAX_INT:
        kind = "positive" if positive else "non-negative"
        raise ProtocolError(f"'{name}' must be a {kind} int, got {_show(value)}")
    return value


def token_list(req: dict[str, Any], name: str, bound: int | None, *, nonempty: bool) -> list[int]:
    value = req.get(name)
    if not isinstance(value, list):
        raise ProtocolError(f"'{name}' must be a list of ints, got {_show(value)}")
    if nonempty and not value:
        raise ProtocolError(f"'{name}' must be non-empty")
    limit = MAX_INT if bound is None else bound - 1
    for t in value:
        if not is_int(t) or not 0 <= t <= limit:
            raise ProtocolError(f"'{name}' must hold ints in [0, {limit}], got {_show(t)}")
    return value


def text_field(req: dict[str, Any], name: str) -> str:
    value = req.get(name)
    if not isinstance(value, str):
        raise ProtocolError(f"'{name}' must be a string, got {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can spell a lone surrogate (\ud800); no tokenizer can encode it
        raise ProtocolError(f"'{name}' is not valid Unicode text (lone surrogate at index {e.start})") from None
    return value


def b64_len(n_bytes: int) -> int:
    return 4 * ((n_bytes + 2) // 3)


def decode_hidden(req: dict[str, Any], seq_len: int, hidden_dim: int) -> bytes:
    """Strict base64 of exactly seq_len * hidden_dim * 2 bytes. The length is checked on the text first,
    so an oversized payload is refused without decoding it."""
    text = req.get("hidden_b64")
    if isinstance(text, B64):  # what parse_json cut out of a long line, already checked
        text = text.data
    if not isinstance(text, str | bytes):
        raise ProtocolError(f"'hidden_b64' must be a string, got {_show(text)}")
    expected = seq_len * hidden_dim * BYTES_PER_ELEM
    if len(text) != b64_len(expected):
        raise ProtocolError(f"hidden length does not match seq_len*hidden_dim*2 ({seq_len}*{hidden_dim}*2 = "
                            f"{expected} bytes, {b64_len(expected)} base64 chars); got {len(text)} base64 chars")
    try:
        data = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"invalid base64 in hidden_b64: {e}") from None
    if len(data) != expected:
        raise ProtocolError(f"hidden length {len(data)} does not match seq_len*hidden_dim*2 = {expected}")
    return data


class B64:
    """Base64 text held as ASCII bytes: only [A-Za-z0-9+/=], so the line writer splices it into the line as is,
    without json.dumps's escape scan (~10 ms for a 5 MB payload) or a str copy. Compares equal to its text."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __str__(self) -> str:
        return self.data.decode("ascii")

    def __eq__(self, other: object) -> bool:
        return str(self) == (other if isinstance(other, str) else str(other))

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def checked(cls, text: str | bytes | B64) -> B64:
        """Text from elsewhere (a worker's reply), checked to be base64 before it may be spliced into a line."""
        if isinstance(text, B64):  # checked when it was made
            return text
        data = text.encode("ascii") if isinstance(text, str) and text.isascii() else text
        if not isinstance(data, bytes):
            raise ValueError("hidden_b64 is not base64 text")
        try:
            pybase64.b64decode(data, validate=True)  # ~0.1 ms per MB: cheaper than JSON's escape scan
        except binascii.Error as e:
            raise ValueError(f"hidden_b64 is not base64: {e}") from None
        return cls(data)


def encode_hidden(data: bytes | memoryview) -> B64:
    return B64(pybase64.b64encode(data))


def request_id_of(obj: Any) -> int | None:
    """The request's id when it has a usable one (for error replies)."""
    if isinstance(obj, dict):
        rid = obj.get("request_id")
        if is_int(rid) and 0 <= rid <= MAX_INT:
            return rid
    return None


def parse_envelope(obj: Any) -> tuple[str, int, dict[str, Any]]:
    """Check the parts every request shares: an object with a string op and a non-negative int request_id."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"request must be a JSON object, got {_json_type(obj)}")
    rid = request_id_of(obj)
    op = obj.get("op")
    if "op" not in obj:
        raise ProtocolError("missing 'op' field", rid)
    if not isinstance(op, str):
        raise ProtocolError(f"'op' must be a string, got {_show(op)}", rid)
    if rid is None:
        raise ProtocolError(f"'request_id' must be a non-negative int, got {_show(obj.get('request_id'))}")
    return op, rid, obj


def _json_type(x: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if x is None else names.get(type(x), type(x).__name__)


def _show(x: Any) -> str:
    """A short description of a bad value for error messages (never the whole payload)."""
    if isinstance(x, (dict, list)):
        return f"an {_json_type(x)}"
    text = json.dumps(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _positions(obj: dict[str, Any]) -> dict[str, Any]:
    return {"position": nonneg_int(obj, "position"), "seq_len": nonneg_int(obj, "seq_len", positive=True)}


def _hidden_fields(obj: dict[str, Any], lim: Limits) -> dict[str, Any]:
    fields = _positions(obj)
    fields["hidden"] = decode_hidden(obj, fields["seq_len"], lim.hidden_dim)
    return fields


# op -> the parser of its own fields; ops absent here take no fields
_FIELDS = {
    "tokenize": lambda o, lim: {"prompt": text_field(o, "prompt")},
    "detokenize": lambda o, lim: {"tokens": token_list(o, "tokens", lim.token_bound, nonempty=False)},
    "embed_and_forward": lambda o, lim: {"tokens": token_list(o, "tokens", lim.token_bound, nonempty=True),
                                         "position": nonneg_int(o, "position", default=0)},
    "decode_step": lambda o, lim: {"tokens": [_token(o, lim)], "position": nonneg_int(o, "position")},
    "forward_range": _hidden_fields,
    "forward_and_sample": _hidden_fields,
}


def _token(obj: dict[str, Any], lim: Limits) -> int:
    token = nonneg_int(obj, "token_id")
    if lim.token_bound is not None and token >= lim.token_bound:
        raise ProtocolError(f"'token_id' must be in [0, {lim.token_bound - 1}], got {token}")
    return token


def parse_fields(op: str, obj: dict[str, Any], lim: Limits) -> dict[str, Any]:
    """The op's own fields, validated; extra fields are ignored (callers may send a superset)."""
    parser = _FIELDS.get(op)
    return parser(obj, lim) if parser else {}
