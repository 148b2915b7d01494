"""The integer path's matmuls built for other CPUs than this one (`testing.cross`, as tests/test_kernel_arches.py):
aarch64 (the generic integer dot products, NEON files included) under qemu-user, an AVX2 CPU (vpmaddubsw), a baseline
x86-64 one (generic, no F16C) and this CPU's build (VNNI where it has it), each against the numpy model of ggml's
scheme (testing/ggml_int8.py) on the same inputs: the same int8 blocks and integer sums, floats combined in
another order. One row of x (the one-row call) and B rows (in tiles, then the rest)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cpu_kernels import random_rows

from pp_worker.testing import cross, ggml_int8
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf.types import TYPES as TABLE
from pp_worker.worker.gguf.types import type_name

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                                reason="these builds cross from a Linux x86-64 machine (and run aarch64 under qemu)")
INT8 = sorted(t.id for t in TABLE.values() if t.int8)
N, B, T = 37, 35, 3  # rows of W, rows of x (a block of 32 in tiles, then 3 more), parts
IDS = np.array([7, 0], np.int32)
KERNELS = [(t, 2 * TABLE[t].kernel_block if TABLE[t].kernel_block > 32 else 9 * 32) for t in INT8]
AVX2 = "avx2" in open("/proc/cpuinfo").read()


def inputs(folder: Path) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """Each kernel's input file in ``folder``; returns ggml's scheme's x @ W^T and float64's, per (type, K)."""
    want = {}
    for t, k in KERNELS:
        raw, w = random_rows(t, N, k, seed=k + t)
        x = np.random.default_rng(k + 1).standard_normal((B, k)).astype(np.float32)
        cross.write_input(folder, cross.pair(t, k), raw, x, IDS, T)
        want[t, k] = (ggml_int8.product(x, w, TABLE[t].kernel_block), x.astype(np.float64) @ w.T.astype(np.float64))
    return want


def build_and_run(target: str, folder: Path, tmp: Path) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """Every int8 matmul built for ``target`` (with tinygrad's files for it) and run: per (type, K), x's first row's
    products (N,) and all B rows' (B, N)."""
    t = cross.TARGETS[target]
    units = cross.kernel_units(KERNELS, cpu_kernels.type_files, int8=True)
    objects = cross.compile_units(units, t, tmp / "obj")
    program = cross.kernels_program(KERNELS, list(objects.values()), t, tmp / "bin")
    (tmp / "out").mkdir()
    cross.run(program, t, str(folder), str(tmp / "out"))
    return {(g, k): cross.read_output(tmp / "out", cross.pair(g, k), N, B, k)[:2] for g, k in KERNELS}


TARGETS = ["native", "aarch64", "x86-64", *(["avx2"] if AVX2 else [])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("int8_arches")
    folder = tmp / "in"
    folder.mkdir()
    want = inputs(folder)
    with ThreadPoolExecutor(2) as pool:
        done = {target: pool.submit(build_and_run, target, folder, tmp / target) for target in TARGETS}
        return want, {target: d.result() for target, d in done.items()}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("ggml_type", INT8, ids=type_name)
def test_every_arch_builds_integer_path_is_ggmls_scheme(runs, target, ggml_type):
    want, results = runs
    k = dict(KERNELS)[ggml_type]
    scheme, exact = want[ggml_type, k]
    one, many = results[target][ggml_type, k]
    scale = np.abs(exact).max()
    assert np.abs(scheme - exact).max() > 1e-4 * scale  # int8 rounding: 1e-5 tells the schemes apart
    np.testing.assert_allclose(one, scheme[0], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(many, scheme, rtol=0, atol=1e-5 * scale)
    np.testing.assert_array_equal(many[0], one)  # several rows at once (weights unpacked once for all): the same floats


SIGNED = [t for t in INT8 if TABLE[t].name in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS")]  # IQ_SIGNED 1: w's sign
MIN_TYPES = ("Q4_1", "Q5_1")  # a min per block: their product is c/matmul_min.h's
# instructions clang writes where it emulates a byte operation x86 lacks: u8 shifts (a multiply and a pack), the sign
# of one byte vector put on another (compares and masks), 32-bit lanes narrowed to bytes (packs)
EMULATED = ("vpmullw", "vpackuswb", "vpackusdw", "vpcmpgtb", "vpmovb2m")


def sign_mask(op: list[str]) -> bool:
    """AVX-512 has no 512-bit vpsignb: there the sign trick is w's sign bits as a mask (vpmovb2m from a zmm) and x
    negated under it."""
    return op[0] == "vpmovb2m" and op[1].startswith("%zmm")


@pytest.mark.parametrize("target", ["avx2", "avx512"])
def test_integer_products_use_the_byte_instructions(tmp_path, target):
    """The integer matmuls' assembly for an AVX2 CPU and an AVX-512 one: the signed types' sign trick is vpabsb and
    vpsignb (or, on 512-bit vectors, vpabsb and a sign mask), no byte work is emulated (each emulation cost 1.2-1.6x
    a kernel's time, bench/NOTES.md), and on AVX-512 the products are 512 bits wide (but Q4_1's and Q5_1's, a block
    a 256-bit step: c/matmul_min.h)."""
    t = cross.TARGETS[target]
    units = {n: s for n, s in cross.kernel_units(KERNELS, cpu_kernels.type_files, int8=True).items()
             if n.endswith("_mm")}
    for name, source in units.items():
        out = tmp_path / f"{name}.s"
        cross.clang("-S", "-x", "c", *t.kernel_flags(), "-", "-o", str(out), source=source)
        lines = [line.split() for line in out.read_text().splitlines() if line.startswith("\t") and line.split()]
        masks = any(sign_mask(op) for op in lines)
        ops = {op[0] for op in lines if not sign_mask(op)}
        assert not ops & set(EMULATED), (name, sorted(ops & set(EMULATED)))
        if any(name.startswith(cross.pair(g, k)) for g, k in KERNELS if g in SIGNED):
            assert "vpabsb" in ops and ("vpsignb" in ops or masks), name
        ggml_type = next(g for g, k in KERNELS if name.startswith(cross.pair(g, k)))
        if target == "avx512" and TABLE[ggml_type].name not in MIN_TYPES:  # two groups (256-value blocks) or two
            # blocks (32-value) a step, in 512 bits
            block = TABLE[ggml_type].kernel_block
            wide = "vpmaddubsw" if block == 256 else "vpdpbusd"
            assert any(op[0] == wide and "%zmm" in op[-1] for op in lines), name


BROADCAST_UNPACKED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]  # x86/pairs512.h's one-row step


def avx512_ops(names: list[str], tmp: Path) -> dict[str, set[tuple[str, bool]]]:
    """The instructions of the integer matmuls of the types ``names`` built for an AVX-512 CPU: per kernel, each
    (mnemonic, whether its destination is a ymm register)."""
    t = cross.TARGETS["avx512"]
    pairs = [cross.pair(g, k) for g, k in KERNELS if TABLE[g].name in names]
    units = {n: s for n, s in cross.kernel_units(KERNELS, cpu_kernels.type_files, int8=True).items()
             if n.endswith("_mm") and any(n.startswith(p) for p in pairs)}
    assert len(units) == len(names)
    ops = {}
    for name, source in units.items():
        out = tmp / f"{name}.s"
        cross.clang("-S", "-x", "c", *t.kernel_flags(), "-", "-o", str(out), source=source)
        lines = [line.split("#")[0].split() for line in out.read_text().splitlines() if line.startswith("\t")]
        ops[name] = {(op[0], "%ymm" in op[-1]) for op in lines if op}
    return ops


def test_avx512s_one_row_step_unpacks_a_block_without_a_shuffle(tmp_path):
    """With AVX-512 (BW, VL) and VNNI, the 32-value block types' one-row products read a block's nibbles into both
    128-bit lanes at once and shift the second down a nibble (vbroadcasti128, vpsrlvw on 256 bits), its d into 8
    lanes (vpbroadcastw): about half the instructions of the generic unpacking and a scale a block (bench/NOTES.md)."""
    for name, ops in avx512_ops(BROADCAST_UNPACKED, tmp_path).items():
        assert {("vbroadcasti128", True), ("vpsrlvw", True), ("vpbroadcastw", False)} <= ops, name


@pytest.mark.parametrize("name", ["IQ4_XS", "IQ4_NL"])
def test_avx512s_iq4_step_takes_the_sign_from_the_index(tmp_path, name):
    """IQ4's one-row step looks |level| up and negates x where the index is below 8 (vptestnmb): one instruction fewer
    a step than the levels' abs and their sign bits taken apart (IQ4_XS's vpmovb2m), one multiply fewer a block than
    the levels + 128 and x's sums times 128 (IQ4_NL's second vpdpbusd)."""
    (ops,) = avx512_ops([name], tmp_path).values()
    assert ("vptestnmb", False) in ops
