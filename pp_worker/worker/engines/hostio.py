"""Host <-> device copies of a stage's inputs and outputs, the same on every device.

Inputs: a persistent realized tensor per JIT, written from a staging array of its exact size with copyin (writable:
CUDA's copyin takes the address of its source). Outputs: copied with copyout into one reusable host buffer,
page-locked on CUDA. No allocation per call. On the CPU, copyin/copyout are a synchronize and a memmove, the same
work as writing through a zero-copy view, so there is one code path, and it is the one CI runs
(tests/test_device_memory.py runs it with GPU-like memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from tinygrad import Device, Tensor

from pp_worker.worker.engines.base import device_kind

if TYPE_CHECKING:
    from tinygrad.device import Buffer


def device_buffer(t: Tensor) -> Buffer:
    """The device buffer behind a realized tensor."""
    buf = t.uop.base.realized
    assert buf is not None, "expected a realized tensor"
    return buf


class InputBuffer:
    """A persistent realized input a JIT reads, written through a host staging array of its exact size: a new
    Tensor per call would cost milliseconds of scheduling, this costs a copy."""

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.tensor = Tensor.zeros(*shape, dtype=dtype).contiguous().realize()
        self.staging = np.zeros(shape, dtype=np.dtype(self.tensor.dtype.fmt))

    def write(self, values: np.ndarray) -> None:
        self.staging[...] = values.reshape(self.staging.shape)
        device_buffer(self.tensor).copyin(memoryview(self.staging).cast("B"))  # ordered after kernels still reading it


class HostBuffer:
    """The host memory every output is copied into, reused call after call and grown only for a longer request
    than any before. With ``pinned`` (CUDA's allocator) it is page-locked, so a device -> host copy is one DMA
    instead of a bounce through the driver's own staging memory. A view is valid until the next `view`."""

    def __init__(self, nbytes: int, pinned: Any = None):
        self._pinned = pinned
        self._held: tuple[Any, int] | None = None  # (pinned allocation, its size) to free when growing
        self._mv = self._allocate(nbytes)

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
        return to_mv(self._held[0].value, nbytes)


def pinned_allocator(device: str) -> Any:
    """The allocator that gives page-locked host memory on this device, or None. Only CUDA: tinygrad's other GPU
    backends (NV, AMD) copy through their own pinned buffers already."""
    return Device[device].allocator if device_kind(device) == "CUDA" else None
