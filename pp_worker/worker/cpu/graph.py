"""A JIT graph for tinygrad's CPU device that runs every captured kernel from one native call.

tinygrad replays a captured JIT on the CPU through `HCQGraph`: a list of Python commands that its CPU worker thread
walks, calling each kernel through ctypes and handing each multi-threaded kernel's other parts to pool threads
through Python queues. That costs ~25 us a kernel (bench/NOTES.md), about half of a decode step's time on the
bench model. `NativeGraph` is a graph runner of tinygrad's own kind (`GraphRunner`, installed as the device's
``graph``, so TinyJit builds it for the batches it would have given `HCQGraph`): it lays the captured calls out
as one table of (kernel address, argument values) and runs the table with one C function, compiled by tinygrad's
clang compiler and loaded by its CPU runtime (``c/runner.c``). The kernels are the same programs with the same
arguments and the same ``core_id`` split (the parts claimed by the calling thread and ``threads - 1`` helpers, see
runner.c), so results are bit-identical (the tests compare).

Per replay only what changes is written into the table: the input buffers' addresses (a session's KV cache) and
the symbolic values (positions). Only for Linux on x86-64 and aarch64, whose calling conventions pass a kernel's
integer arguments in 64-bit registers and stack slots whatever their C type, so every kernel can be called with
MAX_ARGS slots (Apple's arm64 convention packs stack arguments), and whose futex and yield the runner calls by their
syscall numbers; elsewhere tinygrad's own graph stays.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from tinygrad import Device
from tinygrad.engine.jit import GraphRunner
from tinygrad.uop.ops import Ops, UOp

from pp_worker.worker.cpu.kernels import unit
from pp_worker.worker.hostio import settle

MAX_ARGS = 24  # argument slots of a table row: a kernel's buffers, then its variables
ROW = 4 + MAX_ARGS  # kernel address, parts, argument count, index of core_id (-1: none), arguments
STATE = {"gen": 0, "table": 1, "rows": 2, "sleeping": 3, "spin": 4, "job": 5, "jobs": 6}  # c/runner.c's S_ words
SPIN_S = 40e-6  # a helper spins this long after its last part before it sleeps (the gap between a forward's graphs,
# not the gap between tokens), and a waiter this long / 10 before it starts yielding


def supported() -> bool:
    """Where the runner's waits are written: Linux on x86-64 and aarch64 (elsewhere tinygrad's graph stays)."""
    return platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") and sys.platform.startswith("linux")


def runner_source(entry: str) -> str:
    """The C of the runner's entry point ``entry`` ("run", "help" or "ticks")."""
    return unit({"MAX_ARGS": MAX_ARGS, "ROW": ROW, "PARAMS": ", ".join(["long"] * MAX_ARGS),
                 "ARGS": ", ".join(f"a[{i}]" for i in range(MAX_ARGS)), f"ENTRY_{entry.upper()}": 1}, ["runner.c"])


class Runner:
    """The compiled runner of one CPU device for ``threads`` threads: its programs (kept: their memory holds the
    code), its state words, and its ``threads - 1`` helper threads (started on first use; daemons, asleep in a futex
    between tables)."""

    def __init__(self, device: str, threads: int):
        from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

        dev = Device[device]
        compiler = ClangJITCompiler(dev.arch.split(","))
        self.main, self.help, ticks = (dev.runtime(f"pp_{e}", compiler.compile_cached(runner_source(e)))
                                       for e in ("run", "help", "ticks"))
        self.threads = threads
        self.state = np.zeros(16, np.int64)
        self.state[STATE["spin"]] = int(SPIN_S * _tick_rate(ticks))
        # written per table through a plain view and passed as a ready argument: numpy's item and ctypes paths are
        # cold code each time between two tokens (~10-20 us each from memory in a live pipeline; bench/NOTES.md)
        self._words = memoryview(self.state).cast("B").cast("q")
        self._arg = ctypes.c_uint64(self.state.ctypes.data)
        self.lock = threading.Lock()  # one table at a time: the helpers serve one caller
        self.helpers: list[threading.Thread] = []

    def run(self, address: int, rows: int) -> None:
        """Run the table of ``rows`` rows at ``address`` (an int64 array's data, see `Table`)."""
        with self.lock:
            while len(self.helpers) < self.threads - 1:
                self.helpers.append(threading.Thread(target=self.help.fxn, args=(self._arg,), daemon=True,
                                                     name=f"pp-cpu-graph-helper-{len(self.helpers) + 1}"))
                self.helpers[-1].start()
            self._words[STATE["table"]], self._words[STATE["rows"]] = address, rows
            self.main.fxn(self._arg)


