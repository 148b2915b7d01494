"""Requests to replies: the op table (the one place roles are checked) and the handlers.

``Worker.handle_line`` never raises: every failure becomes an error reply naming what was wrong.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pp_worker.wire import B64, WireError, encode_payload, lenient_object, parse_json
from pp_worker.worker import protocol, q8
from pp_worker.worker.engines.base import Engine, EngineError
from pp_worker.worker.events import Clock, rss_mb
from pp_worker.worker.grammar import Constraints, GrammarError
from pp_worker.worker.protocol import ProtocolError
from pp_worker.worker.sampling import sample, token_logprobs
from pp_worker.worker.shard import Role

Reply = dict[str, Any]
ANY = frozenset(Role)
BATCH_ROWS = 32  # a request of at most this many rows may share a batched forward with others (checks of drafted
# tokens: up to 17; a chat's short turns): a longer one is a prompt's prefill, which runs alone in its own calls


class Worker:
    """One stage: an engine plus the bookkeeping the control ops report."""

    def __init__(self, engine: Engine, clock: Clock, model: str, wire_dtype: str = q8.DEFAULT_WIRE,
                 strict_finite: bool = False, emit: Callable[..., None] = lambda kind, **fields: None):
        """``model``: what the stage was given (a path, URL or name); ``strict_finite`` (PP_STRICT_FINITE): a hidden
        state holding inf or NaN is an error, not computed on; ``emit(kind, **fields)``: an event line."""
        self.engine, self.clock, self.model = engine, clock, model
        self.wire_dtype = wire_dtype  # of the hidden states this stage emits (PP_WIRE_DTYPE); any is accepted
        self.strict_finite, self.emit = strict_finite, emit
        self.shard = engine.shard
        info = engine.info
        self.limits = protocol.Limits(info.hidden_dim, info.vocab_size, info.check_token_ids)
        self.shutdown_requested = False
        self.batched = 0  # requests served as part of a batched forward (status: batched_requests)
        self.constraints = Constraints(engine.vocabulary, info.vocab_size)  # grammars' matchers, last stage

    def handle_line(self, line: bytes) -> Reply:
        return self.handle_lines([line])[0]

    def handle_lines(self, lines: list[bytes]) -> list[Reply]:
        """The replies to consecutive request lines, in order (see `serve`)."""
        return list(self.serve([self._prepare(line) for line in lines]))

    def handle_objects(self, objs: list[Any]) -> list[Reply]:
        """The replies to consecutive parsed requests (a batch op's), in order (see `serve`); one whose op may not
        be batched fails alone."""
        return list(self.serve([self._prepare(None, obj, in_batch=True) for obj in objs]))

    def prepare_lines(self, lines: list[bytes]) -> list[Request | Reply]:
        return [self._prepare(line) for line in lines]

    def serve(self, ready: list[Request | Reply]) -> Iterator[Reply]:
        """Serve validated requests (an error reply stands for one that failed validation) in order, each as if
        alone, yielding each reply as soon as it is known; but a run of forward steps of distinct sessions, each
        continuing the session it names, becomes one batched forward (``Engine.forward_batch``, `_batch_rows`):
        one-token steps, checks of drafted tokens, and on the other stages their rows and short prompts. Never
        raises. Nothing after a shutdown is served (as if never read)."""
        i = 0
        while i < len(ready) and not self.shutdown_requested:
            item, run = ready[i], self._batch_run(ready, i)
            if len(run) > 1:
                yield from self._run_guarded(run, lambda run=run: _forward_batch(self, run))
            elif isinstance(item, Request):
                yield from self._run_guarded([item], lambda item=item: [_serve_one(self, item)])
            else:
                yield item
            i += max(1, len(run))

    def _prepare(self, line: bytes | None, obj: Any = None, in_batch: bool = False) -> Request | Reply:
        """A request line (or an already parsed object, ``in_batch``: an entry of a batch op) -> its validated
        Request, or its error reply."""
        try:
            if line is not None:
                obj = parse_json(line)
            op, rid, obj = protocol.parse_envelope(obj)
            if in_batch and op not in protocol.BATCH_OPS:
                raise ProtocolError(f"a batch holds forward requests ({', '.join(sorted(protocol.BATCH_OPS))}); "
                                    f"got op {op[:60]!r}")
            entry = OPS.get(op)
            if entry is None:  # never echo a huge op
                raise ProtocolError(f"unknown op {op[:60]!r}; known ops: {', '.join(sorted(OPS))}")
            roles, handler = entry
            if self.shard.role not in roles:
                raise ProtocolError(f"op {op!r} needs the {_describe(roles)} stage; this worker is stage "
                                    f"{self.shard.stage} of {self.shard.num_stages} ({self.shard.role.value})")
            fields = protocol.parse_fields(op, obj, self.limits)
            if self.strict_finite and fields.get("nonfinite"):  # refused before any session changes
                raise ProtocolError(f"hidden_b64 {_nonfinite(fields['nonfinite'])}; PP_STRICT_FINITE=1 refuses it")
            return Request(op, rid, obj, fields, handler)
        except WireError as e:  # not strict JSON: its id where a lenient parse still finds one
            if obj is None and line is not None:
                obj = lenient_object(line)
            return _error(protocol.request_id_of(obj), str(e))
        except ProtocolError as e:
            return _error(protocol.request_id_of(obj), str(e))
        except Exception as e:  # a bug must not take the stage down
            traceback.print_exc(file=sys.stderr)
            return _error(protocol.request_id_of(obj), f"internal error: {type(e).__name__}: {e}")

    def _batch_run(self, ready: list[Request | Reply], i: int) -> list[Request]:
        """The requests from ``ready[i]`` on that can share batched forwards (empty if ``ready[i]`` cannot): at most
        the engine's max_batch, of distinct sessions, each `_batch_rows`."""
        run: list[Request] = []
        for item in ready[i:i + self.engine.max_batch]:
            if not (isinstance(item, Request) and all(r.rid != item.rid for r in run) and self._batch_rows(item)):
                break
            run.append(item)
        return run

    def _batch_rows(self, item: Request) -> int:
        """The rows ``item`` brings to a batched forward; 0 where it runs alone: not a forward op, more than
        BATCH_ROWS rows (a prompt's prefill), on the last stage rows that are no check (only the last one's logits
        count there), or rows the engine cannot batch (a new session; several rows on an engine without mixed
        calls)."""
        f = item.fields
        if item.op not in protocol.BATCH_OPS:
            return 0
        rows = _rows(f)
        if rows > BATCH_ROWS or (self.shard.is_last and rows > 1 and f.get("verify") is None):
            return 0
        return rows if self.engine.can_batch(item.rid, f["position"], rows) else 0

    def _run_guarded(self, run: list[Request], work: Callable[[], list[Reply]]) -> list[Reply]:
        """``work()``'s replies, or an error reply for each request of ``run`` when it fails (its sessions put back
        as the step found them)."""
        for r in run:
            if r.fields.get("nonfinite"):
                self.emit("nonfinite_input", **_where_nonfinite(r.op, r.rid, r.fields["position"],
                                                                 r.fields["nonfinite"]))
        try:
            return work()
        except Exception as e:  # a bug or resource failure must not take the stage down either
            known = isinstance(e, EngineError | GrammarError)
            if not known:
                traceback.print_exc(file=sys.stderr)
            for r in run:
                if r.op in protocol.BATCH_OPS:
                    self.engine.undo(r.rid)
            message = str(e) if known else f"internal error: {type(e).__name__}: {e}"
            return [_error(r.rid, message) for r in run]


@dataclass
class Request:
    """A validated request: its op, id, raw object, typed fields and handler."""

    op: str
    rid: int
    obj: dict[str, Any]
    fields: dict[str, Any]
    handler: Handler


def _describe(roles: frozenset[Role]) -> str:
    return " or ".join(r.value for r in Role if r in roles)


def _error(rid: int | None, message: str) -> Reply:
    return {"error": message} if rid is None else {"request_id": rid, "error": message}


def _nonfinite(rows: Any) -> str:
    return f"has inf or NaN in {len(rows)} row(s) (first: row {int(rows[0])})"


def _where_nonfinite(op: str, rid: int, position: int, rows: Any) -> dict[str, Any]:
    """An event's fields for inf or NaN in a hidden state: the session (never a field named request_id), the op,
    the step's position, how many rows and the first."""
    return {"session": rid, "op": op, "position": position, "rows": len(rows), "first_row": int(rows[0])}


# --- handlers: (worker, request id, raw request, validated fields) -> reply fields -------------------------

def _tokenize(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    return {"tokens": w.engine.tokenize(f["prompt"], f["add_special"])}


def _detokenize(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    if not f["partial"]:
        return {"text": w.engine.detokenize(f["tokens"])}
    text, pending = w.engine.detokenize_partial(f["tokens"])
    return {"text": text, "pending": pending}


def _embed(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    hidden = w.engine.embed_and_forward(rid, f["tokens"], f["position"])
    return _hidden_reply(w, hidden, len(f["tokens"]), (obj["op"], rid, f["position"]))


def _forward_range(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    hidden = w.engine.forward_range(rid, f["hidden"], f["position"], f["seq_len"])
    return _hidden_reply(w, hidden, f["seq_len"], (obj["op"], rid, f["position"]))


def _hidden_reply(w: Worker, hidden: bytes | memoryview, seq_len: int, step: tuple[str, int, int]) -> Reply:
    """The engine's (1, T, D) on the stage's wire (`q8.emit`): float16 byte for byte where it holds the state (no
    ``hidden_dtype`` field), float32 past its range on auto, an error there on f16 and q8. inf or NaN go out as
    computed, as the seed's did, with a `nonfinite_output` event (an error with PP_STRICT_FINITE=1, and on q8).
    ``step``: (op, request id, position), for the event."""
    _check_output(w, step, q8.as_rows(hidden, w.engine.hidden_dtype, w.limits.hidden_dim))
    try:
        payload, dtype = q8.emit(hidden, w.engine.hidden_dtype, w.wire_dtype, w.limits.hidden_dim)
    except q8.Q8Error as e:
        raise EngineError(str(e)) from None
    reply = {"hidden_b64": encode_payload(payload), "seq_len": seq_len}
    return reply if dtype == "f16" else reply | {"hidden_dtype": dtype}


def _check_output(w: Worker, step: tuple[str, int, int], rows: Any) -> None:
    """inf or NaN in what a step computed (rows (T, D), or logits (1, V)): an error with PP_STRICT_FINITE=1, else
    a `nonfinite_output` event."""
    bad = q8.nonfinite_rows(rows)
    if not len(bad):
        return
    if w.strict_finite:
        raise EngineError(f"the stage's output {_nonfinite(bad)}; PP_STRICT_FINITE=1 refuses to send it")
    w.emit("nonfinite_output", **_where_nonfinite(*step, bad))


def _forward_and_sample(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    if f["verify"] is not None:
        return _verify(w, rid, f)
    logits = w.engine.forward_logits(rid, f["hidden"], f["position"], f["seq_len"])
    return _sampled(w, rid, f, logits)


def _sampled(w: Worker, rid: int, f: dict[str, Any], logits: Any) -> Reply:
    """The token sampled from ``logits`` and, when asked (``logprobs``), its log-probability and the most probable
    alternatives', each with its text (the last stage holds the vocabulary; the driver does not). Log-probabilities
    are the model's own distribution: before a grammar's mask, as before the sampling filters."""
    token = _pick(w, rid, f, logits)
    if f.get("logprobs") is None:
        return {"token_id": token}
    logprob, top = token_logprobs(logits, token, f["logprobs"])
    return {"token_id": token, "logprobs": {**_piece(w, token, logprob), "top": [_piece(w, *t) for t in top]}}


def _piece(w: Worker, token: int, logprob: float) -> Reply:
    return {"token_id": token, "logprob": logprob, "text": w.engine.detokenize([token])}


def _pick(w: Worker, rid: int, f: dict[str, Any], logits: Any) -> int:
    """The next token of session ``rid``: its grammar (if any) masks the logits before the sampler sees them; inf or
    NaN logits are reported (`_check_output`), all of them NaN is this step's error."""
    if "grammar" in f:
        w.constraints.keep_only(w.engine.sessions())  # matchers of evicted sessions go before a new one comes
    _check_output(w, ("forward_and_sample", rid, f["position"]), np.asarray(logits).reshape(1, -1))
    masked = w.constraints.mask(rid, f, logits)
    try:  # NaN logits are skipped by argmax
        token = sample(masked, f["sampling"], step_key=f["position"] + f["seq_len"])
    except ValueError as e:  # every logit NaN: no token to give
        raise EngineError(f"no token: {e}") from None
    w.constraints.advance(rid, f, token)
    return token


def _verify(w: Worker, rid: int, f: dict[str, Any]) -> Reply:
    """Speculative decoding's check: the k + 1 rows run as one forward (`Engine.forward_rows`), row i giving the
    logits of the one-token step at position + i it stands for (up to a multi-row forward's rounding, as on the
    stages before; same ``step_key``), and each guess is kept while it equals the token the model samples there;
    the first that differs is replaced by the model's token. The session then holds the rows up to that one (the
    caller's next step starts right after them). ``accepted``: the guesses kept; ``token_id``: the model's token
    after them."""
    return _checked(w, rid, f, w.engine.forward_rows(rid, f["hidden"], f["position"], f["seq_len"]))


def _checked(w: Worker, rid: int, f: dict[str, Any], rows: Any) -> Reply:
    """A check's reply (`_verify`) given its rows' logits, the session rewound past the last row kept."""
    position, guesses = f["position"], f["verify"]
    step = {k: v for k, v in f.items() if k != "grammar"}  # a check is never a generation's first step
    for i, guess in enumerate([*guesses, None]):  # the last row has no guess: it always answers
        token = _pick(w, rid, {**step, "position": position + i, "seq_len": 1}, rows[i])  # a grammar masks each row
        if token != guess:
            w.engine.rewind(rid, position + i + 1)
            return {"token_id": token, "accepted": i}
    raise AssertionError("unreachable: no token equals the last row's missing guess")


def _status(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    s = w.shard
    return {"stage": s.stage, "num_stages": s.num_stages, "role": s.role.value, "layer_range": [s.start, s.end],
            "model": w.model, "pid": os.getpid(), "sessions": {str(k): v for k, v in w.engine.sessions().items()},
            "cached_sessions": w.engine.cached_sessions(),
            "requests_served": w.clock.requests_served, "batched_requests": w.batched, "uptime_ms": w.clock.uptime_ms(),
            "rss_mb": rss_mb(), "max_context": w.engine.info.max_context, **model_fields(w.engine, w.wire_dtype)}


def model_fields(engine: Engine, wire_dtype: str) -> Reply:
    """What a driver needs beyond the shapes, so it needs no copy of the GGUF, and how the stage runs
    (the dtype of the hidden states it emits, device, KV cache dtype...): on the ready line and in status."""
    info = engine.info
    return {"model_name": info.name, "chat_template": info.chat_template, "bos_token_id": info.bos_token_id,
            "add_bos": info.add_bos, "bos_token": info.bos_token, "eos_token": info.eos_token,
            "max_sessions": engine.max_sessions, "wire_dtype": wire_dtype, **engine.describe()}


def _release(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    w.constraints.release(rid)
    return {"released": w.engine.release(rid, f["keep"])}


def _claim(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    return {"positions": w.engine.claim(rid)}


def _fork(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    return {"positions": w.engine.fork(rid, f["from"], f["positions"])}


def _reset(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    released = w.engine.reset()
    w.constraints.keep_only(w.engine.sessions())  # no session, no matcher
    return {"released": released}


def _ping(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    return {"pong": True, "uptime_ms": w.clock.uptime_ms()}


def _shutdown(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    w.shutdown_requested = True
    return {"ok": True}


def _batch(w: Worker, rid: int, obj: dict[str, Any], f: dict[str, Any]) -> Reply:
    """Several forward requests in one line, served as consecutive lines would be (batched where they can be);
    nested payloads are small one-token rows, so they travel as plain strings."""
    replies = w.handle_objects(f["requests"])
    return {"replies": [{k: str(v) if isinstance(v, B64) else v for k, v in r.items()} for r in replies]}


def _rows(f: dict[str, Any]) -> int:
    """The positions a forward request runs: its tokens on the first stage, its hidden state's rows elsewhere."""
    return len(f["tokens"]) if "tokens" in f else f["seq_len"]


def _serve_one(w: Worker, r: Request) -> Reply:
    return {"request_id": r.rid, **r.handler(w, r.rid, r.obj, r.fields)}


def _forward_batch(w: Worker, run: list[Request]) -> list[Reply]:
    """The steps of ``run`` (distinct sessions, each `Worker._batch_rows`) in one forward of the engine; each
    request's reply is its own op's: its hidden rows, its sampled token, or its check's answer (`_checked`)."""
    rows = [_rows(r.fields) for r in run]
    positions = [r.fields["position"] for r in run]
    inputs = [r.fields["tokens"] if "tokens" in r.fields else r.fields["hidden"] for r in run]
    out = w.engine.forward_batch([r.rid for r in run], positions, inputs, rows)
    w.batched += len(run)
    starts = np.cumsum([0, *rows]).tolist()
    if w.shard.is_last:
        return [_row_reply(w, r, lambda r=r, logits=out[a:b]: _checked(w, r.rid, r.fields, logits)
                           if r.fields["verify"] is not None else _sampled(w, r.rid, r.fields, logits[-1]))
                for r, a, b in zip(run, starts[:-1], starts[1:], strict=True)]
    size = len(out) // starts[-1]
    return [_row_reply(w, r, lambda r=r, a=a, b=b: _hidden_reply(w, out[a * size:b * size], b - a,
                                                                 (r.op, r.rid, r.fields["position"])))
            for r, a, b in zip(run, starts[:-1], starts[1:], strict=True)]


def _row_reply(w: Worker, r: Request, reply: Callable[[], Reply]) -> Reply:
    """One batched session's reply, or its own error, its session put back (the others' rows are still good)."""
    try:
        return {"request_id": r.rid, **reply()}
    except (EngineError, GrammarError) as e:
        w.engine.undo(r.rid)
        return _error(r.rid, str(e))


Handler = Callable[[Worker, int, dict[str, Any], dict[str, Any]], Reply]
OPS: dict[str, tuple[frozenset[Role], Handler]] = {
    "tokenize": (frozenset({Role.FIRST}), _tokenize),
    "embed_and_forward": (frozenset({Role.FIRST}), _embed),
    "decode_step": (frozenset({Role.FIRST}), _embed),
    "forward_range": (frozenset({Role.MIDDLE}), _forward_range),
    "forward_and_sample": (frozenset({Role.LAST}), _forward_and_sample),
    "detokenize": (frozenset({Role.LAST}), _detokenize),
    "status": (ANY, _status),
    "release": (ANY, _release),
    "claim": (ANY, _claim),
    "fork": (ANY, _fork),
    "reset": (ANY, _reset),
    "ping": (ANY, _ping),
    "shutdown": (ANY, _shutdown),
    "batch": (ANY, _batch),
}
