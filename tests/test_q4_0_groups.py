"""Q4_0's products on the integer path over rows interleaved at load in groups of 16 (`gguf.tensors.grouped`,
``c/matmul_groups.h``): the layout's bytes, the kernel against the numpy model of ggml's scheme (testing/ggml_int8.py)
in this CPU's build, AVX2's, the baseline x86-64's and aarch64's (under qemu), every row of a chunk the same floats
as alone, and a stage holding its products' Q4_0 matrices so (the embedding's rows plain) with logits near the
scheme."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cpu_kernels import AVX512, random_rows
from test_int8 import _plain_x86_64
from test_int8_model import assert_near_ggmls_scheme
from tinygrad import Tensor

from pp_worker.testing import cross, ggml_int8
from pp_worker.testing.chain import Chain
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf import tensors
from pp_worker.worker.gguf.tensors import PackedWeight

Q4_0, G = 2, cpu_kernels.GROUP_ROWS
N = 37  # two whole groups and 5 plain rows after them


@pytest.fixture(autouse=True)
def int8_path(monkeypatch):
    monkeypatch.delenv("PP_EXACT", raising=False)


def grouped(raw: np.ndarray) -> np.ndarray:
    out = raw.copy()
    tensors.grouped(out, G)
    return out


def test_the_layout_interleaves_whole_groups_and_keeps_the_rest():
    """Block j of group g: the 16 rows' d, then chunk c's 4 bytes of row r, each low nibble value 8c + t of the row's
    block and high nibble value 8c + 4 + t; the rows past the last group unchanged."""
    k = 96
    raw, _ = random_rows(Q4_0, N, k, seed=3)
    got = grouped(raw)
    nb = k // 32
    flat = got[:2 * G].reshape(-1)
    for g in range(2):
        for j in range(nb):
            at = (g * nb + j) * G * 18
            for r in range(G):
                block = raw[g * G + r, 18 * j:18 * (j + 1)]
                values = [block[2 + v % 16] >> (4 * (v // 16)) & 15 for v in range(32)]
                assert bytes(flat[at + 2 * r:at + 2 * r + 2]) == bytes(block[:2])
                for c in range(4):
                    for t in range(4):
                        byte = flat[at + 32 + 64 * c + 4 * r + t]
                        assert (byte & 15, byte >> 4) == (values[8 * c + t], values[8 * c + 4 + t])
    np.testing.assert_array_equal(got[2 * G:], raw[2 * G:])


def products(raw: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    return cpu_kernels.matmul(Tensor(x), Tensor(grouped(raw)), Q4_0, raw.shape[0], k, G).numpy()


def check(n: int, k: int, b: int) -> None:
    raw, w = random_rows(Q4_0, n, k, seed=7)
    x = np.random.default_rng(8).standard_normal((b, k)).astype(np.float32)
    x[:, :32] *= 20  # one block with a large value: its scale differs from the others'
    scheme, exact = ggml_int8.product(x, w, 32), x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(exact).max()
    assert np.abs(scheme - exact).max() > 1e-4 * scale  # the int8 rounding: 1e-5 tells the schemes apart
    np.testing.assert_allclose(products(raw, x, k), scheme, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("n, k, b", [(N, 288, 1), (16, 32, 2), (48, 512, 11), (N, 2048, 3)])
def test_grouped_products_are_ggmls_scheme(n, k, b):
    check(n, k, b)


def test_grouped_rows_take_the_grouped_kernel_whatever_pp_exact_says_later(monkeypatch):
    """The layout is chosen at load (`group_rows`); a product of grouped rows reads them as groups even when the
    float path is asked for afterwards (its kernel would read them as plain rows)."""
    monkeypatch.setenv("PP_EXACT", "1")
    check(N, 288, 3)


def test_every_row_of_a_chunk_is_the_same_row_alone():
    """A chunk of 128 rows of x (x in blocks of up to 32, passes of 8 against a group), 37 weight rows (two groups
    and plain rows): ggml's scheme, and each row the same floats as in a chunk of 1, 7, 8, 9 or 33 rows and alone."""
    n, k = N, 512
    check(n, k, 128)
    raw, _ = random_rows(Q4_0, n, k, seed=7)
    x = np.random.default_rng(9).standard_normal((128, k)).astype(np.float32)
    chunk = products(raw, x, k)
    for b in (1, 7, 8, 9, 33):
        assert np.array_equal(products(raw, x[:b], k), chunk[:b])
    for i in (3, 8, 31, 32, 127):
        assert np.array_equal(products(raw, x[i:i + 1], k)[0], chunk[i]), i


def test_the_generic_build_reads_the_groups(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "type_files", lambda t: [f"generic/{t.kernel}.c"])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: _plain_x86_64())
    cpu_kernels._binary.cache_clear()
    try:
        check(N, 512, 3)
    finally:
        cpu_kernels._binary.cache_clear()


@pytest.mark.skipif(not AVX512, reason="this CPU has no AVX-512: its native build is AVX2's")
def test_avx2s_build_reads_the_groups(monkeypatch):
    from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

    native = cpu_kernels._compiler("CPU")
    portable = ClangJITCompiler([native.arch, "native", "-avx512f", "-avx512vnni", "-avxvnni"])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: portable)
    cpu_kernels._binary.cache_clear()
    try:
        check(N, 512, 35)
    finally:
        cpu_kernels._binary.cache_clear()


@pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                    reason="these builds cross from a Linux x86-64 machine (and run aarch64 under qemu)")
@pytest.mark.parametrize("target", ["aarch64", "x86-64"])
def test_other_cpus_builds_read_the_groups(tmp_path, target):
    """The grouped kernel built for aarch64 (run under qemu) and the baseline x86-64 by `testing.cross`, in 3 parts
    (a part starts at a group): one row of x and 35 (a block of 32, then 3), against ggml's scheme."""
    k, b = 288, 35
    name = cross.pair(Q4_0, k)
    defines = {"PP_K": k, "PP_ROWS": G, "BLOCK_VALUES": 32, "BLOCK_BYTES": 18}
    units = {f"{name}_mm": cpu_kernels.source("matmul", Q4_0, k, f"{name}_mm", G),
             f"{name}_gather": cpu_kernels.unit({"NAME": f"{name}_gather", **defines},
                                                ["common.h", *cpu_kernels.type_files(cpu_kernels.TYPES[Q4_0]),
                                                 "gather.c"]),
             f"{name}_q": cpu_kernels.quantize_source(32, k, f"{name}_q")}
    t = cross.TARGETS[target]
    objects = cross.compile_units(units, t, tmp_path / "obj")
    program = cross.kernels_program([(Q4_0, k)], list(objects.values()), t, tmp_path / "bin")
    raw, w = random_rows(Q4_0, N, k, seed=11)
    x = np.random.default_rng(12).standard_normal((b, k)).astype(np.float32)
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    cross.write_input(tmp_path / "in", name, grouped(raw), x, np.array([0], np.int32), 3)
    cross.run(program, t, str(tmp_path / "in"), str(tmp_path / "out"))
    one, many, _ = cross.read_output(tmp_path / "out", name, N, b, k)  # (the gather read the groups as rows: unused)
    scheme = ggml_int8.product(x, w, 32)
    scale = np.abs(x.astype(np.float64) @ w.T.astype(np.float64)).max()
    np.testing.assert_allclose(many, scheme, rtol=0, atol=1e-5 * scale)
    np.testing.assert_array_equal(many[0], one)


def test_which_weights_are_grouped(monkeypatch):
    """Q4_0 on the integer path on x86-64 (where it measured faster); its float path (PP_EXACT=1), other types and
    aarch64 (not timed on a real core) keep plain rows."""
    import platform

    assert cpu_kernels.group_rows(Q4_0) == (G if platform.machine() == "x86_64" else 0)
    assert cpu_kernels.group_rows(8) == cpu_kernels.group_rows(6) == 0  # Q8_0, Q5_0
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_kernels.group_rows(Q4_0) == 0
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert cpu_kernels.group_rows(Q4_0) == G
    monkeypatch.setenv("PP_EXACT", "1")
    assert cpu_kernels.group_rows(Q4_0) == 0


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 assembly")
def test_avx512s_grouped_kernel_broadcasts_x_into_vpdpbusd(tmp_path):
    """With AVX-512 VNNI a block's step is `vpdpbusd` on 512 bits with x's 4 bytes broadcast from memory ({1to16}),
    the 16 rows' d converted at once (`vcvtph2ps`, or `vcvtph2psx` with AVX512-FP16), and no byte operation
    emulated (tests/test_int8_arches.py's list; the plain rows past the groups take their sign mask)."""
    from test_int8_arches import EMULATED, sign_mask

    out = tmp_path / "g.s"
    cross.clang("-S", "-x", "c", *cross.TARGETS["avx512"].kernel_flags(), "-", "-o", str(out),
                source=cpu_kernels.source("matmul", Q4_0, 2048, "g", G))
    lines = [line.split("#")[0].split() for line in out.read_text().splitlines() if line.startswith("\t")]
    ops = {op[0] for op in lines if op and not sign_mask(op)}
    assert any(op[0] == "vpdpbusd" and "{1to16}" in " ".join(op) and op[-1].startswith("%zmm") for op in lines if op)
    assert any(op[0].startswith("vcvtph2ps") and op[-1].startswith("%zmm") for op in lines if op)
    assert not ops & set(EMULATED), ops & set(EMULATED)


@pytest.fixture(scope="module")
def q4_0_model(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("groups") / "kq-Q4_0.gguf", "kq", seed=3, dtype="Q4_0")


def test_a_q4_0_stage_holds_its_products_grouped_and_computes_ggmls_scheme(q4_0_model):
    """Every product's Q4_0 matrix of a stage is held in groups on x86-64 (q, k and v stacked, the head too), the
    embedding's rows plain (its gather reads rows), and the logits of a prefill and steps lie near ggml's scheme
    (test_int8_model's bound; rows past the last group: the kernel tests' 37 rows)."""
    chain = Chain(q4_0_model, 2, 64, prefill_chunk=8)
    first, last = (e._w for e in chain.engines)
    layers = [m for w in (first, last) for blk in w.blocks for m in vars(blk).values()]
    weights = [m.weight for m in layers if isinstance(getattr(m, "weight", None), PackedWeight)]
    want = cpu_kernels.group_rows(Q4_0)  # G on x86-64 (`test_which_weights_are_grouped`)
    assert len(weights) >= 6 * 2 and all(w.group == want for w in weights)  # q k v (stacked), o, gate up, down
    assert last.output.weight.group == want
    assert first.token_embd.weight.group == 0
    assert_near_ggmls_scheme(q4_0_model, RefModel, vocab=500)
