"""Compiled forwards kept on disk: a restarted stage replays its JITs without tinygrad scheduling, lowering or
compiling anything (a cold start's first request spent most of its seconds there; bench/NOTES.md).

What is kept is what a native replay needs (`cpu_graph.Table`): per row the kernel's machine code, its thread count,
and its arguments, each written down by what it is rather than where it was: an input (the call's input buffer or
a session's KV cache), a variable (a position), a constant, or a buffer that is one of the stage's own weights
(by tensor name), a kernel-shape constant, the JIT's scratch arena or its output, at an offset. A restart loads the
same weights, allocates a new arena and output, loads the machine code into executable memory through tinygrad's
CPU runtime, and lays the rows out again. A JIT with any argument that fits none of these is not kept.

Entries live under ``$PP_CACHE_DIR/jits`` (default ``$XDG_CACHE_HOME/pp_worker/jits``), one file per JIT, named by a
digest of everything that shapes its kernels (see `key`). ``PP_CACHE=0`` turns the cache off. A file that cannot
be read back is ignored with one line on stderr, and rebuilt; files are written whole, then renamed into place, so
stages sharing the directory never see half of one. Every new version of this code, of tinygrad, and every model
or setting gets entries of its own, so the directory would only grow: past `BUDGET` bytes, a write removes the
entries used longest ago (a read marks an entry used) down to three quarters of it, and writes some crashed
process left half done.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.device import Buffer
from tinygrad.uop.ops import Ops

from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.cpu.graph import ROW, Table

FORMAT = 1  # bump when an entry's layout changes
BUDGET = 512 << 20  # bytes of entries kept: thousands of forwards (one is 10-100 KiB on the development machine)
STALE_S = 3600.0  # a write's temporary file this old was left by a process that died mid-write


def cache_root() -> Path | None:
    """The cache directory (``PP_CACHE_DIR``...), or None when ``PP_CACHE=0``."""
    from pp_worker.worker.cachedir import kept

    return kept("jits")


def key(*parts: Any) -> str:
    """A file name for an entry: the digest of everything that shapes a JIT's kernels (``parts``), with this code's
    and tinygrad's versions and the CPU's identity (its machine code runs nowhere else)."""
    return hashlib.sha256(repr((_machine(), parts)).encode()).hexdigest()[:32]


@functools.cache
def _machine() -> tuple[Any, ...]:
    from importlib.metadata import version

    from tinygrad.helpers import CPU_COUNT

    from pp_worker import __file__ as package

    code = hashlib.sha256()  # the worker's Python and C: what traces a forward and what it compiles
    worker = Path(package).parent / "worker"
    for path in sorted(p for p in worker.rglob("*") if p.suffix in (".py", ".c", ".h")):
        code.update(path.read_bytes())
    cpu = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in cpu.splitlines() if line.startswith(("flags", "Features"))), "")
    # the kernels' parts are the thread count; CC may be a wrapper that changes the instruction sets compiled for
    return (FORMAT, code.hexdigest(), version("tinygrad"), Device[Device.DEFAULT].arch, flags, CPU_COUNT.value,
            os.environ.get("CC", "clang"))


@dataclass
class Named:
    """The stage's persistent buffers by name (weights, tables), both ways."""

    by_buffer: dict[int, str]  # id(base Buffer) -> name
    by_name: dict[str, Buffer]

    @classmethod
    def of(cls, tensors: dict[str, Tensor]) -> Named:
        by_name: dict[str, Buffer] = {}
        for name, t in tensors.items():
            bufs = [u for u in t.uop.toposort() if u.op is Ops.BUFFER]  # under a view (an fp16 view of uint8 bytes)
            if len(bufs) == 1 and bufs[0].is_realized:  # lazy leftovers of a block's constructor are no buffers
                by_name.setdefault(name, bufs[0].buffer)
        return cls({id(b): n for n, b in reversed(list(by_name.items()))}, by_name)

    def resolve(self, name: str, device: str) -> Buffer:
        if name.startswith("dims:"):
            return cpu_kernels.dims(device, *map(int, name[5:].split(","))).uop.base.buffer
        return self.by_name[name]

    def name(self, buf: Buffer) -> str | None:
        if (n := self.by_buffer.get(id(buf))) is not None:
            return n
        values = cpu_kernels.dims_values(buf)
        return None if values is None else "dims:" + ",".join(map(str, values))


