"""Every C kernel built for other CPUs than this one (`testing.cross`, with tinygrad's flags, each object loaded by
tinygrad's loader): for aarch64 with its NEON files and without, run under qemu-user against the generic C built
for this x86 CPU on the same inputs; for an AVX2 CPU and a baseline x86-64 one (no FMA, no F16C), run here; for
AVX-512, compiled (this CPU may lack it). And the table runner on 1-4 threads, under qemu and natively.

The generic C gives the same floats on every CPU, and so does each arch's decoder (DECODE32): products of several
rows of x and gathered rows are compared bit for bit (products without FMA: within float32 rounding). A one-row
product of an arch's own (ROW_DOT) sums in its own order: it is compared with float64 on the `gguf` package's
values, within float32 rounding; a baseline x86-64 build's products of several rows (no FMA) likewise, each row.

Attention (with Gemma 3's sliding window and without, over fp16 and fp32 pages) and every type's expert kernel
(moe.c) are built for aarch64 (run under qemu), a baseline x86-64 CPU, an AVX2 one and this one, and run through
testing/c/call_main.c against float64."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from test_cpu_kernels import random_rows

from pp_worker.testing import cross
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf.types import TYPES as TABLE
from pp_worker.worker.gguf.types import GGMLType, type_name

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                                reason="these builds cross from a Linux x86-64 machine (and run aarch64 under qemu)")
TYPES = sorted(t.id for t in TABLE.values() if t.kernel)
N, B, T = 37, 5, 3  # rows of W (not a multiple of the kernel's 4-row steps), rows of x, parts
IDS = np.array([7, 0, N - 1, 3, -1], np.int32)  # -1: read as row 0
Results = dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]  # (type, K) -> the kernels' outputs


def sizes(ggml_type: int) -> tuple[int, ...]:
    """Row lengths: 3 blocks of 256, or 25 of 32 (Q8_0's one-row products take 16, then pairs, then one); for the
    types with NEON code also one block of 256, or 3 of 32. (Each size is a kernel to compile: ~0.2-2 s.)"""
    kb = TABLE[ggml_type].kernel_block
    big, small = (3 * kb, kb) if kb > 32 else (25 * kb, 3 * kb)
    return (big, small) if "neon" in TABLE[ggml_type].simd else (big,)


KERNELS = [(t, k) for t in TYPES for k in sizes(t)]


def neon_row_dot(ggml_type: int) -> bool:
    """Whether the type's NEON file has a one-row product of its own (summing in another order)."""
    t = TABLE[ggml_type]
    return "neon" in t.simd and "#define ROW_DOT " in cpu_kernels.unit({}, [f"arm/{t.kernel}.c"])


def generic_files(t: GGMLType) -> list[str]:
    return [f"generic/{t.kernel}.c"]


def inputs(folder: Path) -> dict[tuple[int, int], np.ndarray]:
    """Each kernel pair's input file in ``folder``; returns float64 x @ W^T (B, N), per (type, K)."""
    want = {}
    for t, k in KERNELS:
        raw, w = random_rows(t, N, k, seed=k)
        x = np.random.default_rng(k + 1).standard_normal((B, k)).astype(np.float32)
        cross.write_input(folder, cross.pair(t, k), raw, x, IDS, T)
        want[t, k] = x.astype(np.float64) @ w.T.astype(np.float64)
    return want


def build_and_run(target: cross.Target, builds: dict[str, cross.Files], folder: Path, tmp: Path) -> list[Results]:
    """Every kernel built of each of ``builds``' files for ``target`` and run on the inputs in ``folder``: per (type,
    K), the products of one row (N,), of B rows (B, N) and the gathered rows (len(IDS), K)."""
    sources = {name: cross.kernel_units(KERNELS, files) for name, files in builds.items()}
    objects = cross.compile_units({f"{b}/{u}": src for b, us in sources.items() for u, src in us.items()}, target,
                                  tmp / "obj")  # a kernel the same in two builds is compiled once
    results = []
    for b in builds:
        program = cross.kernels_program(KERNELS, [objects[f"{b}/{u}"] for u in sources[b]], target, tmp / b)
        (tmp / b / "out").mkdir()
        cross.run(program, target, str(folder), str(tmp / b / "out"))
        results.append({(t, k): cross.read_output(tmp / b / "out", cross.pair(t, k), N, B, k) for t, k in KERNELS})
    return results


AVX2 = "avx2" in open("/proc/cpuinfo").read()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[tuple[int, int], np.ndarray], dict[str, Results]]:
    """(float64 products, each build's results): this CPU's generic build ("x86"), aarch64's ("neon") and
    aarch64's generic build ("arm") under qemu, and the builds tinygrad makes on an AVX2 CPU ("avx2", where this CPU
    runs them) and on a baseline x86-64 one, without FMA or F16C ("x86-64"). Built and run once for the module."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("arches")
    folder = tmp / "in"
    folder.mkdir()
    want = inputs(folder)
    plan = [("native", {"x86": generic_files}), ("aarch64", {"neon": cpu_kernels.type_files, "arm": generic_files}),
            ("x86-64", {"x86-64": cpu_kernels.type_files}), *([("avx2", {"avx2": cpu_kernels.type_files})] * AVX2)]
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(build_and_run, cross.TARGETS[target], builds, folder, tmp / target)
                for target, builds in plan]
        results = {name: got for (_, builds), d in zip(plan, done, strict=True)
                   for name, got in zip(builds, d.result(), strict=True)}
    return want, results


def close(got: np.ndarray, want: np.ndarray) -> bool:
    """Within float32 rounding of a float64 product (a sum in another order than the dequantized product's)."""
    return bool(np.abs(got - want).max() <= 2e-6 * np.abs(want).max())


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
def test_aarch64_generic_build_gives_the_x86_generic_floats(ggml_type, runs):
    _, got = runs
    for k in sizes(ggml_type):
        for arm, x86, what in zip(got["arm"][ggml_type, k], got["x86"][ggml_type, k], ("one row", "rows", "gathered"),
                                  strict=True):
            assert np.array_equal(arm, x86), f"K={k}, {what}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
def test_aarch64_build_gives_the_generic_floats(ggml_type, runs):
    """The build tinygrad makes on aarch64 (NEON files included) against this CPU's generic build and aarch64's: the
    same floats, but for a one-row product of NEON's own, which is within float32 rounding of float64."""
    want, got = runs
    for k in sizes(ggml_type):
        neon, x86, arm = (got[b][ggml_type, k] for b in ("neon", "x86", "arm"))
        assert np.array_equal(neon[1], x86[1]) and np.array_equal(neon[1], arm[1]), f"K={k}, rows"
        assert np.array_equal(neon[2], x86[2]) and np.array_equal(neon[2], arm[2]), f"K={k}, gathered"
        if neon_row_dot(ggml_type):
            assert close(neon[0], want[ggml_type, k][0]), f"K={k}, one row"
        else:
            assert np.array_equal(neon[0], x86[0]), f"K={k}, one row"


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("build", ["x86-64", pytest.param("avx2", marks=pytest.mark.skipif(
    not AVX2, reason="this CPU has no AVX2: it cannot run that build"))])
def test_x86_builds_decode_the_generic_floats(ggml_type, build, runs):
    """The builds for an AVX2 CPU and a baseline x86-64 one (fp16 converted in software, tinygrad's loader links no
    runtime) decode the generic floats: the same gathered rows; the same products of several rows where the CPU
    has FMA, as this one; without it (each row of x) and for one row of x, within float32 rounding of float64."""
    want, got = runs
    for k in sizes(ggml_type):
        mine, x86 = got[build][ggml_type, k], got["x86"][ggml_type, k]
        assert np.array_equal(mine[2], x86[2]), f"K={k}, gathered"
        if build == "avx2":
            assert np.array_equal(mine[1], x86[1]), f"K={k}, rows"
        for i in range(B if build == "x86-64" else 0):  # each row against its own scale
            assert close(mine[1][i], want[ggml_type, k][i]), f"K={k}, row {i}"
        assert close(mine[0], want[ggml_type, k][0]), f"K={k}, one row"


def test_neon_code_covers_the_types_asked_for():
    """F16 has none on purpose: the generic C compiles to NEON's fcvtl and fmla already (docs/internals.md)."""
    assert {t.name for t in TABLE.values() if "neon" in t.simd} >= {"Q8_0", "Q4_K"}
    assert neon_row_dot(8) and neon_row_dot(12)


def attention_and_runner() -> dict[str, str]:
    """Attention over fp32 and fp16 KV pages (and over a sliding window), and the runner's entry points, as a stage
    compiles them."""
    from tinygrad import dtypes

    from pp_worker.worker.cpu import attention
    from pp_worker.worker.cpu.graph import runner_source

    shapes = [attention.Shape(8, 2, 64, tokens, 4, 256, 4, d, 2) for d in (dtypes.float32, dtypes.float16)
              for tokens in (1, 8)]  # one token and a prefill call, over pages of either dtype
    shapes.append(attention.Shape(8, 2, 64, 8, 4, 256, 4, dtypes.float16, 2, window=12))  # Gemma 3's sliding window
    runner = {f"pp_{e}": runner_source(e) for e in ("run", "help", "ticks")}
    return {s.name: attention.source(s) for s in shapes} | runner


def basic_blocks(listing: str) -> list[list[list[str]]]:
    """An assembly listing's instructions (mnemonic, then operands), in runs between its labels."""
    blocks: list[list[list[str]]] = [[]]
    for line in listing.splitlines():
        if line and not line[0].isspace() and line.split("#")[0].rstrip().endswith(":"):
            blocks.append([])
        elif line.startswith("\t") and (op := line.split("#")[0].split()):
            blocks[-1].append(op)
    return blocks


@pytest.mark.parametrize("target", ["avx2", "avx512"])
@pytest.mark.parametrize("vendor", ["amd", "intel"])
def test_f16_tiles_convert_the_rows_as_they_load_them(tmp_path, monkeypatch, target, vendor):
    """The F16 matmul's tile steps (the runs of at least 12 multiply-adds: 4 weight rows against 3 rows of x without
    AVX-512, 6 against 4 with) take each of their weight vectors by one conversion of fp16 values in memory
    (vcvtph2ps, or vcvtph2psx with AVX512-FP16): no decoded copy of the rows is written, then read back
    (bench/NOTES.md, "AVX2 F16 tile"). Where the conversion takes an FMA slot (Intel's cores: forced here either
    way), the AVX2 build has the steps of rows decoded a chunk at a time too (floats loaded, nothing converted), for
    calls of F16_DECODE_FROM rows of x and more, and the AVX-512 build the matrix product's (`gemm`: 24
    multiply-adds a step, 12 weights each broadcast to a panel's two vectors, or 6 to two panels' four (18 where the
    second has one), nothing converted) for F16_GEMM_FROM rows and more. The baseline x86-64 build, without F16C,
    decodes a chunk of rows first (test_x86_builds_... above)."""
    monkeypatch.setattr(cpu_kernels, "intel", lambda: vendor == "intel")
    out = tmp_path / "f16.s"
    cross.clang("-S", "-x", "c", *cross.TARGETS[target].kernel_flags(), "-", "-o", str(out),
                source=cpu_kernels.source("matmul", 1, 2048, "f16_mm"))
    steps = [b for b in basic_blocks(out.read_text()) if sum(op[0].startswith("vfmadd") for op in b) >= 12]
    rows = 6 if target == "avx512" else 4  # matmul.c's TILE_ROWS
    converting = [b for b in steps if sum(op[0].startswith("vcvtph2ps") and "(" in op[1] for op in b) >= rows]
    plain = [b for b in steps if not any(op[0].startswith("vcvtph2ps") for op in b)]
    broadcast = [b for b in plain if sum("{1to16}" in " ".join(op) or op[0] == "vbroadcastss" for op in b) >= 6]
    assert converting and len(converting) + len(plain) == len(steps), steps
    assert bool(broadcast) == (vendor == "intel" and target == "avx512")
    assert bool([b for b in plain if b not in broadcast]) == (vendor == "intel" and target == "avx2")
    paired = [b for b in broadcast if sum(op[0].startswith("vfmadd") for op in b) >= 24
              and sum("{1to16}" in " ".join(op) or op[0] == "vbroadcastss" for op in b) == 6]
    assert bool(paired) == (vendor == "intel" and target == "avx512")  # two panels at once


@pytest.mark.parametrize("target", ["avx2", "avx512"])
def test_f16_tiles_ask_for_the_rows_ahead_into_the_l2(tmp_path, monkeypatch, target):
    """The F16 tile's pass that reads the rows from memory asks for their lines ~48 KiB on, into the L2
    (prefetcht1): a few rows of x had waited on memory there (bench/NOTES.md, "A few rows of x from memory"). Never
    into the L1 (prefetcht0 pushed the tile's own rows and x out of it). The matrix product's (AVX-512 on Intel's
    cores, forced here) asks for a line of each of the next 12 rows every 32 steps of its first panel's tile."""
    monkeypatch.setattr(cpu_kernels, "intel", lambda: True)
    out = tmp_path / "f16.s"
    cross.clang("-S", "-x", "c", *cross.TARGETS[target].kernel_flags(), "-", "-o", str(out),
                source=cpu_kernels.source("matmul", 1, 576, "f16_mm"))
    blocks = basic_blocks(out.read_text())
    asks = [[op[0] for op in b if op[0].startswith("prefetch")] for b in blocks]
    assert {op for b in asks for op in b} == {"prefetcht1"}, asks
    rows = 6 if target == "avx512" else 4  # matmul.c's TILE_ROWS
    assert all(len(b) % rows == 0 for b in asks) and any(asks)  # a line of each of the tile's weight rows
    assert any(len(b) == 12 for b in asks) == (target == "avx512")  # gemm's GR rows


def test_every_kernel_compiles_for_avx512(tmp_path):
    """Each type's matmul and gather, attention and the runner, for an AVX-512 CPU (this one may lack it): compiled
    and loaded by tinygrad's loader (`cross.compile_units`; a BuildError holds clang's messages)."""
    units = cross.kernel_units([(t, sizes(t)[0]) for t in TYPES], cpu_kernels.type_files) | attention_and_runner()
    assert len(cross.compile_units(units, cross.TARGETS["avx512"], tmp_path)) == len(units)


@pytest.mark.parametrize("target", ["avx2", "x86-64", "aarch64"])
def test_attention_and_the_runner_compile_for(target, tmp_path):
    """The rest of these targets' units are built and run above and below."""
    units = attention_and_runner()
    assert len(cross.compile_units(units, cross.TARGETS[target], tmp_path)) == len(units)


@pytest.fixture(scope="module", params=["aarch64", "native"])
def runner_program(request, tmp_path_factory) -> tuple[cross.Target, Path]:
    """testing/c/runner_main.c with the runner and two kernels (Q8_0 and F16, K 64), built for the target. Q8_0's
    on the float path: it takes x as floats (the integer path takes x's int8 blocks from a kernel ahead of it)."""
    from pp_worker.worker.cpu.graph import runner_source

    target, tmp = cross.TARGETS[request.param], tmp_path_factory.mktemp(f"runner-{request.param}")
    sources = {f"pp_{e}": runner_source(e) for e in ("run", "help", "ticks")}
    with mock.patch.dict(os.environ, {"PP_EXACT": "1"}):
        sources |= {"q8_0_mm": cpu_kernels.source("matmul", 8, 64, "q8_0_mm"),
                    "f16_mm": cpu_kernels.source("matmul", 1, 64, "f16_mm")}
    objects = cross.compile_units(sources, target, tmp / "obj")
    return target, cross.link("runner_main.c", list(objects.values()), target, tmp / "runner")


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_the_runner_gives_the_serial_results_on_threads(runner_program, threads):
    """The runner's claims, waits, futex sleeps and wake-ups (aarch64's svc, cntvct_el0 and yield under qemu, and
    this CPU's; testing/c/runner_main.c): 220 tables, their rows' results bit-identical to the same rows run part
    after part; the helpers asleep in their futex before 14 of them; and in the last 20, woken by the table's start,
    every helper taking a part of two rows that wait for all of them."""
    target, program = runner_program
    assert cross.run(program, target, str(threads), "200", "20").split() == \
        ["ok", f"threads={threads}", "tables=220", "asleep=14", "met=20"]


# ---------------------------------------------------------------- attention and the expert kernel, run on each CPU

ATTENTION = [  # (shape, start_pos): fp16 pages with Gemma 3's sliding window, its start and its last token across a
    # page; a window past a chunk of keys and a page; a window longer than the positions; fp32 pages, no window
    (dict(tokens=8, dtype="float16", window=12), 250), (dict(tokens=1, dtype="float16", window=300), 700),
    (dict(tokens=3, dtype="float32", window=40), 5), (dict(tokens=1, dtype="float32", window=0), 600),
]
ROW, TABLE_ROW, PAGES = 1, 1, [[0, 0, 0], [2, 0, 1]]  # block 1 of session 1, its pages out of the pool's order
EXPERT_IDS, XDIV = np.array([3, 0, 3, 5, 0, 3], np.int32), 2  # experts 3 and 0: several slots; 5: one
EXPERTS, EXPERT_N, EXPERT_K, EXPERT_THREADS = 6, 20, 256, 3


def attention_shape(tokens: int, dtype: str, window: int):
    from tinygrad import dtypes

    from pp_worker.worker.cpu import attention

    return attention.Shape(8, 2, 64, tokens, 2, 2 * attention.CHUNK, 3, getattr(dtypes, dtype), 2, window)


def attention_reference(q: np.ndarray, pool: np.ndarray, start: int, window: int) -> np.ndarray:
    """float64: token t of q (T, H, D) over keys [start + t - window + 1 (window > 0), start + t] of block ROW of
    session TABLE_ROW's pages of pool (pages, rows, 2, KvH, page, D): (T, H, D)."""
    kv = np.concatenate([pool[p, ROW] for p in PAGES[TABLE_ROW]], axis=2).astype(np.float64)
    tokens, heads, d = q.shape
    group = heads // kv.shape[1]
    out = np.empty((tokens, heads, d))
    for t in range(tokens):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        for h in range(heads):
            k, v = kv[0, h // group, lo:pos + 1], kv[1, h // group, lo:pos + 1]
            s = k @ q[t, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[t, h] = p @ v / p.sum()
    return out


def call_inputs(folder: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """The sources of the attention kernels of ATTENTION and every type's expert kernel, their inputs in
    ``folder`` (`cross.write_call`), and the float64 results each must give, by kernel name."""
    from pp_worker.worker.cpu import attention
    from pp_worker.worker.cpu.kernels import source

    sources, want = {}, {}
    for i, (shape, start) in enumerate(ATTENTION):
        s = attention_shape(**shape)
        rng = np.random.default_rng(i)
        pool = (rng.standard_normal((3, s.rows, 2, s.n_kv_heads, s.page, s.head_dim)) * 2).astype(shape["dtype"])
        q = rng.standard_normal((s.tokens, s.n_heads, s.head_dim)).astype(np.float32)
        table = np.array(PAGES, np.int32)
        out = np.zeros(s.tokens * s.n_heads * s.head_dim, np.float32)
        cross.write_call(folder, s.name, [out, pool, q, table, np.array([ROW, TABLE_ROW], np.int32)], [start],
                         s.threads)
        sources[s.name], want[s.name] = attention.source(s), attention_reference(q, pool, start, s.window).ravel()
    for t in TYPES:
        name = f"{type_name(t).lower()}_moe"
        raw, w = random_rows(t, EXPERTS * EXPERT_N, EXPERT_K, seed=t)
        raw, w = raw.reshape(EXPERTS, EXPERT_N, -1).copy(), w.reshape(EXPERTS, EXPERT_N, EXPERT_K)
        raw[[e for e in range(EXPERTS) if e not in EXPERT_IDS]] = 0xFF  # NaN scales: a read of them shows
        x = np.random.default_rng(t + 1).standard_normal((len(EXPERT_IDS) // XDIV, EXPERT_K)).astype(np.float32)
        out = np.zeros((len(EXPERT_IDS), EXPERT_N), np.float32)
        dims = np.array([EXPERT_N, len(EXPERT_IDS), XDIV, EXPERTS, EXPERT_THREADS], np.int32)
        cross.write_call(folder, name, [out, raw, x, EXPERT_IDS, dims], [], EXPERT_THREADS)
        sources[name] = source("moe", t, EXPERT_K, name)
        want[name] = np.stack([w[e].astype(np.float64) @ x[m // XDIV] for m, e in enumerate(EXPERT_IDS)]).ravel()
    return sources, want


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """(the float64 results, each target's results by kernel): attention and the expert kernels built as tinygrad
    builds them for aarch64 (run under qemu), a baseline x86-64 CPU, an AVX2 one (where this CPU has AVX2) and this
    one, each run on the same inputs (testing/c/call_main.c)."""
    tmp = tmp_path_factory.mktemp("calls")
    (tmp / "in").mkdir()
    sources, want = call_inputs(tmp / "in")
    results = {}
    for target in CALL_TARGETS:
        t, folder = cross.TARGETS[target], tmp / target
        objects = cross.compile_units(sources, t, folder / "obj")
        program = cross.calls_program(list(sources), list(objects.values()), t, folder)
        (folder / "out").mkdir()
        cross.run(program, t, str(tmp / "in"), str(folder / "out"))
        results[target] = {name: cross.read_call(folder / "out", name) for name in sources}
    return want, results


CALL_TARGETS = ["aarch64", "x86-64", *(["avx2"] * AVX2), "native"]


@pytest.mark.parametrize("target", CALL_TARGETS)
@pytest.mark.parametrize("case", range(len(ATTENTION)))
def test_attention_on_every_cpu_is_the_float64_softmax(calls, target, case):
    """Each build's attention (its sliding window too: only the last ``window`` positions weigh) against float64."""
    want, got = calls
    name = attention_shape(**ATTENTION[case][0]).name
    np.testing.assert_allclose(got[target][name], want[name], rtol=0, atol=3e-6 * np.abs(want[name]).max())


@pytest.mark.parametrize("target", CALL_TARGETS)
@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
def test_the_expert_kernel_on_every_cpu_is_the_float64_product(calls, target, ggml_type):
    """Each build's expert products (slots of one expert decoded once for all, and a lone slot's one-row product)
    against float64; unrouted experts are NaN bytes, which a read of them would carry into the products."""
    want, got = calls
    name = f"{type_name(ggml_type).lower()}_moe"
    np.testing.assert_allclose(got[target][name], want[name], rtol=0, atol=1e-5 * np.abs(want[name]).max())
