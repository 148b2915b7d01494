"""Hidden states past float16's range. Gemma 3's residual stream passes 65504 on real models (its post-norm gains
are large), and a float16 wire would carry those values as inf, from which the next stage computes only NaN. On
``auto`` (the default) a stage sends such a state as float32 and says so (``hidden_dtype: "f32"``), and float16 byte
for byte otherwise; the receiver knows a payload's dtype from its length, so a caller that forwards only the seed's
fields (hidden_b64, seq_len, position) runs such a model too. ``f16`` answers such a state with an error that names
the remedy; ``f32`` sends float32 always. inf and NaN go out as computed (as the seed's did), reported by an event,
or are errors with PP_STRICT_FINITE=1; a step that fails leaves its session as it found it. Checked on the codec,
the protocol, a stub stage, and a generated Gemma 3 whose block before the stage boundary lifts the residual stream
past float16's range: in one process against the float64 reference, and through two worker processes and the
driver."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_worker, request_line, serve_bytes

from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing import gemma3gen
from pp_worker.testing.chain import Chain
from pp_worker.testing.npref import Gemma3Ref
from pp_worker.worker import q8
from pp_worker.worker.dispatch import Worker
from pp_worker.worker.engines.stub import StubEngine
from pp_worker.worker.events import Clock
from pp_worker.worker.protocol import ProtocolError, decode_hidden

D = 16  # the stub's hidden_dim
F16_MAX = 65504.0
MAX_CONTEXT = 64
ATOL = 3e-2  # test_gemma3's tolerance against float64
PROMPT = [int(t) for t in np.random.default_rng(1).integers(5, 500, 20)]


def rows(*values: float) -> np.ndarray:
    """(2, D) float32: row 0 small values, row 1 ``values`` then small ones."""
    x = np.random.default_rng(0).uniform(-3, 3, (2, D)).astype(np.float32)
    x[1, :len(values)] = values
    return x


# --- the codec ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wire", ["f16", "auto"])
def test_in_range_states_stay_float16_byte_for_byte(wire: str) -> None:
    x = rows(65519.0, -65519.0)  # the largest values that round to float16's 65504, not to inf
    payload, dtype = q8.emit(x.tobytes(), "f32", wire, D)
    assert dtype == "f16" and payload == x.astype("<f2").tobytes()
    assert np.abs(np.frombuffer(payload, "<f2")).max() == F16_MAX


@pytest.mark.parametrize("big", [65520.0, -70000.0, 3.0e38])
def test_auto_sends_a_state_past_float16s_range_as_float32(big: float) -> None:
    x = rows(big)
    payload, dtype = q8.emit(x.tobytes(), "f32", "auto", D)
    assert dtype == "f32" and payload == x.tobytes()  # every value exact, not only the large one


@pytest.mark.parametrize("wire", ["f16", "q8"])
def test_past_float16s_range_f16_and_q8_answer_with_the_remedy(wire: str) -> None:
    with pytest.raises(q8.Q8Error, match=rf"float16's range in 1 row\(s\) \(first: row 1\); {wire} cannot carry "
                                         r"it: start the stages with PP_WIRE_DTYPE=auto \(the default.*\) or f32$"):
        q8.emit(rows(1e5).tobytes(), "f32", wire, D)


def test_an_f32_wire_sends_float32_always() -> None:
    x = rows()
    assert q8.emit(x.tobytes(), "f32", "f32", D) == (x.tobytes(), "f32")
    half = x.astype("<f2")  # a float16 engine (the stub): its values widened exactly
    assert q8.emit(half.tobytes(), "f16", "f32", D) == (half.astype("<f4").tobytes(), "f32")


@pytest.mark.parametrize("wire", ["f16", "auto", "f32"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_inf_and_nan_go_out_as_computed(wire: str, bad: float) -> None:
    """As the seed's float16 did: float16 (or float32) holds inf and NaN; they are no reason for float32 on auto."""
    x = rows(bad)
    payload, dtype = q8.emit(x.tobytes(), "f32", wire, D)
    assert dtype == ("f32" if wire == "f32" else "f16")
    assert payload == x.astype("<f4" if wire == "f32" else "<f2").tobytes()


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_q8_cannot_carry_inf_or_nan(bad: float) -> None:
    with pytest.raises(q8.Q8Error, match=r"inf or NaN in 1 row\(s\) \(first: row 1\); q8 cannot carry them"):
        q8.emit(rows(bad).tobytes(), "f32", "q8", D)


