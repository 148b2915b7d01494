"""The products of Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q6_K and IQ4_XS on the integer path over rows
interleaved at load in groups of 16 (`gguf.tensors.grouped`, ``c/matmul_groups.h``): the layout's bytes, the kernel
against the numpy model of ggml's scheme (testing/ggml_int8.py) in this CPU's build, AVX2's, the baseline x86-64's and
aarch64's (under qemu), every row of a chunk the same floats as alone, and a stage holding its products' matrices so
(the embedding's rows plain) with logits near the scheme."""

from __future__ import annotations

import collections
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_cpu_kernels import AVX512, random_rows
from test_int8 import _avx2, _plain_x86_64, avx2_build  # noqa: F401 (a fixture)
from test_int8_model import assert_near_ggmls_scheme
from tinygrad import Tensor

from pp_worker.testing import cross, ggml_int8
from pp_worker.testing.chain import Chain
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf import tensors
from pp_worker.worker.gguf.tensors import PackedWeight

Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 10, 11, 12, 14, 20, 23
G = cpu_kernels.GROUP_ROWS
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", IQ4_NL: "IQ4_NL", Q2_K: "Q2_K", Q3_K: "Q3_K",
         Q4_K: "Q4_K", Q6_K: "Q6_K", IQ4_XS: "IQ4_XS"}
