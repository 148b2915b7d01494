"""Constrained decoding on the last stage (worker.grammar): the field's validation, the mask, a matcher's life on a
session (begun by ``grammar``, ended by a rewind, a null grammar, release or eviction) and the batched path, on a
small hand-made vocabulary with random logits: whatever the logits, the output must fit the grammar."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from conftest import request_line, serve_bytes

from pp_worker.driver.generation import Generation
from pp_worker.worker.dispatch import Worker
from pp_worker.worker.engines.stub import STUB_HIDDEN_DIM, StubEngine
from pp_worker.worker.events import Clock
from pp_worker.worker.grammar import Constraints, Grammar, GrammarError
from pp_worker.worker.protocol import ProtocolError, parse_grammar
from pp_worker.worker.text.vocabulary import Vocabulary

PIECES = [bytes([b]) for b in range(256)] + [b'{"', b'":', b'", "', b"true", b"false", b"null", b"  ", b"\n"]
EOS = len(PIECES)
TOKENS = [*PIECES, b"\xff<|end|>"]
N_LOGITS = len(TOKENS) + 5  # a head wider than the vocabulary: the extra ids are never allowed


def _encode(text: str) -> list[int]:
    return list(text.encode())  # the byte tokens spell anything


VOCAB = Vocabulary(TOKENS, [EOS], [EOS], _encode)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


def _grammar(schema: dict[str, Any] = SCHEMA) -> Grammar:
    return Grammar.parse({"type": "json_schema", "schema": schema})


def _generate(c: Constraints, session: int, first: dict[str, Any], rng: np.random.Generator, position: int = 0,
              limit: int = 200) -> list[int]:
    """Greedy tokens over random logits under ``c`` until EOS: the first step carries ``first``'s fields."""
    fields, out = {"position": position, "seq_len": 3, **first}, []
    while len(out) < limit:
        token = int(np.argmax(c.mask(session, fields, rng.standard_normal(N_LOGITS).astype(np.float32))))
        c.advance(session, fields, token)
        out.append(token)
        if token == EOS:
            return out
        fields = {"position": fields["position"] + fields["seq_len"], "seq_len": 1}
    raise AssertionError("no EOS within the limit")


def _text(tokens: list[int]) -> str:
    return b"".join(TOKENS[t] for t in tokens if t != EOS).decode()


def test_every_output_fits_the_schema_whatever_the_logits() -> None:
    rng = np.random.default_rng(0)
    c = Constraints(lambda: VOCAB, N_LOGITS)
    for session in range(20):
        out = _generate(c, session, {"grammar": _grammar()}, rng)
        jsonschema.validate(json.loads(_text(out)), SCHEMA)
        assert out[-1] == EOS and max(out) < len(TOKENS)


