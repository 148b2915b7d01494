"""JIT replays on the CPU from one native call (cpu.graph.NativeGraph) against tinygrad's own graph: the same
kernels with the same arguments give bit-identical results, through input buffers that change per call (a session's
KV cache), symbolic positions, multi-threaded kernels and the C kernels of cpu.kernels."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from tinygrad import Context, Device, Tensor, TinyJit, UOp
from tinygrad.engine.realize import graph_cache

from pp_worker.testing.chain import Chain
from pp_worker.testing.modelgen import generate
from pp_worker.worker.cpu import graph as cpu_graph
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.cpu.graph import NativeGraph, Table

pytestmark = pytest.mark.skipif(not cpu_graph.supported(), reason="the native graph: Linux on x86-64, aarch64")


def _step_fn(weight: Tensor):
    pos = UOp.variable("pos", 0, 15)

    def step(x: Tensor, cache: Tensor, p: UOp) -> Tensor:
        y = cpu_kernels.matmul(x, weight, 8, 64, 64)  # a C kernel (Q8_0), on every thread
        cache[p:p + 1].assign(y.reshape(1, 64)).realize()  # written into the argument buffer at the position
        return (cache[:p + 1].sum(0) * 0.5 + y.exp()).contiguous().sum(keepdim=True).realize()  # tinygrad's kernels
    return step, pos


def _replays(graph_on: bool) -> tuple[list[np.ndarray], list[type]]:
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    weight = Tensor(quants.quantize(rng.standard_normal((64, 64)).astype(np.float32) * 0.1,
                                    GGMLQuantizationType.Q8_0)).realize()
    caches = [Tensor.zeros(16, 64).contiguous().realize() for _ in range(2)]
    step, pos = _step_fn(weight)
    jit = TinyJit(step)
    outs = []
    # captures on the second call, then replays: alternating the caches, one cache twice in a row (the table keeps
    # its addresses), and a cache freed and replaced by a new one (which may take the freed memory's address)
    for i, which in enumerate((0, 1, 0, 1, 1, 0, 0, 1, "new", 1, "new")):
        if which == "new":  # the old one freed first, so its memory is free to take
            caches.pop(0)
            caches.insert(0, Tensor.zeros(16, 64).contiguous().realize())
            which = 0
        x = Tensor(rng.standard_normal((1, 64)).astype(np.float32)).realize()
        outs.append(jit(x, caches[which], pos.bind(i // 2)).numpy().copy())
    outs += [c.numpy() for c in caches]
    graphs = [type(graph_cache[c.src[0]]) for c in jit.captured.linear.src if c.src[0] in graph_cache]
    return outs, graphs


def test_native_replays_are_bit_identical_to_tinygrads_graph():
    with cpu_graph.tinygrads_graph(Device.DEFAULT):
        want, want_graphs = _replays(graph_on=False)
    assert cpu_graph.install(Device.DEFAULT)
    got, got_graphs = _replays(graph_on=True)
    assert got_graphs and all(g is NativeGraph for g in got_graphs)
    assert want_graphs and not any(g is NativeGraph for g in want_graphs)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_same_objects_never_takes_a_new_object_for_a_freed_one():
    class Obj:
        pass

    a, b = Obj(), Obj()
    refs = [cpu_graph.weakref.ref(a), cpu_graph.weakref.ref(b)]
    assert cpu_graph.same_objects([a, b], refs) and not cpu_graph.same_objects([b, a], refs)
    assert not cpu_graph.same_objects([a], refs)
    del a
    assert not any(cpu_graph.same_objects([Obj(), b], refs) for _ in range(100))  # ids get reused; refs do not


def test_a_stage_decodes_the_same_bits_with_either_graph(tmp_path):
    model = generate(tmp_path / "tiny.gguf", "tiny", seed=1, dtype="Q8_0")
    prompt = [5, 9, 11, 3, 7, 2, 40, 41, 42]

    def run() -> tuple[list[int], list[np.ndarray], list[bool], list[Any]]:
        c = Chain(model, 2, 32, prefill_chunk=4)
        tokens, logits = c.generate(0, prompt, 6)
        return tokens, logits, [e.native_graph for e in c.engines], [e._stage.decode.native for e in c.engines]

    with cpu_graph.tinygrads_graph(Device.DEFAULT):
        want_tokens, want_logits, _, tinygrads = run()
    tokens, logits, native, runners = run()
    assert all(native) and tinygrads == [None, None]
    # each stage's decode JIT is one native table, replayed directly (tinygrad's walk over the calls skipped), and
    # tinygrad's record of the capture is dropped: the table, its buffers and programs are all that is kept
    assert all(r is not None and len(r) == 1 and isinstance(r[0], Table) and r[0].buffers for r in runners)
    assert tokens == want_tokens and all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_every_thread_count_replays_tinygrads_bits_and_the_helpers_go_back_to_sleep(threads):
    """Tables back to back and after pauses (the helpers spinning, asleep, or still waking when a table starts), two
    tables to a replay, on 1 to 4 threads (more than this machine's cores included): the same bits as tinygrad's graph
    every time, every part of every job done; afterwards every helper goes back to sleep, none left waiting on a
    table that has ended."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(2)
    weights = [Tensor(quants.quantize(rng.standard_normal((512, 512)).astype(np.float32) * 0.05,
                                      GGMLQuantizationType.Q8_0)).realize() for _ in range(4)]

    def chain(x: Tensor) -> Tensor:
        for i in range(24):  # C kernels on every thread, tinygrad's tanh too; tinygrad cuts two tables of them
            x = cpu_kernels.matmul(x, weights[i % 4], 8, 512, 512).tanh()
        return x.realize()

    x = Tensor(rng.standard_normal((1, 512)).astype(np.float32)).realize()
    with Context(CPU_COUNT=threads):
        with cpu_graph.tinygrads_graph(Device.DEFAULT):
            reference = TinyJit(chain)
            want = [reference(x).numpy().copy() for _ in range(3)][-1]
        assert cpu_graph.install(Device.DEFAULT)
        jit, runner = TinyJit(chain), cpu_graph._runner(Device.DEFAULT, threads)
        state, words = runner.state, cpu_graph.STATE
        for i in range(40):
            time.sleep((0.0, 0.002, 0.02)[i % 3])
            assert np.array_equal(jit(x).numpy(), want)
        assert state[words["gen"]] > 0 and (threads == 1) == (state[words["jobs"]] == 0)  # tables ran; parts shared
        assert len(runner.helpers) == threads - 1
    deadline = time.monotonic() + 30.0
    while state[words["sleeping"]] < threads - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state[words["sleeping"]] == threads - 1


def test_a_kernel_with_more_arguments_than_a_row_runs_outside_the_table():
    assert cpu_graph.install(Device.DEFAULT)
    n = cpu_graph.MAX_ARGS + 2
    parts = [Tensor.full((8,), float(i)).contiguous().realize() for i in range(n)]

    def add_all(x: Tensor) -> Tensor:
        wide = (x + 1).contiguous().realize()  # a kernel that fits a row, before and after the wide one
        for p in parts:
            wide = wide + p  # one kernel reading n + 1 buffers
        return (wide.contiguous().realize() * 2).contiguous().realize()

    jit = TinyJit(add_all)
    for k in range(4):
        x = Tensor.full((8,), float(k)).contiguous().realize()
        assert np.array_equal(jit(x).numpy(), np.full(8, 2.0 * (k + 1 + sum(range(n))), np.float32))
    calls = jit.captured.linear.src
    programs = [c for c in calls if c.src[0].op.name == "PROGRAM"]
    assert any(len(c.src[0].arg.globals) > cpu_graph.MAX_ARGS for c in programs)  # left out of any graph


class _Signal:
    def __init__(self, value: int):
        self.memory = np.array([value], np.uint64)
        self.value_addr = self.memory.ctypes.data


class _Device:
    """What `hostio.settle` reads of a tinygrad HCQ device, with a counting synchronize."""

    def __init__(self, done: int, submitted: int, cpu: bool = True):
        self.timeline_signal, self.timeline_value, self.error_state, self.cpu = _Signal(done), submitted, None, cpu
        self.synced = 0

    def _is_cpu(self) -> bool:
        return self.cpu

    def synchronize(self) -> None:
        self.synced += 1


def test_settle_synchronizes_only_while_work_is_queued(monkeypatch):
    from pp_worker.worker.hostio import settle

    idle, busy, gpu = _Device(done=6, submitted=7), _Device(done=5, submitted=7), _Device(6, 7, cpu=False)
    for dev in (idle, busy, gpu):
        settle(dev)
    assert (idle.synced, busy.synced, gpu.synced) == (0, 1, 1)
    busy.timeline_signal.memory[0] = 6  # its work finished: read through the same view
    settle(busy)
    assert busy.synced == 1
    # tinygrad's own CPU device, idle once synchronized: the fast path reads what it names (a rename would fall back
    # to the full synchronize silently, and this would fail)
    Tensor.ones(4).contiguous().realize()
    cpu = Device["CPU"]
    cpu.synchronize()
    calls: list[int] = []
    monkeypatch.setattr(type(cpu), "synchronize", lambda self, timeout=None: calls.append(1))
    settle(cpu)
    assert calls == []
