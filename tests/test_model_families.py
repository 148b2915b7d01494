"""Real GGUF families on generated models, through chained engines, against the independent float64 reference.

- RoPE scaling: Llama 3.1+'s rope_freqs.weight, linear and yarn rope.scaling.* keys. The reference (tests/npref.py)
  computes ggml's rope_ext with them; the same reference with plain RoPE differs by more than 1 logit on these
  models, so an engine that ignored the scaling (tinygrad's own table) fails here.
- SentencePiece (Llama 2 / Mistral / TinyLlama): tokenized with the BOS by llama.cpp's default rule, generated,
  detokenized.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from spm_ref import SpmReference

from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing import rope_scaling as rs
from pp_worker.testing.chain import on_wire
from pp_worker.testing.modelgen import SPM, generate
from pp_worker.testing.npref import RefModel, RopeScaling
from pp_worker.worker.engines.rope import RopeParams, rope_table
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine
from pp_worker.worker.gguf.header import ModelLoadError, read_header
from pp_worker.worker.text.detokenizer import Detokenizer

MAX_CONTEXT = 64
LOGIT_ATOL_FP64 = 3e-2  # as test_tinygrad_engine: fp16 weights and stage boundaries vs float64
UNSCALED_MIN_DIFF = 1.0  # measured 1.35-1.82 on these models (the chain: <= 5.0e-3): ignoring the scaling fails
N_STEPS = 8

ROPE = {  # original contexts of 32 / 64 positions, so that the scaling matters within MAX_CONTEXT
    "llama3 rope_freqs": rs.RopeScaling(freq_factors=rs.llama3_rope_factors(16, 10000.0, 4.0, original_context=32)),
    "linear x2": rs.RopeScaling(type="linear", factor=2.0),
    "yarn x4": rs.RopeScaling(type="yarn", factor=4.0, original_context_length=64),
    "factor without a type (linear)": rs.RopeScaling(factor=2.0),
}


def chain(path: Path, num_stages: int = 2) -> list[TinygradEngine]:
    return [TinygradEngine(str(path), s, num_stages, max_context=MAX_CONTEXT) for s in range(num_stages)]


def step(engines: list[TinygradEngine], rid: int, tokens: list[int], position: int) -> np.ndarray:
    h = on_wire(engines[0], engines[0].embed_and_forward(rid, tokens, position))  # as the worker sends it
    for e in engines[1:-1]:
        h = on_wire(e, e.forward_range(rid, h, position, len(tokens)))
    return engines[-1].forward_logits(rid, h, position, len(tokens)).copy()  # a view of the engine's host buffer


def generate_logits(engines: list[TinygradEngine], prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy: a prefill (in two chunks when the prompt is longer than 32) then decode steps."""
    logits = [step(engines, 0, prompt, 0)]
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        logits.append(step(engines, 0, [out[-1]], len(prompt) + len(out) - 1))
        out.append(int(logits[-1].argmax()))
    return out, np.stack(logits)


# ---------------------------------------------------------------- RoPE scaling


@pytest.mark.parametrize("case", sorted(ROPE))
def test_rope_scaling_matches_the_reference(tmp_path, case):
    path = generate(tmp_path / "rope.gguf", "tiny", seed=1, rope=ROPE[case])
    ref = RefModel.from_gguf(path)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 500, 40)]  # > 32: two prefill chunks
    tokens, logits = generate_logits(chain(path, 3), prompt, N_STEPS)
    context = prompt + tokens[:-1]
    want = ref.logits(context)[len(prompt) - 1:]  # (N_STEPS, V): the positions the chain predicted from
    unscaled = replace(ref, rope_scaling=RopeScaling()).logits(context)[len(prompt) - 1:]
    assert np.abs(want - unscaled).max() > UNSCALED_MIN_DIFF  # the reference did read the scaling, and it matters
    np.testing.assert_allclose(logits, want, rtol=0, atol=LOGIT_ATOL_FP64)


def test_an_unscaled_table_is_tinygrads_own():
    from tinygrad.llm.model import precompute_freqs_cis

    ours = rope_table(RopeParams(16, 10000.0), MAX_CONTEXT)
    np.testing.assert_allclose(ours, precompute_freqs_cis(16, MAX_CONTEXT, 10000.0).numpy(), rtol=0, atol=2e-5)


