"""The CPU's C kernels and table runner built for CPUs other than this one: compiled by clang with tinygrad's flags
for a named target, linked with a small C program of the tests (``testing/c/``), and run natively or under qemu-user.

tinygrad compiles each kernel with ``clang --target=<arch>-none-unknown-elf -O2 -fPIC -ffreestanding
-fno-math-errno`` plus its arch's flags (`ClangJITCompiler`: ``-march=<cpu>`` on x86-64, ``-ffixed-x18 -mcpu=<cpu>``
on arm64); the objects here are compiled the same way, so they are the code tinygrad runs (for a Linux triple clang
would call libgcc for aarch64's atomics, which tinygrad's loader could not link), and linked into a Linux program.
The aarch64 programs are static and run under Debian's ``qemu-aarch64-static``; ``make install`` puts it and the
arm64 cross C library in place.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinygrad.runtime.autogen import libc
from tinygrad.runtime.support.elf import elf_loader, jit_loader

from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf.types import TYPES, GGMLType

C_DIR = Path(__file__).parent / "c"
KERNEL_FLAGS = ("-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", "-Wno-psabi")  # tinygrad's (compile_to_obj)


@dataclass(frozen=True)
class Target:
    """A CPU to build for: tinygrad's arch string for it (arch, cpu), the target triple of its programs, and the
    emulator that runs them here (None: this CPU runs them)."""

    arch: tuple[str, str]
    triple: str
    qemu: str | None = None

    def kernel_flags(self) -> list[str]:
        from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

        return [f"--target={self.arch[0]}-none-unknown-elf", *KERNEL_FLAGS, *ClangJITCompiler(list(self.arch)).args]

    def program_flags(self) -> list[str]:
        return [f"--target={self.triple}", "-O2", "-pthread", *(["-static"] if self.qemu else [])]


TARGETS = {
    "native": Target(("x86_64", "native"), "x86_64-linux-gnu"),  # this CPU
    "avx512": Target(("x86_64", "sapphirerapids"), "x86_64-linux-gnu"),
    "cascadelake": Target(("x86_64", "cascadelake"), "x86_64-linux-gnu"),  # AVX-512 VNNI without GFNI
    "skylake": Target(("x86_64", "skylake-avx512"), "x86_64-linux-gnu"),  # AVX-512 (F, BW, VL, DQ) without VNNI
    "avx2": Target(("x86_64", "haswell"), "x86_64-linux-gnu"),  # AVX2, FMA, F16C
    "x86-64": Target(("x86_64", "x86-64"), "x86_64-linux-gnu"),  # the baseline: SSE2
    "aarch64": Target(("arm64", "generic"), "aarch64-linux-gnu", "qemu-aarch64-static"),  # armv8-a (NEON)
}


def jobs() -> int:
    return len(os.sched_getaffinity(0))


def compile_units(units: dict[str, str], target: Target, out: Path) -> dict[str, Path]:
    """Object files of the C sources ``units`` (name -> source) for ``target``, compiled in parallel into ``out``;
    identical sources compiled once. Raises BuildError when one fails to compile, or when tinygrad's loader could not
    load it (a call into a runtime library, which it does not link; a relocation it does not know)."""
    out.mkdir(parents=True, exist_ok=True)
    digests = {name: hashlib.sha256(src.encode()).hexdigest()[:16] for name, src in units.items()}
    sources = {digests[name]: src for name, src in units.items()}

    def build(digest: str) -> None:
        clang("-c", "-x", "c", *target.kernel_flags(), "-", "-o", str(out / f"{digest}.o"), source=sources[digest])
        name = next(n for n, d in digests.items() if d == digest)
        obj = (out / f"{digest}.o").read_bytes()
        try:
            jit_loader(obj)
        except (RuntimeError, NotImplementedError) as e:
            raise BuildError(f"{name} for {target.arch}: tinygrad's loader: {e}") from e
        if (first := entry(obj)) != (kernel := kernel_function(obj)):
            raise BuildError(f"{name} for {target.arch}: tinygrad would call {first}, not the kernel {kernel}")

    with ThreadPoolExecutor(jobs()) as pool:
        list(pool.map(build, sources))
    return {name: out / f"{digests[name]}.o" for name in units}


def _functions(obj: bytes) -> list[tuple[int, str, int]]:
    """(offset in the image tinygrad's loader makes, name, binding) of each function an object file defines."""
    _, sections, _ = elf_loader(obj)  # lays the sections out as tinygrad does: their sh_addr is the image offset
    symtab = next(sh for sh in sections if sh.header.sh_type == libc.SHT_SYMTAB)
    names = sections[symtab.header.sh_link].content
    syms = (libc.Elf64_Sym * (symtab.header.sh_size // symtab.header.sh_entsize)).from_buffer_copy(symtab.content)
    return [(sections[s.st_shndx].header.sh_addr + s.st_value, names[s.st_name:names.index(b"\0", s.st_name)].decode(),
             s.st_info >> 4) for s in syms if s.st_info & 0xF == libc.STT_FUNC and 0 < s.st_shndx < len(sections)]


def entry(obj: bytes) -> str:
    """The function tinygrad runs of this object: the one at the start of its image (tinygrad calls a program at its
    first byte)."""
    return next(name for offset, name, _ in _functions(obj) if offset == 0)


def kernel_function(obj: bytes) -> str:
    """The unit's one strong global function: its kernel (or the runner's entry point)."""
    (name,) = [name for _, name, bind in _functions(obj) if bind == libc.STB_GLOBAL]
    return name


def link(main: str, objects: list[Path], target: Target, out: Path, include: Path | None = None) -> Path:
    """The program of ``testing/c/<main>`` and ``objects`` for ``target`` (``include``: a folder of generated
    headers it includes)."""
    clang(*target.program_flags(), *([f"-I{include}"] if include else []), str(C_DIR / main), *map(str, objects),
          "-o", str(out))
    return out


class BuildError(Exception):
    """clang failed: its messages."""


def clang(*args: str, source: str = "") -> None:
    done = subprocess.run(["clang", *args], input=source.encode(), capture_output=True)
    if done.returncode:
        raise BuildError(f"clang {' '.join(args)}:\n{done.stderr.decode()}")


def pair(ggml_type: int, k: int) -> str:
    """The name of a type's kernel pair for rows of ``k`` values: functions <name>_mm and <name>_gather."""
    return f"{TYPES[ggml_type].kernel}_{k}"


Files = Callable[[GGMLType], list[str]]  # a type's C files in a build: cpu.kernels.type_files, or the generic alone


def kernel_units(kernels: list[tuple[int, int]], files: Files, int8: bool = False) -> dict[str, str]:
    """The matmul and gather sources of each (type, K) in ``kernels``, of the type's C files that ``files`` picks
    (`cpu.kernels.type_files`: what tinygrad builds; or the generic file alone); ``int8``: the matmuls of the types
    that have one on the integer path (``matmul_int.c``), with x's quantization ahead of them (``<pair>_q``,
    ``quantize.c``)."""
    out = {}
    for ggml_type, k in kernels:
        t = TYPES[ggml_type]
        defines = {"PP_K": k, "PP_ROWS": cpu_kernels.ROWS, "BLOCK_VALUES": t.kernel_block,
                   "BLOCK_BYTES": t.row_bytes(t.kernel_block)}
        for kind, suffix in (("matmul", "mm"), ("gather", "gather")):
            name = f"{pair(ggml_type, k)}_{suffix}"
            if int8 and kind == "matmul" and t.int8:
                parts = ["common.h", "q8.h", *files(t), "matmul_int.c"]
                out[name] = cpu_kernels.unit({"NAME": name, **defines, "PP_INT": 1}, parts)
                q = f"{pair(ggml_type, k)}_q"
                out[q] = cpu_kernels.quantize_source(t.kernel_block, k, q)
            else:
                out[name] = cpu_kernels.unit({"NAME": name, **defines}, ["common.h", *files(t), f"{kind}.c"])
    return out


def kernels_program(kernels: list[tuple[int, int]], objects: list[Path], target: Target, out: Path) -> Path:
    """``testing/c/kernels_main.c`` linked with ``objects``, which hold the kernel pairs of ``kernels`` (type, K),
    in folder ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(f" X({pair(t, k)}, {k}, {TYPES[t].row_bytes(k)}, "
                    f"{cpu_kernels.x_row_bytes(TYPES[t].kernel_block, k)})" for t, k in kernels)
    (out / "kernels.h").write_text(f"#define KERNELS(X){lines}\n")
    return link("kernels_main.c", objects, target, out / "kernels", out)


def write_input(folder: Path, name: str, raw: np.ndarray, x: np.ndarray, ids: np.ndarray, parts: int) -> None:
    """kernels_main.c's input for kernel pair ``name``: weight rows ``raw`` (N, row bytes) uint8, ``x`` (B, K) float32,
    ``ids`` int32 rows to gather, each product in ``parts`` parts."""
    head = np.array([raw.shape[0], x.shape[0], parts, len(ids)], np.int32)
    (folder / f"{name}.in").write_bytes(head.tobytes() + raw.tobytes() + x.astype(np.float32).tobytes() +
                                        ids.astype(np.int32).tobytes())


def read_output(folder: Path, name: str, n: int, b: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kernels_main.c's output for kernel pair ``name``: x's first row times W^T (N,), x W^T (B, N), the gathered
    rows (ids, K)."""
    got = np.fromfile(folder / f"{name}.out", np.float32)
    return got[:n], got[n:n + b * n].reshape(b, n), got[n + b * n:].reshape(-1, k)


def calls_program(names: list[str], objects: list[Path], target: Target, out: Path) -> Path:
    """``testing/c/call_main.c`` linked with ``objects``, which define the kernels ``names``, in folder ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "calls.h").write_text(f"#define CALLS(X){''.join(f' X({n})' for n in names)}\n")
    return link("call_main.c", objects, target, out / "calls", out)


def write_call(folder: Path, name: str, buffers: list[np.ndarray], scalars: list[int], threads: int) -> None:
    """call_main.c's input for kernel ``name``: called with ``buffers``' addresses (the first: its output), its
    core_id, then ``scalars``, for core_id 0 .. ``threads`` - 1."""
    head = np.array([len(buffers), len(scalars), threads], np.int32).tobytes()
    bufs = b"".join(np.int64(b.nbytes).tobytes() + np.ascontiguousarray(b).tobytes() for b in buffers)
    (folder / f"{name}.in").write_bytes(head + bufs + np.array(scalars, np.int64).tobytes())


def read_call(folder: Path, name: str, dtype: type = np.float32) -> np.ndarray:
    """call_main.c's output for kernel ``name``: its first buffer after the calls."""
    return np.fromfile(folder / f"{name}.out", dtype)


def run(program: Path, target: Target, *args: str, timeout: float = 120, qemu_args: tuple[str, ...] = ()) -> str:
    """``program``'s stdout, run with ``args`` (under qemu where the target needs it, with ``qemu_args``); raises on
    a failure."""
    cmd = [*([target.qemu, *qemu_args] if target.qemu else []), str(program), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout
