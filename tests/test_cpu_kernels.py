"""The CPU's C kernels (cpu.kernels) against the `gguf` package's numpy dequantizer, for every block type:
products for one row, a few, and a prefill chunk's worth, row counts that do not split evenly over the threads (nor
into the kernel's steps of 4 rows: 10 and 11 rows once lost their last rows on 2 threads),
inside a TinyJit (captured, then replayed with new inputs), and the embedding gather."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from tinygrad import Tensor, TinyJit
from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

from pp_worker.testing import ggml_int8
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf.types import TYPES as TABLE
from pp_worker.worker.gguf.types import type_name

TYPES = sorted(t.id for t in TABLE.values() if t.kernel)
SIMD = sorted(t.id for t in TABLE.values() if t.simd)  # types with code of their own for some instruction set
# types with a one-row product of their own (for some instruction set), which sums in another order
ROW_DOTS = [t for t in TYPES if "ROW_DOT" in cpu_kernels.unit({}, cpu_kernels.type_files(TABLE[t]))]
SCALES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
          14: (208,), 20: (0,), 23: (0,)}  # fp16 fields


def random_rows(ggml_type: int, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw (n, row bytes) uint8, its values (n, k) by gguf): random bytes, with the fp16 scales made finite."""
    rng = np.random.default_rng(seed)
    t = TABLE[ggml_type]
    qk, bb = t.kernel_block, t.row_bytes(t.kernel_block)
    if ggml_type == 1:
        raw = rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
        return raw, raw.view(np.float16).astype(np.float32)
    raw = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
    for off in SCALES[ggml_type]:
        raw[:, :, off:off + 2] = rng.uniform(0.001, 0.05, (n, k // qk)).astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(n, -1)
    return raw, quants.dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(n, k)


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("n, k, b", [(37, 256, 1), (10, 256, 1), (11, 512, 2), (64, 512, 3), (36, 768, 32)])
def test_products_equal_the_dequantized_matrix_product(ggml_type, n, k, b):
    raw, w = random_rows(ggml_type, n, k)
    x = np.random.default_rng(1).standard_normal((b, k)).astype(np.float32)
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, n, k).numpy()
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
def test_gather_decodes_exactly_the_rows_asked_for(ggml_type):
    n, k = 40, 512
    raw, w = random_rows(ggml_type, n, k, seed=2)
    ids = np.array([[7, 0, n - 1], [7, 3, -1]], np.int32)  # -1: never a token id here; read as row 0, not outside W
    got = cpu_kernels.gather(Tensor(ids), Tensor(raw), ggml_type, n, k).numpy()
    want = w[np.where(ids < 0, 0, ids)]
    assert got.shape == (2, 3, k) and np.array_equal(got, want)


def test_kernels_are_captured_and_replayed_by_the_jit_with_new_inputs():
    ggml_type, n, k = 12, 64, 256  # Q4_K
    raw, w = random_rows(ggml_type, n, k)
    weight = Tensor(raw).realize()
    step = TinyJit(lambda x: cpu_kernels.matmul(x, weight, ggml_type, n, k).realize())
    rng = np.random.default_rng(3)
    for _ in range(4):  # the JIT runs, captures, then replays
        x = rng.standard_normal((2, k)).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        np.testing.assert_allclose(step(Tensor(x)).numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert step.captured is not None


AVX512 = "avx512f" in open("/proc/cpuinfo").read()


@pytest.fixture
def generic(monkeypatch):
    """Kernels built from the generic C alone (no per-arch file), for the test's duration."""
    monkeypatch.setattr(cpu_kernels, "type_files", lambda t: [f"generic/{t.kernel}.c"])
    yield


@pytest.fixture
def without_avx512(monkeypatch):
    """Kernels compiled as for a CPU without AVX-512 (AVX2's paths), for the test's duration."""
    native = cpu_kernels._compiler("CPU")
    portable = ClangJITCompiler([native.arch, "native", "-avx512f"])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: portable)
    cpu_kernels._binary.cache_clear()
    yield
    cpu_kernels._binary.cache_clear()


def products_and_rows(ggml_type: int, b: int, n: int = 37, k: int = 512) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the kernels' products of b random rows x with a random W, float64 x @ W^T, rows 3 and 0 of W decoded)."""
    raw, w = random_rows(ggml_type, n, k, seed=4)
    x = np.random.default_rng(5).standard_normal((b, k)).astype(np.float32)
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, n, k).numpy()
    rows = cpu_kernels.gather(Tensor(np.array([3, 0], np.int32)), Tensor(raw), ggml_type, n, k).numpy()
    return got, x.astype(np.float64) @ w.T, rows


