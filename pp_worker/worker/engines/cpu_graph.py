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
import threading
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

# The runner: the table's rows in order, each kernel's parts (core_id 0..threads-1) dealt over the runner's threads
# (part t to thread t mod n), a barrier after each row. The calling thread is thread 0; thread 1 is a helper that
# waits in pp_help between tables (spinning briefly, then asleep in a futex), so one call runs a whole table.
# State words (int64; futexes use the low 32 bits): see the S_ names below.
RUNNER = r"""
typedef void (*kernel)(%(params)s);
enum { S_GEN, S_TABLE, S_ROWS, S_THREADS, S_COUNT, S_SENSE, S_SLEEPING, S_SPIN };
static long futex(long* word, long op, long val) {  /* Linux x86-64: futex(2) on the word's low 32 bits */
  long ret; register long timeout __asm__("r10") = 0;
  __asm__ volatile("syscall" : "=a"(ret) : "0"(202L), "D"(word), "S"(op), "d"(val), "r"(timeout)
                   : "rcx", "r11", "memory");
  return ret;
}
static inline long get(long* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline void put(long* p, long v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static void barrier(long* s, long* sense, long n) {
  *sense = !*sense;
  if (__atomic_add_fetch(&s[S_COUNT], 1, __ATOMIC_SEQ_CST) == n) { put(&s[S_COUNT], 0); put(&s[S_SENSE], *sense); }
  else while (get(&s[S_SENSE]) != *sense) __builtin_ia32_pause();
}
static void run_rows(long* s, long tid) {
  long* table = (long*)get(&s[S_TABLE]);
  long rows = get(&s[S_ROWS]), n = get(&s[S_THREADS]), sense = get(&s[S_SENSE]);
  for (long r = 0; r < rows; r++) {
    long* row = table + r * %(row)d;
    kernel f = (kernel)row[0];
    long threads = row[1], core = row[3], a[%(max_args)d];
    for (int i = 0; i < %(max_args)d; i++) a[i] = row[4 + i];
    for (long t = tid; t < threads; t += n) {
      if (core >= 0) a[core] = t;
      f(%(args)s);
    }
    if (n > 1) barrier(s, &sense, n);
  }
}
"""
MAIN = r"""
void pp_run(long* s) {  /* run the table in s[S_TABLE] as thread 0, with the helper as thread 1 */
  put(&s[S_GEN], get(&s[S_GEN]) + 1);
  if (get(&s[S_SLEEPING])) futex(&s[S_GEN], 1 | 128, 1);  /* FUTEX_WAKE_PRIVATE */
  run_rows(s, 0);
}
"""
HELP = r"""
void pp_help(long* s) {  /* thread 1, for ever: each new generation's table, then wait for the next */
  long seen = 0;  /* started before the first table: generation 1 is its first (pp_run may have announced it) */
  for (;;) {
    for (long spins = 0; get(&s[S_GEN]) == seen;) {
      if (++spins < s[S_SPIN]) { __builtin_ia32_pause(); continue; }
      put(&s[S_SLEEPING], 1);
      if (get(&s[S_GEN]) == seen) futex(&s[S_GEN], 0 | 128, seen);  /* FUTEX_WAIT_PRIVATE while GEN is seen */
      put(&s[S_SLEEPING], 0);
    }
    seen = get(&s[S_GEN]);
    run_rows(s, 1);
  }
}
"""
STATE = {"gen": 0, "table": 1, "rows": 2, "threads": 3, "spin": 7}
SPIN = 20000  # pauses before the helper sleeps: ~0.1-0.5 ms, past the gap between a forward's graphs


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and sys.platform.startswith("linux")


class Runner:
    """The compiled runner of one CPU device: its programs (kept: their memory holds the code), its state words,
    and its helper thread (started on first use; a daemon, asleep in a futex between tables)."""

    def __init__(self, device: str, threads: int):
        from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

        dev = Device[device]
        compiler = ClangJITCompiler(dev.arch.split(","))
        common = RUNNER % {"params": ", ".join(["long"] * MAX_ARGS), "row": ROW, "max_args": MAX_ARGS,
                           "args": ", ".join(f"a[{i}]" for i in range(MAX_ARGS))}
        self.main = dev.runtime("pp_run", compiler.compile_cached(common + MAIN))
        self.help = dev.runtime("pp_help", compiler.compile_cached(common + HELP))
        self.state = np.zeros(16, np.int64)
        self.state[STATE["threads"]], self.state[STATE["spin"]] = threads, SPIN
        self.lock = threading.Lock()  # one table at a time: the helper serves one caller
        self.helper: threading.Thread | None = None

    def run(self, table: np.ndarray) -> None:
        with self.lock:
            if self.helper is None and self.state[STATE["threads"]] > 1:
                self.helper = threading.Thread(target=self.help.fxn, args=(ctypes.c_uint64(self.state.ctypes.data),),
                                               name="pp-cpu-graph-helper", daemon=True)
                self.helper.start()
            self.state[STATE["table"]], self.state[STATE["rows"]] = table.ctypes.data, len(table)
            self.main.fxn(ctypes.c_uint64(self.state.ctypes.data))


@functools.cache
def _runner(device: str) -> Runner:
    from tinygrad.helpers import CPU_COUNT

    return Runner(device, min(2, CPU_COUNT.value))


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
        self.runner.run(table)
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
