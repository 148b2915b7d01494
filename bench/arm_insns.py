"""Instructions the aarch64 kernels execute per weight value, with their NEON files and with the generic C alone:
counted under qemu-user, one instruction per translation block (``-singlestep -d exec``: a log line per instruction,
named by its function). qemu's speed says nothing about a real core's; instruction counts are what it can tell.
Not a cycle count: a real core runs 2-4 SIMD instructions a cycle, and bigger rows are bound by memory.

    .venv/bin/python -m bench.arm_insns [CPU]    # ~10 s; CPU: clang's -mcpu, generic by default
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from pp_worker.testing import cross
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf.types import TYPES

KERNELS = [(1, 2048), (8, 2048), (12, 2048)]  # F16, Q8_0, Q4_K
N, B = 16, 4  # rows of W, rows of x in the several-rows product
BUILDS: dict[str, cross.Files] = {"generic": lambda t: [f"generic/{t.kernel}.c"], "neon": cpu_kernels.type_files}


def counts(target: cross.Target, files: cross.Files, tmp: Path) -> dict[tuple[int, int], list[int]]:
    """Per kernel pair: instructions of the one-row product, the product of B rows, and the gather of one row."""
    objects = cross.compile_units(cross.kernel_units(KERNELS, files), target, tmp / "obj")
    program = cross.kernels_program(KERNELS, sorted(set(objects.values())), target, tmp)
    rng = np.random.default_rng(0)
    for t, k in KERNELS:  # any bytes: the instructions do not depend on the values
        raw = rng.integers(0, 256, (N, TYPES[t].row_bytes(k)), dtype=np.uint8)
        cross.write_input(tmp, cross.pair(t, k), raw, rng.standard_normal((B, k)), np.array([1]), 1)
    log = tmp / "exec.log"
    cross.run(program, target, str(tmp), str(tmp), qemu_args=("-singlestep", "-d", "exec,nochain", "-D", str(log)),
              timeout=600)
    runs: list[tuple[str, int]] = []  # (function, instructions) for each run of lines in one function
    with open(log, errors="replace") as f:
        for line in f:
            name = line.rsplit(" ", 1)[-1].strip()
            if runs and runs[-1][0] == name:
                runs[-1] = (name, runs[-1][1] + 1)
            else:
                runs.append((name, 1))
    out: dict[tuple[int, int], list[int]] = {}
    for name, n in runs:  # each kernel's calls in order: the one-row product, the product of B rows, the gather
        for t, k in KERNELS:
            if name in (f"{cross.pair(t, k)}_mm", f"{cross.pair(t, k)}_gather"):
                out.setdefault((t, k), []).append(n)
    return out


def main(cpu: str = "generic") -> None:
    """``cpu``: clang's -mcpu (tinygrad's native pick on a real machine: neoverse-n1, neoverse-v1, ...)."""
    target = cross.Target(("arm64", cpu), "aarch64-linux-gnu", "qemu-aarch64-static")
    with tempfile.TemporaryDirectory() as tmp:
        got = {b: counts(target, files, Path(tmp) / b) for b, files in BUILDS.items()}
    print(f"instructions per weight value, aarch64 (-mcpu={cpu}), K={KERNELS[0][1]}, {N} rows; B={B} for 'rows'")
    print(f"{'type':6} {'path':8} {'generic':>8} {'neon':>8} {'ratio':>6}")
    for t, k in KERNELS:
        for i, (path, values) in enumerate((("one row", N * k), ("rows", N * k), ("gather", k))):
            g, n = got["generic"][t, k][i] / values, got["neon"][t, k][i] / values
            print(f"{TYPES[t].name:6} {path:8} {g:8.3f} {n:8.3f} {g / n:6.2f}x")


if __name__ == "__main__":
    main(*sys.argv[1:])
