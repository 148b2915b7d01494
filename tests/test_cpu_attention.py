"""A session's attention as a C kernel (cpu.attention): against a float64 numpy softmax for float32 and float16
pages, grouped and ungrouped heads, positions within and across the kernel's chunks of keys and the pool's pages
(read through a scrambled page table), one token and several (a prefill call, each token causal), any block's row and
any session's row of the page table; replayed by a JIT with a new position and a new table per call; and used by a
CPU stage's decode and batched decode, whose logits stay within the float64 reference's tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp, dtypes

from pp_worker.testing.chain import Chain, step_batch, wire_rows
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cpu import attention as cpu_attention

C = cpu_attention.CHUNK
PAGE = 2 * C  # positions per page here


def logical(pool: np.ndarray, pages: list[int], row: int) -> np.ndarray:
    """A session's keys and values of block ``row`` in position order: (2, KvH, len(pages) * page, D)."""
    return np.concatenate([pool[p, row] for p in pages], axis=2)


def softmax_attention(q: np.ndarray, kv: np.ndarray, pos: int) -> np.ndarray:
    """float64: each query head of q (H, D) over keys and values [0, pos] of its key head in kv (2, KvH, L, D)."""
    n_heads, d = q.shape
    group = n_heads // kv.shape[1]
    out = []
    for h in range(n_heads):
        k, v = (kv[i, h // group, :pos + 1].astype(np.float64) for i in (0, 1))
        s = k @ q[h].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out.append(p @ v / p.sum())
    return np.concatenate(out)


def table_of(sessions: list[list[int]], max_pages: int) -> Tensor:
    rows = np.zeros((len(sessions), max_pages), np.int32)
    for b, pages in enumerate(sessions):
        rows[b, :len(pages)] = pages
    return Tensor(rows, dtype=dtypes.int32).realize()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (4, 2, 16), (6, 1, 32), (4, 4, 128)])
def test_attention_equals_the_float64_softmax(dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(heads * head_dim)
    pool = (rng.standard_normal((5, 3, 2, kv_heads, PAGE, head_dim)) * 2).astype(dtype)
    sessions = [[4, 1, 3], [2, 0]]  # each session's pages, in its position order: none in the pool's order
    t, table = Tensor(pool).realize(), table_of(sessions, 3)
    var = UOp.variable("start_pos", 0, 3 * PAGE - 1)
    for tokens in (1, 3):
        for pos in (0, 1, C - 1, C, PAGE - 1, PAGE, 2 * PAGE + 1, 3 * PAGE - tokens):  # chunks, pages
            for row, trow in ((0, 0), (2, 0), (1, 1)):
                if pos + tokens > len(sessions[trow]) * PAGE:
                    continue
                q = rng.standard_normal((1, heads, tokens, head_dim)).astype(np.float32)
                got = cpu_attention.attend(Tensor(q), t, table, row, trow, var.bind(pos)).numpy()
                assert got.shape == (1, tokens, heads * head_dim)
                kv = logical(pool, sessions[trow], row)
                for i in range(tokens):  # token i sees [0, pos + i]
                    want = softmax_attention(q[0, :, i], kv, pos + i)
                    np.testing.assert_allclose(got[0, i], want, rtol=0, atol=3e-6 * np.abs(want).max())


def test_a_jit_replays_the_kernel_at_each_calls_position_and_table():
    rng = np.random.default_rng(5)
    pool = rng.standard_normal((4, 2, 2, 2, PAGE, 32)).astype(np.float32)
    t = Tensor(pool).realize()
    table = table_of([[0, 0]], 2)  # written in place before each call, as the engine does
    view = table.uop.base.buffer.as_memoryview(force_zero_copy=True).cast("i")
    var = UOp.variable("start_pos", 0, 2 * PAGE - 1)
    step = TinyJit(lambda q, p: cpu_attention.attend(q, t, table, 1, 0, p).realize())
    for pos, pages in ((3, [2, 1]), (300, [3, 0]), (7, [1, 2]), (2 * PAGE - 1, [0, 3]), (0, [3, 2])):
        view[0], view[1] = pages  # runs, captures, then replays with positions and pages it never saw
        q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
        want = softmax_attention(q[0, :, 0], logical(pool, pages, 1), pos)
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

    def counted(q, pool, table, row, table_row, start_pos, window=0):
        calls.append(row)
        return attend(q, pool, table, row, table_row, start_pos, window)

    mixed: list[int] = []
    attend_rows = cpu_attention.attend_rows

    def counted_rows(q, pool, table, positions, row, window=0):
        mixed.append(row)
        return attend_rows(q, pool, table, positions, row, window)

    monkeypatch.setattr(cpu_attention, "attend", counted)
    monkeypatch.setattr(cpu_attention, "attend_rows", counted_rows)
    chain = Chain(model, 2, 64, max_sessions=2, max_batch=2, every_size=False)
    blocks = [len(e._w.blocks) for e in chain.engines]
    assert all(b.c_attention for e in chain.engines for b in e._w.blocks)
    prompt = [5, 6, 7, 8]
    tokens, logits = chain.generate(0, prompt, 5)  # a cold stage runs a short prompt as single-token calls
    assert sorted(calls) == sorted(j for n in blocks for j in range(n)), "each block's decode capture, once"
    want = RefModel.from_gguf(model).logits(prompt + tokens[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=3e-2)

    calls.clear()  # a batch of two sessions: a mixed call, whose attention is one call per block for both
    chain.step(1, prompt, 0)
    first, last = chain.engines
    at = [len(prompt) + len(tokens) - 1, len(prompt)]
    hidden = step_batch(first, [0, 1], at, [tokens[-1], tokens[0]])
    batched = step_batch(last, [0, 1], at, wire_rows(first, hidden)).copy()
    assert calls == [] and sorted(mixed) == sorted(j for n in blocks for j in range(n)), "each block's, once"
    ref = RefModel.from_gguf(model)
    np.testing.assert_allclose(batched[0], ref.logits(prompt + tokens)[-1], rtol=0, atol=3e-2)
    np.testing.assert_allclose(batched[1], ref.logits(prompt + tokens[:1])[-1], rtol=0, atol=3e-2)
