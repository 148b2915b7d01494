"""The C products' speed, one thread, outside tinygrad: G weights/s of builds of the same kernel side by side.

    python -m bench.kernel_speed [--types Q4_K,Q6_K] [--shapes 1536x512,5632x2048] [--batch 1,8] [--rounds 15]
                                 [--variant LABEL=FILE[,FILE...]] [--dram] [--int8] [--base REV]

Each build of a (type, shape) is compiled here with tinygrad's clang flags into a shared library whose loop calls
the matmul kernel ``reps`` times on one thread (core 0 of 1), so no Python lies between calls. Builds are timed in
turn, round after round, and the median of the rounds is reported (this VM's speed swings between phases; only
builds measured side by side compare). The default builds are ``generic`` (the type's generic C alone) and
``native`` (its row of the type table: this CPU's SIMD files); ``--variant`` adds a build from other files (relative
to ``cpu/c/`` or absolute: e.g. a trial copy of an x86 file); ``--int8`` adds the integer path (``matmul_int.c``,
its products checked against the first build's within the int8 rounding only), and for the types that group
``int8g``, its rows interleaved as a stage holds them (`gguf.tensors.grouped`). ``CC`` picks the compiler (the AVX2
wrapper: ../shared/tools/clang-no-avx512). ``--dram`` adds one shape per type bigger than the L3
(32000x2048) and prints GB/s of the weights' bytes too. ``--base REV`` adds the native and integer builds made from
git revision REV's ``cpu/c/`` (``native@REV``, ``int8@REV``): a kernel change against its base in one run. Weights
are random bytes with finite scales, as the tests'.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from pp_worker.worker.cpu import kernels
from pp_worker.worker.gguf.tensors import grouped
from pp_worker.worker.gguf.types import TYPES

BY_NAME = {t.name: t for t in TYPES.values() if t.kernel}
LOOP = """
void bench_loop(float* out, const unsigned char* w, const float* x, const int* dims, int reps) {
  for (int i = 0; i < reps; i++) NAME(out, w, x, dims, 0);
}
"""
# the integer path: x quantized (quantize.c, its own unit) then the product, each rep, as a stage runs them; x's
# quantized rows in a static buffer of XQ_BYTES (less than 2 bytes a value: `main` refuses a batch past it)
XQ_BYTES = 64 << 20
LOOP_INT8 = f"""
void kern(float*, const unsigned char*, const unsigned char*, const int*, int);
void kern_q(unsigned char*, const float*, const int*, int);
static unsigned char xq[{XQ_BYTES}];
void bench_loop(float* out, const unsigned char* w, const float* x, const int* dims, int reps) {{
  int q[2] = {{dims[1], 1}};
  for (int i = 0; i < reps; i++) {{ kern_q(xq, x, q, 0); kern(out, w, xq, dims, 0); }}
}}
"""
# F16's matrix product (matmul.c's gemm, where the vendor asks for it): x arranged as panels (panels.c, its own unit)
# then the product, each rep, for the calls that take it (dims[3], `kernels.gemm_rows`) in a build with AVX-512
XP_FLOATS = 16 << 20
LOOP_PANELS = f"""
void kern(float*, const unsigned char*, const float*, const int*, int);
void kern_p(float*, const float*, const int*, int);
static float xp[{XP_FLOATS}] __attribute__((aligned(64)));
#ifdef __AVX512F__
enum {{ GEMM_BUILT = 1 }};
#else
enum {{ GEMM_BUILT = 0 }};
#endif
void bench_loop(float* out, const unsigned char* w, const float* x, const int* dims, int reps) {{
  int p[2] = {{dims[1], 1}}, d[4] = {{dims[0], dims[1], dims[2], GEMM_BUILT && dims[3]}};
  for (int i = 0; i < reps; i++) {{ if (d[3]) kern_p(xp, x, p, 0); kern(out, w, d[3] ? xp : x, d, 0); }}
}}
"""
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def build(files: list[str], k: int, type_name: str, workdir: Path, int8: bool = False,
          c_dir: Path | None = None, group: int = 0) -> ctypes.CDLL:
    """A shared library of the matmul kernel over ``files`` (the type's C files) for rows of ``k`` values; ``int8``:
    the integer path's kernel, with x's quantization ahead of it (a revision before ``quantize.c``: inside it);
    ``c_dir``: the C sources from there instead of the package's; ``group``: the kernel for rows interleaved at load
    (`gguf.tensors.grouped`)."""
    t = BY_NAME[type_name]
    c_dir = c_dir or kernels.C_DIR
    defines = {"NAME": "kern", "PP_K": k, "PP_ROWS": max(kernels.ROWS, group), "BLOCK_VALUES": t.kernel_block,
               "BLOCK_BYTES": t.row_bytes(t.kernel_block), **({"PP_INT": 1} if int8 else {}),
               **({"PP_GROUP": group} if group else {}), **kernels.vendor_choices(t.id, group, int8)}
    parts = ["common.h", "q8.h", *files, "matmul_int.c"] if int8 else ["common.h", *files, "matmul.c"]
    units = [kernels.unit(defines, parts, c_dir)]
    if int8 and (c_dir / "quantize.c").exists():
        units.append(kernels.quantize_source(t.kernel_block, k, "kern_q", c_dir))
        units.append(LOOP_INT8)
    elif "PP_F16_GEMM_FROM" in defines and (c_dir / "panels.c").exists():
        units.append(kernels.unit({"NAME": "kern_p", "PP_K": k}, ["common.h", "panels.c"], c_dir))
        units.append(LOOP_PANELS)
    else:
        units[0] += LOOP
    so = workdir / f"{abs(hash(tuple(units)))}.so"
    if not so.exists():
        flags = ["-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", "-nostdlib", "-Wno-psabi", "-march=native"]
        objects = []
        for i, src in enumerate(units):
            obj = so.with_suffix(f".{i}.o")
            subprocess.run([os.environ.get("CC", "clang"), "-c", "-x", "c", *flags, "-", "-o", str(obj)],
                           input=src.encode(), check=True)
            objects.append(str(obj))
        subprocess.run([os.environ.get("CC", "clang"), "-shared", "-nostdlib", *objects, "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))


def base_sources(rev: str, workdir: Path) -> Path:
    """The kernels' C folder as it was at git revision ``rev``, unpacked under ``workdir``."""
    rel = kernels.C_DIR.resolve().relative_to(Path(__file__).resolve().parents[1])
    tar = subprocess.run(["git", "archive", rev, str(rel)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=tar, check=True)
    return workdir / rel


def base_groups(base_dir: Path, stem: str) -> bool:
    """Whether the C sources at ``base_dir`` read a type's rows in groups: Q4_0 since ``matmul_groups.h``, another type
    where its generic file, or a header of generic/ it includes, defines the groups' parameters (GROUP_OFF, GROUP_K,
    GROUP_LEVELS)."""
    generic = (base_dir / f"generic/{stem}.c").read_text()
    for name in re.findall(r'#include "([^"/]+)"', generic):
        if (base_dir / "generic" / name).exists():
            generic += (base_dir / "generic" / name).read_text()
    return (base_dir / "matmul_groups.h").exists() and (stem == "q4_0" or "#define GROUP_" in generic)


def weights(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8: random bytes, the fp16 fields finite (F16: normal values)."""
    t = BY_NAME[type_name]
    if t.name == "F16":
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    qk, bb = t.kernel_block, t.row_bytes(t.kernel_block)
    raw = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
    for off in FP16_FIELDS[t.name]:
        raw[:, :, off:off + 2] = rng.uniform(0.001, 0.05, (n, k // qk)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def measure(libs: dict[str, ctypes.CDLL], w: np.ndarray, n: int, k: int, b: int, rounds: int,
            ws: dict[str, np.ndarray] | None = None) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(median seconds per call of each library, its best round's, median of its per-round speed over the first
    library's). ``ws``: a library's own weights (the same rows in its layout), else ``w``. The libraries are timed
    in turn, ~2 ms each, the order reversed every other round; a ratio taken within one round compares runs a few ms
    apart, which this VM's phases (other tenants on the cores) rarely split."""
    x = np.random.default_rng(1).standard_normal((b, k)).astype(np.float32)
    out = np.zeros((b, n), np.float32)
    dims = np.array([n, b, 1, kernels.gemm_rows(b)], np.int32)  # the fourth: F16's x as panels (LOOP_PANELS)
    ws = ws or {}
    args = {name: [a.ctypes.data_as(ctypes.c_void_p) for a in (out, ws.get(name, w), x, dims)] for name in libs}
    outs = {}
    for name, lib in libs.items():  # warm up, and keep each build's products to compare
        lib.bench_loop(*args[name], 1)
        outs[name] = out.copy()
    t0 = time.perf_counter()
    first_name = next(iter(libs))
    libs[first_name].bench_loop(*args[first_name], 3)
    reps = max(1, int(0.002 / ((time.perf_counter() - t0) / 3)))
    times: dict[str, list[float]] = {name: [] for name in libs}
    names = list(libs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            libs[name].bench_loop(*args[name], reps)
            times[name].append((time.perf_counter() - t0) / reps)
    ref = outs[names[0]]
    for name, o in outs.items():  # a build that computes something else is no faster build
        err = np.abs(o - ref).max() / max(np.abs(ref).max(), 1e-30)
        if err > (0.05 if name.startswith("int8") else 1e-5):
            print(f"  !! {name} differs from the first build by {err:.2e} of the largest output")
    first = times[names[0]]
    return ({name: statistics.median(ts) for name, ts in times.items()}, {name: min(ts) for name, ts in times.items()},
            {name: statistics.median(f / t for f, t in zip(first, ts, strict=True)) for name, ts in times.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_1,Q5_0,Q4_K,Q5_K,Q6_K,IQ4_XS")
    ap.add_argument("--shapes", default="1536x512,5632x2048")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=61)
    ap.add_argument("--variant", action="append", default=[], help="LABEL=FILE[,FILE...] (files after generic/)")
    ap.add_argument("--no-native", action="store_true", help="leave out the table's build")
    ap.add_argument("--dram", action="store_true", help="also 32000x2048, bigger than the L3")
    ap.add_argument("--int8", action="store_true", help="add the integer path's build (int8)")
    ap.add_argument("--no-generic", action="store_true", help="leave out the generic build")
    ap.add_argument("--base", metavar="REV", help="add the builds from git revision REV's C sources")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    batches = [int(v) for v in a.batch.split(",")]
    if a.int8 and (worst := max(batches) * max(k for _, k in shapes) * 2) > XQ_BYTES:
        ap.error(f"--batch {max(batches)} at K {max(k for _, k in shapes)}: x's quantized rows need up to {worst} "
                 f"bytes, past the loop's buffer of {XQ_BYTES}")
    if (worst := -(-max(batches) // 32) * 32 * max(k for _, k in shapes)) > XP_FLOATS:
        ap.error(f"--batch {max(batches)} at K {max(k for _, k in shapes)}: F16's panels of x need up to {worst} "
                 f"floats, past the loop's buffer of {XP_FLOATS}")
    workdir = Path(tempfile.mkdtemp(prefix="kernel_speed_"))
    rng = np.random.default_rng(0)
    base_dir = base_sources(a.base, workdir) if a.base else None
    print(f"G weights/s (and GB/s of weights for the DRAM shape), medians of {a.rounds} rounds, one thread; "
          "(median of the per-round speed ratios to the first build, best round's G/s)")
    for type_name in a.types.split(","):
        t = BY_NAME[type_name]
        generic = f"generic/{t.kernel}.c"
        builds = {} if a.no_generic else {"generic": [generic]}
        if not a.no_native:
            builds["native"] = kernels.type_files(t)
        if a.int8 and t.int8:
            builds["int8"] = kernels.type_files(t)
        group = kernels.GROUP_ROWS if a.int8 and t.grouped else 0  # its rows interleaved, as a stage's (where it pays)
        for v in a.variant:
            label, files = v.split("=", 1)
            builds[label] = [generic, *files.split(",")]
        for n, k in shapes + ([(32000, 2048)] if a.dram else []):
            w = weights(type_name, n, k, rng)
            libs = {name: build(files, k, type_name, workdir, name == "int8") for name, files in builds.items()}
            ws = {}
            if group:
                ws["int8g"] = w.copy()
                grouped(ws["int8g"], group, t.id)
                libs["int8g"] = build(kernels.type_files(t), k, type_name, workdir, True, group=group)
                if base_dir is not None and base_groups(base_dir, t.kernel):
                    libs[f"int8g@{a.base}"] = build(kernels.type_files(t), k, type_name, workdir, True, base_dir, group)
                    ws[f"int8g@{a.base}"] = ws["int8g"]
            for name in ("native", "int8") if base_dir is not None else ():
                if name in builds:
                    libs[f"{name}@{a.base}"] = build(kernels.type_files(t), k, type_name, workdir, name == "int8",
                                                     base_dir)
            for b in batches if (n, k) != (32000, 2048) else [1]:
                med, best, ratio = measure(libs, w, n, k, b, a.rounds, ws)
                dram = (n, k) == (32000, 2048)
                cells = [f"{name} {n * k / s / 1e9:6.2f}" + (f" {w.nbytes / s / 1e9:5.1f} GB/s" if dram else "")
                         + f" ({ratio[name]:4.2f}x, best {n * k / best[name] / 1e9:5.2f})" for name, s in med.items()]
                print(f"{type_name:7} {n:>5}x{k:<5} B={b}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
