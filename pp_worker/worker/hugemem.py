"""A CPU stage's weights in huge pages: one after another in private memory advised MADV_HUGEPAGE.

tinygrad maps its CPU buffers shared, and Linux backs shared memory with 4 KiB pages only (shmem THP is ``never``
by default), so a weight streamed from DRAM crossed a page every 4 KiB: a TLB miss (two levels of page tables in a
VM) and a hardware prefetcher that stops at the page's end. Here the weights are placed in arenas of private
memory from a huge page's boundary, each weight on a 4 KiB boundary of its own, so all but an arena's last 2 MiB
can be huge pages. On the 1.1B Q4_K_M file a stage's decode call ran 1.03-1.10x (bench/NOTES.md); F16 streams at
the memory's rate either way. Huge pages are the kernel's to give (THP ``madvise`` or ``always``); only the bytes
written are resident, so a model's memory stays its weights'. An arena is unmapped once every weight placed in it
is freed.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from typing import Any

from tinygrad import Tensor

from pp_worker.worker.device import device_kind

HUGE_PAGE = 2 << 20  # a transparent huge page: x86-64's, and aarch64's with 4 KiB pages
ARENA = 256 << 20  # the address space an arena reserves (what is not written costs nothing)
ALIGN = 4096  # where each weight starts: any vector load of tinygrad's kernels is aligned


class _Arena:
    """Private memory from a huge page's boundary, advised MADV_HUGEPAGE, weights placed one after another."""

    def __init__(self, size: int):
        self.mem = mmap.mmap(-1, size + HUGE_PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        self.start = -base % HUGE_PAGE
        self.address, self.size, self.used, self.live = base + self.start, size, 0, 0
        self.mem.madvise(mmap.MADV_HUGEPAGE, self.start, size)

    def close(self) -> None:
        try:
            self.mem.close()
        except BufferError:  # a view of it is still held somewhere: unmapped with the last one
            pass


_lock = threading.Lock()  # weights are freed by the garbage collector, on any thread
_arena: _Arena | None = None  # where the next weight goes


def weight(shape: tuple[int, ...], dtype: Any, device: str) -> tuple[Tensor, memoryview] | None:
    """A new realized tensor in an arena (zeros) and a writable view of its bytes, for ``device`` (a canonical name,
    whose memory the caller knows to be the host's), or None where this does not apply: not the CPU, no
    MADV_HUGEPAGE (not Linux), an arena the system refuses to map."""
    global _arena
    if device_kind(device) != "CPU" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return None
    with _lock:
        if _arena is None or _arena.used + nbytes > _arena.size:
            try:
                _arena = _Arena(max(ARENA, -(-nbytes // HUGE_PAGE) * HUGE_PAGE))
            except OSError:  # no address space or commit for an arena (strict overcommit): tinygrad's memory
                return None
        arena, at = _arena, _arena.used
        arena.used = -(-(at + nbytes) // ALIGN) * ALIGN
        arena.live += 1
    t = Tensor.from_blob(arena.address + at, shape, dtype=dtype, device=device)
    weakref.finalize(t.uop.base.realized, _freed, arena)
    return t, memoryview(arena.mem)[arena.start + at:arena.start + at + nbytes]


def _freed(arena: _Arena) -> None:
    """One weight of ``arena`` freed: the arena is unmapped with its last (and no new weight goes there)."""
    global _arena
    with _lock:
        arena.live -= 1
        if arena.live:
            return
        if _arena is arena:
            _arena = None
    arena.close()
