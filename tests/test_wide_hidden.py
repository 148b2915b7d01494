"""Hidden states past float16's range. Gemma 3's residual stream passes 65504 on real models (its post-norm gains
are large), and a float16 wire would carry those values as inf, from which the next stage computes only NaN. A stage
on the contract's wire (``PP_WIRE_DTYPE`` unset: f16) answers such a state with an error that names the remedy; on
``auto`` (what the drivers start stages with) it sends it as float32 and says so (``hidden_dtype: "f32"``), and
float16 byte for byte otherwise; ``f32`` sends float32 always. Checked on the codec, the protocol, a stub stage, and
a generated Gemma 3 whose block before the stage boundary lifts the residual stream past float16's range: in one
process against the float64 reference, and through two worker processes and the driver."""

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
                                         r"it: start the stages with PP_WIRE_DTYPE=auto .* or f32, and forward"):
        q8.emit(rows(1e5).tobytes(), "f32", wire, D)


def test_an_f32_wire_sends_float32_always() -> None:
    x = rows()
    assert q8.emit(x.tobytes(), "f32", "f32", D) == (x.tobytes(), "f32")
    half = x.astype("<f2")  # a float16 engine (the stub): its values widened exactly
    assert q8.emit(half.tobytes(), "f16", "f32", D) == (half.astype("<f4").tobytes(), "f32")


@pytest.mark.parametrize("wire", q8.WIRE_DTYPES)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_inf_and_nan_are_errors_on_every_wire(wire: str, bad: float) -> None:
    with pytest.raises(q8.Q8Error, match=r"inf or NaN \(first: row 1\)"):
        q8.emit(rows(bad).tobytes(), "f32", wire, D)


# --- the protocol -------------------------------------------------------------------------------------------

def test_an_f32_payload_is_read_as_float32() -> None:
    x = rows(1e6)
    text = base64.b64encode(x.tobytes()).decode()
    assert decode_hidden({"hidden_b64": text, "hidden_dtype": "f32"}, 2, D) == x.tobytes()
    with pytest.raises(ProtocolError, match=r"hidden_dim\*2 .*size of a f32 payload: send 'hidden_dtype': 'f32'"):
        decode_hidden({"hidden_b64": text}, 2, D)  # its hidden_dtype dropped on the way
    half = base64.b64encode(bytes(2 * D * 2)).decode()
    with pytest.raises(ProtocolError, match=r"seq_len\*hidden_dim\*4 \(2\*16\*4 = 128 bytes.*size of a f16 payload"):
        decode_hidden({"hidden_b64": half, "hidden_dtype": "f32"}, 2, D)


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


def test_two_stages_match_the_reference(model: Path, ref: Gemma3Ref) -> None:
    """In one process (`Chain` passes each hidden state on as a worker on ``auto`` sends it); and stage 0 behind
    the worker's dispatch on each wire."""
    chain = Chain(model, 2, MAX_CONTEXT, wire="auto")
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
    want = ref.logits(PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=ATOL)
    assert tokens == [int(a) for a in want.argmax(-1)]


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
    it as float32 (auto) or as that request's error (f16), one with NaN is that request's error alone."""
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
    replies = serve(Worker(engine, Clock(), "stub", wire_dtype=wire), *prefills, *steps)
    assert engine.batches == [3]
    one, two, three = replies[3:]
    assert set(one) == {"request_id", "hidden_b64", "seq_len"} and one["request_id"] == 1
    if wire == "auto":
        assert two["hidden_dtype"] == "f32" and np.frombuffer(base64.b64decode(two["hidden_b64"]), "<f4")[0] == 1e5
    else:
        assert two["request_id"] == 2 and "exceeds float16's range" in two["error"]
    assert three == {"request_id": 3, "error": "hidden state has inf or NaN (first: row 0): nothing after it could "
                                               "be computed"}
