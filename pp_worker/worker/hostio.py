"""Host <-> device copies of a stage's inputs and outputs, the same on every device.

Inputs: a persistent realized tensor per JIT, written from a staging array of its exact size with copyin (writable:
CUDA's copyin takes the address of its source). Outputs: copied with copyout into one reusable host buffer,
page-locked on CUDA (``PP_PINNED_HOST`` forces either way). No allocation per call. Where device memory is host
memory (the CPU's), both go through a zero-copy view of the tensor's memory, made once, after a synchronize: the
same work as copyin/copyout without their Python (~0.1 ms of a ~0.8 ms decode request, bench/NOTES.md).
tests/test_device_memory.py runs the copy path with GPU-like memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from tinygrad import Device, Tensor

from pp_worker.worker import hugemem
from pp_worker.worker.device import device_kind

if TYPE_CHECKING:
    from tinygrad.device import Buffer


def device_buffer(t: Tensor) -> Buffer:
    """The device buffer behind a realized tensor."""
    buf = t.uop.base.realized
    assert buf is not None, "expected a realized tensor"
    return buf


def filled(shape: tuple[int, ...], dtype: Any, fill: Callable[[memoryview], None] | None = None,
           device: str | None = None, weight: bool = False) -> Tensor:
    """A new realized tensor whose bytes ``fill`` writes (zeros without one), with no kernel scheduled (a cold
    stage's first kernels cost it ~0.1-0.3 s; and none is recorded by a TinyJit capturing meanwhile): in place where
    the device memory is host memory (the CPU's), else through one staging copy, freed at once (writable: CUDA's
    copyin takes the address of its source). A ``weight`` on the CPU goes to huge pages (`hugemem`)."""
    device = Device.canonicalize(device)
    host = hasattr(Device[device].allocator, "_as_buffer")
    if weight and host and (huge := hugemem.weight(shape, dtype, device)) is not None:
        t, mem = huge
        if fill is not None:  # else zeros: new anonymous memory
            fill(mem)
        return t
    t = Tensor.empty(*shape, dtype=dtype, device=device)
    if fill is None and not host:
        return Tensor.zeros(*shape, dtype=dtype, device=device).contiguous().realize()  # a device memset
    buf = t.uop.base.buffer.ensure_allocated()
    if (mv := host_bytes(buf)) is not None:
        if fill is None:
            ctypes.memset((ctypes.c_char * len(mv)).from_buffer(mv), 0, len(mv))
        else:
            fill(mv)
    else:
        staging = bytearray(buf.nbytes)
        if fill is not None:
            fill(memoryview(staging))
        buf.copyin(memoryview(staging))
    return t


_TIMELINES: dict[int, tuple[Any, Any]] = {}  # id(device) -> (its timeline signal, a view of its value or None)


def settle(dev: Any) -> None:
    """``dev.synchronize()``, without its Python (~10 us) when a CPU device has nothing queued, as between a stage's
    native replays (which run to completion): tinygrad counts a device's finished work in its timeline signal, read
    here through a view made once (None: not a CPU device). Any other device, or work still queued: the full
    synchronize."""
    signal = getattr(dev, "timeline_signal", None)
    known = _TIMELINES.get(id(dev))
    if known is None or known[0] is not signal:
        view = None
        if signal is not None and getattr(dev, "_is_cpu", bool)():
            from tinygrad.helpers import to_mv

            view = to_mv(signal.value_addr, 8).cast("Q")  # a plain view: no numpy code on this path
        known = _TIMELINES[id(dev)] = (signal, view)
    if known[1] is not None and dev.error_state is None and known[1][0] >= dev.timeline_value - 1:
        return
    dev.synchronize()


def host_view(t: Tensor) -> memoryview | None:
    """A zero-copy byte view of a realized tensor's memory where that is host memory we may write (the CPU's), else
    None (device memory: copy with copyin/copyout)."""
    return host_bytes(device_buffer(t))


def host_bytes(buf: Buffer) -> memoryview | None:
    """A zero-copy byte view of a device buffer where its memory is host memory we may write, else None."""
    if not hasattr(buf.allocator, "_as_buffer") or buf.options is not None:
        return None
    return buf.as_memoryview(force_zero_copy=True).cast("B")


class InputBuffer:
    """A persistent realized input a JIT reads, written in place (host memory) or through a host staging array of
    its exact size: a new Tensor per call would cost milliseconds of scheduling, this costs a copy."""

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.tensor = filled(shape, dtype)
        self.staging = np.zeros(shape, dtype=np.dtype(self.tensor.dtype.fmt))
        view = host_view(self.tensor)
        self._host = None if view is None else np.frombuffer(view, self.staging.dtype).reshape(shape)
        self._device = Device[self.tensor.device]

    def write(self, values: np.ndarray) -> None:
        if self._host is not None:
            settle(self._device)  # kernels still reading it finish first
            self._host[...] = values.reshape(self._host.shape)
            return
        self.staging[...] = values.reshape(self.staging.shape)
        device_buffer(self.tensor).copyin(memoryview(self.staging).cast("B"))  # ordered after kernels still reading it


class Outputs:
    """Copies the tensors a stage's JITs return into host memory: through a zero-copy view of each where its memory
    is host memory (made at its first copy: a JIT returns the same tensor every call), else with copyout."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[Tensor, Any, memoryview | None]] = {}  # id -> (tensor, device, view)

    def copy(self, t: Tensor, dst: memoryview) -> None:
        """``dst`` = the tensor's first len(dst) bytes (all of them, or a padded call's real rows), once the kernels
        writing them are done."""
        known = self._views.get(id(t))
        if known is None or known[0] is not t:
            if len(self._views) >= 64:  # a caller returning new tensors: never hold more than a few
                self._views.clear()
            known = self._views[id(t)] = (t, Device[t.device], host_view(t))
        _, device, view = known
        if view is None:
            buf = device_buffer(t)
            if len(dst) == buf.nbytes:
                buf.copyout(dst)
            else:
                whole = memoryview(bytearray(buf.nbytes))
                buf.copyout(whole)
                dst[:] = whole[:len(dst)]
            return
        settle(device)
        dst[:] = view[:len(dst)]


