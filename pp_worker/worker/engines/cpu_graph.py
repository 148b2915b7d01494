"""A JIT graph for tinygrad's CPU device that runs every captured kernel from one native call.

tinygrad replays a captured JIT on the CPU through `HCQGraph`: a list of Python commands that its CPU worker thread
walks, calling each kernel through ctypes and handing each multi-threaded kernel's other parts to pool threads
through Python queues. That costs ~25 us a kernel (bench/NOTES.md), about half of a decode step's time on the
bench model. `NativeGraph` is a graph runner of tinygrad's own kind (`GraphRunner`, installed as the device's
``graph``, so TinyJit builds it for the batches it would have given `HCQGraph`): it lays the captured calls out
as one table of (kernel address, argument values) and runs the table with one C function, compiled by tinygrad's
clang compiler and loaded by its CPU runtime. The kernels are the same programs with the same arguments and the same
``core_id`` split, run one after the other on the calling thread, so results are bit-identical (the tests compare).

Per replay only what changes is written into the table: the input buffers' addresses (a session's KV cache) and
the symbolic values (positions). Only for x86-64 Linux, where a kernel's arguments are 64-bit slots whatever their
C type, so every kernel can be called with MAX_ARGS slots; elsewhere tinygrad's own graph stays.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from tinygrad import Device
from tinygrad.engine.jit import GraphRunner
from tinygrad.uop.ops import Ops, UOp

MAX_ARGS = 24  # argument slots of a table row: a kernel's buffers, then its variables
ROW = 4 + MAX_ARGS  # kernel address, threads, argument count, index of core_id (-1: none), arguments

RUNNER = r"""
typedef void (*kernel)(%(params)s);
void pp_run_table(long* restrict table, int rows) {
  for (int r = 0; r < rows; r++) {
    long* row = table + (long)r * %(row)d;
    kernel f = (kernel)row[0];
    long threads = row[1], core = row[3];
    long* a = row + 4;
    for (long t = 0; t < threads; t++) {
      if (core >= 0) a[core] = t;
      f(%(args)s);
    }
  }
}
"""


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and sys.platform.startswith("linux")


@functools.cache
def _runner(device: str) -> Any:
    """The compiled table runner, loaded as a program of ``device`` (kept: its memory holds the code)."""
    from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

    src = RUNNER % {"params": ", ".join(["long"] * MAX_ARGS), "args": ", ".join(f"a[{i}]" for i in range(MAX_ARGS)),
                    "row": ROW}
    dev = Device[device]
    lib = ClangJITCompiler(dev.arch.split(",")).compile_cached(src)
    return dev.runtime("pp_run_table", lib)


class NativeGraph(GraphRunner):
    """A batch of a captured JIT's CPU kernels, replayed by one call of the table runner."""

    def __init__(self, linear: UOp, input_uops: tuple[UOp, ...] = ()):
        super().__init__(linear, input_uops)
        self.table = np.zeros((len(self.calls), ROW), np.int64)
        self.input_slots: list[tuple[int, int, int]] = []  # (row, slot, input index): buffers passed per call
        self.var_slots: list[tuple[int, int, str]] = []  # (row, slot, variable): positions bound per call
        for j, ((_, ast, bufs, device_vars), rt) in enumerate(zip(self.calls, self.runtimes, strict=True)):
            info = ast.arg
            self.table[j, :4] = (ctypes.cast(rt.fxn, ctypes.c_void_p).value, info.global_size[0],
                                 len(bufs) + len(info.vars), -1)
            self.table[j, 4:4 + len(bufs)] = [b._buf.va_addr for b in bufs]
            for pos, iidx in self.uop_replace[j]:
                self.input_slots.append((j, 4 + pos, iidx))
            for i, v in enumerate(info.vars):
                slot = 4 + len(bufs) + i
                if v.expr in info.runtimevars:
                    self.table[j, 3] = slot - 4
                elif v.expr in device_vars:
                    self.table[j, slot] = device_vars[v.expr]
                else:
                    self.var_slots.append((j, slot, v.expr))
        self.runner = _runner(self.calls[0][2][0].device)

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

    def __call__(self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait: bool = False) -> float | None:
        table = self.table
        for row, slot, iidx in self.input_slots:
            table[row, slot] = input_uops[iidx].buffer._buf.va_addr
        for row, slot, name in self.var_slots:
            table[row, slot] = var_vals[name]
        Device[self.device].synchronize()  # whatever tinygrad queued before this replay runs first
        start = time.perf_counter()
        self.runner.fxn(ctypes.c_uint64(table.ctypes.data), ctypes.c_int32(len(table)))
        return time.perf_counter() - start if wait else None


def install(device: str) -> bool:
    """Make ``device`` (a CPU) replay the JITs it captures from now on with `NativeGraph`; False (nothing changed)
    where it cannot. Process-wide, as the device is."""
    dev = Device[device]
    if not supported() or not dev.device.startswith("CPU") or dev.graph is None:
        return False
    dev.graph = NativeGraph
    return True


@contextmanager
def tinygrads_graph(device: str) -> Iterator[None]:
    """JITs captured inside replay with the graph tinygrad gave ``device`` (the tests' comparison)."""
    from tinygrad.runtime.graph.hcq import HCQGraph

    dev = Device[device]
    kept, dev.graph = dev.graph, HCQGraph
    try:
        yield
    finally:
        dev.graph = kept