def test_a_state_past_float16s_range_with_nan_goes_out_as_float32_on_auto() -> None:
    x = rows(1e5, np.nan)
    assert q8.emit(x.tobytes(), "f32", "auto", D) == (x.tobytes(), "f32")


# --- the protocol -------------------------------------------------------------------------------------------

def test_an_f32_payload_is_read_as_float32() -> None:
    x = rows(1e6)
    text = base64.b64encode(x.tobytes()).decode()
    assert decode_hidden({"hidden_b64": text, "hidden_dtype": "f32"}, 2, D) == x.tobytes()
    assert decode_hidden({"hidden_b64": text}, 2, D) == x.tobytes()  # the seed's fields only: its length says f32
    half = base64.b64encode(bytes(2 * D * 2)).decode()
    with pytest.raises(ProtocolError, match=r"expected for hidden_dtype 'f32' 172 chars \(f32: 2\*16\*4 = 128 bytes\); "
                                            r"that is the size of a f16 payload$"):
        decode_hidden({"hidden_b64": half, "hidden_dtype": "f32"}, 2, D)


def test_a_wrong_seq_len_is_told_the_lengths_it_allows() -> None:
    """A float16 payload of 3 rows sent with seq_len 2: no hint to send a hidden_dtype (no dtype fits)."""
    half = base64.b64encode(bytes(3 * D * 2)).decode()
    with pytest.raises(ProtocolError) as e:
        decode_hidden({"hidden_b64": half}, 2, D)
    assert str(e.value) == ("hidden_b64 does not match seq_len 2: got 128 base64 chars; expected 88 chars (f16: "
                            "2*16*2 = 64 bytes) or 56 chars (q8: 2*(16+4) = 40 bytes) or 172 chars (f32: 2*16*4 = "
                            "128 bytes)")


def serve(worker: Worker, *requests: dict[str, Any]) -> list[dict[str, Any]]:
    return serve_bytes(worker, b"".join(request_line(r) for r in requests))[0]


def test_a_stub_stage_on_an_f32_wire() -> None:
    embed = {"op": "embed_and_forward", "request_id": 1, "tokens": [3, 1, 4], "position": 0}
    (f16,) = serve(make_worker(0, 3), embed)
    (f32,) = serve(Worker(StubEngine(0, 3), Clock(), "stub", wire_dtype="f32"), embed)
    assert f32["hidden_dtype"] == "f32" and "hidden_dtype" not in f16
    want = np.frombuffer(base64.b64decode(f16["hidden_b64"]), "<f2").astype("<f4")
    assert base64.b64decode(f32["hidden_b64"]) == want.tobytes()
    hop = {"op": "forward_range", "request_id": 2, "position": 0, "seq_len": 3, "hidden_b64": f32["hidden_b64"],
           "hidden_dtype": "f32"}
    (reply,) = serve(make_worker(1, 3), hop)  # an f16 stage reads it, and answers in float16
    assert set(reply) == {"request_id", "hidden_b64", "seq_len"}, reply


def test_a_default_stub_stage_replies_in_float16_on_auto() -> None:
    worker = make_worker(0, 2)
    assert worker.wire_dtype == "auto"
    (reply,) = serve(worker, {"op": "embed_and_forward", "request_id": 1, "tokens": [3, 1, 4], "position": 0})
    assert set(reply) == {"request_id", "hidden_b64", "seq_len"}
    assert base64.b64decode(reply["hidden_b64"]) == StubEngine(0, 2).embed_and_forward(1, [3, 1, 4], 0)