class HostBuffer:
    """The host memory every output is copied into, reused call after call and grown only for a longer request
    than any before. With ``pinned`` (CUDA's allocator) it is page-locked, so a device -> host copy is one DMA
    instead of a bounce through the driver's own staging memory. A view is valid until the next `view`."""

    def __init__(self, nbytes: int, pinned: Any = None):
        self._pinned = pinned
        self._held: tuple[Any, int] | None = None  # (pinned allocation, its size) to free when growing
        self._mv = self._allocate(nbytes)

    @property
    def pinned(self) -> bool:
        """Whether this memory comes from a device's allocator (page-locked on CUDA), not from a bytearray."""
        return self._held is not None

    def view(self, nbytes: int) -> memoryview:
        if nbytes > len(self._mv):
            self._mv = self._allocate(max(nbytes, 2 * len(self._mv)))
        return self._mv[:nbytes]

    def _allocate(self, nbytes: int) -> memoryview:
        if self._pinned is None:
            return memoryview(bytearray(nbytes))
        from tinygrad.device import BufferSpec
        from tinygrad.helpers import to_mv

        if self._held is not None:
            self._pinned.free(self._held[0], self._held[1], BufferSpec(host=True))
        self._held = (self._pinned.alloc(nbytes, BufferSpec(host=True)), nbytes)
        return to_mv(_host_address(self._held[0]), nbytes)


def _host_address(opaque: Any) -> int:
    """Where a host allocation starts: CUDA's allocator returns a c_void_p, the HCQ devices' (CPU, NV, AMD) an
    HCQBuffer. Any other device's allocation is refused by name rather than misread."""
    address = getattr(opaque, "va_addr", None) or getattr(opaque, "value", None)
    if not isinstance(address, int):
        raise RuntimeError(f"pinned host memory is not supported here: the device's allocator returned a "
                           f"{type(opaque).__name__} with no host address")
    return address


def default_pinned_host(device: str) -> bool:
    """Whether outputs go to page-locked memory by default: on CUDA only. tinygrad's other GPU backends (NV, AMD)
    copy through their own pinned buffers already."""
    return device_kind(device) == "CUDA"


def pinned_allocator(device: str, pinned: bool | None = None) -> Any:
    """The allocator whose host memory outputs are copied into, or None for plain host memory. ``pinned`` None: as
    `default_pinned_host`; True: the device's allocator on any device (PP_PINNED_HOST=1; on the CPU it maps ordinary
    memory, which is how CI runs this path); False: never."""
    if pinned is None:
        pinned = default_pinned_host(device)
    return Device[device].allocator if pinned else None


def return_freed_heap() -> None:
    """Hand memory freed by Python back to the OS (glibc keeps it otherwise), e.g. after building the tokenizer."""
    gc.collect()
    if (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