# the builds this CPU runs: its own (AVX-512 or AVX2 on x86), and where it has AVX-512, the build of a CPU without it
# (AVX2's code, run here)
ARCH_BUILDS = ["native", pytest.param("without_avx512", marks=pytest.mark.skipif(
    not AVX512, reason="this CPU has no AVX-512: the native build is the build without it"))]


@pytest.fixture
def native():
    """The kernels tinygrad builds for this CPU (nothing changed)."""
    yield


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("build", ["generic", pytest.param("without_avx512", marks=pytest.mark.skipif(
    not AVX512, reason="this CPU has no AVX-512: the native build is the build without it"))])
def test_every_build_is_right(ggml_type, build, request):
    request.getfixturevalue(build)
    for b in (1, 5):
        got, want, _ = products_and_rows(ggml_type, b)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _chunk_near_float64(ggml_type: int, n: int, k: int, rows: int, seed: int) -> tuple[np.ndarray, ...]:
    """``rows`` rows of x against ``n`` random rows of W as one product, checked within float32 rounding of float64:
    (x, W's bytes, the product, float64's)."""
    raw, w = random_rows(ggml_type, n, k, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((rows, k)).astype(np.float32)
    chunk = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, n, k).numpy()
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(chunk, want, rtol=0, atol=1e-5 * np.abs(want).max())
    return x, raw, chunk, want


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("build", ARCH_BUILDS)
def test_prefill_chunks_at_the_edges_of_the_tiles(ggml_type, build, request):
    """A prefill chunk's products at the edges of the kernel's tiles (the float path takes rows of x in blocks of up
    to 64 (66 without AVX-512), in each 4 at a time with AVX-512 and 3 without, then the rest in one tile, against
    weight rows 4 at a time; without AVX-512 K in chunks, here 27, 27 and 26 steps of 16, each (row of x, weight
    row)'s lanes carried from chunk to chunk): 1, 7, 8, 33 and 128 rows of x against 37 rows of W, each within float32
    rounding of float64, and a row of x the same floats wherever it falls (alone, in a tile of its chunk's last rows,
    inside a tile of a longer chunk, in a later block) among the calls of one kind: the tiles, or F16's matrix
    product on Intel's cores (`f16_panels`: 128 rows there)."""
    request.getfixturevalue(build)
    n, k = 37, 1280
    x, raw, chunk, want = _chunk_near_float64(ggml_type, n, k, 128, seed=9)
    first: dict[bool, np.ndarray] = {}  # each kind's first call: the floats of its rows in every other call
    for b in (128, 33, 8, 7, 1):
        got = chunk if b == 128 else cpu_kernels.matmul(Tensor(x[:b]), Tensor(raw), ggml_type, n, k).numpy()
        np.testing.assert_allclose(got, want[:b], rtol=0, atol=1e-5 * np.abs(want).max())
        if b > 1:  # one row alone takes the one-row product (row.h)
            kind = cpu_kernels.f16_panels(ggml_type, b, k, "CPU")
            assert np.array_equal(got, first.setdefault(kind, got)[:b]), b