def test_rope_scaling_type_none_is_unscaled(tmp_path):
    path = generate(tmp_path / "none.gguf", "tiny", seed=1, rope=rs.RopeScaling(type="none", factor=2.0))
    plain = generate(tmp_path / "plain.gguf", "tiny", seed=1)
    prompt = list(range(10, 30))
    np.testing.assert_array_equal(step(chain(path), 0, prompt, 0), step(chain(plain), 0, prompt, 0))


@pytest.mark.parametrize("rope, message", [
    (rs.RopeScaling(type="longrope", factor=2.0), "unsupported RoPE scaling 'longrope' \\(llama.rope.scaling.type"),
    (rs.RopeScaling(type="yarn", factor=4.0, attn_factor=0.5),
     "unsupported RoPE setting llama.rope.scaling.attn_factor=0.5"),
    (rs.RopeScaling(type="linear", factor=-2.0), "invalid RoPE scaling factor -2.0"),
    (rs.RopeScaling(freq_factors=(1.0,) * 4), "rope_freqs.weight has shape \\(4,\\), expected \\(8,\\)"),
])
def test_rope_scaling_that_cannot_be_reproduced_is_refused(tmp_path, rope, message):
    path = generate(tmp_path / "bad.gguf", "tiny", rope=rope)
    for stage in (0, 1):  # every stage ropes, so every stage refuses
        with pytest.raises(ModelLoadError, match=message):
            TinygradEngine(str(path), stage, 2)


def test_rope_settings_at_the_values_applied_anyway_are_accepted(tmp_path):
    yarn = rs.RopeScaling(type="yarn", factor=4.0, original_context_length=64)
    path = generate(tmp_path / "explicit.gguf", "tiny", rope=replace(yarn, attn_factor=1.0))
    plain = generate(tmp_path / "yarn.gguf", "tiny", rope=yarn)
    assert TinygradEngine(str(path), 1, 2)._w.rope == TinygradEngine(str(plain), 1, 2)._w.rope


def test_rope_freqs_is_read_as_float32_by_every_stage(tmp_path):
    factors = rs.llama3_rope_factors(16, 10000.0, 4.0, original_context=32)
    path = generate(tmp_path / "l3.gguf", "tiny", rope=rs.RopeScaling(freq_factors=factors))
    for e in chain(path, 3):
        assert e._w.rope.freq_factors == factors  # float32 values exactly, no fp16 rounding
        assert e.loaded_tensors["rope_freqs.weight"] == 4 * len(factors)


# ---------------------------------------------------------------- SentencePiece


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("spm") / "spm.gguf", "tiny", seed=2, tokenizer=SPM, add_bos=None)


def test_sentencepiece_model_generates_as_the_reference(spm_model):
    engines = chain(spm_model)
    kv = read_header(spm_model).kv
    text = "Beautiful is better than ugly. Grüße ☃"
    prompt = engines[0].tokenize(text)
    assert prompt == [1, *SpmReference(kv).encode(text)]  # the BOS: no add_bos_token key, SentencePiece's default
    tokens, logits = generate_logits(engines, prompt, N_STEPS)
    ref = RefModel.from_gguf(spm_model)
    np.testing.assert_allclose(logits, ref.logits(prompt + tokens[:-1])[len(prompt) - 1:], rtol=0,
                               atol=LOGIT_ATOL_FP64)
    assert tokens == ref.greedy(prompt, N_STEPS)
    assert engines[-1].detokenize(prompt) == " " + text  # BOS hidden; the space prefix shows, as in llama.cpp


def test_sentencepiece_model_through_the_driver(spm_model):
    launch = Launch(2, model=str(spm_model), env={"MAX_CONTEXT": str(MAX_CONTEXT)})
    with Pipeline(launch, log=None) as p:
        assert (p.stages[0].ready["bos_token_id"], p.stages[0].ready["add_bos"]) == (1, True)
        g = p.run(make_generations(p, ["Flat is better than nested."], 6, Sampling())).generations[0]
    assert g.prompt_tokens == [1, *SpmReference(read_header(spm_model).kv).encode("Flat is better than nested.")]
    assert g.tokens == RefModel.from_gguf(spm_model).greedy(g.prompt_tokens, len(g.tokens))
    shown = g.tokens[:-1] if g.stop_reason == "eos" else g.tokens
    assert g.text == Detokenizer.from_gguf_kv(read_header(spm_model).kv).decode(shown)
