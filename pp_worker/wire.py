"""The JSON-lines codec both ends of a pipe use: strict parsing, line framing, the base64 hidden-state payload.

A line is one JSON object and a newline, ASCII only. Hidden states travel as base64 of raw little-endian float16;
a multi-MB payload is cut out of a line before JSON sees it and spliced into a line without JSON's escape scan
(``B64``), so neither side pays for scanning megabytes of characters that need no escaping.
"""

from __future__ import annotations

import binascii
import json
import math
import re
from typing import Any

import pybase64  # SIMD base64: see bench/NOTES.md for what the stdlib's costs on a prefill payload

PAYLOAD_FIELD = "hidden_b64"
SPLIT_PAYLOAD_FROM = 1 << 16  # lines this long have their payload cut out before JSON sees them
_PAYLOAD_KEY = b'"hidden_b64"'
_STRING_VALUE = re.compile(rb'[ \t\r]*:[ \t\r]*"')


class WireError(Exception):
    """A line that is not strict JSON; the message says why."""


class B64:
    """Base64 text held as ASCII bytes: only [A-Za-z0-9+/=], so ``to_line`` splices it into a line as is, without
    json.dumps's escape scan or a str copy. Compares equal to its text."""

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
            pybase64.b64decode(data, validate=True)  # cheaper than JSON's escape scan
        except binascii.Error as e:
            raise ValueError(f"hidden_b64 is not base64: {e}") from None
        return cls(data)


def encode_payload(data: bytes | memoryview) -> B64:
    return B64(pybase64.b64encode(data))


def decode_payload(text: str | bytes) -> bytes:
    """Strict base64 (no whitespace, correct padding); binascii.Error or ValueError otherwise."""
    return pybase64.b64decode(text, validate=True)


def b64_len(n_bytes: int) -> int:
    """Length of the base64 text of ``n_bytes`` bytes (with padding)."""
    return 4 * ((n_bytes + 2) // 3)


# --- reading ----------------------------------------------------------------------------------------------------

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
        if key in obj:  # which of two values the sender meant is a guess we refuse to make
            raise ValueError(f"duplicate key {key[:60]!r}")
        obj[key] = value
    return obj


# built once: json.loads with hooks would build a new decoder for every line
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)


def split_payload(line: bytes) -> tuple[bytes, B64] | None:
    """(the line with its hidden_b64 string emptied, that string as checked B64), so that JSON never scans megabytes
    of base64. Only where the result is provably what a full parse gives: the key occurs once and its value is a
    string of base64 characters only (no escapes, nothing JSON would refuse). None otherwise; ``parse_json`` then
    also checks that the key was at the top level."""
    if line.count(_PAYLOAD_KEY) != 1:
        return None
    m = _STRING_VALUE.match(line, line.index(_PAYLOAD_KEY) + len(_PAYLOAD_KEY))
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
    Never raises anything but WireError (deep nesting included). On a long line, a top-level hidden_b64 string
    comes back as a ``B64`` (already checked, spliced onward as is) instead of a str."""
    split = split_payload(line) if len(line) >= split_from else None
    if split is not None:
        obj = _strict_json(split[0])
        if isinstance(obj, dict) and obj.get(PAYLOAD_FIELD) == "":
            obj[PAYLOAD_FIELD] = split[1]
            return obj
    return _strict_json(line)


def lenient_object(line: bytes) -> dict[str, Any] | None:
    """What Python's own JSON makes of a line the strict parse refused (NaN or Infinity in a field, a number out of
    range, a repeated key other than request_id): only so that its error reply can name the request it answers
    (json.dumps writes NaN, so a Python caller's bad float would otherwise leave its request unanswered). None where
    even that parse fails, the line is no object, or request_id occurs twice (which one was meant is a guess)."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if sum(key == "request_id" for key, _ in items) > 1:
            raise ValueError("request_id repeated")
        return dict(items)
    try:
        obj = json.loads(line, object_pairs_hook=pairs)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return obj if isinstance(obj, dict) else None


def _strict_json(line: bytes) -> Any:
    try:
        return _DECODER.decode(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise WireError(f"line is not valid UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise WireError("invalid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, our hooks, int digit limit
        raise WireError(f"invalid JSON: {e}") from None


def parse_object(line: bytes) -> dict[str, Any] | None:
    """A line as a JSON object, or None when it is not one (noise, which the protocol forbids on stdout)."""
    try:
        obj = parse_json(line)
    except WireError:
        return None
    return obj if isinstance(obj, dict) else None


# --- writing ----------------------------------------------------------------------------------------------------

_ENCODER = json.JSONEncoder(allow_nan=False)  # built once: json.dumps with an argument builds one per call


def to_line(obj: dict[str, Any]) -> bytes:
    """One JSON line. A base64 payload (``B64``, megabytes on a prefill) is spliced in as is: it needs no escaping."""
    pieces: list[bytes] = []
    if _plain(obj, pieces):
        pieces.append(b"\n")
        return b"".join(pieces)
    payloads = {k: v for k, v in obj.items() if isinstance(v, B64)}
    if not payloads:
        return (_ENCODER.encode(obj) + "\n").encode("ascii")
    text = _ENCODER.encode({k: "" if k in payloads else v for k, v in obj.items()})
    parts = []
    for key, value in payloads.items():
        head, sep, text = text.partition(_ENCODER.encode(key) + ': "')
        parts += [head.encode("ascii"), sep.encode("ascii"), value.data]
    return b"".join([*parts, text.encode("ascii"), b"\n"])


_escape = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # the encoder's own string escape


def _plain(obj: Any, out: list[bytes]) -> bool:
    """Append the JSON of a dict whose keys are strings and whose values are ints, finite floats, strings, booleans,
    None, ``B64`` payloads or such dicts, exactly as the encoder writes it; False (``out`` then unusable) for
    anything else, which the encoder takes (or refuses). Every decode step's lines are of this kind: built here,
    they skip the encoder's machinery, code fetched from memory again every token in a live pipeline (~15 us a
    line; bench/NOTES.md)."""
    if type(obj) is not dict:
        return False
    sep = b"{"
    for key, value in obj.items():
        kind = type(value)
        if type(key) is not str:
            return False
        out += [sep, _escape(key).encode("ascii"), b": "]
        sep = b", "
        if kind is int:
            out.append(b"%d" % value)
        elif kind is float and math.isfinite(value):
            out.append(float.__repr__(value).encode("ascii"))  # the encoder's own float text
        elif kind is str:
            out.append(_escape(value).encode("ascii"))
        elif kind is B64:
            out += [b'"', value.data, b'"']
        elif value is None or kind is bool:
            out.append(b"null" if value is None else b"true" if value else b"false")
        elif not _plain(value, out):
            return False
    out.append(b"{}" if sep == b"{" else b"}")
    return True


def widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """Ask for a 1 MiB pipe buffer (default 64 KiB): a multi-MB prefill payload then crosses in a few wake-ups
    instead of dozens. Best effort: not a pipe, another OS, or above /proc/sys/fs/pipe-max-size is fine."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (OSError, ImportError, AttributeError, ValueError):  # AttributeError: not Linux
        pass