@pytest.mark.skipif(not AVX512, reason="F16's matrix product is built with AVX-512 only, which this CPU lacks")
def test_f16_matrix_product_on_intels_cores(monkeypatch):
    """Where the CPU's vendor asks for it (Intel's: forced here whatever this CPU is), F16's product with AVX-512
    takes calls of F16_GEMM_FROM rows of x and more as a matrix product over panels of 32 rows (matmul.c's gemm):
    rows of W not a multiple of its 12 and split into parts (37, 13: one part of a single row, one of none), x in
    blocks of panels taken two at a time (K 1280 and 5632 (K in 3 chunks): 2 panels a block, so 100 rows take 2
    blocks, the second pair's last panel 4 rows), a last panel alone (65, 81 rows), full, more than half full or at
    most half (from 64 rows): each within float32 rounding of float64, and a row's floats the same in every call that
    takes it (each output sums its products in order of k, alone or paired), not the tiles' (31 rows), and as near
    float64's as theirs."""
    monkeypatch.setattr(cpu_kernels, "intel", lambda: True)
    cpu_kernels._binary.cache_clear()
    try:
        assert "#define PP_F16_GEMM_FROM" in cpu_kernels.source("matmul", 1, 1280, "k")
        for n, k in ((37, 1280), (13, 5632)):
            x, raw, chunk, want = _chunk_near_float64(1, n, k, 100, seed=17)
            for b in (32, 49, 64, 65, 81):
                assert cpu_kernels.f16_panels(1, b, k, "CPU")
                got = cpu_kernels.matmul(Tensor(x[:b]), Tensor(raw), 1, n, k).numpy()
                np.testing.assert_allclose(got, want[:b], rtol=0, atol=1e-5 * np.abs(want).max())
                assert np.array_equal(got, chunk[:b]), (n, k, b)
            tiles = cpu_kernels.matmul(Tensor(x[:31]), Tensor(raw), 1, n, k).numpy()
            assert not np.array_equal(tiles, chunk[:31])
            # its rounding as the tiles' (their 16 lanes sum K / 16 steps each; one sum over K: 2-4x theirs)
            rms = [np.sqrt(((got - want[:31]) ** 2).mean()) for got in (chunk[:31], tiles)]
            assert rms[0] <= 1.5 * rms[1], rms
    finally:
        cpu_kernels._binary.cache_clear()


@pytest.mark.parametrize("ggml_type", [1, 8], ids=type_name)
@pytest.mark.parametrize("build", ARCH_BUILDS)
def test_a_long_row_in_many_chunks_and_blocks_of_x(ggml_type, build, request):
    """K 5632 (the 1.1B shape's down product): without AVX-512 11 chunks of 32 steps, each block of x copied as the
    two passes read it, and blocks of x of at most 21 rows (512 KiB; 20 with AVX-512), so 47 rows take 3 blocks (18,
    18 and 11 rows: 3 tiles and 2 rows; with AVX-512 16, 16, 15). F16's rows read as they are, Q8_0's (the float
    path) decoded a chunk at a time; 9 rows of W (a last step of one row). Each row within float32 rounding of
    float64, and the same floats in a call of 2, 3 or 19 rows."""
    request.getfixturevalue(build)
    n, k = 9, 5632
    x, raw, chunk, _ = _chunk_near_float64(ggml_type, n, k, 47, seed=11)
    for b in (2, 3, 19):
        assert np.array_equal(cpu_kernels.matmul(Tensor(x[:b]), Tensor(raw), ggml_type, n, k).numpy(), chunk[:b])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the F16 rows' two ways are x86's build without AVX-512")
