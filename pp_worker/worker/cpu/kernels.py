"""Hand-written C kernels for products with GGUF weights on the CPU, run through tinygrad's own program path.

A weight stays as the file's bytes: one uint8 buffer of N rows, each row K / QK blocks of the GGML type (F16 rows
are K fp16 values). A kernel decodes R rows at a time into float32 vectors in registers or L1 and multiplies them
with B input rows: decode (B = 1), batched decode (B sessions), and prefill chunks (B tokens) share one kernel.

The C lives in ``c/`` as ggml-cpu lays it out: ``common.h`` (vector types and helpers), ``generic/<type>.c`` (each
type's portable decoder, by the formulas of ggml's ``dequantize_row_*``; the tests check every type against the `gguf`
package's numpy dequantizer), ``x86/<type>.c`` and ``arm/<type>.c`` (faster decoders and one-row products, each under
the instruction sets it needs), and the kernels (``matmul.c``, ``gather.c``, ``attention.c``). Which files a type
has is its row of the type table (`gguf.types`). A kernel's source is those files put together (`unit`), its
includes inlined, so tinygrad's compile cache, keyed by the source, sees every byte of it.

Two numerics (`numerics`): by default the products with Q8_0 and K-quant weights take the integer path
(``c/q8.h``, ``c/matmul_int.c``: x quantized to int8 blocks as ggml's CPU backend does, summed in integers);
``PP_EXACT=1`` keeps every product on the float path above (docs/internals.md).

Why C: tinygrad's CPU codegen sums each output row serially and re-derives the dequantization per element; these
kernels keep 16-wide accumulators over contiguous rows (bench/NOTES.md has the measurements). They run as ordinary
tinygrad programs: an ``Ops.PROGRAM`` whose source tinygrad compiles with its own clang compiler (and caches),
launched by its CPU runtime on ``threads`` threads (``core_id`` splits the rows), captured by TinyJit like any kernel.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
from pathlib import Path
from typing import Any

import numpy as np
from tinygrad import Context, Device, Tensor, UOp, dtypes
from tinygrad.helpers import CPU_COUNT
from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo

from pp_worker.worker.gguf.types import SIMD_DIRS, TYPES, GGMLType, has_int8, has_kernel
from pp_worker.worker.hostio import filled

C_DIR = Path(__file__).parent / "c"
PART_BYTES, PARTS_PER_THREAD = 128 << 10, 8  # `matmul_parts`: a part's weight bytes, at most per thread
QUANT_ROWS = 16  # rows of x per thread of `quantized` at least (a row of 2048 values: ~1 us)
SILU_PART = 16384  # activations per thread of `silu_mul` at least: a decode call's (~6k) is one thread's ~1 us
ROWS = 4  # weight rows decoded per step: each input vector loaded once serves ROWS products
_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.M)


@functools.cache
def _file(path: Path) -> str:
    return path.read_text()


def _inlined(path: Path, seen: set[Path]) -> str:
    """``path``'s text with its ``#include "name"`` lines (relative to its folder) replaced by those files, each
    file once per unit."""
    if path in seen:
        return ""
    seen.add(path)
    return _INCLUDE.sub(lambda m: _inlined((path.parent / m.group(1)).resolve(), seen), _file(path))


def unit(defines: dict[str, Any], files: list[str], c_dir: Path = C_DIR) -> str:
    """One translation unit: ``#define``s, then ``files`` (relative to ``c_dir``) with their includes inlined, then
    ``tail.h`` (helpers defined after the kernel: tinygrad calls a program at its first byte)."""
    seen: set[Path] = set()
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + "".join(_inlined((c_dir / f).resolve(), seen) for f in [*files, "tail.h"])


def type_files(t: GGMLType) -> list[str]:
    """A type's C files: its generic decoder, then one file per arch folder that has SIMD code for it."""
    assert t.kernel is not None, t
    return [f"generic/{t.kernel}.c", *sorted({f"{SIMD_DIRS[s]}/{t.kernel}.c" for s in t.simd})]


