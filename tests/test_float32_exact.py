"""With a float32 KV cache (``PP_KV_DTYPE=float32``) and float32 hidden states on the wire (``PP_WIRE_DTYPE=f32``),
nothing a stage computes is rounded to fp16: an F16 or Q8_0 file's weights are exactly the reference's (the float path
dequantizes them exactly), and norm gains and biases are held as the file's float32. The logits of 2 stages then
match the float64 reference within float32 rounding, for each family and both kernel sets (the CPU's C kernels, and
tinygrad's, which other devices run).

Measured: at most ~1.3e-5 (logits of a few units). With norm gains held as fp16 (before) the same runs were 2.7e-3
(llama, qwen3moe) to 1.8e-2 (Gemma 3) away.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pp_worker.testing import modelgen
from pp_worker.testing.chain import Chain
from pp_worker.testing.npref import Gemma3Ref, RefModel

ATOL = 1e-4
MAX_CONTEXT = 64
PROMPT = [int(t) for t in np.random.default_rng(0).integers(5, 200, 40)]  # more than one 32-token prefill chunk
N_TOKENS = 6

CASES = [("tiny", "F16", "c"), ("qwen3moe", "F16", "tinygrad"), ("gemma3", "F16", "c"), ("small", "Q8_0", "c")]


@pytest.mark.parametrize(("preset", "dtype", "kernels"), CASES, ids=["-".join(c) for c in CASES])
def test_float32_kv_and_wire_match_the_float64_reference(tmp_path: Path, preset: str, dtype: str, kernels: str):
    path = modelgen.generate(tmp_path / f"{preset}-{dtype}.gguf", preset, dtype=dtype)
    ref = (Gemma3Ref if preset == "gemma3" else RefModel).from_gguf(path)
    chain = Chain(path, 2, MAX_CONTEXT, wire="f32", kv_dtype="float32", kernels=kernels, every_size=False)
    held = {t for e in chain.engines for t in e.describe()["weights"]}
    assert "F32" in held and held <= {dtype, "F32"}  # the gains as the file has them; no matrix converted
    tokens, logits = chain.generate(0, PROMPT, N_TOKENS)
    want = ref.logits(PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=ATOL)
    assert tokens == [int(t) for t in want.argmax(-1)]