@pytest.mark.parametrize("takes_fma_slot", [True, False], ids=["intel", "amd"])
def test_f16_rows_decoded_or_read_as_they_are_give_the_same_floats(monkeypatch, takes_fma_slot):
    """Without AVX-512, where converting fp16 takes an FMA slot (forced here either way, whatever this CPU is), F16's
    rows are decoded a chunk at a time from F16_DECODE_FROM rows of x, else read as they are: at K 2048 (4 chunks),
    37 weight rows, 1-70 rows of x (two blocks), each within float32 rounding of float64 and the same floats in a
    call below the threshold and above it."""
    monkeypatch.setattr(cpu_kernels, "intel", lambda: takes_fma_slot)
    native = cpu_kernels._compiler("CPU")
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: ClangJITCompiler([native.arch, "native", "-avx512f"]))
    cpu_kernels._binary.cache_clear()
    try:
        decodes = "#define PP_F16_DECODE_FROM" in cpu_kernels.source("matmul", 1, 2048, "k")
        assert decodes == takes_fma_slot
        n, k, edge = 37, 2048, cpu_kernels.F16_DECODE_FROM
        x, raw, chunk, _ = _chunk_near_float64(1, n, k, 70, seed=13)
        for b in (2, edge - 1, edge, 33):
            assert np.array_equal(cpu_kernels.matmul(Tensor(x[:b]), Tensor(raw), 1, n, k).numpy(), chunk[:b]), b
    finally:
        cpu_kernels._binary.cache_clear()


@pytest.mark.parametrize("ggml_type", SIMD, ids=type_name)
@pytest.mark.parametrize("build", ARCH_BUILDS)
def test_every_arch_build_decodes_the_generic_floats(ggml_type, build, request):
    """A type's SIMD decoder (AVX-512 or AVX2 on x86) against the generic C: the same floats, so the same sums, bit
    for bit (one row of x too, unless the type has a one-row product: that one sums in another order, and is checked
    against float64 below)."""
    request.getfixturevalue(build)
    sizes = (5,) if ggml_type in ROW_DOTS else (1, 5)
    arch = [products_and_rows(ggml_type, b) for b in sizes]
    request.getfixturevalue("generic")
    portable = [products_and_rows(ggml_type, b) for b in sizes]
    for (got, _, rows), (ref, _, ref_rows) in zip(arch, portable, strict=True):
        assert np.array_equal(got, ref) and np.array_equal(rows, ref_rows)


@pytest.mark.parametrize("ggml_type", ROW_DOTS, ids=type_name)
@pytest.mark.parametrize("n, k", [(37, 1536), (9, 256)])
@pytest.mark.parametrize("build", ARCH_BUILDS)
def test_a_types_one_row_product_is_the_dequantized_product(ggml_type, n, k, build, request):
    """The one-row products that rearrange the sum (AVX-512 or AVX2 on x86): several blocks a row, rows split
    unevenly over the threads, within float32 rounding of float64 on gguf's values."""
    request.getfixturevalue(build)
    check_one_row(ggml_type, n, k)


@pytest.mark.parametrize("ggml_type", [t for t in ROW_DOTS if TABLE[t].kernel_block == 32], ids=type_name)
@pytest.mark.parametrize("k", [96, 800])
@pytest.mark.parametrize("build", ARCH_BUILDS)
def test_one_row_products_over_odd_runs_of_blocks(ggml_type, k, build, request):
    """The one-row products of the 32-value types take a row's blocks in runs (Q8_0's generic one 16 at a time, then
    two at a time; AVX2's two a vector): 3 blocks (a pair and one), 25 (16, then 9: four pairs and one)."""
    request.getfixturevalue(build)
    check_one_row(ggml_type, 11, k)


def check_one_row(ggml_type: int, n: int, k: int) -> None:
    raw, w = random_rows(ggml_type, n, k, seed=6)
    for seed in (7, 8):
        x = np.random.default_rng(seed).standard_normal((1, k)).astype(np.float32)
        got = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, n, k).numpy()
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_supported_needs_whole_blocks():
    assert cpu_kernels.supported(8, 64) and cpu_kernels.supported(1, 160)
    assert not cpu_kernels.supported(12, 128) and not cpu_kernels.supported(8, 48)
    assert not cpu_kernels.supported(16, 256)  # IQ2_XXS: no kernel, dequantized at load
    assert TABLE[14].row_bytes(512) == 2 * 210 and TABLE[1].row_bytes(64) == 128