def numerics() -> str:
    """Which products the matmul kernels compute: "int8" (x quantized to int8 blocks and summed in integers, as
    ggml's CPU backend does; the default, see docs/internals.md) or "float" (``PP_EXACT=1``: every weight decoded to
    float32, the path the float64-reference tests hold exact). Read from the environment at each kernel's build, so
    the worker's settings (validated by `cli`) and a test's apply alike."""
    return "float" if os.environ.get("PP_EXACT", "").strip() == "1" else "int8"


INT8_EVERY_TYPE = False  # True: every type with integer code takes it (the tests of that code), not only the defaults


def uses_int8(kind: str, ggml_type: int) -> bool:
    """Whether a ``kind`` kernel of ``ggml_type`` runs the integer path now (`numerics`; only products have one):
    the types whose row says ``int8_default`` (where it measured faster than the float path here, bench/NOTES.md: as
    of Q4_1's and Q5_1's own product, every type with integer code), or with `INT8_EVERY_TYPE` every type with
    integer code."""
    if kind != "matmul" or not has_int8(ggml_type) or numerics() != "int8":
        return False
    return INT8_EVERY_TYPE or TYPES[ggml_type].int8_default


def source(kind: str, ggml_type: int, k: int, name: str, group: int = 0) -> str:
    """C source of kernel ``name``, ``kind`` "matmul" or "gather", for rows of ``k`` values of ``ggml_type``: a
    matmul on the integer path where `uses_int8` (``matmul_int.c``), else the float one. ``group``: the weight's rows
    interleaved at load (`gguf.tensors.grouped`; a matmul on the integer path whatever `numerics` says now: the
    layout was chosen for it at load)."""
    t = TYPES[ggml_type]
    qk = t.kernel_block
    defines: dict[str, Any] = {"NAME": name, "PP_K": k, "PP_ROWS": max(ROWS, group), "BLOCK_VALUES": qk,
                               "BLOCK_BYTES": t.row_bytes(qk)}
    if group:
        defines["PP_GROUP"] = group
    int8 = bool(group) or uses_int8(kind, ggml_type)
    if kind == "matmul":
        defines |= vendor_choices(ggml_type, group, int8)
    if int8:
        return unit({**defines, "PP_INT": 1}, ["common.h", "q8.h", *type_files(t), "matmul_int.c"])
    return unit(defines, ["common.h", *type_files(t), f"{kind}.c"])


GROUP_ROWS = 16  # rows interleaved per group at load (``c/matmul_groups.h``: a row per int32 lane of 512 bits)
# Choices measured on an Intel Xeon against Zen 4 (bench/NOTES.md, "Prefill on an Intel Xeon", "F16 as a matrix
# product on Intel's cores"), made by the CPU's vendor:
# - F16's float tile without AVX-512 decodes its rows a chunk at a time from F16_DECODE_FROM rows of x: Intel's cores
#   issue the fp16 conversion (vcvtph2ps) on the ports of their multiply-adds, one every 3 of the tile's, and there
#   decoded rows ran 1.1-1.4x faster at 12-64 rows of x (0.56-0.98x at 2-8); on Zen 4 the conversions take no FMA
#   slot and the rows read as they are ran 1.2-1.5x faster.
# - every grouped product asks for its blocks GROUP_AHEAD bytes ahead (in a block of x's first pass over a group):
#   on Intel's cores one thread from DRAM read 1.09-1.14x faster so (the hardware's prefetch did not keep a group's
#   stream ahead; cache-hot 0.88-0.94x), and a stage's decode bytes/s against F16's rose Q4_1 0.92-0.95 -> 1.09,
#   IQ4_NL 0.92-0.99 -> 1.03-1.07, Q2_K 0.94 -> 1.0; on Zen 4 asking ahead cost the grouped types it was tried on
#   3-45%.
# - F16's AVX-512 product from F16_GEMM_FROM rows of x is a matrix product over x in panels (`f16_panels`): no
#   conversion in its loop, where the tile converts a weight vector every 4 multiply-adds on the multiply-adds' ports
#   (one thread 1.03-1.4x at 32-256 rows); on Zen 4 the tile already ran at ~88% of its peak.
F16_DECODE_FROM = 12
F16_GEMM_FROM = 32
GROUP_AHEAD = 16384


