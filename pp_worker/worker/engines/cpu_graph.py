"""A JIT graph for tinygrad's CPU device that runs every captured kernel from one native call.

tinygrad replays a captured JIT on the CPU through `HCQGraph`: a list of Python commands that its CPU worker thread
walks, calling each kernel through ctypes and handing each multi-threaded kernel's other parts to pool threads
through Python queues. That costs ~25 us a kernel (bench/NOTES.md), about half of a decode step's time on the
bench model. `NativeGraph` is a graph runner of tinygrad's own kind (`GraphRunner`, installed as the device's
``graph``, so TinyJit builds it for the batches it would have given `HCQGraph`): it lays the captured calls out
as one table of (kernel address, argument values) and runs the table with one C function, compiled by tinygrad's
clang compiler and loaded by its CPU runtime. The kernels are the same programs with the same arguments and the same
``core_id`` split (the parts dealt over the calling thread and one helper thread, see RUNNER), so results are
bit-identical (the tests compare).

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
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from tinygrad import Device
from tinygrad.engine.jit import GraphRunner
from tinygrad.uop.ops import Ops, UOp

from pp_worker.worker.engines.hostio import settle

MAX_ARGS = 24  # argument slots of a table row: a kernel's buffers, then its variables
ROW = 4 + MAX_ARGS  # kernel address, threads, argument count, index of core_id (-1: none), arguments

# The runner: the table's rows in order, each kernel's parts (core_id 0..threads-1) dealt over the runner's threads
# (part t to thread t mod n). The calling thread is thread 0; thread 1 is a helper that waits in pp_help between
# tables. The helper is usually asleep when a table starts and takes ~30 us to wake, so the caller does not wait for
# it: it runs every part of each row itself until the helper says it is here (S_READY), then names the row from which
# they share the parts (S_JOIN: generation and row; a row of JOIN_NONE when the table ended first). From there the
# threads meet at a barrier after each row they share, and the helper waits at one before such a row when the rows
# before it were the caller's alone. Waiting spins for a few microseconds, then yields the CPU (the stages of a
# pipeline share the cores: a spinning waiter would take one from another stage's working thread); between tables
# the helper sleeps in a futex. State words (int64; the futex uses the low 32 bits): the S_ names below.
RUNNER = r"""
typedef void (*kernel)(%(params)s);
enum { S_GEN, S_TABLE, S_ROWS, S_THREADS, S_COUNT, S_SENSE, S_SLEEPING, S_SPIN, S_READY, S_JOIN };
enum { JOIN_ROW = (1 << 24) - 1, JOIN_NONE = JOIN_ROW };  /* S_JOIN = generation << 24 | row */
static long syscall3(long nr, long a, long b, long c) {  /* Linux x86-64; a fourth argument (r10) of 0 */
  long ret; register long d __asm__("r10") = 0;
  __asm__ volatile("syscall" : "=a"(ret) : "0"(nr), "D"(a), "S"(b), "d"(c), "r"(d) : "rcx", "r11", "memory");
  return ret;
}
static inline long get(long* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline void put(long* p, long v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static void wait_for(long* p, long v) {  /* until *p == v: spin ~%(spin)d cycles, then yield between looks */
  for (long t0 = __builtin_ia32_rdtsc(); get(p) != v;) {
    if (__builtin_ia32_rdtsc() - t0 < %(spin)d) __builtin_ia32_pause(); else syscall3(24, 0, 0, 0);  /* sched_yield */
  }
}
static void barrier(long* s, long* sense) {
  *sense = !*sense;
  if (__atomic_add_fetch(&s[S_COUNT], 1, __ATOMIC_SEQ_CST) == 2) { put(&s[S_COUNT], 0); put(&s[S_SENSE], *sense); }
  else wait_for(&s[S_SENSE], *sense);
}
static long joined_at(long* s, long gen) {  /* the helper: the row the caller shares from (JOIN_NONE: none) */
  long join;
  for (long t0 = __builtin_ia32_rdtsc(); (join = get(&s[S_JOIN])) >> 24 != gen;) {
    if (get(&s[S_GEN]) != gen) return JOIN_NONE;  /* that table is over, and its word overwritten by a later one's */
    if (__builtin_ia32_rdtsc() - t0 < %(spin)d) __builtin_ia32_pause(); else syscall3(24, 0, 0, 0);
  }
  return join & JOIN_ROW;
}
static void run_rows(long* s, long tid, long from) {
  long* table = (long*)get(&s[S_TABLE]);
  long rows = get(&s[S_ROWS]), n = get(&s[S_THREADS]), sense = get(&s[S_SENSE]), alone = 0;
  long gen = get(&s[S_GEN]), joined = tid || n < 2;  /* the caller: every part itself until the helper is here */
  for (long r = from; r < rows; r++) {
    long* row = table + r * %(row)d;
    long threads = row[1], core = row[3], a[%(max_args)d];
    if (!joined && threads > 1 && get(&s[S_READY]) == gen) {  /* the helper is here: shared from this row on */
      put(&s[S_JOIN], gen << 24 | r);
      joined = 1, alone = 0;
    }
    long shared = joined && n > 1 && threads > 1;
    if (shared && alone) barrier(s, &sense);  /* the caller's rows before this one are done */
    alone = !shared;
    if (!shared && tid) continue;
    kernel f = (kernel)row[0];
    for (int i = 0; i < %(max_args)d; i++) a[i] = row[4 + i];
    for (long t = shared ? tid : 0; t < threads; t += shared ? n : 1) {
      if (core >= 0) a[core] = t;
      f(%(args)s);
    }
    if (shared) barrier(s, &sense);
  }
  if (!joined) put(&s[S_JOIN], gen << 24 | JOIN_NONE);  /* done before the helper came: nothing left to share */
  else if (alone && n > 1) barrier(s, &sense);  /* the table ends with the caller's rows: the helper waits them out */
}
"""
MAIN = r"""
void pp_run(long* s) {  /* run the table in s[S_TABLE] as thread 0, with the helper as thread 1 */
  put(&s[S_GEN], get(&s[S_GEN]) + 1);
  if (get(&s[S_SLEEPING])) syscall3(202, (long)&s[S_GEN], 1 | 128, 1);  /* futex FUTEX_WAKE_PRIVATE */
  run_rows(s, 0, 0);
}
"""
HELP = r"""
void pp_help(long* s) {  /* thread 1, for ever: each new generation's table, then wait for the next */
  long seen = 0;  /* started before the first table: generation 1 is its first (pp_run may have announced it) */
  for (;;) {
    for (long t0 = __builtin_ia32_rdtsc(); get(&s[S_GEN]) == seen;) {
      if (__builtin_ia32_rdtsc() - t0 < s[S_SPIN]) { __builtin_ia32_pause(); continue; }
      put(&s[S_SLEEPING], 1);
      if (get(&s[S_GEN]) == seen) syscall3(202, (long)&s[S_GEN], 0 | 128, seen);  /* futex FUTEX_WAIT_PRIVATE */
      put(&s[S_SLEEPING], 0);
    }
    seen = get(&s[S_GEN]);
    put(&s[S_READY], seen);
    long from = joined_at(s, seen);
    if (from != JOIN_NONE) run_rows(s, 1, from);
  }
}
"""
STATE = {"gen": 0, "table": 1, "rows": 2, "threads": 3, "sleeping": 6, "spin": 7, "join": 9}
SPIN_CYCLES = 100_000  # TSC cycles the helper spins after a table before it sleeps (~30-50 us: the gap between a
# forward's graphs, not the gap between tokens), and a waiter at a barrier before it starts yielding (a tenth)


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
                           "args": ", ".join(f"a[{i}]" for i in range(MAX_ARGS)), "spin": SPIN_CYCLES // 10}
        self.main = dev.runtime("pp_run", compiler.compile_cached(common + MAIN))
        self.help = dev.runtime("pp_help", compiler.compile_cached(common + HELP))
        self.state = np.zeros(16, np.int64)
        self.state[STATE["threads"]], self.state[STATE["spin"]] = threads, SPIN_CYCLES
        # written per table through a plain view and passed as a ready argument: numpy's item and ctypes paths are
        # cold code each time between two tokens (~10-20 us each from memory in a live pipeline; bench/NOTES.md)
        self._words = memoryview(self.state).cast("B").cast("q")
        self._arg = ctypes.c_uint64(self.state.ctypes.data)
        self.lock = threading.Lock()  # one table at a time: the helper serves one caller
        self.helper: threading.Thread | None = None

    def run(self, address: int, rows: int) -> None:
        """Run the table of ``rows`` rows at ``address`` (an int64 array's data, see `Table`)."""
        with self.lock:
            if self.helper is None and self._words[STATE["threads"]] > 1:
                self.helper = threading.Thread(target=self.help.fxn, args=(self._arg,), name="pp-cpu-graph-helper",
                                               daemon=True)
                self.helper.start()
            self._words[STATE["table"]], self._words[STATE["rows"]] = address, rows
            self.main.fxn(self._arg)


@functools.cache
def _runner(device: str) -> Runner:
    from tinygrad.helpers import CPU_COUNT

    return Runner(device, min(2, CPU_COUNT.value))


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
        self.runner, self._dev = _runner(device), Device[device]
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
