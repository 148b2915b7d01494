"""GGUF header parsing: metadata and the tensor directory, read with bounds checks.

Every read fails with `ModelLoadError` (one line, naming the file) rather than reading past the end of a truncated
or malformed file, and every tensor's data is checked to lie inside the file. Tensor data is read by `read_data`
(for `tensors`), which first makes the bytes present when the file is a remote model's cache (`fetch`). Tensors are
sized by the type table (`types`); nothing heavy is imported, so `ModelLoadError` can be imported cheaply.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pp_worker.worker.gguf.types import TYPES

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9  # GGUF value types that are not fixed-size scalars (those are in _SCALARS)
class ModelLoadError(Exception):
    """The model cannot be loaded (missing, malformed, unsupported); the message is one line."""


class HeaderTruncated(ModelLoadError):
    """A header read past the end of the bytes at hand: a truncated file, or a header fetched only in part so far
    (`fetch` then fetches more). ``needed``: the offset where that read would have ended."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    ggml_type: int
    offset: int  # absolute, in bytes from the start of the file

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

    @property
    def nbytes(self) -> int | None:
        """Bytes of data, None for a GGML type the table (`types`) does not know."""
        t = TYPES.get(self.ggml_type)
        return None if t is None else self.n_elements // t.block * t.nbytes


@dataclass
class GGUFHeader:
    path: Path
    kv: dict[str, Any]
    tensors: dict[str, TensorInfo]
    # a remote model's cache (`fetch`): makes the bytes of the [start, end) ranges present in ``path``; None: local
    ensure: Callable[[list[tuple[int, int]]], None] | None = None


class _Reader:
    """Little-endian reads that fail with ModelLoadError instead of reading past the end of the file."""

    def __init__(self, f: BinaryIO, size: int, path: Path):
        self.f, self.size, self.path = f, size, path

    def bytes(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise HeaderTruncated(f"{self.path}: truncated or malformed GGUF header (read of {n} bytes past the end)",
                                  self.f.tell() + n)
        return self.f.read(n)

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.bytes(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.bytes(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: malformed GGUF header (a string is not UTF-8)") from e

    def value(self, typ: int) -> Any:
        if typ == _STRING:
            return self.string()
        if typ == _ARRAY:
            item_typ, n = self.scalar("<i"), self.scalar("<Q")
            return [self.value(item_typ) for _ in range(n)]
        if typ not in _SCALARS:
            raise ModelLoadError(f"{self.path}: malformed GGUF header (unknown value type {typ})")
        return self.scalar(_SCALARS[typ])


def read_header(path: Path, available: int | None = None) -> GGUFHeader:
    """Metadata and tensor directory of a GGUF file; checks that every tensor's data lies inside the file.
    ``available``: only that many bytes at the start of ``path`` are the file's yet (a cache being filled, `fetch`);
    reading past them raises `HeaderTruncated`."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size if available is None else min(available, size), path)
        magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        if (version := r.scalar("<I")) not in (2, 3):
            raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        kv = {r.string(): r.value(r.scalar("<i")) for _ in range(n_kv)}
        entries = [(r.string(), tuple(r.scalar("<Q") for _ in range(r.scalar("<I"))), r.scalar("<i"), r.scalar("<Q"))
                   for _ in range(n_tensors)]
        if not isinstance(alignment := kv.get("general.alignment", 32), int) or alignment < 1:
            raise ModelLoadError(f"{path}: malformed GGUF header (general.alignment {alignment!r})")
        data_start = -(-f.tell() // alignment) * alignment
    tensors = {name: TensorInfo(name, dims, typ, data_start + off) for name, dims, typ, off in entries}
    for t in tensors.values():
        if t.nbytes is not None and t.offset + t.nbytes > size:
            raise ModelLoadError(f"{path}: truncated file: tensor {t.name} ends at byte {t.offset + t.nbytes} "
                                 f"but the file has {size} bytes")
    if kv.get("split.count", 1) > 1:
        raise ModelLoadError(f"{path}: multi-part GGUF files are not supported (split.count={kv['split.count']})")
    return GGUFHeader(path, kv, tensors)


def read_data(header: GGUFHeader, offset: int, out: memoryview) -> int:
    """Read ``len(out)`` bytes of tensor data at ``offset`` into ``out``; the number of bytes read. The one reader
    of tensor data: a remote model's cache fetches the bytes first if it lacks them (``header.ensure``)."""
    if header.ensure is not None:
        header.ensure([(offset, offset + len(out))])
    with open(header.path, "rb") as f:
        f.seek(offset)
        return f.readinto(out) or 0