@functools.cache
def intel() -> bool:
    """Whether this CPU is Intel's (/proc/cpuinfo's vendor)."""
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def vendor_choices(ggml_type: int, group: int, int8: bool) -> dict[str, int]:
    """The defines of a matmul of ``ggml_type`` (rows in groups of ``group``, on the integer path or not) that the
    CPU's vendor chooses (above): PP_GROUP_AHEAD, PP_F16_DECODE_FROM and PP_F16_GEMM_FROM, or none."""
    if not intel():
        return {}
    if group:
        return {"PP_GROUP_AHEAD": GROUP_AHEAD}
    if not int8 and TYPES[ggml_type].name == "F16":
        return {"PP_F16_DECODE_FROM": F16_DECODE_FROM, "PP_F16_GEMM_FROM": F16_GEMM_FROM}
    return {}


@functools.cache
def avx512_vnni() -> bool:
    """Whether this CPU has AVX-512 BW and VNNI (its kernels are built for the CPU they run on: ``-march=native``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512bw" in flags and "avx512_vnni" in flags


def group_rows(ggml_type: int) -> int:
    """How many rows a product's weight of ``ggml_type`` interleaves at load (`gguf.tensors.grouped`), 0 for none: a
    type on the integer path (`uses_int8`) on an x86-64 CPU its row's ``grouped`` names, where the grouped kernel
    measured faster than the plain one (bench/NOTES.md): the 32-value types on AVX-512 VNNI and on AVX2 (1.4-7x: a
    block's 16 row sums in one vector, scaled at once, its values unpacked once per 2-8 rows of x); Q4_K there too
    (AVX2: 1.75-2x at 64 rows of x, its pairs summed in 16 bits); Q2_K, Q3_K, Q6_K and IQ4_XS (256-value blocks) with
    AVX-512 VNNI only (1.2-3x, from DRAM and at 64 rows of x; with AVX2 0.6-0.85x in prefill). Every build reads the
    groups (the tests run aarch64's under qemu), but aarch64's generic C ran ~1.1x the plain kernel's instructions
    there (Q4_0), and no aarch64 core was at hand to time: it keeps the plain rows. Only a product's matrix
    (`weights.Linear`): the embedding's gather reads plain rows."""
    t = TYPES[ggml_type]
    if not t.grouped or not uses_int8("matmul", ggml_type) or platform.machine().lower() not in ("x86_64", "amd64"):
        return 0
    return GROUP_ROWS if "avx2" in t.grouped or avx512_vnni() else 0


def supported(ggml_type: int, k: int) -> bool:
    """Whether rows of ``k`` values of ``ggml_type`` have a kernel here (whole blocks)."""
    return has_kernel(ggml_type, k)


@functools.cache
def _compiler(device: str) -> ClangJITCompiler:
    """tinygrad's clang compiler for ``device``'s CPU (whatever renderer the device uses for its own kernels)."""
    return ClangJITCompiler(Device[device].arch.split(","))


@functools.cache
def _binary(src: str, device: str) -> bytes:
    """The machine code of ``src``, compiled once per process (and cached on disk by tinygrad)."""
    return _compiler(device).compile_cached(src)


_DIMS: dict[tuple[str, tuple[int, ...]], Tensor] = {}


def dims(device: str, *values: int) -> Tensor:
    """The realized int32 ``dims`` argument of a kernel call, made once per shape. Written through the buffer
    (`hostio.filled`), not realized: the first call of a shape may come while a TinyJit captures, which would record
    a realize."""
    if (t := _DIMS.get((device, values))) is None:
        def fill(mv: memoryview) -> None:
            np.frombuffer(mv, np.int32)[:] = values

        t = _DIMS[device, values] = filled((len(values),), dtypes.int32, fill, device)
    return t


def dims_values(buf: Any) -> tuple[int, ...] | None:
    """The values of a `dims` argument, given its buffer (None for any other buffer): what `jitcache` writes down."""
    return next((values for (_, values), t in _DIMS.items() if t.uop.base.buffer is buf), None)


def _buffer(x: UOp) -> UOp:
    """What a kernel gets for argument ``x``: another kernel's output (AFTER), reshaped or not, as it is (a reshape
    of a contiguous buffer is the same bytes; a copy of it was a kernel of its own: 3-6 us a block of a decode
    call); anything else made contiguous."""
    base = x
    while base.op is Ops.RESHAPE:
        base = base.src[0]
    return base if base.op is Ops.AFTER else x.contiguous()


def launch(name: str, src: str, tensors: tuple[Tensor, ...], shape: tuple[int, ...], threads: int,
           bound: tuple[UOp, ...] = ()) -> Tensor:
    """The first of ``tensors`` (the output) after C function ``name`` of ``src`` ran on (*tensors, dims) on
    ``threads`` threads. The function's parameters: the tensors' buffers, the int32 ``dims`` holding ``shape``,
    ``int core_id`` (0..threads-1), then one int per variable of ``bound`` (bound variables: positions)."""
    device = tensors[0].device
    variables = tuple(b.unbind()[0] if b.op is Ops.BIND else b for b in bound)
    # the first call of a kernel or shape may come while tinygrad traces a block (`function`, which forbids device
    # use to catch stray realizes): compiling our source and realizing a constant of our own are safe there
    with Context(ALLOW_DEVICE_USAGE=1):
        lib = _binary(src, device)
        dims_t = dims(device, *shape)
    n = len(tensors) + 1

    def fxn(*params: UOp) -> UOp:
        core = UOp.variable("core_id", 0, threads - 1, dtypes.int)
        sink = UOp.sink(*params, core, *variables, arg=KernelInfo(name=name))
        info = ProgramInfo(name=name, global_size=(threads, 1, 1), local_size=None, vars=(core, *variables),
                           globals=tuple(range(n)), outs=(0,), ins=tuple(range(1, n)))
        return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.DEVICE, arg=device), UOp(Ops.LINEAR, src=(*sink.src, sink)),
                                     UOp(Ops.SOURCE, arg=src), UOp(Ops.BINARY, arg=lib)), arg=info)
    # Tensor.custom_kernel's call, with the variables' bindings as arguments of the call too: what tells the schedule
    # their values when nothing else in it uses them
    srcs = tuple(_buffer(x) for x in (*(t.uop for t in tensors), dims_t.uop))
    call = fxn(*(UOp.placeholder_like(x, slot=i) for i, x in enumerate(srcs))).call(*srcs, *bound)
    return Tensor(srcs[0].after(call))