@pytest.mark.parametrize(("field", "check"), [
    ({"type": "regex", "text": "[0-9]{3}-[a-z]{2}"}, lambda text: len(text) == 6 and text[3] == "-"),
    ({"type": "lark", "text": 'start: "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ({"type": "gbnf", "text": 'root ::= "a" [0-9] "z"'}, lambda text: len(text) == 3 and text[1].isdigit()),
])
def test_each_kind_of_grammar_constrains_the_output(field: dict[str, Any], check: Any) -> None:
    c, rng = Constraints(lambda: VOCAB, N_LOGITS), np.random.default_rng(1)
    for session in range(5):
        assert check(_text(_generate(c, session, {"grammar": Grammar.parse(field)}, rng)))


def test_json_object_gives_an_object() -> None:
    c, logits = Constraints(lambda: VOCAB, N_LOGITS), np.zeros(N_LOGITS, dtype=np.float32)
    logits[[ord("["), ord("1"), ord("}"), EOS]] = [9, 8, 1, 1]  # the model wants a list of ones: it gets an object
    fields, out = {"position": 0, "seq_len": 1, "grammar": Grammar.parse({"type": "json_object"})}, []
    while not out or out[-1] != EOS:
        out.append(int(np.argmax(c.mask(0, fields, logits))))
        c.advance(0, fields, out[-1])
        fields = {"position": fields["position"] + 1, "seq_len": 1}
    assert json.loads(_text(out)) == {}


def test_a_step_that_is_not_the_next_one_ends_the_matcher() -> None:
    c, rng = Constraints(lambda: VOCAB, N_LOGITS), np.random.default_rng(2)
    logits = rng.standard_normal(N_LOGITS).astype(np.float32)

    def begin() -> None:  # a prefill of 4 positions with a grammar: the first token fed back at position 4
        fields = {"position": 0, "seq_len": 4, "grammar": _grammar()}
        c.advance(7, fields, int(np.argmax(c.mask(7, fields, logits))))

    begin()
    assert np.isinf(c.mask(7, {"position": 4, "seq_len": 1}, logits)).any()  # the next step: masked
    for step in ({"position": 2, "seq_len": 1}, {"position": 4, "seq_len": 2}, {"position": 9, "seq_len": 1}):
        c.release(7)
        begin()
        np.testing.assert_array_equal(c.mask(7, step, logits), logits)  # a rewind, new tokens, a gap: unconstrained
        assert c.sessions() == []


def test_a_null_grammar_ends_the_matcher_and_release_and_eviction_forget_it() -> None:
    c, logits = Constraints(lambda: VOCAB, N_LOGITS), np.zeros(N_LOGITS, dtype=np.float32)
    for rid in (1, 2, 3):
        c.mask(rid, {"position": 0, "seq_len": 1, "grammar": _grammar()}, logits)
    np.testing.assert_array_equal(c.mask(1, {"position": 0, "seq_len": 1, "grammar": None}, logits), logits)
    c.release(2)
    assert c.sessions() == [3]
    c.keep_only([1, 2])
    assert c.sessions() == []


def test_without_a_vocabulary_a_grammar_is_accepted_and_not_applied() -> None:
    c, logits = Constraints(lambda: None, N_LOGITS), np.arange(N_LOGITS, dtype=np.float32)
    np.testing.assert_array_equal(c.mask(1, {"position": 0, "seq_len": 1, "grammar": _grammar()}, logits), logits)


@pytest.mark.parametrize(("value", "message"), [
    ({"type": "xml"}, "'grammar.type' must be one of"),
    ("json", "'grammar.type' must be one of"),
    ({"type": "json_schema", "schema": {"type": "strin"}}, "does not compile"),
    ({"type": "json_schema", "schema": {"$ref": "#/nowhere"}}, "does not compile"),
    ({"type": "json_schema", "schema": [1]}, "'grammar.schema' must be"),
    ({"type": "json_schema", "schema": {"not": {"type": "string"}}}, "Unimplemented keys"),
    ({"type": "json_schema", "schema": {}, "strict": 1}, "'grammar.strict' must be"),
    ({"type": "regex", "text": "(unclosed"}, "does not compile"),
    ({"type": "lark", "text": ""}, "'grammar.text' must be"),
    ({"type": "lark", "text": "start: undefined_rule"}, "does not compile"),
])
def test_a_bad_grammar_is_refused_naming_the_field(value: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_grammar({"grammar": value})


def test_a_schema_not_strict_ignores_what_the_library_lacks() -> None:
    assert Grammar.parse({"type": "json_schema", "schema": {"not": {"type": "string"}}, "strict": False})


def test_vocabulary_from_gguf_marks_control_tokens_special() -> None:
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "Ġb", "<|im_end|>", "<tool_call>"],
          "tokenizer.ggml.token_type": [1, 1, 3, 4]}
    v = Vocabulary.from_gguf_kv(kv, [2], _encode)
    assert v.tokens == [b"a", b" b", b"\xff<|im_end|>", b"\xff<tool_call>"] and v.special == [2, 3]


# --- through the worker: single and batched steps --------------------------------------------------------------


class _VocabStub(StubEngine):
    """The stub's last stage with a vocabulary and random logits of its size: grammars apply."""

    def __init__(self) -> None:
        super().__init__(1, 2)
        self.rng = np.random.default_rng(3)

    def vocabulary(self) -> Vocabulary:
        return VOCAB

    def _logits(self, hidden: bytes, position: int) -> np.ndarray:  # type: ignore[override]
        return self.rng.standard_normal(N_LOGITS).astype(np.float32)


def _step(rid: int, position: int, seq_len: int = 1, **extra: Any) -> dict[str, Any]:
    hidden = base64.b64encode(b"\0\x3c" * (seq_len * STUB_HIDDEN_DIM)).decode()
    return {"op": "forward_and_sample", "request_id": rid, "hidden_b64": hidden, "position": position,
            "seq_len": seq_len, **extra}


def test_worker_masks_single_and_batched_steps_and_release_drops_the_matcher() -> None:
    worker = Worker(_VocabStub(), Clock(), "stub")
    grammar = {"type": "json_schema", "schema": SCHEMA}
    sessions = {rid: [worker.handle_line(request_line(_step(rid, 0, 3, grammar=grammar)))["token_id"]]
                for rid in (10, 11, 12)}
    for _ in range(200):  # the three sessions' next steps in one batch line each time
        live = [rid for rid, out in sessions.items() if out[-1] != EOS]
        if not live:
            break
        batch = {"op": "batch", "request_id": 99, "requests": [_step(r, 2 + len(sessions[r]), 1) for r in live]}
        for reply in worker.handle_line(request_line(batch))["replies"]:
            sessions[reply["request_id"]].append(reply["token_id"])
    assert worker.engine.batches  # the steps were batched
    for out in sessions.values():
        assert out[-1] == EOS
        jsonschema.validate(json.loads(_text(out)), SCHEMA)
    replies, _ = serve_bytes(worker, request_line({"op": "release", "request_id": 10}))
    assert replies[0]["released"] and worker.constraints.sessions() == [11, 12]


def test_a_bad_grammar_is_an_error_reply_and_the_stage_goes_on() -> None:
    worker = Worker(_VocabStub(), Clock(), "stub")
    bad = worker.handle_line(request_line(_step(5, 0, grammar={"type": "json_schema", "schema": {"type": "strin"}})))
    assert "does not compile" in bad["error"] and bad["request_id"] == 5
    assert "token_id" in worker.handle_line(request_line(_step(5, 0)))


def test_grammar_error_is_a_value_error() -> None:
    assert issubclass(GrammarError, ValueError)


# --- the driver: the field on a generation's first step ----------------------------------------------------------


def _last_stage_fields(g: Generation) -> list[dict[str, Any]]:
    """The fields of every forward_and_sample a 2-stage generation sends (fake replies: 2 tokens, then EOS)."""
    steps, sent, reply = g.steps(2, frozenset({9})), [], None
    while True:
        try:
            call = steps.send(reply)
        except StopIteration:
            return sent
        if call.op == "tokenize":
            reply = {"tokens": [1, 2, 3]}
        elif call.op == "forward_and_sample":
            sent.append(call.fields)
            reply = {"token_id": 9 if len(sent) == 3 else 5}
        elif call.op == "detokenize":
            reply = {"text": "x"}
        else:
            reply = {"hidden_b64": "AAAA"}


@pytest.mark.parametrize(("grammar", "cached", "first"), [
    ({"type": "json_object"}, [], {"grammar": {"type": "json_object"}}),
    (None, [1, 2], {"grammar": None}),  # a kept session: an earlier turn's matcher must not constrain this one
    (None, [], {}),  # a fresh session holds none: the field is left out (the contract's requests, unchanged)
])
def test_the_driver_sends_the_grammar_on_the_first_step_only(grammar: Any, cached: list[int], first: Any) -> None:
    sent = _last_stage_fields(Generation(0, "p", 7, max_tokens=8, grammar=grammar, cached=cached))
    assert len(sent) == 3
    assert {k: v for k, v in sent[0].items() if k == "grammar"} == first
    assert all("grammar" not in f for f in sent[1:])


def test_the_stub_accepts_a_grammar_and_applies_nothing() -> None:
    worker = Worker(StubEngine(1, 2), Clock(), "stub")
    plain = worker.handle_line(request_line(_step(3, 0, 2)))
    worker.engine.release(3)
    constrained = worker.handle_line(request_line(_step(3, 0, 2, grammar={"type": "regex", "text": "x"})))
    assert constrained == plain and "token_id" in plain
    bad = worker.handle_line(request_line(_step(3, 2, 1, grammar={"type": "regex", "text": "("})))
    assert "does not compile" in bad["error"]  # validated all the same