def _tick_rate(ticks: Any) -> float:
    """Ticks per second of the runner's clock (x86's TSC, aarch64's virtual counter: rates differ by 100x between
    CPUs), measured against the OS clock over ~2 ms."""
    c = np.zeros(2, np.int64)
    t0 = time.perf_counter()
    ticks.fxn(ctypes.c_uint64(c.ctypes.data))
    while time.perf_counter() - t0 < 0.002:
        pass
    ticks.fxn(ctypes.c_uint64(c.ctypes.data + 8))
    return float(c[1] - c[0]) / (time.perf_counter() - t0)


@functools.cache
def _runner(device: str, threads: int) -> Runner:
    return Runner(device, threads)


def threads() -> int:
    """The threads a stage runs its kernels on: tinygrad's CPU_COUNT, which the worker sets from PP_THREADS."""
    from tinygrad.helpers import CPU_COUNT

    return max(1, CPU_COUNT.value)


def same_objects(objs: Sequence[Any], refs: list[weakref.ref[Any]]) -> bool:
    """Whether ``objs`` are the very objects ``refs`` point to, in order. A weak reference is never alive for an
    object that was freed, so an object made since at the same address cannot pass for it (as an id could)."""
    return len(objs) == len(refs) and all(r() is o for o, r in zip(objs, refs, strict=True))


def _words_of(slots: list[tuple[int, int, Any]], width: int) -> list[tuple[Any, list[int]]]:
    """(row, column, key) slots of a table ``width`` words wide -> each key with its words' flat indices."""
    return [(key, [r * width + c for r, c, k in slots if k == key]) for key in sorted({k for _, _, k in slots})]


class Table:
    """Rows ready to run (kernel address, threads, argument count, core_id's index, arguments) and what changes per
    call: input buffers' addresses (a session's KV cache) and bound variables (positions). ``keep``: what the rows
    point to (buffers, programs), held for as long as the table lives."""

    def __init__(self, device: str, table: np.ndarray, input_slots: list[tuple[int, int, int]],
                 var_slots: list[tuple[int, int, str]], keep: list[Any]):
        self.device, self.table, self.input_slots, self.var_slots = device, table, input_slots, var_slots
        self.buffers = keep
        self.runner, self._dev = _runner(device, threads()), Device[device]
        # each input's and each variable's words in the table, written per call through a plain view
        self._in_words, self._var_words = _words_of(input_slots, table.shape[1]), _words_of(var_slots, table.shape[1])
        self._words = memoryview(table).cast("B").cast("q")
        self._address, self._rows = table.ctypes.data, len(table)
        self._written: list[weakref.ref[UOp]] = []  # the inputs whose addresses the table holds (see same_objects)

    def __call__(self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait: bool = False) -> float | None:
        words = self._words
        if self.input_slots and not same_objects(input_uops, self._written):  # else the addresses are written
            for iidx, at in self._in_words:
                address = input_uops[iidx].buffer._buf.va_addr
                for i in at:
                    words[i] = address
            self._written = [weakref.ref(u) for u in input_uops]
        for name, at in self._var_words:
            value = var_vals[name]
            for i in at:
                words[i] = value
        settle(self._dev)  # whatever tinygrad queued before this replay runs first
        start = time.perf_counter()
        self.runner.run(self._address, self._rows)
        return time.perf_counter() - start if wait else None