# --- a Gemma 3 past float16's range ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test_gemma3 preset with block 3's post-feed-forward gains near 6e4 (Gemma 3's post-norm gains are what
    lift its residual stream; a stage holds gains as float16, so they stay below 65504): 2 stages split after block
    3, where the residual stream holds values past 65504."""
    spec = gemma3gen.PRESETS["gemma3"]
    weights = gemma3gen.random_weights(spec, len(gemma3gen.vocab(spec.n_merges).tokens), seed=0)
    gain = weights["blk.3.post_ffw_norm.weight"]  # near 3
    weights["blk.3.post_ffw_norm.weight"] = np.clip(gain * np.float32(2e4), 1e4, 65000)
    return gemma3gen.write_gguf(tmp_path_factory.mktemp("wide") / "gemma3-wide.gguf", spec, weights)


@pytest.fixture(scope="module")
def ref(model: Path) -> Gemma3Ref:
    return Gemma3Ref.from_gguf(model)


@pytest.fixture(scope="module")
def chain(model: Path) -> Chain:
    return Chain(model, 2, MAX_CONTEXT, wire="auto")


def test_two_stages_match_the_reference(chain: Chain, ref: Gemma3Ref) -> None:
    """In one process (`Chain` passes each hidden state on as a worker on ``auto`` sends it); and stage 0 behind
    the worker's dispatch on each wire."""
    first = chain.engines[0]
    assert first.shard.end == 4
    x = np.frombuffer(first.embed_and_forward(0, PROMPT, 0), "<f4").reshape(len(PROMPT), -1)
    assert np.isfinite(x).all() and np.abs(x).max() > F16_MAX  # in float16 it would have been inf
    first.release(0)
    embed = {"op": "embed_and_forward", "request_id": 0, "tokens": PROMPT, "position": 0}
    for wire in ("auto", "f32", "f16"):
        (reply,) = serve(Worker(first, Clock(), "m", wire_dtype=wire), embed, {"op": "release", "request_id": 0})[:1]
        if wire == "f16":
            assert "exceeds float16's range" in reply["error"] and "PP_WIRE_DTYPE=auto" in reply["error"]
        else:
            assert reply["hidden_dtype"] == "f32" and base64.b64decode(reply["hidden_b64"]) == x.tobytes()
    tokens, logits = chain.generate(1, PROMPT, 4)
    chain.release(1)
    want = ref.logits(PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=ATOL)
    assert tokens == [int(a) for a in want.argmax(-1)]


def seed_caller(workers: list[Worker], rid: int, prompt: list[int], n: int, forward_dtype: bool) -> list[int]:
    """``n`` greedy tokens as the Rust caller drives stages: from each forward reply it forwards hidden_b64, seq_len
    and position (and ``hidden_dtype`` only if ``forward_dtype``)."""
    tokens: list[int] = []
    position = 0
    while len(tokens) < n:
        first = ({"op": "embed_and_forward", "tokens": prompt} if not tokens else
                 {"op": "decode_step", "token_id": tokens[-1]})
        (reply,) = serve(workers[0], first | {"request_id": rid, "position": position})
        for w in workers[1:]:
            hop = {"op": "forward_range" if w is not workers[-1] else "forward_and_sample", "request_id": rid,
                   "hidden_b64": reply["hidden_b64"], "seq_len": reply["seq_len"], "position": position}
            if forward_dtype and "hidden_dtype" in reply:
                hop["hidden_dtype"] = reply["hidden_dtype"]
            (reply,) = serve(w, hop)
        tokens.append(reply["token_id"])
        position += len(prompt) if len(tokens) == 1 else 1
    for w in workers:
        serve(w, {"op": "release", "request_id": rid})
    return tokens


