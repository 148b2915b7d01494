"""One token's attention as a C kernel (cpu.attention): against a float64 numpy softmax for float32 and
float16 caches, grouped and ungrouped heads, positions within and across the kernel's chunks of keys, any block's
row of the cache; replayed by a JIT with a new position per call; and used by a CPU stage's decode and batched
decode, whose logits stay within the float64 reference's tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp

from pp_worker.testing.chain import Chain
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cpu import attention as cpu_attention

C = cpu_attention.CHUNK


def softmax_attention(q: np.ndarray, cache: np.ndarray, row: int, pos: int) -> np.ndarray:
    """float64: each query head over keys and values [0, pos] of its key head, (H * D,)."""
    _, n_heads, _, d = q.shape
    group = n_heads // cache.shape[3]
    out = []
    for h in range(n_heads):
        k, v = (cache[row, i, 0, h // group, :pos + 1].astype(np.float64) for i in (0, 1))
        s = k @ q[0, h, 0].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out.append(p @ v / p.sum())
    return np.concatenate(out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (4, 2, 16), (6, 1, 32), (4, 4, 128)])
def test_attention_equals_the_float64_softmax(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * head_dim)
    ctx = 2 * C + 40
    cache = (rng.standard_normal((3, 2, 1, kv_heads, ctx, head_dim)) * 2).astype(dtype)
    q = rng.standard_normal((1, heads, 1, head_dim)).astype(np.float32)
    t = Tensor(cache).realize()
    var = UOp.variable("start_pos", 0, ctx - 1)
    for pos in (0, 1, C - 1, C, 2 * C + 1, ctx - 1):  # one key; whole and partial chunks
        for row in (0, 2):
            got = cpu_attention.attend(Tensor(q), t, row, var.bind(pos)).numpy()
            want = softmax_attention(q, cache, row, pos)
            assert got.shape == (1, 1, heads * head_dim)
            np.testing.assert_allclose(got.reshape(-1), want, rtol=0, atol=3e-6 * np.abs(want).max())


def test_a_jit_replays_the_kernel_at_each_calls_position():
    rng = np.random.default_rng(5)
    cache = rng.standard_normal((2, 2, 1, 2, 200, 32)).astype(np.float32)
    t = Tensor(cache).realize()
    var = UOp.variable("start_pos", 0, 199)
    step = TinyJit(lambda q, p: cpu_attention.attend(q, t, 1, p).realize())
    for pos in (3, 150, 7, 199, 0):  # runs, captures, then replays with positions it never saw
        q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
        want = softmax_attention(q, cache, 1, pos)
        got = step(Tensor(q).realize(), var.bind(pos)).numpy().reshape(-1)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-6 * np.abs(want).max())
    assert step.captured is not None


def test_supported_heads():
    assert cpu_attention.supported(8, 4, 64) and cpu_attention.supported(4, 1, 16)
    assert not cpu_attention.supported(8, 4, 40)  # not whole 16-float vectors: tinygrad's attention
    assert not cpu_attention.supported(6, 4, 64)  # heads not in whole groups


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("attn") / "tiny.gguf", "tiny", seed=3)


def test_cpu_stages_decode_through_the_kernel(model, monkeypatch):
    calls: list[int] = []
    attend = cpu_attention.attend

    def counted(q, cache, row, start_pos):
        calls.append(row)
        return attend(q, cache, row, start_pos)

    monkeypatch.setattr(cpu_attention, "attend", counted)
    chain = Chain(model, 2, 64, max_sessions=2, max_batch=2, every_size=False)
    blocks = [len(e._w.blocks) for e in chain.engines]
    assert all(b.c_attention for e in chain.engines for b in e._w.blocks)
    prompt = [5, 6, 7, 8]
    tokens, logits = chain.generate(0, prompt, 5)  # a cold stage runs a short prompt as single-token calls
    assert sorted(calls) == sorted(j for n in blocks for j in range(n)), "each block's decode capture, once"
    want = RefModel.from_gguf(model).logits(prompt + tokens[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=3e-2)

    calls.clear()  # a batch of two sessions: each session's attention is its own call, per block
    chain.step(1, prompt, 0)
    first, last = chain.engines
    at = [len(prompt) + len(tokens) - 1, len(prompt)]
    hidden = first.step_batch([0, 1], at, [tokens[-1], tokens[0]])
    row = first.info.hidden_dim * 2
    batched = last.step_batch([0, 1], at, [bytes(hidden[:row]), bytes(hidden[row:2 * row])]).copy()
    assert sorted(calls) == sorted(j for n in blocks for j in range(n) for _ in range(2))
    ref = RefModel.from_gguf(model)
    np.testing.assert_allclose(batched[0], ref.logits(prompt + tokens)[-1], rtol=0, atol=3e-2)
    np.testing.assert_allclose(batched[1], ref.logits(prompt + tokens[:1])[-1], rtol=0, atol=3e-2)
