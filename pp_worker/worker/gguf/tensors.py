"""One stage's tensors out of a GGUF file: which it reads, and each read into its own realized buffer.

tinygrad's `Transformer.from_gguf` copies the whole file into memory, which defeats pipeline parallelism. Here the
header is parsed with bounds checks (`header`), and each tensor a stage needs is read from its offset into its own
realized buffer, one tensor at a time, in its final layout, llama's Q/K rows un-permuted on the host exactly as
`from_gguf` does (a packed row's blocks move whole). A matrix whose type has a CPU kernel (`types.has_kernel`) stays
as the file's bytes (`PackedWeight`): on the CPU F16 too, since the C kernels read every type; elsewhere F16 is a
native fp16 buffer. Any other type (and every tensor when ``keep_quantized`` is off, the reference path of the tests)
is dequantized once, here, and cast to fp16 (`HALF=1`, tinygrad's default); norm gains and biases are float32. A
model given by URL is read the same way from a sparse cache file that `fetch` fills with the header and this stage's
tensors only. tinygrad is imported inside the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pp_worker.worker.gguf.fetch import RemoteFile, is_url
from pp_worker.worker.gguf.header import GGUFHeader, ModelLoadError, TensorInfo, read_data, read_header
from pp_worker.worker.gguf.types import F16, F32, TYPES, has_kernel, tinygrad_expands, type_name
from pp_worker.worker.hostio import filled
from pp_worker.worker.shard import Shard

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.dtype import DType


@dataclass(frozen=True)
class PackedWeight:
    """An (n, k) matrix held as its GGUF bytes: ``raw`` is a uint8 (n, row_bytes) tensor of ``ggml_type`` rows;
    ``group`` > 0: the rows interleaved in groups of that many at load (`grouped`: only the C kernels'
    integer-path product reads them)."""

    raw: Tensor
    ggml_type: int
    shape: tuple[int, int]
    group: int = 0


def resolve_model(model: str) -> Path | str:
    """A local .gguf path, or the URL of one: given as such (http:// or https://), or a name from
    tinygrad.llm.cli.models. A URL's stage fetches only its own bytes (`fetch`)."""
    if is_url(model):
        return model
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from tinygrad.llm.cli import models

    if model not in models:
        raise ModelLoadError(f"model file not found: {model} (not a file, nor an http(s) URL, nor one of tinygrad's "
                             f"model names: {', '.join(sorted(models))})")
    return models[model]


def open_header(model: str, emit: Callable[..., None]) -> GGUFHeader:
    """The header of a local file, or of a URL's (fetched into the cache, which then serves its tensors)."""
    where = resolve_model(model)
    return read_header(where) if isinstance(where, Path) else RemoteFile(where, emit).open()


def stage_tensors(header: GGUFHeader, shard: Shard) -> list[TensorInfo]:
    """Every tensor this stage reads: its blocks', the embedding on the first stage, the output norm and head
    (or the embedding, when tied) on the last, and the RoPE factors."""
    blocks = tuple(f"blk.{i}." for i in range(shard.start, shard.end))
    wanted = {"rope_freqs.weight"} | ({"token_embd.weight"} if shard.is_first else set())
    if shard.is_last:
        wanted |= {"output_norm.weight", "output.weight" if "output.weight" in header.tensors else "token_embd.weight"}
    return [t for name, t in header.tensors.items() if name in wanted or name.startswith(blocks)]


@dataclass
class TensorSource:
    """Reads single tensors out of the file into their own realized device buffers, in their final layout, and
    remembers which (``loaded``: name -> bytes read) and what each holds (``held``: name -> (type, bytes);
    ``converted``: name -> the file's type, for matrices turned into fp16 values at load).

    ``kernels`` ("c" or "tinygrad", see `weights`) decides how matrices are held: with "c" every fp16 buffer is a
    uint8 buffer (the C kernels, and tinygrad's CPU kernels, read those fastest), and F16 matrices stay packed too."""

    header: GGUFHeader
    half: bool = True
    kernels: str = "tinygrad"
    keep_quantized: bool = True
    loaded: dict[str, int] = field(default_factory=dict)
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    converted: dict[str, str] = field(default_factory=dict)
    # rows a product's matrix of a type interleaves at load (`grouped`; the C kernels' `cpu.kernels.group_rows`, which
    # the engine passes: this room sits below cpu), None: none
    group_rows: Callable[[int], int] | None = None

    def matrix(self, name: str, shape: tuple[int, ...], heads: tuple[int, int] | None = None,
               product: bool = False) -> Tensor | PackedWeight:
        """A weight matrix of ``shape`` (n, k): its file bytes (`PackedWeight`) when its type has a kernel and
        the stage keeps it (see the class); else fp16 values, packed as F16 rows when the C kernels run. A 3-D
        ``shape`` (E, n, k), a mixture of experts' tensor, is held the same way as E * n rows of k. ``product``: the
        matrix only ever multiplies (`weights.Linear`), so its rows may be interleaved for the C kernels' product
        (``group_rows``)."""
        from tinygrad import dtypes

        info = self._info(name)
        if info.shape != shape:
            raise ModelLoadError(f"{self.header.path}: tensor {name} has shape {info.shape}, expected {shape}")
        c = self.kernels == "c"
        keep = c if info.ggml_type == F16 else self.keep_quantized
        rows, k = math.prod(shape[:-1]), shape[-1]
        # the C kernels read their types; tinygrad's expressions (`weights.dequantize`) only the types it expands
        if keep and has_kernel(info.ggml_type, k) and (c or tinygrad_expands(info.ggml_type)):
            group = self.group_rows(info.ggml_type) if self.group_rows and product and len(shape) == 2 else 0
            raw = self._raw(info.nbytes, self._filler(info, heads, group)).reshape(rows, -1)
            self.loaded[name] = info.nbytes
            self.held[name] = (type_name(info.ggml_type), info.nbytes)
            return PackedWeight(raw, info.ggml_type, (rows, k), group)
        if info.ggml_type != F16:
            self.converted[name] = type_name(info.ggml_type)
        raw = self.tensor(name, heads, raw=True)
        if c and raw.dtype == dtypes.uint8 and has_kernel(F16, k):
            return PackedWeight(raw.reshape(rows, -1), F16, (rows, k))
        return self._view(raw, shape)

    def tensor(self, name: str, heads: tuple[int, int] | None = None, raw: bool = False) -> Tensor:
        """(GGUF dims reversed) tensor, realized: a matrix in fp16 when ``half``, a 1-D tensor in float32.
        ``heads=(n_heads, keep)``: GGUF's interleaved-rope Q/K rows un-permuted (`unpermute_rows`). F16 data is
        read straight into its final buffer; other types are dequantized by tinygrad once, here. ``raw``: an fp16
        tensor held in a uint8 buffer (see the class) is returned as that uint8 buffer."""
        from tinygrad import dtypes

        info = self._info(name)
        self.loaded[name] = info.nbytes
        # 1-D tensors (norm gains, biases) stay float32, as ggml keeps them: a few KiB a block, and their fp16
        # rounding was, after an fp16 KV cache, the largest error against the float64 reference (bench/NOTES.md)
        dtype = dtypes.float16 if self.half and len(info.shape) > 1 else dtypes.float32
        if dtype == dtypes.float16 and info.ggml_type == F16:  # already what we keep: no staging copy, no cast
            fill = self._filler(info, heads)
        else:
            values = self._dequantized(info, dtype)
            values = unpermute_rows(values, *heads) if heads else values

            def fill(mv: memoryview) -> None:
                np.frombuffer(mv, np.uint8)[:] = values.reshape(-1).view(np.uint8)
        nbytes = math.prod(info.shape) * dtype.itemsize
        self.held[name] = ("F16" if dtype == dtypes.float16 else "F32", nbytes)
        if self.kernels == "c" and dtype == dtypes.float16:
            t = self._raw(nbytes, fill)
            return t if raw else self._view(t, info.shape)
        return filled(info.shape, dtype, fill, weight=True)

    def _filler(self, info: TensorInfo, heads: tuple[int, int] | None, group: int = 0) -> Callable[[memoryview], None]:
        """Writes ``info``'s file bytes into a buffer, rows un-permuted in place when ``heads`` (whole rows move, so
        packed rows of any block type move as fp16 rows do), then, with ``group``, interleaved in place (`grouped`)."""
        def fill(mv: memoryview) -> None:
            self._read(info, mv)
            rows = np.frombuffer(mv, np.uint8).reshape(info.shape[0], -1)  # (rows, row bytes), writes through
            if heads:
                rows[:] = unpermute_rows(rows, *heads)
            if group:
                grouped(rows, group, info.ggml_type)
        return fill

    def _info(self, name: str) -> TensorInfo:
        info = self.header.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.header.path}: tensor {name} is missing")
        if info.nbytes is None:
            raise self._unreadable(info)
        return info

    def _unreadable(self, info: TensorInfo) -> ModelLoadError:
        return ModelLoadError(f"{self.header.path}: tensor {info.name} has GGML type {info.ggml_type} "
                              f"({type_name(info.ggml_type)}), which this worker cannot read")

    def _dequantized(self, info: TensorInfo, dtype: DType) -> np.ndarray:
        """Any GGML type -> ``dtype`` values (shape ``info.shape``), by tinygrad's dequantizer and cast; float32 and
        float16 data by numpy's cast (the same rounding): a stage's first tinygrad kernels, scheduled and compiled
        here for the norms' gains, cost a restart ~0.3 s (bench/NOTES.md). The types tinygrad lacks (Q2_K, Q3_K,
        IQ4_NL, TQ2_0...) by the `gguf` package's numpy version of ggml's ``dequantize_row_*``."""
        from tinygrad import dtypes
        from tinygrad.llm.gguf import ggml_data_to_tensor

        if info.ggml_type in (F32, F16) or not tinygrad_expands(info.ggml_type):
            data = np.empty(info.nbytes, np.uint8)
            self._read(info, memoryview(data))
            if info.ggml_type in (F32, F16):
                values = data.view(np.float32 if info.ggml_type == F32 else np.float16)
            else:
                from gguf import GGMLQuantizationType, quants

                try:
                    values = quants.dequantize(data, GGMLQuantizationType(info.ggml_type))
                except NotImplementedError:  # Q8_1, Q8_K: ggml's types for activations, never a model's weights
                    raise self._unreadable(info) from None
            return values.reshape(info.shape).astype(np.float16 if dtype == dtypes.float16 else np.float32)

        raw = self._raw(info.nbytes, lambda mv: self._read(info, mv))
        return ggml_data_to_tensor(raw, info.n_elements, info.ggml_type).reshape(info.shape).cast(dtype).numpy()

    @staticmethod
    def _raw(nbytes: int, fill: Callable[[memoryview], None]) -> Tensor:
        """A new realized uint8 buffer of ``nbytes``, filled by ``fill(its bytes)``: in place on the CPU
        (`hostio.filled`; a numpy copy plus a device copy per tensor used to stay resident)."""
        from tinygrad import dtypes

        return filled((nbytes,), dtypes.uint8, fill, weight=True)

    @staticmethod
    def _view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A uint8 buffer of fp16 bytes viewed as the fp16 tensor of ``shape`` (other tensors as they are)."""
        from tinygrad import dtypes

        return t.bitcast(dtypes.float16).reshape(shape) if t.dtype == dtypes.uint8 else t

    def _read(self, info: TensorInfo, mv: memoryview) -> None:
        if read_data(self.header, info.offset, mv) != info.nbytes:
            raise ModelLoadError(f"{self.header.path}: truncated file: tensor {info.name} is short of data")


def unpermute_rows(w: np.ndarray, n_heads: int, keep: int = 0) -> np.ndarray:
    """GGUF interleaved-rope rows -> half-split rows per head (the first ``keep`` rows of a head are not roped),
    the same rearrange as `Transformer.from_gguf` ("n (h two) d -> n (two h) d"), on the host, once."""
    w = w.reshape(n_heads, w.shape[0] // n_heads, -1)  # (H, Hd, D)
    n, hd, d = w.shape
    roped = w[:, keep:].reshape(n, (hd - keep) // 2, 2, d).transpose(0, 2, 1, 3).reshape(n, hd - keep, d)
    return np.concatenate([w[:, :keep], roped], axis=1).reshape(n * hd, d)


# where a grouped block's fifth bit of each value lies (`grouped`): byte t's bit k of a row's word the fifth bit of
# value 8 (k // 2) + 4 (k % 2) + t, so chunk c's values (8c..8c+7) are bits 2c and 2c + 1 of its 4 bytes. qh's byte c
# (values 8c + 4e + t at its bit 4e + t) goes to bits 8t + e, shifted by 2c: FIFTH_SPREAD[byte] << 2c
FIFTH_SPREAD = np.array([sum((v >> (4 * e + t) & 1) << (8 * t + e) for e in range(2) for t in range(4))
                         for v in range(256)], np.uint32)


def grouped(rows: np.ndarray, group: int, ggml_type: int) -> None:
    """Rows (n, row bytes) uint8 of a type whose rows the C kernels read in groups (`types.GGMLType.grouped`)
    rewritten in place into their layout (``cpu/c/matmul_groups.h``): each whole group of ``group`` rows as its blocks
    in turn, a block the group's rows' fields side by side (`_nibble_blocks`, `_k_blocks`); the rows past the last
    whole group as they were. The same bytes, moved, a few groups at a time (the temporaries ~1 MiB): ~3 ms a MiB
    here for Q4_0."""
    n, row_bytes = rows.shape
    size = TYPES[ggml_type].nbytes
    nb = row_bytes // size
    step = max(1, (1 << 20) // (group * row_bytes))
    for g0 in range(0, n // group, step):
        s = min(step, n // group - g0)
        part = rows[g0 * group:(g0 + s) * group]
        blocks = part.reshape(s, group, nb, size).transpose(0, 2, 1, 3)  # (s, nb, row, size)
        out = (_k_blocks if TYPES[ggml_type].name in K_FIELDS else _nibble_blocks)(blocks, ggml_type)
        part[:] = out.reshape(part.shape)


# the fields before a nibble type's 16-byte runs of nibbles, their widths (`_nibble_blocks`): d; Q4_1's and Q5_1's m;
# Q5_0's and Q5_1's qh; IQ4_XS's scales_h and scales_l
HEAD_FIELDS = {"Q4_0": (2,), "IQ4_NL": (2,), "Q5_0": (2, 4), "IQ4_XS": (2, 2, 4), "Q4_1": (2, 2), "Q5_1": (2, 2, 4)}


def _nibble_blocks(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """(s, nb, group, size) blocks of a type of nibbles in runs of 16 bytes a 32 values (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
    IQ4_XS) -> (s, nb, group size) grouped: the fields before the nibbles (`HEAD_FIELDS`) each side by side, qh's fifth
    bits reordered (`FIFTH_SPREAD`), then for each 32 values 4 chunks of 4 bytes a row (chunk c: low nibbles values
    8c..8c+3, high ones 8c+4..8c+7). A run's 16 bytes of nibbles as 4 words w0..w3 (values 4i..4i+3 in w_i's low
    nibbles, 16 + 4i.. in its high ones), each chunk is two of them masked."""
    s, nb, group, size = blocks.shape
    widths = HEAD_FIELDS[TYPES[ggml_type].name]
    head = sum(widths)
    out = np.empty((s, nb, size * group), np.uint8)
    at = 0
    for width in widths:
        field = out[..., at * group:(at + width) * group].reshape(s, nb, group, width)
        if TYPES[ggml_type].name in ("Q5_0", "Q5_1") and width == 4:  # qh: value i's fifth bit its bit i
            fifth = field.view(np.uint32)[..., 0]  # (s, nb, row)
            fifth[:] = FIFTH_SPREAD[blocks[..., at]]
            for c in range(1, 4):
                fifth |= FIFTH_SPREAD[blocks[..., at + c]] << np.uint32(2 * c)
        else:
            field[:] = blocks[..., at:at + width]
        at += width
    lo4 = np.uint32(0x0F0F0F0F)
    hi4 = ~lo4
    runs = (size - head) // 16
    w = np.ascontiguousarray(blocks[..., head:]).view(np.uint32).reshape(s, nb, group, runs, 4)
    w0, w1, w2, w3 = (w[..., i].transpose(0, 1, 3, 2) for i in range(4))  # (s, nb, run, row)
    chunks = out[..., head * group:].view(np.uint32).reshape(s, nb, runs, 4, group)
    chunks[:, :, :, 0] = (w0 & lo4) | ((w1 & lo4) << 4)
    chunks[:, :, :, 1] = (w2 & lo4) | ((w3 & lo4) << 4)
    chunks[:, :, :, 2] = ((w0 >> 4) & lo4) | (w1 & hi4)
    chunks[:, :, :, 3] = ((w2 >> 4) & lo4) | (w3 & hi4)
    return out


def _side_by_side(fields: np.ndarray, width: int) -> np.ndarray:
    """(s, nb, group, n width) bytes, each row's n fields of ``width`` bytes -> (s, nb, n, group, width): field f of
    every row of the group together."""
    s, nb, group, size = fields.shape
    return fields.reshape(s, nb, group, size // width, width).transpose(0, 1, 3, 2, 4)


# a K-quant block's fields in their grouped order (`_k_blocks`): (first byte, end, bytes a field of a row); None: the
# block's values, rewritten as each value's bits together in triples of words (`TRIPLES`)
# Q2_K: each half (pairs of sub-blocks 4h..4h + 3) its scales in pairs and its qs in words, then d, dmin
K_FIELDS = {"Q2_K": [(0, 8, 2), (16, 48, 4), (8, 16, 2), (48, 80, 4), (80, 82, 2), (82, 84, 2)],
            "Q3_K": [(108, 110, 2), (96, 108, 2), None],  # d, scales in pairs, the values
            "Q4_K": [(0, 2, 2), (2, 4, 2), (4, 16, 4), (16, 144, 4)],  # d, dmin, scales in words, qs
            # the scales in words, the values, d last
            "Q6_K": [(192, 208, 4), None, (208, 210, 2)]}


def _k_blocks(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """(s, nb, group, size) K-quant blocks -> (s, nb, group size) grouped: each field of `K_FIELDS` in turn, its bytes
    of the group's rows side by side a field (a pair of bytes or a word of 4) at a time, the values' triples a word
    at a time."""
    s, nb, group, size = blocks.shape
    name = TYPES[ggml_type].name
    out = np.empty((s, nb, size * group), np.uint8)
    at = 0
    for f in K_FIELDS[name]:
        if f is None:
            values = TRIPLES[name](blocks)  # (s, nb, triple, word, group) words
            n = values.shape[2] * 3 * 4 * group
            out[..., at:at + n].view(np.uint32).reshape(values.shape)[:] = values
            at += n
            continue
        lo, hi, width = f
        out[..., at:at + (hi - lo) * group].reshape(s, nb, (hi - lo) // width, group, width)[:] = _side_by_side(
            blocks[..., lo:hi], width)
        at += (hi - lo) * group
    return out


def _q3_k_triples(blocks: np.ndarray) -> np.ndarray:
    """(s, nb, group, 110) Q3_K blocks -> (s, nb, 8, 3, group) words: each row's 3-bit values u (the bit pair from qs,
    the hmask bit as bit 2: ggml's q + 4) in 8 triples of words, triple p the values 32p.. (sub-blocks 2p, 2p + 1),
    so that the kernel takes most by one and. Byte t of words a, e, c holds, of values 4v + t of sub-block 2p (u0) and
    2p + 1 (u1): a at bits 0-2 u0 of v = 0, at 3-5 u1 of v = 0, at 6-7 u0 of v = 3's bit pair; e the same of v = 1
    and u1 of v = 3's bit pair; c of v = 2, at bit 6 u0 of v = 3's third bit, at bit 7 u1's. The same 96 bytes a row
    as hmask and qs. Computed a word (4 values, t = 0..3) at a time: no field leaves its byte."""
    s, nb, group = blocks.shape[:3]
    words = np.ascontiguousarray(blocks[..., :96]).view(np.uint32)  # hmask's 8 words, then qs's 16
    hm, qs = words[..., :8], words[..., 8:]
    # value 32p + 16h + 4v + t: qs word 8 (p // 4) + 4h + v's bit pair p % 4 and hmask word 4h + v's bit p, byte t
    pairs = (qs.reshape(s, nb, group, 2, 1, 8) >> (2 * np.arange(4, dtype=np.uint32))[:, None]) & np.uint32(0x03030303)
    third = (hm.reshape(s, nb, group, 1, 8) >> np.arange(8, dtype=np.uint32)[:, None]) & np.uint32(0x01010101)
    u = (pairs.reshape(s, nb, group, 8, 8) | third << 2).reshape(s, nb, group, 8, 2, 4)  # (.., p, h, v)
    lo, hi = u[..., 0, :], u[..., 1, :]
    two, bit2 = np.uint32(0x03030303), np.uint32(0x04040404)  # each byte's bit pair, its bit 2 (masked before the
    # shift: a word's shift moves bits across bytes)
    out = np.stack([lo[..., 0] | hi[..., 0] << 3 | (lo[..., 3] & two) << 6,
                    lo[..., 1] | hi[..., 1] << 3 | (hi[..., 3] & two) << 6,
                    lo[..., 2] | hi[..., 2] << 3 | (lo[..., 3] & bit2) << 4 | (hi[..., 3] & bit2) << 5], 4)
    return out.transpose(0, 1, 3, 4, 2)  # (s, nb, p, word, group)


def _q6_k_triples(blocks: np.ndarray) -> np.ndarray:
    """(s, nb, group, 210) Q6_K blocks -> (s, nb, 16, 3, group) words: each row's 6-bit values u (ql's nibble, qh's bit
    pair as bits 4-5: ggml's q + 32) in 16 triples of words, triple j the values 16j.. (sub-block j), so that the
    kernel takes 3 of a sub-block's 4 vectors by one and each. Byte t of words a, e, c holds u of value 16j + 4v + t
    at bits 0-5, a of v = 0, e of v = 1, c of v = 2; u of v = 3 in their bits 6-7: a its bits 0-1, e 2-3, c 4-5. The
    same 192 bytes a row as ql and qh. Computed a word (4 values, t = 0..3) at a time: no field leaves its byte."""
    s, nb, group = blocks.shape[:3]
    words = np.ascontiguousarray(blocks[..., :192]).view(np.uint32)  # ql's 32 words, then qh's 16
    ql, qh = words[..., :32].reshape(s, nb, group, 2, 1, 2, 8), words[..., 32:].reshape(s, nb, group, 2, 1, 8)
    # value 128h + 32i + 4c + t: ql word 16h + 8 (i % 2) + c's nibble i // 2 and qh word 8h + c's bit pair i, byte t
    nibble = (ql >> (4 * np.arange(2, dtype=np.uint32))[:, None, None]) & np.uint32(0x0F0F0F0F)  # (.., h, i//2, i%2, c)
    pair = (qh >> (2 * np.arange(4, dtype=np.uint32))[:, None]) & np.uint32(0x03030303)  # (.., h, i, c)
    u = (nibble.reshape(s, nb, group, 2, 4, 8) | pair << 4).reshape(s, nb, group, 16, 4)  # (.., sub-block j, v)
    two = np.uint32(0x03030303)  # each byte's bit pair (masked before the shift: a word's shift moves bits
    # across bytes)
    out = np.stack([u[..., v] | (u[..., 3] >> 2 * v & two) << 6 for v in range(3)], 4)  # (.., j, word)
    return out.transpose(0, 1, 3, 4, 2)  # (s, nb, j, word, group)


# each K-quant whose values lie in triples of words: its words (`_k_blocks`)
TRIPLES = {"Q3_K": _q3_k_triples, "Q6_K": _q6_k_triples}