def record(rows: list[tuple[str, bytes, list[Any]]], table: Table, named: Named, arenas: list[Buffer],
           out: Buffer) -> dict[str, Any] | None:
    """An entry for a captured native JIT (`NativeGraph.calls_made` before slimming, its table), or None when an
    argument is none of the kinds the module docstring lists."""
    kernels: dict[bytes, int] = {}
    entry: dict[str, Any] = {"format": FORMAT, "kernels": [], "rows": [], "arenas": [a.nbytes for a in arenas],
                             "out": out.nbytes, "inputs": table.input_slots, "vars": table.var_slots}
    arena_index = {id(a): i for i, a in enumerate(arenas)}
    for j, (name, lib, bufs) in enumerate(rows):
        if lib not in kernels:
            kernels[lib] = len(entry["kernels"])
            entry["kernels"].append((name, lib))
        args = []
        for slot, value in enumerate(table.table[j, 4:]):
            buf = bufs[slot] if slot < len(bufs) else None
            if buf is None:  # an input's place, a variable's, a constant
                args.append(("int", int(value)))
                continue
            base, offset = buf.base, buf.offset
            if (n := named.name(base)) is not None:
                args.append(("named", n, offset))
            elif id(base) in arena_index:
                args.append(("arena", arena_index[id(base)], offset))
            elif base is out:
                args.append(("out", 0, offset))
            else:
                return None
        entry["rows"].append((kernels[lib], int(table.table[j, 1]), int(table.table[j, 3]), args))
    return entry


def restore(entry: dict[str, Any], named: Named, device: str, out_shape: tuple[int, ...],
            out_dtype: Any) -> tuple[Table, Tensor]:
    """The table of an entry, over this stage's buffers, and the output tensor it writes."""
    dev = Device[device]
    programs = [dev.runtime(name, lib) for name, lib in entry["kernels"]]
    arenas = [Tensor.empty(n, dtype=dtypes.uint8, device=device).realize() for n in entry["arenas"]]
    out = Tensor.empty(*out_shape, dtype=out_dtype, device=device).realize()
    if out.nbytes() != entry["out"]:
        raise ValueError(f"output of {out.nbytes()} bytes, the entry wrote {entry['out']}")
    bases = {"arena": [a.uop.base.buffer for a in arenas], "out": [out.uop.base.buffer]}
    table = np.zeros((len(entry["rows"]), ROW), np.int64)
    for j, (k, threads, core, args) in enumerate(entry["rows"]):
        table[j, :4] = (ctypes.cast(programs[k].fxn, ctypes.c_void_p).value, threads, len(args), core)
        for slot, (kind, a, *rest) in enumerate(args):
            if kind == "int":
                table[j, 4 + slot] = a
            else:
                buf = named.resolve(a, device) if kind == "named" else bases[kind][a]
                table[j, 4 + slot] = buf.ensure_allocated()._buf.va_addr + rest[0]
    keep = [*programs, *arenas, out]
    return Table(device, table, [tuple(s) for s in entry["inputs"]], [tuple(s) for s in entry["vars"]], keep), out


class Store:
    """Entries on disk under ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def has(self, name: str) -> bool:
        return (self.root / f"{name}.jit").exists()

    def load(self, name: str) -> dict[str, Any] | None:
        path = self.root / f"{name}.jit"
        try:
            data = path.read_bytes()
        except OSError:  # none (or another stage's prune just removed it): compiled by the caller
            return None
        with contextlib.suppress(OSError):  # a read-only cache still serves
            os.utime(path)  # used now: the last to go when the directory is over its budget
        try:
            entry = pickle.loads(data)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                raise ValueError("not an entry of this format")
            return entry
        except Exception as e:  # corrupt, truncated, another version: rebuilt by the caller
            print(f"pp_worker: ignoring the compiled-forward cache entry {path} ({type(e).__name__}: {e}); "
                  "compiling again", file=sys.stderr, flush=True)
            return None

    def save(self, name: str, entry: dict[str, Any]) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=f".{name}.", delete=False) as f:
                f.write(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(f.name, self.root / f"{name}.jit")  # whole or not at all, whoever else writes the same entry
        except OSError as e:
            print(f"pp_worker: cannot write the compiled-forward cache under {self.root} ({e}); "
                  "this start works without it", file=sys.stderr, flush=True)
            return
        self.prune()

    def prune(self) -> None:
        """Past `BUDGET` bytes of entries, remove those used longest ago down to three quarters of it; and
        temporary files older than `STALE_S`. Another stage may be pruning too: a file already gone is skipped."""
        entries, now = [], time.time()
        for path in self.root.iterdir():
            try:
                st = path.stat()
                if path.name.startswith(".") and now - st.st_mtime > STALE_S:
                    path.unlink()
                elif path.suffix == ".jit":
                    entries.append((st.st_mtime, st.st_size, path))
            except OSError:
                continue
        total = sum(size for _, size, _ in entries)
        if total <= BUDGET:
            return
        for _, size, path in sorted(entries):
            if total <= BUDGET * 3 // 4:
                break
            try:
                path.unlink()
            except OSError:
                pass
            total -= size
