"""Replay: a TinyJit whose replays skip tinygrad's per-call input preparation, with the same results."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp
from tinygrad.engine import jit as tinygrad_jit

from pp_worker.worker.compiled.replay import Replay

N = 8


def step(inp: Tensor, caches: list[Tensor], pos: UOp) -> Tensor:
    """Writes inp into each cache at pos and returns the sum over [0, pos] of every cache: a stage's shape of call
    (an input buffer, KV caches in a list, a bound position)."""
    out = inp.zeros_like()
    for cache in caches:
        stored = Tensor(cache.uop.after(cache[pos:pos + 1].uop.store(inp.uop)))
        out = out + stored[0:pos + 1].sum(axis=0, keepdim=True)
    return out.contiguous()


def buffers(n_caches: int) -> tuple[Tensor, list[list[Tensor]]]:
    inp = Tensor.zeros(1, 4).contiguous().realize()
    return inp, [[Tensor.zeros(N, 4).contiguous().realize() for _ in range(n_caches)] for _ in range(3)]


def drive(fn, inp: Tensor, sessions: list[list[Tensor]], calls: int) -> list[np.ndarray]:
    """``calls`` calls cycling over the sessions' caches and positions; each call's output."""
    pos_var = UOp.variable("pos", 0, N - 1)
    rng = np.random.default_rng(0)
    outs = []
    for i in range(calls):
        inp.assign(Tensor(rng.standard_normal((1, 4)).astype(np.float32))).realize()
        outs.append(fn(inp, sessions[i % len(sessions)], pos_var.bind(i // len(sessions) % N)).numpy().copy())
    return outs


def test_replays_give_tinygrads_results_without_its_per_call_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    inp, sessions = buffers(2)
    want = drive(TinyJit(step), inp, sessions, 12)
    prepared = []
    real = tinygrad_jit._prepare_jit_inputs
    monkeypatch.setattr(tinygrad_jit, "_prepare_jit_inputs", lambda a, k: prepared.append(1) or real(a, k))
    inp, sessions = buffers(2)
    replay = Replay(step)
    got = drive(replay, inp, sessions, 12)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert replay.direct is True
    # tinygrad prepares the first call (which captures: Replay skips tinygrad's eager first run) and the check of
    # that capture; never again
    assert len(prepared) == 2


def test_the_first_call_captures_the_kernels() -> None:
    """tinygrad's TinyJit runs its first call eagerly and captures on the second: every kernel is scheduled and
    compiled twice, and the eager run's buffers stay cached. A Replay captures at its first call."""
    inp, sessions = buffers(1)
    replay = Replay(step)
    drive(replay, inp, sessions, 1)
    assert replay.ready and (replay.captured is not None or replay.native is not None)


@pytest.mark.parametrize("lean", [False, True])
def test_a_lean_replay_drops_tinygrads_memos_after_capturing(lean: bool) -> None:
    """A worker process's stages are lean: tinygrad's process-wide memos of lowered kernels (every kernel's AST) go
    once a JIT has captured; engines sharing one process keep them for each other."""
    from tinygrad.codegen import to_program_cache

    inp, sessions = buffers(1)
    replay = Replay(step, lean=lean)
    drive(replay, inp, sessions, 2)
    assert replay.ready and (len(to_program_cache) == 0) == lean


def test_an_argument_that_is_a_view_keeps_tinygrads_own_path() -> None:
    def fn(x: Tensor, pos: UOp) -> Tensor:
        return (x * 2 + pos).contiguous()

    base = Tensor.arange(8).float().contiguous().realize()
    replay, jit, var = Replay(fn), TinyJit(fn), UOp.variable("p", 0, 9)
    for i in range(6):
        view = base[2:6]  # not a whole buffer: what tinygrad hands the JIT is the view, not its buffer
        np.testing.assert_array_equal(replay(view, var.bind(i)).numpy(), jit(view, var.bind(i)).numpy())
    assert replay.direct is False


def test_a_call_unlike_the_captured_one_still_gets_tinygrads_own_check() -> None:
    inp, sessions = buffers(1)
    replay = Replay(step)
    drive(replay, inp, sessions, 6)
    assert replay.direct is True
    wider = [Tensor.zeros(N + 1, 4).contiguous().realize()]  # a cache of another shape than the JIT captured
    with pytest.raises(tinygrad_jit.JitError, match="args mismatch"):
        replay(inp, wider, UOp.variable("pos", 0, N - 1).bind(0))
