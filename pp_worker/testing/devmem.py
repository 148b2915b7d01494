"""Make tinygrad's CPU device behave, at its host <-> device boundary, like a device whose memory is not host memory.

Two things tell tinygrad 0.13.0's CPU allocator apart from a GPU's (CUDA, NV, AMD...):

1. ``CPUAllocator._as_buffer`` exists, so ``Buffer.as_memoryview(allow_zero_copy=True)`` hands out the device memory
   itself and code can write into it in place. GPU allocators have no ``_as_buffer``: every read is a ``_copyout``
   into host memory, every write a ``_copyin`` from it.
2. ``CUDAAllocator._copyin``/``_copyout`` take ``mv_address(host view)``, which raises
   ``TypeError: underlying buffer is not writable`` for a read-only view (``memoryview(bytes)``,
   ``np.frombuffer(bytes)``): the H200's load failure.

``device_memory()`` takes (1) away and enforces (2) on the CPU and NULL allocators while it is active. Kernels still
run on the CPU and results stay bit-identical. Enter it before building an engine: what takes the zero-copy path
decides so when its buffers are made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_PATCHED = ("_as_buffer", "_copyin", "_copyout")


def _allocator_classes() -> list[type]:
    from tinygrad.runtime.ops_cpu import CPUAllocator
    from tinygrad.runtime.ops_null import NullAllocator  # its copyin is a no-op that accepts anything

    return [CPUAllocator, NullAllocator]


def _patch(cls: type) -> Callable[[], None]:
    """Give ``cls`` GPU memory semantics; returns the function that restores it."""
    from tinygrad.helpers import mv_address

    own = {k: cls.__dict__[k] for k in _PATCHED if k in cls.__dict__}
    base_copyin, base_copyout = cls._copyin, cls._copyout

    def _copyin(self: Any, dest: Any, src: memoryview) -> None:
        mv_address(src)  # what CUDAAllocator._copyin does first: a TypeError for a read-only source
        base_copyin(self, dest, src)

    def _copyout(self: Any, dest: memoryview, src: Any) -> None:
        mv_address(dest)  # CUDAAllocator._copyout writes through the address of ``dest``
        base_copyout(self, dest, src)

    if "_as_buffer" in own:
        delattr(cls, "_as_buffer")  # no zero-copy view of device memory, as on a GPU
    cls._copyin, cls._copyout = _copyin, _copyout

    def restore() -> None:
        for k in _PATCHED:
            if k in cls.__dict__:
                delattr(cls, k)
        for k, v in own.items():
            setattr(cls, k, v)

    return restore


@contextlib.contextmanager
def device_memory() -> Iterator[None]:
    """While active, CPU (and NULL) buffers behave like GPU memory (see the module docstring)."""
    undo = [_patch(cls) for cls in _allocator_classes()]
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()
