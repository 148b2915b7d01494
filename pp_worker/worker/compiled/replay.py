"""A TinyJit whose replays skip tinygrad's per-call preparation of its inputs.

On every call ``TinyJit.__call__`` re-derives, from the argument tensors, the buffers and variable values to replay
with: substitutions and rewrites over each argument's graph, ~0.16 ms per call on the development machine
(bench/NOTES.md), paid once per stage per token. A stage's arguments are always plain realized buffers (its input
buffer and KV caches) and bound position variables, so what the captured JIT needs is just each tensor's buffer and
each variable's value. `Replay` computes that directly, after checking once, on its first replay, that it is exactly
what tinygrad's own preparation gives (and that the inputs match what the JIT captured). Where the check fails
(another tinygrad, an argument that is a view), every call keeps tinygrad's own path.

A Replay captures at its first call: TinyJit would run that call eagerly first, scheduling and compiling every
kernel twice (once unfused) and leaving the eager run's buffers in tinygrad's allocator cache (~40 MiB on a stage of
the 0.73B bench model). The capture batches every kernel into one graph (``JIT_BATCH_SIZE=0``; tinygrad's default
splits a JIT into graphs of 32, 64, 128... kernels): a replay is one graph launch on every device with a graph
(CUDA's included: 2-4 launches a decode step on the 0.74B model before).

When every call of the captured JIT is a batch replayed by `cpu_graph.NativeGraph` (the CPU's own kernels), a
checked replay calls those runners directly, without tinygrad's walk over the captured calls: one native call.
tinygrad's record of the capture (every kernel's AST, ~10 MiB a JIT) is then dropped: the runner's table, buffers
and programs are all a replay needs (a later call unlike the checked one is refused, as tinygrad refuses one unlike
its capture).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinygrad import Context, Device, Tensor, TinyJit, UOp, dtypes
from tinygrad.device import Buffer
from tinygrad.engine.jit import JitError
from tinygrad.engine.realize import graph_cache
from tinygrad.uop.ops import Ops

from pp_worker.worker.compiled import jitcache
from pp_worker.worker.cpu.graph import NativeGraph, Table, same_objects
from pp_worker.worker.hostio import return_freed_heap


class Replay:
    """``Replay(fn)(*args)`` is ``TinyJit(fn)(*args)``; once captured and checked, without the preparation."""

    def __init__(self, fn: Callable[..., Tensor], lean: bool = False, cache: CacheSlot | None = None):
        """``lean``: after capturing, drop tinygrad's memos of lowered kernels (`forget_lowerings`): right for a
        worker process; several engines in one process (tests, bench.gpu) are better off sharing them. ``cache``:
        where this JIT's compiled form is kept on disk (`jitcache`): read at the first call instead of capturing,
        written after a native capture."""
        self.lean, self.cache = lean, cache
        self.restored = False  # whether the compiled form came from the cache
        self.jit: TinyJit = TinyJit(fn)
        self.jit.cnt = 1  # capture at the first call: tinygrad would run it eagerly first (see the module docstring)
        self.direct: bool | None = None  # None: not checked yet; then whether replays skip the preparation
        self._signature: list[Signature] = []  # the checked call's arguments: a call unlike it takes tinygrad's path
        self._checked: list[weakref.ref[UOp]] = []  # the arguments of the last call `replay` checked
        self.native: list[Table] | None = None  # the tables of every captured call, when they are all native
        self.ret: Tensor | None = None  # what the JIT returns (its output buffer), kept when the capture is dropped

    @property
    def captured(self) -> Any:
        """tinygrad's CapturedJit once the JIT has captured (its first call, here), else None (and None again once a
        native replay dropped it)."""
        return self.jit.captured

    @property
    def ready(self) -> bool:
        """Whether the JIT has captured: its kernels are compiled, a call replays them."""
        return self.jit.captured is not None or self.native is not None

    @property
    def cached(self) -> bool:
        """Whether the compiled form is kept on disk (`jitcache`): the first call reads it instead of compiling."""
        return self.cache is not None and self.cache.store.has(self.cache.name)

    def buffers(self) -> set[Any]:
        """The buffers (tinygrad ``Buffer``s) a replay reads or writes besides its inputs: weights, scratch, output."""
        if self.native is not None:
            return {b.base for r in self.native for b in r.buffers if isinstance(b, Buffer)}
        return {u.buffer for u in self.jit.captured.linear.toposort() if u.op is Ops.BUFFER}

    def replay(self, tensors: list[Tensor], values: dict[str, int]) -> Tensor | None:
        """A native replay given the argument tensors (in `_tensors`' order) and the variables' values, with no
        bound variables to make (~30 us a call); None where that does not apply (not captured natively yet, or
        arguments unlike the checked call's): call the Replay instead."""
        if self.native is None:
            return None
        uops = [t.uop for t in tensors]
        if not same_objects(uops, self._checked):  # the last checked call's arguments again: nothing to check
            if list(map(_signature, tensors)) != self._signature:
                return None
            self._checked = [weakref.ref(u) for u in uops]  # weak: a released session's cache is not kept alive
        inputs = tuple(u.base for u in uops)
        for runner in self.native:
            runner(inputs, values)
        return self.ret

    def __call__(self, *args: Any) -> Tensor:
        tensors = _tensors(args)
        if self.native is not None and (out := self.replay(tensors, _values(args))) is not None:
            return out
        if self.direct and self.native is None and list(map(_signature, tensors)) == self._signature:
            return self.jit.captured([t.uop.base for t in tensors], _values(args))
        if self.native is not None:  # tinygrad's capture is gone: refuse as tinygrad would have
            raise JitError(f"args mismatch in JIT: captured for {self._signature}, "
                           f"called with {list(map(_signature, tensors))}")
        if self.direct is None and self.cache is not None and self._restore(tensors):
            return self(*args)
        with Context(JIT_BATCH_SIZE=0):
            out = self.jit(*args)  # the capture (the first call) batches its kernels: one graph for the whole JIT
        if self.direct is None and self.jit.captured is not None:  # just captured (its kernels ran once)
            self._signature = list(map(_signature, tensors))
            self.direct = all(sig[3] for sig in self._signature) and _shortcut_holds(self.jit, args, tensors)
            self.native = _native_runners(self.jit, tensors) if self.direct else None
            if self.native is not None:
                self.ret = self.jit.captured.ret
                entry = self.cache and _record(self.jit, self.native, self.cache)
                self.native = [runner.slim() for runner in self.native]
                self.jit.captured = None
                if entry:
                    self.cache.store.save(self.cache.name, entry)
            if self.lean:
                forget_lowerings()
        return out

    def _restore(self, tensors: list[Tensor]) -> bool:
        """Take this JIT's compiled form from the cache, if it holds it (and every argument is a whole buffer)."""
        signature = list(map(_signature, tensors))
        if not all(sig[3] for sig in signature) or (entry := self.cache.store.load(self.cache.name)) is None:
            return False
        try:
            shape, dtype = entry["out_shape"], getattr(dtypes, entry["out_dtype"])
            table, self.ret = jitcache.restore(entry, self.cache.named(), Device.DEFAULT, tuple(shape), dtype)
        except Exception as e:  # an entry that does not fit this stage: compile instead
            print(f"pp_worker: the compiled-forward cache entry {self.cache.name} does not fit "
                  f"({type(e).__name__}: {e}); compiling again", file=sys.stderr, flush=True)
            return False
        self.native, self.direct, self._signature, self.restored = [table], True, signature, True
        return True


@dataclass(frozen=True)
class CacheSlot:
    """Where one JIT's compiled form lives: the store, its entry's name, the stage's named buffers (made on demand)."""

    store: jitcache.Store
    name: str
    named: Callable[[], jitcache.Named]


def _record(jit: TinyJit, runners: list[NativeGraph], slot: CacheSlot) -> dict[str, Any] | None:
    """The cache entry of a just-captured all-native JIT (one table), or None when it cannot be written down."""
    captured = jit.captured
    if len(runners) != 1 or not isinstance(captured.ret, Tensor):
        return None
    arenas = list({u.src[0].buffer for u in captured.linear.toposort() if u.op is Ops.BUFFER_VIEW})
    entry = jitcache.record(runners[0].calls_made(), runners[0].rows, slot.named(), arenas,
                            captured.ret.uop.base.buffer)
    return entry and {**entry, "out_shape": captured.ret.shape, "out_dtype": captured.ret.dtype.name}


Signature = tuple[tuple[Any, ...], Any, Any, bool]  # shape, dtype, device, whether it is a whole buffer


def _signature(t: Tensor) -> Signature:
    u = t.uop  # a realized tensor is its buffer, reshaped: anything else (a slice, a bitcast...) is a view
    return t.shape, t.dtype, t.device, u is u.base or (u.op is Ops.RESHAPE and u.src[0] is u.base)


def _tensors(args: tuple[Any, ...]) -> list[Tensor]:
    """The argument tensors in tinygrad's order: tensor arguments, then tensors inside list arguments."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    return tensors + [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, Tensor)]


def _values(args: tuple[Any, ...]) -> dict[str, int]:
    values: dict[str, int] = {}
    for a in args:
        if isinstance(a, UOp):
            var, value = a.unbind()
            values[var.expr] = value
    return values


def forget_lowerings() -> None:
    """Drop tinygrad's process-wide memos of lowered kernels and schedules (every kernel's AST, kept for ever) and
    hand the freed memory back: a stage of the 0.73B model peaks ~26 MiB lower over a warm-up, which takes no longer
    (a kernel that comes again is lowered again; its machine code stays in tinygrad's disk cache)."""
    from tinygrad.codegen import to_program_cache
    from tinygrad.schedule import schedule_cache

    to_program_cache.clear()
    schedule_cache.clear()
    return_freed_heap()


def _native_runners(jit: TinyJit, tensors: list[Tensor]) -> list[Any] | None:
    """The NativeGraph runners of the captured JIT's calls, in order, when every call is one (and the JIT writes
    none of its inputs, which tinygrad would copy first); else None."""
    captured = jit.captured
    runners = [graph_cache.get(call.src[0]) for call in captured.linear.src]
    if not all(isinstance(r, NativeGraph) for r in runners) or {t.uop.base for t in tensors} & captured._written_uops:
        return None
    return runners


def _shortcut_holds(jit: TinyJit, args: tuple[Any, ...], tensors: list[Tensor]) -> bool:
    """Whether tinygrad's own preparation of ``args`` gives the buffers and values the shortcut would."""
    try:
        from tinygrad.engine.jit import _prepare_jit_inputs
        buffers, values, names, info = _prepare_jit_inputs(args, {})
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    captured = jit.captured
    mine = [t.uop.base for t in tensors]
    return (captured is not None and names == captured.expected_names and info == captured.expected_input_info
            and len(buffers) == len(mine) and all(a is b for a, b in zip(buffers, mine, strict=True))
            and values == _values(args))
