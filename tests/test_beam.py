"""PP_BEAM: parsed and validated like the other PP_* settings, reported by the engine, and in force (as tinygrad's
BEAM) exactly while the decode JIT compiles its kernels. Structural: the search itself is replaced by a spy, so
this stays fast; no timing."""

from __future__ import annotations

import numpy as np
import pytest
import tinygrad.engine.jit
import tinygrad.engine.realize
from tinygrad.helpers import BEAM

from pp_worker import DEFAULT_MODEL
from pp_worker.worker.cli import ConfigError, parse_config
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

ENV = {"STAGE": "1", "NUM_STAGES": "2"}


def test_pp_beam_parses_and_defaults_off():
    assert parse_config([], ENV).beam == 0
    assert parse_config([], ENV | {"PP_BEAM": "2"}).beam == 2
    assert parse_config([], ENV | {"PP_BEAM": " "}).beam == 0


@pytest.mark.parametrize("value", ["-1", "two", "1.5", "\u0662"])
def test_bad_pp_beam_is_a_config_error(value):
    with pytest.raises(ConfigError, match="PP_BEAM"):
        parse_config([], ENV | {"PP_BEAM": value})


@pytest.fixture
def compiled_beams(monkeypatch) -> list[int]:
    """The BEAM width each kernel compilation ran with; compiles with 0 instead (no search: fast)."""
    seen: list[int] = []
    original = tinygrad.engine.realize.compile_linear

    def spy(linear, beam=None, validate=False):
        seen.append(BEAM.value if beam is None else beam)
        return original(linear, beam=0, validate=validate)

    monkeypatch.setattr(tinygrad.engine.realize, "compile_linear", spy)  # run_linear: the JIT's first (eager) call
    monkeypatch.setattr(tinygrad.engine.jit, "compile_linear", spy)  # jit_lower: the capture
    return seen


def test_pp_beam_applies_to_the_decode_jit_only(compiled_beams):
    engine = TinygradEngine(str(DEFAULT_MODEL), 1, 2, max_context=32, prefill_chunk=4, beam=3, every_size=True)
    assert engine.describe()["beam"] == 3
    row = np.zeros(engine.info.hidden_dim, np.float16).tobytes()
    for _ in range(2):  # the prefill JIT's first call and its capture
        engine.forward_logits(0, row * 4, 0, 4)
    assert compiled_beams and set(compiled_beams) == {0}, "prefill is not searched"
    compiled_beams.clear()
    for position in range(4, 8):  # decode: first call, capture, replays
        engine.forward_logits(0, row, position, 1)
    assert compiled_beams and set(compiled_beams) == {3}
    assert BEAM.value == 0, "BEAM is back to tinygrad's own value outside the decode JIT"