def _call(kind: str, out: Tensor, w: Tensor, x: Tensor, ggml_type: int, k: int, shape: tuple[int, ...],
          threads: int, group: int = 0) -> Tensor:
    """``out`` after the ``kind`` kernel ("matmul" or "gather") ran on (out, w, x, dims); ``group``: w's rows
    interleaved (`gguf.tensors.grouped`)."""
    name = kernel_name(kind, ggml_type, k, group)
    return launch(name, source(kind, ggml_type, k, name, group), (out, w, x), shape, threads)


def kernel_name(kind: str, ggml_type: int, k: int, group: int = 0) -> str:
    """The C function name of the ``kind`` kernel ("matmul" or "gather") of ``ggml_type`` for rows of ``k`` values."""
    op = "gather" if kind == "gather" else f"mm8g{group}" if group else "mm8" if uses_int8(kind, ggml_type) else "mm"
    return f"{TYPES[ggml_type].name.lower()}_{op}_{k}"


def matmul_parts(ggml_type: int, n: int, k: int) -> int:
    """The parts a product of an (n, k) weight splits into: F16's and the integer path's (whose x is quantized once,
    ahead: `quantized`), which prepare nothing per part, in parts of `PART_BYTES` (up to `PARTS_PER_THREAD` a
    thread: tinygrad's own runtime, which runs a JIT's first call, starts a thread per part). The threads claim
    parts in turn, so whichever is ahead takes more: a 2-stage decode of the 1.1B shape as F16 1.05-1.16x; the
    integer path's 0.99-1.02x, and 1.0-1.06x in prefill (bench/NOTES.md). The float path's other types prepare x
    per part: one part a thread."""
    t, threads = TYPES[ggml_type], CPU_COUNT.value
    if t.name != "F16" and not uses_int8("matmul", ggml_type):
        return threads
    return max(threads, min(PARTS_PER_THREAD * threads, n * t.row_bytes(k) // PART_BYTES))


def x_row_bytes(block: int, k: int) -> int:
    """Bytes of a row of k values of x on the integer path, in blocks of ``block`` values (``c/q8.h``'s XB each: int8
    values, 16-bit sums of 16, a float d; a 256-value block padded to 320)."""
    return k // block * (320 if block == 256 else block + block // 8 + 4)


def quantize_source(block: int, k: int, name: str, c_dir: Path = C_DIR) -> str:
    """C source of kernel ``name``: rows of k values of x quantized for the integer path (``c/quantize.c``)."""
    return unit({"NAME": name, "PP_K": k, "BLOCK_VALUES": block}, ["common.h", "q8.h", "quantize.c"], c_dir)


def quantized(x: Tensor, block: int, k: int) -> Tensor:
    """x (B, k) float32 -> its int8 blocks for the integer path's products (B, `x_row_bytes`) uint8,
    as ggml quantizes (``c/quantize.c``): once per product, so its parts share them. Split over the threads by
    rows where there are enough of them to pay for their meeting (a prefill chunk; a decode call runs on one)."""
    b = x.shape[0]
    parts = max(1, min(CPU_COUNT.value, b // QUANT_ROWS))
    out = Tensor.empty(b, x_row_bytes(block, k), dtype=dtypes.uint8, device=x.device)
    name = f"q8_{block}_{k}"
    return launch(name, quantize_source(block, k, name), (out, x), (b, parts), parts)


def gemm_rows(b: int) -> bool:
    """Whether a call of ``b`` rows of x is one F16's matrix product takes (`f16_panels`): from F16_GEMM_FROM rows;
    below 64 only where the last panel of 32 is more than half full (a panel's tile of 16 rows ran no faster than
    the other tile: 40 and 48 rows 0.9-1.15x)."""
    return b >= F16_GEMM_FROM and (b >= 2 * F16_GEMM_FROM or not 0 < b % 32 <= 16)


GEMM_MARK = b"pp-f16-gemm"  # in the machine code of an F16 kernel built with the matrix product (matmul.c)


def f16_panels(ggml_type: int, b: int, k: int, device: str) -> bool:
    """Whether a product of ``b`` rows of x takes x as panels (``c/panels.c``) and runs as matmul.c's matrix product
    (`gemm`): F16 on the float path where the CPU's vendor asks for it (`vendor_choices`), for `gemm_rows`, and where
    the kernel the call runs has it (built with AVX-512: the AVX2 build of it ran at 0.55-0.75x of the tile there).
    That kernel's own machine code answers (GEMM_MARK; compiled once, as the call would): /proc/cpuinfo cannot say
    what a test's or the AVX2 bench's compiler built, nor can a probe of its own (tinygrad's disk cache keys a
    source's machine code without the compiler, so a probe and a kernel could come from two compilers)."""
    if TYPES[ggml_type].name != "F16" or uses_int8("matmul", ggml_type) or not gemm_rows(b):
        return False
    if "PP_F16_GEMM_FROM" not in vendor_choices(ggml_type, 0, False):
        return False
    name = kernel_name("matmul", ggml_type, k)
    with Context(ALLOW_DEVICE_USAGE=1):  # asked while tinygrad traces a block, as `launch`'s compiles are
        return GEMM_MARK in _binary(source("matmul", ggml_type, k, name), device)


def panels(x: Tensor, k: int) -> Tensor:
    """x (B, k) float32 -> its panels for F16's matrix product (``c/panels.c``), (ceil(B / 32) * 32, k) float32: once
    per product whatever its parts, split over the threads by panels where there are enough of them."""
    b = x.shape[0]
    p = (b + 31) // 32
    parts = max(1, min(CPU_COUNT.value, p))
    out = Tensor.empty(p * 32, k, dtype=dtypes.float32, device=x.device)
    name = f"f16_panels_{k}"
    return launch(name, unit({"NAME": name, "PP_K": k}, ["common.h", "panels.c"]), (out, x), (b, parts), parts)


def matmul(x: Tensor, raw: Tensor, ggml_type: int, n: int, k: int, group: int = 0,
           shared: dict[tuple[int, int], Tensor] | None = None) -> Tensor:
    """``x`` (..., k) @ W^T -> (..., n) float32, W the (n, k) weight held as ``raw``: its GGUF bytes, (n, row_bytes),
    rows interleaved in groups of ``group`` where `gguf.tensors.grouped` did so. ``shared``: x's int8 blocks (by
    (block, k)) or panels (by (0, k)) made for other products of the same x, to take and add to
    (`weights.products`)."""
    lead = x.shape[:-1]
    b = math.prod(lead)
    threads = max(1, min(matmul_parts(ggml_type, n, k), n // ROWS))
    out = Tensor.empty(b, n, dtype=dtypes.float32, device=x.device)
    xs = x.reshape(b, k).cast(dtypes.float32)
    shape: tuple[int, ...] = (n, b, threads)
    shared = {} if shared is None else shared
    if group or uses_int8("matmul", ggml_type):
        key = (TYPES[ggml_type].kernel_block, k)
        if key not in shared:
            shared[key] = quantized(xs, *key)
        xs = shared[key]
    elif TYPES[ggml_type].name == "F16":  # F16's kernels take a fourth dim: whether x comes as panels
        shape = (n, b, threads, int(f16_panels(ggml_type, b, k, x.device)))
        if shape[3]:
            if (0, k) not in shared:
                shared[0, k] = panels(xs, k)
            xs = shared[0, k]
    return _call("matmul", out, raw, xs, ggml_type, k, shape, threads, group).reshape(*lead, n)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) * u, float32, as one C kernel (``c/silu_mul.c``): a feed-forward's activation in 16-wide vectors,
    split over the threads where it is big enough to pay for their meeting (a prefill chunk; a decode call runs it
    on one). The last dimension a multiple of 16 (`silu_mul_fits`)."""
    n = math.prod(g.shape)
    parts = max(1, min(CPU_COUNT.value, n // SILU_PART))
    out = Tensor.empty(*g.shape, dtype=dtypes.float32, device=g.device)
    ins = tuple(t if t.dtype == dtypes.float32 else t.cast(dtypes.float32) for t in (g, u))  # the products' as they are
    return launch("silu_mul", unit({"NAME": "silu_mul"}, ["common.h", "silu_mul.c"]), (out, *ins), (n, parts), parts)


def silu_mul_fits(width: int) -> bool:
    """Whether `silu_mul` takes activations of this width (whole 16-float vectors)."""
    return width % 16 == 0


def gather(idx: Tensor, raw: Tensor, ggml_type: int, n: int, k: int) -> Tensor:
    """Rows ``idx`` (...) of the (n, k) weight held as ``raw``, decoded: (..., k) float32."""
    lead = idx.shape
    t = math.prod(lead)
    out = Tensor.empty(t, k, dtype=dtypes.float32, device=idx.device)
    ids = idx.reshape(t).cast(dtypes.int32).contiguous()
    return _call("gather", out, raw, ids, ggml_type, k, (n, t), 1).reshape(*lead, k)