K_TYPES = (Q2_K, Q3_K, Q6_K, IQ4_XS)  # grouped with AVX-512 VNNI only (Q4_K with AVX2 too)
GROUPED = pytest.mark.parametrize("ggml_type", list(NAMES), ids=list(NAMES.values()))
N = 37  # two whole groups and 5 plain rows after them
CASCADE = AVX512 and "avx512_vnni" in open("/proc/cpuinfo").read().split()
SKYLAKE = AVX512 and {"avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= set(open("/proc/cpuinfo").read().split())


@pytest.fixture(autouse=True)
def int8_path(monkeypatch):
    monkeypatch.delenv("PP_EXACT", raising=False)


def grouped(raw: np.ndarray, ggml_type: int = Q4_0) -> np.ndarray:
    out = raw.copy()
    tensors.grouped(out, G, ggml_type)
    return out


def width(k: int, ggml_type: int) -> int:
    """k rounded up to whole blocks of ``ggml_type`` (Q2_K's 256 values)."""
    block = cpu_kernels.TYPES[ggml_type].kernel_block
    return -(-k // block) * block


# a nibble type's fields before its runs of 16 bytes of nibbles (32 values each), their widths
NIBBLE_HEADS = {Q4_0: (2,), Q4_1: (2, 2), Q5_0: (2, 4), Q5_1: (2, 2, 4), IQ4_NL: (2,),  # d; m; qh
                IQ4_XS: (2, 2, 4)}  # d, scales_h, scales_l


@pytest.mark.parametrize("ggml_type", list(NIBBLE_HEADS), ids=[NAMES[t] for t in NIBBLE_HEADS])
def test_the_layout_interleaves_whole_groups_and_keeps_the_rest(ggml_type):
    """Block j of group g: each field before the nibbles as the 16 rows' side by side (Q5_0's and Q5_1's qh as each
    row's fifth bits in a 32-bit word whose byte t's bit k is value 8 (k // 2) + 4 (k % 2) + t's), then for each run
    of 32 values chunk c's 4 bytes of row r, each low nibble value 8c + t of the run and high nibble value 8c + 4 + t;
    the rows past the last group unchanged."""
    t_ = cpu_kernels.TYPES[ggml_type]
    k, size, head = width(96, ggml_type), t_.nbytes, sum(NIBBLE_HEADS[ggml_type])
    raw, _ = random_rows(ggml_type, N, k, seed=3)
    got = grouped(raw, ggml_type)
    nb = k // t_.block
    flat = got[:2 * G].reshape(-1)
    for g in range(2):
        for j in range(nb):
            at = (g * nb + j) * G * size
            for r in range(G):
                block = raw[g * G + r, size * j:size * (j + 1)]
                field = 0
                for w in NIBBLE_HEADS[ggml_type]:
                    mine = bytes(flat[at + G * field + w * r:at + G * field + w * (r + 1)])
                    if ggml_type in (Q5_0, Q5_1) and w == 4:
                        fifth = int.from_bytes(bytes(block[field:field + 4]), "little")
                        word = int.from_bytes(mine, "little")
                        for t in range(4):
                            for bit in range(8):
                                v = 8 * (bit // 2) + 4 * (bit % 2) + t
                                assert word >> (8 * t + bit) & 1 == fifth >> v & 1, (t, bit)
                    else:
                        assert mine == bytes(block[field:field + w])
                    field += w
                for run in range((size - head) // 16):
                    values = [block[head + 16 * run + v % 16] >> (4 * (v // 16)) & 15 for v in range(32)]
                    for c in range(4):
                        for t in range(4):
                            byte = flat[at + G * head + 256 * run + 64 * c + 4 * r + t]
                            assert (byte & 15, byte >> 4) == (values[8 * c + t], values[8 * c + 4 + t])
    np.testing.assert_array_equal(got[2 * G:], raw[2 * G:])


# a K-quant block's fields in their grouped order: (first byte, end, bytes a field); None: its values, in triples of
# words (the tests below), so many bytes a row
VALUES = {Q3_K: 96, Q6_K: 192}
K_FIELDS = {Q2_K: [(0, 8, 2), (16, 48, 4), (8, 16, 2), (48, 80, 4), (80, 82, 2), (82, 84, 2)],  # halves; d, dmin
            Q3_K: [(108, 110, 2), (96, 108, 2), None],  # d, scales, the values
            Q4_K: [(0, 2, 2), (2, 4, 2), (4, 16, 4), (16, 144, 4)],  # d, dmin, scales, qs
            Q6_K: [(192, 208, 4), None, (208, 210, 2)]}  # the scales, the values, d


@pytest.mark.parametrize("ggml_type", list(K_FIELDS), ids=[NAMES[t] for t in K_FIELDS])
def test_k_quants_layout_interleaves_whole_groups_and_keeps_the_rest(ggml_type):
    """Block j of group g: each field of the block in turn (Q2_K: for each half of the block its scales in pairs of
    bytes, then its qs in words of 4 bytes; then d, dmin; Q3_K: d, the scales in pairs, its values as the tests below
    say; Q4_K: d, dmin, the scales and qs in words; Q6_K: the scales in words, its values, d), each as the 16 rows' in
    turn; the rows past the last group unchanged."""
    k, size = 512, cpu_kernels.TYPES[ggml_type].nbytes
    raw, _ = random_rows(ggml_type, N, k, seed=3)
    got = grouped(raw, ggml_type)
    nb = k // 256
    flat = got[:2 * G].reshape(-1)
    for g in range(2):
        for j in range(nb):
            at = (g * nb + j) * G * size
            for field in K_FIELDS[ggml_type]:
                if field is None:
                    at += G * VALUES[ggml_type]
                    continue
                lo, hi, width = field
                for f in range(lo, hi, width):
                    for r in range(G):
                        block = raw[g * G + r, size * j:size * (j + 1)]
                        assert bytes(flat[at + width * r:at + width * (r + 1)]) == bytes(block[f:f + width])
                    at += G * width
    np.testing.assert_array_equal(got[2 * G:], raw[2 * G:])


def q3_k_value(block: np.ndarray, v: int) -> int:
    """Value v's unsigned 3 bits (ggml's q + 4) of a Q3_K block as ggml's dequantize_row_q3_K reads them: the bit
    pair 2 ((v % 128) // 32) of qs byte 32 (v // 128) + v % 32, the third bit bit v // 32 of hmask byte v % 32."""
    qs, hmask = block[32:96], block[:32]
    return int(qs[32 * (v // 128) + v % 32]) >> 2 * (v % 128 // 32) & 3 | (int(hmask[v % 32]) >> v // 32 & 1) << 2


def test_q3_k_values_lie_in_triples_of_words():
    """After the d and scales of a Q3_K group's block, for each pair p of sub-blocks (values 32p..32p + 31) words a,
    e, c of the 16 rows in turn: byte t of a row's words holds, of values 32p + 4v + t (u0) and 32p + 16 + 4v + t (u1),
    a: u0, u1 of v = 0 at bits 0-2 and 3-5, u0 of v = 3's bit pair at 6-7; e: the same of v = 1 and u1 of v = 3's
    pair; c: of v = 2, then the third bits of u0 and u1 of v = 3 at bits 6 and 7. 96 bytes a row, as the file's."""
    for flat, at, r, block in _grouped_blocks(Q3_K, 14):
        for p in range(8):
            a, e, c = (flat[at + 192 * p + 64 * w + 4 * r:at + 192 * p + 64 * w + 4 * r + 4] for w in range(3))
            for t in range(4):
                u0, u1 = ([q3_k_value(block, 32 * p + 16 * h + 4 * v + t) for v in range(4)] for h in range(2))
                assert a[t] == u0[0] | u1[0] << 3 | (u0[3] & 3) << 6, (at, r, p, t)
                assert e[t] == u0[1] | u1[1] << 3 | (u1[3] & 3) << 6, (at, r, p, t)
                assert c[t] == u0[2] | u1[2] << 3 | (u0[3] >> 2) << 6 | (u1[3] >> 2) << 7, (at, r, p, t)


def _grouped_blocks(ggml_type: int, head: int) -> Iterator[tuple[np.ndarray, int, int, np.ndarray]]:
    """Two whole groups of random rows of 512 values and 5 more, grouped: for each group's block and row r, the
    grouped bytes, where that block's values start in them (after its ``head`` bytes a row of fields), r and the
    row's block as the file has it; once all are seen, the rows past the groups are checked to be as they were."""
    k, size = 512, cpu_kernels.TYPES[ggml_type].nbytes
    raw, _ = random_rows(ggml_type, N, k, seed=3)
    got = grouped(raw, ggml_type)
    nb, flat = k // 256, got[:2 * G].reshape(-1)
    for g in range(2):
        for j in range(nb):
            for r in range(G):
                yield flat, (g * nb + j) * G * size + G * head, r, raw[g * G + r, size * j:size * (j + 1)]
    np.testing.assert_array_equal(got[2 * G:], raw[2 * G:])


def q6_k_value(block: np.ndarray, v: int) -> int:
    """Value v's unsigned 6 bits (ggml's q + 32) of a Q6_K block as ggml's dequantize_row_q6_K reads them: of the half
    h = v // 128, i = (v % 128) // 32 and m = v % 32, nibble i // 2 of ql byte 64h + 32 (i % 2) + m, and bit pair i of
    qh byte 32h + m as bits 4-5."""
    ql, qh = block[:128], block[128:192]
    h, i, m = v // 128, v % 128 // 32, v % 32
    return int(ql[64 * h + 32 * (i % 2) + m]) >> 4 * (i // 2) & 15 | (int(qh[32 * h + m]) >> 2 * i & 3) << 4


def test_q6_k_values_lie_in_triples_of_words():
    """After the scales of a Q6_K group's block, for each sub-block s (values 16s..16s + 15) words a, e, c of the 16
    rows in turn: byte t of a row's words holds u of value 16s + 4v + t at bits 0-5, a of v = 0, e of v = 1, c of
    v = 2, and u of v = 3's bits 0-1 at a's bits 6-7, its bits 2-3 at e's, 4-5 at c's. 192 bytes a row, as the
    file's ql and qh; the d after them."""
    for flat, at, r, block in _grouped_blocks(Q6_K, 16):
        for s in range(16):
            words = [flat[at + 192 * s + 64 * w + 4 * r:at + 192 * s + 64 * w + 4 * r + 4] for w in range(3)]
            for t in range(4):
                u = [q6_k_value(block, 16 * s + 4 * v + t) for v in range(4)]
                for w in range(3):
                    assert words[w][t] == u[w] | (u[3] >> 2 * w & 3) << 6, (at, r, s, t, w)


def products(raw: np.ndarray, x: np.ndarray, k: int, ggml_type: int = Q4_0) -> np.ndarray:
    return cpu_kernels.matmul(Tensor(x), Tensor(grouped(raw, ggml_type)), ggml_type, raw.shape[0], k, G).numpy()


def check(n: int, k: int, b: int, ggml_type: int = Q4_0) -> None:
    """The grouped product of n random rows of ``ggml_type`` (k rounded up to its blocks) with b rows of x against
    ggml's scheme."""
    k, block = width(k, ggml_type), cpu_kernels.TYPES[ggml_type].kernel_block
    raw, w = random_rows(ggml_type, n, k, seed=7)
    x = np.random.default_rng(8).standard_normal((b, k)).astype(np.float32)
    x[:, :32] *= 20  # one block with a large value: its scale differs from the others'
    scheme, exact = ggml_int8.product(x, w, block), x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(exact).max()
    assert np.abs(scheme - exact).max() > 1e-4 * scale  # the int8 rounding: 1e-5 tells the schemes apart
    np.testing.assert_allclose(products(raw, x, k, ggml_type), scheme, rtol=0, atol=1e-5 * scale)


@GROUPED
@pytest.mark.parametrize("n, k, b", [(N, 288, 1), (16, 32, 2), (48, 512, 11), (N, 2048, 3)])
def test_grouped_products_are_ggmls_scheme(n, k, b, ggml_type):
    check(n, k, b, ggml_type)


def test_grouped_products_ask_ahead_on_intels_cores_with_the_same_floats(monkeypatch):
    """On Intel's cores every grouped product asks for its blocks GROUP_AHEAD bytes ahead, in the first pass of a
    block of x over a group (forced here either way, whatever this CPU is): the define in each grouped type's source
    only there, and the same floats as without (1 row of x, and 33: passes after the first) for each of the three
    ways a group is read (Q4_1: a 32-value block with a min, Q4_K: a K-quant's, IQ4_XS: its levels' superblock)."""
    got: dict[bool, list[np.ndarray]] = {}
    for intel in (False, True):
        monkeypatch.setattr(cpu_kernels, "intel", lambda intel=intel: intel)
        cpu_kernels._binary.cache_clear()
        for ggml_type in NAMES:
            src = cpu_kernels.source("matmul", ggml_type, width(512, ggml_type), "k", G)
            assert ("#define PP_GROUP_AHEAD" in src) == intel, NAMES[ggml_type]
        got[intel] = []
        for ggml_type in (Q4_1, Q4_K, IQ4_XS):
            k = width(512, ggml_type)
            raw, _ = random_rows(ggml_type, N, k, seed=7)
            x = np.random.default_rng(8).standard_normal((33, k)).astype(np.float32)
            got[intel] += [products(raw, x[:b], k, ggml_type) for b in (1, 33)]
    cpu_kernels._binary.cache_clear()
    assert all(np.array_equal(a, b) for a, b in zip(got[False], got[True], strict=True))


def test_grouped_rows_take_the_grouped_kernel_whatever_pp_exact_says_later(monkeypatch):
    """The layout is chosen at load (`group_rows`); a product of grouped rows reads them as groups even when the
    float path is asked for afterwards (its kernel would read them as plain rows)."""
    monkeypatch.setenv("PP_EXACT", "1")
    check(N, 288, 3)


@GROUPED
def test_every_row_of_a_chunk_is_the_same_row_alone(ggml_type):
    """A chunk of 128 rows of x (x in blocks of up to 32, passes of 8 against a group), 37 weight rows (two groups
    and plain rows): ggml's scheme, and each row the same floats as in a chunk of 1, 7, 8, 9 or 33 rows and alone."""
    n, k = N, width(512, ggml_type)
    check(n, k, 128, ggml_type)
    raw, _ = random_rows(ggml_type, n, k, seed=7)
    x = np.random.default_rng(9).standard_normal((128, k)).astype(np.float32)
    chunk = products(raw, x, k, ggml_type)
    for b in (1, 7, 8, 9, 33):
        assert np.array_equal(products(raw, x[:b], k, ggml_type), chunk[:b])
    for i in (3, 8, 31, 32, 127):
        assert np.array_equal(products(raw, x[i:i + 1], k, ggml_type)[0], chunk[i]), i


@GROUPED
def test_the_generic_build_reads_the_groups(monkeypatch, ggml_type):
    monkeypatch.setattr(cpu_kernels, "type_files", lambda t: [f"generic/{t.kernel}.c"])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: _plain_x86_64())
    cpu_kernels._binary.cache_clear()
    try:
        check(N, 512, 3, ggml_type)
    finally:
        cpu_kernels._binary.cache_clear()


@pytest.mark.skipif(not AVX512, reason="this CPU has no AVX-512: its native build is AVX2's")
@GROUPED
@pytest.mark.usefixtures("avx2_build")
def test_avx2s_build_reads_the_groups(ggml_type):
    check(N, 512, 35, ggml_type)


SUMS16 = pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q5_0, Q5_1, Q4_K],
                                 ids=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K"])  # AVX2 adds their pairs in 16 bits


@pytest.mark.skipif(not AVX512 or not cpu_kernels.avx512_vnni(),
                    reason="compares AVX2's build with this CPU's AVX-512 VNNI one")
@SUMS16
def test_avx2s_groups_are_the_avx512_vnni_builds_floats(monkeypatch, ggml_type):
    """AVX2's groups of the unsigned types sum pair products in 16 bits over several chunks, then widen them or take
    Q4_K's scales (``k4_block``), where AVX-512 VNNI sums each chunk's 4 products in 32 bits: the same int32 sums, so
    the same floats, row for row, at 1, 2 (a pass), 3 and 35 rows of x, each row as alone (the groups' rows; the
    plain rows past them take each build's own plain product)."""
    k = width(512, ggml_type)
    raw, _ = random_rows(ggml_type, N, k, seed=7)
    x = np.random.default_rng(8).standard_normal((35, k)).astype(np.float32)
    native = {b: products(raw, x[:b], k, ggml_type)[:, :2 * G] for b in (1, 2, 3, 35)}
    portable = _avx2()
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: portable)
    cpu_kernels._binary.cache_clear()
    try:
        avx2 = {b: products(raw, x[:b], k, ggml_type)[:, :2 * G] for b in native}
    finally:
        cpu_kernels._binary.cache_clear()
    for b in native:
        assert np.array_equal(avx2[b], native[b]), b
        assert np.array_equal(avx2[b], avx2[35][:b]), b


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 assembly")
@SUMS16
def test_avx2s_groups_add_pairs_in_16_bits(tmp_path, ggml_type):
    """AVX2's groups of the unsigned types (Haswell's instructions): each chunk's pair products (`vpmaddubsw`) added
    in 16 bits (`vpaddw`), widened or times Q4_K's scale by one `vpmaddwd` for several chunks (one each before), and
    no `vpmulld` (clang wrote a scale put in both halves of a lane as one)."""
    out = tmp_path / "g.s"
    cross.clang("-S", "-x", "c", *cross.TARGETS["avx2"].kernel_flags(), "-", "-o", str(out),
                source=cpu_kernels.source("matmul", ggml_type, 2048, "g", G))
    ops = collections.Counter(line.split()[0] for line in out.read_text().splitlines()
                              if line.startswith("\t") and line.split())
    assert ops["vpaddw"] >= ops["vpmaddubsw"] // 2 > 0, ops
    assert ops["vpmaddwd"] < ops["vpmaddubsw"] / 2, ops
    assert ops["vpmulld"] == 0, ops


@pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                    reason="these builds cross from a Linux x86-64 machine (and run aarch64 under qemu)")
@pytest.mark.parametrize("target", ["aarch64", "x86-64", pytest.param("cascadelake", marks=pytest.mark.skipif(
    not CASCADE, reason="this CPU has no AVX-512 VNNI: it cannot run that build")), pytest.param(
    "skylake", marks=pytest.mark.skipif(not SKYLAKE, reason="this CPU has no AVX-512 BW: it cannot run that build"))])
@GROUPED
def test_other_cpus_builds_read_the_groups(tmp_path, target, ggml_type):
    """The grouped kernel built for aarch64 (run under qemu), the baseline x86-64, an AVX-512 VNNI CPU without
    GFNI (Cascade Lake: single bits shifted and masked, not picked by vgf2p8affineqb) and an AVX-512 CPU without VNNI
    (Skylake-X: the 32-value types' groups by AVX2's products on 512 bits, Q4_K's by its 16-bit sums) by
    `testing.cross`, in 3 parts (a part starts at a group): one row of x and 35 (a block of 32, then 3), against
    ggml's scheme."""
    k, b, t = width(288, ggml_type), 35, cpu_kernels.TYPES[ggml_type]
    name = cross.pair(ggml_type, k)
    defines = {"PP_K": k, "PP_ROWS": G, "BLOCK_VALUES": t.kernel_block, "BLOCK_BYTES": t.nbytes}
    units = {f"{name}_mm": cpu_kernels.source("matmul", ggml_type, k, f"{name}_mm", G),
             f"{name}_gather": cpu_kernels.unit({"NAME": f"{name}_gather", **defines},
                                                ["common.h", *cpu_kernels.type_files(t), "gather.c"]),
             f"{name}_q": cpu_kernels.quantize_source(t.kernel_block, k, f"{name}_q")}
    arch = cross.TARGETS[target]
    objects = cross.compile_units(units, arch, tmp_path / "obj")
    program = cross.kernels_program([(ggml_type, k)], list(objects.values()), arch, tmp_path / "bin")
    raw, w = random_rows(ggml_type, N, k, seed=11)
    x = np.random.default_rng(12).standard_normal((b, k)).astype(np.float32)
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    cross.write_input(tmp_path / "in", name, grouped(raw, ggml_type), x, np.array([0], np.int32), 3)
    cross.run(program, arch, str(tmp_path / "in"), str(tmp_path / "out"))
    one, many, _ = cross.read_output(tmp_path / "out", name, N, b, k)  # (the gather read the groups as rows: unused)
    scheme = ggml_int8.product(x, w, t.kernel_block)
    scale = np.abs(x.astype(np.float64) @ w.T.astype(np.float64)).max()
    np.testing.assert_allclose(many, scheme, rtol=0, atol=1e-5 * scale)
    np.testing.assert_array_equal(many[0], one)


def test_which_weights_are_grouped(monkeypatch):
    """On the integer path on x86-64 (where they measured faster): the 32-value types and Q4_K with AVX-512 VNNI or
    AVX2, the other K-quants and IQ4_XS with AVX-512 VNNI only; their float path (PP_EXACT=1), other types and
    aarch64 (not timed on a real core) keep plain rows."""
    import platform

    types, k_types, n = list(NAMES), K_TYPES, len(NAMES)
    x86 = platform.machine() == "x86_64"
    assert [cpu_kernels.group_rows(t) for t in types] == [
        G if x86 and (t not in k_types or cpu_kernels.avx512_vnni()) else 0 for t in types]
    assert cpu_kernels.group_rows(8) == cpu_kernels.group_rows(13) == 0  # Q8_0, Q5_K
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert [cpu_kernels.group_rows(t) for t in types] == [0] * n
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "avx512_vnni", lambda: True)
    assert [cpu_kernels.group_rows(t) for t in types] == [G] * n
    monkeypatch.setattr(cpu_kernels, "avx512_vnni", lambda: False)  # AVX2: Q2_K's, Q3_K's, Q6_K's lost in prefill
    assert [cpu_kernels.group_rows(t) for t in types] == [0 if t in k_types else G for t in types]
    monkeypatch.setenv("PP_EXACT", "1")
    assert [cpu_kernels.group_rows(t) for t in types] == [0] * n


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 assembly")
@GROUPED
def test_avx512s_grouped_kernel_broadcasts_x_into_vpdpbusd(tmp_path, ggml_type):
    """With AVX-512 VNNI a block's step is `vpdpbusd` on 512 bits with x's 4 bytes broadcast from memory ({1to16}),
    the 16 rows' d converted at once (`vcvtph2ps`, or `vcvtph2psx` with AVX512-FP16), and no byte operation
    emulated (tests/test_int8_arches.py's list; the plain rows past the groups take their sign mask)."""
    from test_int8_arches import EMULATED, sign_mask

    out = tmp_path / "g.s"
    cross.clang("-S", "-x", "c", *cross.TARGETS["avx512"].kernel_flags(), "-", "-o", str(out),
                source=cpu_kernels.source("matmul", ggml_type, 2048, "g", G))
    lines = [line.split("#")[0].split() for line in out.read_text().splitlines() if line.startswith("\t")]
    ops = {op[0] for op in lines if op and not sign_mask(op)}
    assert any(op[0] == "vpdpbusd" and "{1to16}" in " ".join(op) and op[-1].startswith("%zmm") for op in lines if op)
    assert any(op[0].startswith("vcvtph2ps") and op[-1].startswith("%zmm") for op in lines if op)
    assert not ops & set(EMULATED), ops & set(EMULATED)


@pytest.fixture(scope="module", params=list(NAMES.values()))
def grouped_model(request, tmp_path_factory) -> tuple[Path, int]:
    """A generated model of one grouped type. Seed 3, but 5 for IQ4_XS and Q4_1: their seed 3's lie on the scheme's
    chaos (test_int8_model), rms(got - scheme) / rms(scheme - exact) with the plain rows / the groups 0.79 / 0.79
    (IQ4_XS) and 0.98 / 0.96 (Q4_1); seed 5's 0.20 / 0.0 and 1.02 / 0.0 (ggml's order of the float steps)."""
    dtype = request.param
    seed = 5 if dtype in ("IQ4_XS", "Q4_1") else 3
    return generate(tmp_path_factory.mktemp("groups") / f"kq-{dtype}.gguf", "kq", seed=seed, dtype=dtype), \
        {name: t for t, name in NAMES.items()}[dtype]


def test_a_stage_holds_its_products_grouped_and_computes_ggmls_scheme(grouped_model):
    """Every product's matrix of a stage of one grouped type is held in groups on x86-64 (q, k and v stacked, the head
    too), the embedding's rows plain (its gather reads rows), and the logits of a prefill and steps lie near
    ggml's scheme (test_int8_model's bound; rows past the last group: the kernel tests' 37 rows)."""
    model, ggml_type = grouped_model
    chain = Chain(model, 2, 64, prefill_chunk=8)
    first, last = (e._w for e in chain.engines)
    layers = [m for w in (first, last) for blk in w.blocks for m in vars(blk).values()]
    weights = [m.weight for m in layers if isinstance(getattr(m, "weight", None), PackedWeight)]
    want = cpu_kernels.group_rows(ggml_type)  # G on x86-64 (`test_which_weights_are_grouped`)
    assert len(weights) >= 6 * 2 and all(w.group == want and w.ggml_type == ggml_type for w in weights)
    assert last.output.weight.group == want
    assert first.token_embd.weight.group == 0
    assert_near_ggmls_scheme(model, RefModel, vocab=500)
