"""Request validation: a parsed line -> the op, its request id and its typed fields, or a ProtocolError.

Every check of a request lives here, sampling fields included, so handlers and engines can trust their inputs.
Messages name the field and what was expected. The line codec itself (strict JSON, base64 payloads) is
``pp_worker.wire``.
"""

from __future__ import annotations

import binascii
import json
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pp_worker.wire import B64, b64_len, decode_payload
from pp_worker.worker import q8
from pp_worker.worker.grammar import Grammar, GrammarError
from pp_worker.worker.sampling import SamplingParams

MAX_INT = 2**53  # ints beyond this are not portable JSON numbers; nothing legal needs them
MAX_RECENT_TOKENS = 4096
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI
MAX_LOGPROBS = 20  # alternatives a forward_and_sample reports at most, as OpenAI's top_logprobs


class ProtocolError(Exception):
    """A request that cannot be served; becomes ``{"request_id": ..., "error": ...}``."""

    def __init__(self, message: str, request_id: int | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the engine."""

    hidden_dim: int
    vocab_size: int
    check_token_ids: bool = True  # False: any non-negative int is a token id (stub mode, as the seed did)

    @property
    def token_bound(self) -> int | None:
        return self.vocab_size if self.check_token_ids else None


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


def flag(req: dict[str, Any], name: str, default: bool) -> bool:
    value = req.get(name, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be true or false, got {_show(value)}")
    return value


def hidden_dtype(req: dict[str, Any]) -> str | None:
    """The payload's dtype as the request names it (``hidden_dtype``: "f16", "q8" or "f32"), or None when it names
    none (the seed's protocol: the payload's length says which)."""
    value = req.get("hidden_dtype")
    if value is None and "hidden_dtype" not in req:
        return None
    if not isinstance(value, str) or value not in q8.DTYPES:
        raise ProtocolError(f"'hidden_dtype' must be one of {', '.join(map(repr, q8.DTYPES))}, got {_show(value)}")
    return value


def payload_sizes(seq_len: int, hidden_dim: int) -> dict[str, int]:
    """Bytes of a (1, seq_len, hidden_dim) payload in each dtype: f16 T*D*2, q8 T*(D+4), f32 T*D*4. Three different
    sizes for every D but 4, where q8's is f16's (a stage refuses to emit q8 there, so such a payload is f16)."""
    return {dtype: q8.payload_bytes(dtype, seq_len, hidden_dim) for dtype in q8.DTYPES}


def decode_hidden(req: dict[str, Any], seq_len: int, hidden_dim: int) -> bytes:
    """float16 (f16, q8) or float32 (f32) bytes of (1, seq_len, hidden_dim) from strict base64. The payload's length
    says its dtype (`payload_sizes`), so a caller that forwards only the seed's fields (hidden_b64, seq_len,
    position) hands a float32 or q8 payload on intact; a request's ``hidden_dtype``, when it names one, must agree.
    The length is checked on the text first, so an oversized payload is refused without decoding it."""
    named = hidden_dtype(req)
    text = req.get("hidden_b64")
    if isinstance(text, B64):  # what parse_json cut out of a long line, already checked
        text = text.data
    if not isinstance(text, str | bytes):
        raise ProtocolError(f"'hidden_b64' must be a string, got {_show(text)}")
    sizes = payload_sizes(seq_len, hidden_dim)
    allowed = {d: n for d, n in sizes.items() if named in (None, d)}
    if len(text) not in {b64_len(n) for n in allowed.values()}:
        raise _length_error(named, len(text), seq_len, hidden_dim)
    try:
        data = decode_payload(text)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"invalid base64 in hidden_b64: {e}") from None
    dtype = next((d for d, n in allowed.items() if n == len(data)), None)  # f16 first: at D = 4 the contract's
    if dtype is None:  # base64 padding: a text of the right length can hold a byte or two fewer
        raise _length_error(named, len(text), seq_len, hidden_dim, len(data))
    if dtype != "q8":
        return data
    try:
        return q8.decode(data, seq_len, hidden_dim)
    except q8.Q8Error as e:
        raise ProtocolError(f"invalid q8 hidden_b64: {e}") from None


_SIZE = {"f16": "{}*{}*2", "q8": "{}*({}+4)", "f32": "{}*{}*4"}


def _length_error(named: str | None, b64_chars: int, seq_len: int, hidden_dim: int,
                  n_bytes: int | None = None) -> ProtocolError:
    """What a payload of this length is not, and every length this seq_len allows (for ``named`` only, if given)."""
    sizes = payload_sizes(seq_len, hidden_dim)
    expected = " or ".join(f"{b64_len(n)} chars ({d}: {_SIZE[d].format(seq_len, hidden_dim)} = {n} bytes)"
                           for d, n in sizes.items() if named in (None, d))
    other = [d for d, n in sizes.items() if d != named and b64_len(n) == b64_chars]
    got = f"{b64_chars} base64 chars" + (f" ({n_bytes} bytes)" if n_bytes is not None else "")
    hint = f"; that is the size of a {other[0]} payload" if named and other and n_bytes is None else ""
    return ProtocolError(f"hidden_b64 does not match seq_len {seq_len}: got {got}; expected "
                         f"{f'for hidden_dtype {named!r} ' if named else ''}{expected}{hint}")


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
    if "request_id" not in obj:
        raise ProtocolError("missing 'request_id' field")
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


# --- sampling fields (forward_and_sample) -------------------------------------------------------------------------

# name -> (type, bound in errors, test). Float bounds are finite and NaN fails every comparison: no NaN/inf gets by.
_SAMPLING_NUMBERS: dict[str, tuple[type, str, Callable[[float], bool]]] = {
    "temperature": (float, "a number in [0, 100]", lambda v: 0 <= v <= 100),
    "top_k": (int, "an integer >= 0", lambda v: v >= 0),
    "top_p": (float, "a number in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": (float, "a number in [0, 1)", lambda v: 0 <= v < 1),
    "repetition_penalty": (float, "a number in (0, 100]", lambda v: 0 < v <= 100),
    "seed": (int, "an integer in [0, 2**63)", lambda v: 0 <= v < 2**63),
    "presence_penalty": (float, "a number in [-2, 2]", lambda v: -2 <= v <= 2),
    "frequency_penalty": (float, "a number in [-2, 2]", lambda v: -2 <= v <= 2),
}


def _sampling_number(name: str, value: object) -> float | int:
    kind, bound, ok = _SAMPLING_NUMBERS[name]
    accepted = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, accepted) or not ok(value):  # JSON true is not 1
        raise ProtocolError(f"'{name}' must be {bound}, got {reprlib.repr(value)}")
    return kind(value)


def _recent_tokens(value: object, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_RECENT_TOKENS:
        got = f"{len(value)} items" if isinstance(value, list | tuple) else reprlib.repr(value)
        raise ProtocolError(f"'recent_tokens' must be a list of at most {MAX_RECENT_TOKENS} token ids, got {got}")
    bad = next((i for i, t in enumerate(value) if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"'recent_tokens[{bad}]' must be a token id in [0, {vocab_size}), got {value[bad]!r:.40}")
    return tuple(value)


def _logit_bias(value: object, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's shape: token ids as decimal strings (the keys of a JSON object) -> a number in [-100, 100]."""
    if not isinstance(value, dict):
        raise ProtocolError(f"'logit_bias' must be an object mapping token ids to numbers, got {_show(value)}")
    out = []
    for key, bias in value.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12  # no 4300-digit int()
        if not (digits and key == str(int(key)) and int(key) < vocab_size):
            raise ProtocolError(f"'logit_bias' keys must be token ids in [0, {vocab_size}) written in decimal, "
                                f"got {key!r:.40}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise ProtocolError(f"'logit_bias[{key}]' must be a number in [-100, 100], got {reprlib.repr(bias)}")
        out.append((int(key), float(bias)))
    return tuple(out)


def parse_sampling(req: dict[str, Any], vocab_size: int) -> SamplingParams | None:
    """Validated sampling fields of a request, or None when it carries none (the stage stays on plain argmax)."""
    if not any(name in req for name in (*_SAMPLING_NUMBERS, "recent_tokens", "logit_bias")):
        return None
    fields: dict[str, Any] = {name: _sampling_number(name, req[name]) for name in _SAMPLING_NUMBERS if name in req}
    if "recent_tokens" in req:
        fields["recent_tokens"] = _recent_tokens(req["recent_tokens"], vocab_size)
    if "logit_bias" in req:
        fields["logit_bias"] = _logit_bias(req["logit_bias"], vocab_size)
    return SamplingParams(**fields)


def logprobs_count(req: dict[str, Any]) -> int | None:
    """``logprobs``: how many most probable alternatives to report with the sampled token's log-probability (None:
    no log-probabilities)."""
    value = req.get("logprobs")
    if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise ProtocolError(f"'logprobs' must be an int in [0, {MAX_LOGPROBS}], got {_show(value)}")
    return value


def parse_grammar(req: dict[str, Any]) -> dict[str, Any]:
    """``{"grammar": Grammar | None}`` when the request carries the field (null: none, still a new generation's
    start, see `grammar`), else {}."""
    if "grammar" not in req:
        return {}
    try:
        return {"grammar": None if req["grammar"] is None else Grammar.parse(req["grammar"])}
    except GrammarError as e:
        raise ProtocolError(str(e)) from None


# --- each op's own fields -----------------------------------------------------------------------------------------

def _positions(obj: dict[str, Any]) -> dict[str, Any]:
    return {"position": nonneg_int(obj, "position"), "seq_len": nonneg_int(obj, "seq_len", positive=True)}


def _hidden_fields(obj: dict[str, Any], lim: Limits) -> dict[str, Any]:
    """The positions and the hidden state, with the rows of it holding inf or NaN (``nonfinite``: computed on and
    reported by default, as the seed computed on them; refused with PP_STRICT_FINITE=1)."""
    fields = _positions(obj)
    hidden = fields["hidden"] = decode_hidden(obj, fields["seq_len"], lim.hidden_dim)
    wide = len(hidden) == q8.payload_bytes("f32", fields["seq_len"], lim.hidden_dim)
    rows = q8.as_rows(hidden, "f32" if wide else "f16", lim.hidden_dim)  # (T, D)
    fields["nonfinite"] = tuple(map(int, q8.nonfinite_rows(rows)))
    return fields


def _token(obj: dict[str, Any], lim: Limits) -> int:
    token = nonneg_int(obj, "token_id")
    if lim.token_bound is not None and token >= lim.token_bound:
        raise ProtocolError(f"'token_id' must be in [0, {lim.token_bound - 1}], got {token}")
    return token


def _verify(obj: dict[str, Any], fields: dict[str, Any], lim: Limits) -> dict[str, Any]:
    """forward_and_sample's optional ``verify``: the drafted tokens rows 1.. of the hidden state were fed (speculative
    decoding, docs/protocol.md), so exactly ``seq_len - 1`` ids; None when absent."""
    fields["verify"] = None
    if "verify" in obj:
        fields["verify"] = token_list(obj, "verify", lim.token_bound, nonempty=False)
        if len(fields["verify"]) != fields["seq_len"] - 1:
            raise ProtocolError(f"'verify' must hold seq_len - 1 = {fields['seq_len'] - 1} token ids (the tokens "
                                f"rows 1.. were fed), got {len(fields['verify'])}")
        if fields["logprobs"] is not None:  # one reply carries one token's
            raise ProtocolError("'verify' cannot go with 'logprobs': a check answers several tokens")
        s = fields["sampling"]
        if s is not None and (s.repetition_penalty != 1.0 or s.presence_penalty or s.frequency_penalty):
            raise ProtocolError("'verify' cannot go with a repetition, presence or frequency penalty: their window "
                                "(recent_tokens) would move with each guessed token")
    return fields


MAX_BATCH_REQUESTS = 1024


def _requests(obj: dict[str, Any], lim: Limits) -> dict[str, Any]:
    """A batch's requests: each is validated (and answered) on its own, its op included (one that may not be batched
    fails alone), so only the list itself is checked here."""
    value = obj.get("requests")
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BATCH_REQUESTS:
        got = f"{len(value)} items" if isinstance(value, list) else _show(value)
        raise ProtocolError(f"'requests' must be a list of 1 to {MAX_BATCH_REQUESTS} requests, got {got}")
    return {"requests": value}


BATCH_OPS = frozenset({"decode_step", "embed_and_forward", "forward_range", "forward_and_sample"})

# op -> the parser of its own fields; ops absent here take no fields
_FIELDS: dict[str, Callable[[dict[str, Any], Limits], dict[str, Any]]] = {
    "tokenize": lambda o, lim: {"prompt": text_field(o, "prompt"), "add_special": flag(o, "add_special", True)},
    "detokenize": lambda o, lim: {"tokens": token_list(o, "tokens", lim.token_bound, nonempty=False),
                                  "partial": flag(o, "partial", False)},
    "embed_and_forward": lambda o, lim: {"tokens": token_list(o, "tokens", lim.token_bound, nonempty=True),
                                         "position": nonneg_int(o, "position", default=0)},
    "decode_step": lambda o, lim: {"tokens": [_token(o, lim)], "position": nonneg_int(o, "position")},
    "forward_range": _hidden_fields,
    "forward_and_sample": lambda o, lim: _verify(o, {**_hidden_fields(o, lim),
                                                      "sampling": parse_sampling(o, lim.vocab_size),
                                                      "logprobs": logprobs_count(o), **parse_grammar(o)}, lim),
    "batch": _requests,
    "release": lambda o, lim: {"keep": flag(o, "keep", False)},
    "fork": lambda o, lim: _fork(o),
}


def _fork(obj: dict[str, Any]) -> dict[str, Any]:
    """fork's source session and how many of its positions to copy; the source is never the new session itself."""
    fields = {"from": nonneg_int(obj, "from"), "positions": nonneg_int(obj, "positions", positive=True)}
    if fields["from"] == obj.get("request_id"):
        raise ProtocolError("'from' must name another session than this request's own")
    return fields


def parse_fields(op: str, obj: dict[str, Any], lim: Limits) -> dict[str, Any]:
    """The op's own fields, validated; extra fields are ignored (callers may send a superset)."""
    parser = _FIELDS.get(op)
    return parser(obj, lim) if parser else {}