def test_a_seed_protocol_caller_runs_gemma3_with_the_default_environment(chain: Chain, ref: Gemma3Ref) -> None:
    """Workers as built by default (PP_WIRE_DTYPE unset): stage 0 sends its state past float16's range as float32,
    and a caller that drops hidden_dtype gets the tokens of one that forwards it, the reference's."""
    workers = [Worker(e, Clock(), "m") for e in chain.engines]
    (reply,) = serve(workers[0], {"op": "embed_and_forward", "request_id": 3, "tokens": PROMPT, "position": 0},
                     {"op": "release", "request_id": 3})[:1]
    assert reply["hidden_dtype"] == "f32" and len(base64.b64decode(reply["hidden_b64"])) == len(PROMPT) * 64 * 4
    seed = seed_caller(workers, 3, PROMPT, 4, forward_dtype=False)
    assert seed == seed_caller(workers, 4, PROMPT, 4, forward_dtype=True)
    want = ref.logits(PROMPT + seed[:-1])[len(PROMPT) - 1:]
    assert seed == [int(a) for a in want.argmax(-1)]


def sessions(worker: Worker) -> dict[str, int]:
    (status,) = serve(worker, {"op": "status", "request_id": 99})
    return status["sessions"]


def test_a_step_that_fails_after_its_forward_leaves_its_session_as_it_was(chain: Chain) -> None:
    """Stage 0 on an f16 wire computes a state it cannot send: the error comes after the forward, and the session
    is put back (a new one dropped, an appended one at its length): the next step at the next position is refused,
    the retry at the same position gives what a session that never failed gives."""
    first = chain.engines[0]
    auto, f16 = Worker(first, Clock(), "m"), Worker(first, Clock(), "m", wire_dtype="f16")
    prefill = {"op": "embed_and_forward", "request_id": 5, "tokens": PROMPT, "position": 0}
    assert "exceeds float16's range" in serve(f16, prefill)[0]["error"]
    assert sessions(auto) == {}
    serve(auto, prefill)
    step = {"op": "decode_step", "request_id": 5, "token_id": 9, "position": len(PROMPT)}
    assert "exceeds float16's range" in serve(f16, step | {"token_id": 11})[0]["error"]
    assert sessions(auto) == {"5": len(PROMPT)}
    (refused,) = serve(auto, step | {"position": len(PROMPT) + 1})
    assert refused["error"] == f"position {len(PROMPT) + 1} is past the {len(PROMPT)} positions session 5 holds"
    (retry,) = serve(auto, step)
    serve(auto, prefill | {"request_id": 6})
    assert retry == serve(auto, step | {"request_id": 6})[0] | {"request_id": 5}
    # a rewind that fails has overwritten the positions from its own on: its session keeps those before it
    assert "exceeds float16's range" in serve(f16, prefill | {"tokens": [7, 8], "position": 3})[0]["error"]
    assert sessions(auto) == {"5": 3, "6": len(PROMPT) + 1}
    serve(auto, {"op": "reset", "request_id": 0})


def nan_rows(seq_len: int, dim: int, first_bad: int) -> str:
    x = np.ones((seq_len, dim), "<f2")
    x[first_bad:, 1] = np.nan
    return base64.b64encode(x.tobytes()).decode()


@pytest.mark.parametrize("strict", [False, True])
def test_a_non_finite_input_on_a_real_stage(chain: Chain, strict: bool) -> None:
    """The last stage gets rows with NaN: by default it computes (an event names the first row) and, every logit
    being NaN, has no token to give; with PP_STRICT_FINITE=1 it refuses before the forward. Either way the session
    is as before."""
    last = chain.engines[1]
    events: list[tuple[str, dict[str, Any]]] = []
    worker = Worker(last, Clock(), "m", strict_finite=strict, emit=lambda kind, **f: events.append((kind, f)))
    calls = []
    forward = last.forward_logits
    last.forward_logits = lambda *a: calls.append(a) or forward(*a)  # type: ignore[method-assign]
    try:
        (reply,) = serve(worker, {"op": "forward_and_sample", "request_id": 8, "position": 0, "seq_len": 3,
                                  "hidden_b64": nan_rows(3, 64, 1)})
    finally:
        del last.forward_logits
    assert sessions(worker) == {}
    if strict:
        assert reply == {"request_id": 8, "error": "hidden_b64 has inf or NaN in 2 row(s) (first: row 1); "
                                                   "PP_STRICT_FINITE=1 refuses it"}
        assert calls == [] and events == []
    else:
        assert reply == {"request_id": 8, "error": "no token: all logits are NaN"} and len(calls) == 1
        where = {"session": 8, "op": "forward_and_sample", "position": 0}
        assert events == [("nonfinite_input", where | {"rows": 2, "first_row": 1}),
                          ("nonfinite_output", where | {"rows": 1, "first_row": 0})]