class NativeGraph(GraphRunner):
    """A batch of a captured JIT's CPU kernels, replayed by one call of the table runner (a `Table`)."""

    def __init__(self, linear: UOp, input_uops: tuple[UOp, ...] = ()):
        super().__init__(linear, input_uops)
        table = np.zeros((len(self.calls), ROW), np.int64)
        input_slots: list[tuple[int, int, int]] = []  # (row, slot, input index): buffers passed per call
        var_slots: list[tuple[int, int, str]] = []  # (row, slot, variable): positions bound per call
        for j, ((_, ast, bufs, device_vars), rt) in enumerate(zip(self.calls, self.runtimes, strict=True)):
            info = ast.arg
            table[j, :4] = (ctypes.cast(rt.fxn, ctypes.c_void_p).value, info.global_size[0],
                            len(bufs) + len(info.vars), -1)
            table[j, 4:4 + len(bufs)] = [b._buf.va_addr for b in bufs]
            for pos, iidx in self.uop_replace[j]:
                input_slots.append((j, 4 + pos, iidx))
            for i, v in enumerate(info.vars):
                slot = 4 + len(bufs) + i
                if v.expr in info.runtimevars:
                    table[j, 3] = slot - 4
                elif v.expr in device_vars:
                    table[j, slot] = device_vars[v.expr]
                else:
                    var_slots.append((j, slot, v.expr))
        self.rows = Table(self.calls[0][2][0].device, table, input_slots, var_slots, [])

    @staticmethod
    def supports_uop(batch_devs: list[Any], new_call: UOp) -> bool:
        """CPU programs with concrete launch sizes and at most MAX_ARGS arguments, on one device."""
        ast = new_call.src[0]
        if ast.op is not Ops.PROGRAM:
            return False
        info = ast.arg
        fits = len(info.globals) + len(info.vars) <= MAX_ARGS and isinstance(info.global_size[0], int) and \
            all(s == 1 for s in info.global_size[1:]) and info.local_size in (None, (1, 1, 1))
        return fits and len(GraphRunner._all_devs(batch_devs, new_call)) == 1

    def calls_made(self) -> list[tuple[str, bytes, list[Any]]]:
        """Each row's (kernel name, machine code, argument buffers (None at an input's place)), for `jitcache`:
        before `slim`."""
        out = []
        for (_, ast, bufs, _), replace in zip(self.calls, self.uop_replace, strict=True):
            inputs = {pos for pos, _ in replace}
            out.append((ast.arg.name, ast.src[4].arg, [None if pos in inputs else b for pos, b in enumerate(bufs)]))
        return out

    def slim(self) -> Table:
        """Drop tinygrad's description of the calls (their kernels' ASTs: most of a captured JIT's memory), keeping
        the table and what it points to: the buffers and the programs (the inputs' buffers are each replay's).
        Replays need nothing else: the returned `Table` is this graph from now on."""
        inputs = [{pos for pos, _ in replace} for replace in self.uop_replace]
        self.rows.buffers = [b for (_, _, bufs, _), mine in zip(self.calls, inputs, strict=True)
                             for pos, b in enumerate(bufs) if pos not in mine] + list(self.runtimes)
        self.calls, self.linear = [], None
        return self.rows

    def __call__(self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait: bool = False) -> float | None:
        return self.rows(input_uops, var_vals, wait)


def install(device: str) -> bool:
    """Make ``device`` (a CPU) replay the JITs it captures from now on with `NativeGraph`; False (nothing changed)
    where it cannot. Process-wide, as the device is."""
    dev = Device[device]
    if not supported() or not dev.device.startswith("CPU") or dev.graph is None or _tinygrads:
        return False
    dev.graph = NativeGraph
    return True


_tinygrads: list[bool] = []  # inside `tinygrads_graph`: install changes nothing


@contextmanager
def tinygrads_graph(device: str) -> Iterator[None]:
    """JITs captured inside replay with the graph tinygrad gave ``device``, engines made inside included (the tests'
    comparison)."""
    from tinygrad.runtime.graph.hcq import HCQGraph

    dev = Device[device]
    kept, dev.graph = dev.graph, HCQGraph
    _tinygrads.append(True)
    try:
        yield
    finally:
        _tinygrads.pop()
        dev.graph = kept