@pytest.mark.parametrize("shape", [(1, 1, 5632), (40, 1024)], ids=["decode", "chunk"])
def test_silu_mul_is_silu_of_the_gate_times_up(shape):
    """One thread for a decode call's width, every thread for a prefill chunk's (40960 values: 2 parts or more)."""
    rng = np.random.default_rng(4)
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    g.reshape(-1)[:8] = [-200, -90, -20, 0, 20, 90, 200, -1e-30]  # past exp's range both ways, and zero
    u = rng.standard_normal(shape).astype(np.float32)
    got = cpu_kernels.silu_mul(Tensor(g), Tensor(u)).numpy()
    g64 = g.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)


def test_dense_cpu_stages_run_their_activation_as_the_c_kernel(tmp_path, monkeypatch):
    from pp_worker.testing.chain import Chain
    from pp_worker.testing.modelgen import generate
    from pp_worker.testing.npref import RefModel

    model = generate(tmp_path / "tiny.gguf", "tiny", seed=5)
    calls: list[tuple[int, ...]] = []
    silu_mul = cpu_kernels.silu_mul

    def counted(g: Tensor, u: Tensor) -> Tensor:
        calls.append(g.shape)
        return silu_mul(g, u)

    monkeypatch.setattr(cpu_kernels, "silu_mul", counted)
    chain = Chain(model, 2, 64, every_size=False)
    assert all(b.c_kernels for e in chain.engines for b in e._w.blocks)
    prompt = [5, 6, 7, 8]
    tokens, logits = chain.generate(0, prompt, 4)
    assert len(calls) >= sum(len(e._w.blocks) for e in chain.engines), "each block's feed-forward, traced"
    want = RefModel.from_gguf(model).logits(prompt + tokens[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("ggml_type, n, k", [(1, 600, 512), (12, 600, 2048)], ids=["F16", "Q4_K"])
def test_a_product_in_more_parts_than_threads_is_the_same_product(ggml_type, n, k, monkeypatch):
    """F16's products and the integer path's split into parts of ~PART_BYTES (up to PARTS_PER_THREAD a
    thread), claimed by the threads in turn: every row computed once, whichever thread runs its part. The integer
    path's x is quantized once, by a kernel of its own ahead of the product's parts. (600 KiB of fp16 weights: 4
    parts; 675 KiB of Q4_K: 5.)"""
    threads = cpu_kernels.CPU_COUNT.value
    if ggml_type != 1:  # the float path's product (which prepares x per part): a part a thread
        assert cpu_kernels.matmul_parts(ggml_type, n, k) == threads  # the suite's PP_EXACT=1
        monkeypatch.delenv("PP_EXACT")  # the integer path
    parts = cpu_kernels.matmul_parts(ggml_type, n, k)
    assert parts == max(threads, min(8 * threads, n * TABLE[ggml_type].row_bytes(k) // cpu_kernels.PART_BYTES)) > 2
    raw, w = random_rows(ggml_type, n, k, seed=6)
    weight = Tensor(raw).realize()
    x = np.random.default_rng(7).standard_normal((1, k)).astype(np.float32)

    @TinyJit
    def product(xt: Tensor) -> Tensor:
        return cpu_kernels.matmul(xt, weight, ggml_type, n, k).realize()

    want = x.astype(np.float64) @ w.T.astype(np.float64) if ggml_type == 1 else ggml_int8.product(x, w, 256)
    for _ in range(3):  # tinygrad's runtime, then the capture, then the replay
        np.testing.assert_allclose(product(Tensor(x)).numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())
    launched = []
    launch = cpu_kernels.launch
    monkeypatch.setattr(cpu_kernels, "launch", lambda name, *a, **kw: launched.append(name) or launch(name, *a, **kw))
    cpu_kernels.matmul(Tensor(x), weight, ggml_type, n, k).realize()
    assert launched == ([f"f16_mm_{k}"] if ggml_type == 1 else [f"q8_256_{k}", f"q4_k_mm8_{k}"])