def test_real_workers_through_the_driver(model: Path, ref: Gemma3Ref) -> None:
    """The driver's default (PP_WIRE_DTYPE=auto): stage 0 replies in float32 where it must, the driver forwards
    the field with the payload, and the tokens are the reference's."""
    launch = Launch(2, model=str(model), env={"MAX_CONTEXT": str(MAX_CONTEXT)})
    with Pipeline(launch, log=None) as p:
        (g,) = p.run(make_generations(p, ["Beautiful is better than ugly. " * 2], 4, Sampling())).generations
    want = ref.logits(g.prompt_tokens + g.tokens[:-1])[len(g.prompt_tokens) - 1:]
    assert len(g.tokens) == 4 and g.tokens == [int(a) for a in want.argmax(-1)]
    assert [st.ready["wire_dtype"] for st in p.stages] == ["auto", "auto"]


@pytest.mark.parametrize("wire", ["auto", "f16"])
def test_a_batched_step_puts_each_row_on_the_wire_on_its_own(wire: str) -> None:
    """Three sessions in one batched step of a float32 engine: a row in float16's range goes as float16, one past
    it as float32 (auto) or as that request's error (f16, its session left as it was), one with NaN as float16
    with a `nonfinite_output` event naming it."""
    engine = StubEngine(0, 2)
    engine.hidden_dtype = "f32"
    stub_embed = engine.embed_and_forward

    def embed(session: int, tokens: list[int], position: int) -> bytes:
        stub_embed(session, tokens, position)  # the stub's session bookkeeping
        x = np.full((len(tokens), D), 0.5, "<f4")
        x[:, 0] = {1: 1.0, 2: 1e5, 3: np.nan}[session] if position else 1.0
        return x.tobytes()

    engine.embed_and_forward = embed  # type: ignore[method-assign]
    prefills = [{"op": "embed_and_forward", "request_id": r, "tokens": [7], "position": 0} for r in (1, 2, 3)]
    steps = [{"op": "decode_step", "request_id": r, "token_id": 7, "position": 1} for r in (1, 2, 3)]
    events: list[tuple[str, dict[str, Any]]] = []
    worker = Worker(engine, Clock(), "stub", wire_dtype=wire, emit=lambda kind, **f: events.append((kind, f)))
    replies = serve(worker, *prefills, *steps, {"op": "status", "request_id": 9})
    assert engine.batches == [3]
    one, two, three, status = replies[3:]
    assert set(one) == {"request_id", "hidden_b64", "seq_len"} and one["request_id"] == 1
    if wire == "auto":
        assert two["hidden_dtype"] == "f32" and np.frombuffer(base64.b64decode(two["hidden_b64"]), "<f4")[0] == 1e5
    else:
        assert two["request_id"] == 2 and "exceeds float16's range" in two["error"]
    assert status["sessions"] == {"1": 2, "2": 2 if wire == "auto" else 1, "3": 2}
    assert three["request_id"] == 3 and np.isnan(np.frombuffer(base64.b64decode(three["hidden_b64"]), "<f2")[0])
    assert events == [("nonfinite_output", {"session": 3, "op": "decode_step", "position": 1, "rows": 1,
                                            "first_row": 0})]
