"""Real mode on a device whose memory is not host memory, without a GPU: the CPU under `testing.devmem`, where
nothing is zero-copy and host <-> device copies refuse read-only host memory, as CUDA's do.

Before these tests, nothing in the suite left the CPU's zero-copy paths, which is how a loader that hands
``memoryview(bytes)`` to ``Buffer.copyin`` reached an H200 ("underlying buffer is not writable"). The stage that
serves runs a quantized file (Q4_1): its packed weights go through copyin too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, nn

from pp_worker.testing.devmem import device_memory
from pp_worker.testing.modelgen import generate
from pp_worker.worker.engines.model import load_stage
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine
from pp_worker.worker.hostio import Outputs

PROMPTS = ([5, 9, 11, 3, 7, 2], [4, 8, 1], list(range(20, 57)))  # 37 tokens: 32 + 4 + 1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("devmem")
    return {dt: generate(d / f"tiny-{dt}.gguf", preset="tiny", seed=3, dtype=dt) for dt in ("F16", "Q4_1")}


def test_device_memory_refuses_what_cuda_refuses() -> None:
    t = Tensor.zeros(4).contiguous().realize()
    buf = t.uop.base.realized
    with device_memory():
        assert not hasattr(buf.allocator, "_as_buffer")  # no zero-copy view of device memory
        with pytest.raises(TypeError, match="not writable"):
            buf.copyin(memoryview(bytes(16)))
        buf.copyin(memoryview(bytearray(b"\x00\x00\x80?" * 4)))  # a writable source is fine
    assert hasattr(buf.allocator, "_as_buffer") and t.tolist() == [1.0] * 4  # restored on exit


@pytest.mark.parametrize("device", [False, True])
def test_an_output_copy_takes_a_padded_calls_first_rows(device: bool) -> None:
    # a padded mixed call (`tinygrad_engine.plan`) keeps its real rows: a prefix of the output, through a zero-copy
    # view of host memory or a copyout of device memory
    t = (Tensor.arange(8).float() * 2).contiguous().realize()
    with device_memory() if device else contextlib.nullcontext():
        part, whole = memoryview(bytearray(12)), memoryview(bytearray(32))
        Outputs().copy(t, part)
        Outputs().copy(t, whole)
    assert np.frombuffer(part, np.float32).tolist() == [0.0, 2.0, 4.0]
    assert np.frombuffer(whole, np.float32).tolist() == [2.0 * i for i in range(8)]


def _weights(model: Path, stage: int) -> dict[str, np.ndarray]:
    w = load_stage(str(model), stage, 2)
    parts = [(f"blk{j}", b) for j, b in enumerate(w.blocks)] + [("head", w.output), ("embd", w.token_embd)]
    return {f"{name}.{k}": v.numpy() for name, obj in parts if obj is not None
            for k, v in nn.state.get_state_dict(obj).items()}


@pytest.mark.parametrize("dtype", ["F16", "Q4_1"])
@pytest.mark.parametrize("stage", [0, 1])
def test_the_loader_reads_identical_weights_through_copyin(models: dict[str, Path], dtype: str, stage: int) -> None:
    want = _weights(models[dtype], stage)  # read in place, into the CPU's own memory
    with device_memory():
        got = _weights(models[dtype], stage)  # a staging copy, then copyin
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


def _serve(model: Path, warmup: bool) -> list[bytes]:
    """(Warm-up,) prefills of several lengths, interleaved decode steps, a release and a reused cache, on a
    2-stage chain; every hidden-state payload and logit vector, as bytes."""
    first, last = (TinygradEngine(str(model), s, 2, max_context=64, every_size=True) for s in (0, 1))
    if warmup:  # the JITs capture during warm-up; without it, during the requests: the same kernels either way
        first.warmup()
        last.warmup()
    out: list[bytes] = []

    def step(rid: int, tokens: list[int], position: int) -> int:
        h = bytes(first.embed_and_forward(rid, tokens, position))
        logits = last.forward_logits(rid, h, position, len(tokens))
        out.extend([h, logits.tobytes()])
        return int(logits.argmax())

    nxt = {rid: step(rid, p, 0) for rid, p in enumerate(PROMPTS)}
    for i in range(4):  # the three generations take turns
        for rid, p in enumerate(PROMPTS):
            nxt[rid] = step(rid, [nxt[rid]], len(p) + i)
    touched = first.kv_pool.touched
    assert first.release(1) and last.release(1)
    step(1, PROMPTS[1], 0)  # a new session on the released session's pages
    assert first.kv_pool.touched == touched  # the pages that came back were taken again, no new one
    return out


def test_a_stage_serves_the_same_bytes_with_device_memory(models: dict[str, Path]) -> None:
    want = _serve(models["Q4_1"], warmup=False)
    with device_memory():
        got = _serve(models["Q4_1"], warmup=True)
    assert len(got) == len(want) and all(a == b for a, b in zip(got, want, strict=True))
