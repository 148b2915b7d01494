"""The C kernels' integer path (PP_EXACT unset) against the numpy model of ggml's scheme (testing/ggml_int8.py):
the same int8 blocks of x and integer sums, so equal up to the order of the float steps, for every type that has it,
one row, a few, a prefill chunk's worth, in this CPU's build (VNNI here), AVX2's and the generic C's. And the path
the switch picks: PP_EXACT=1 is the float path, exact against float64 as before."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_cpu_kernels import AVX512, random_rows
from tinygrad import Tensor

from pp_worker.testing import ggml_int8
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.gguf.types import TYPES, type_name

INT8 = sorted(t.id for t in TYPES.values() if t.int8)


@pytest.fixture(autouse=True)
def int8_path(monkeypatch):
    monkeypatch.delenv("PP_EXACT", raising=False)
    monkeypatch.setattr(cpu_kernels, "INT8_EVERY_TYPE", True)  # the code of every type, default or not


@pytest.fixture
def generic(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "type_files", lambda t: [f"generic/{t.kernel}.c"])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: _plain_x86_64())
    cpu_kernels._binary.cache_clear()
    yield
    cpu_kernels._binary.cache_clear()


def _plain_x86_64():
    """A compiler for the baseline x86-64 (SSE2: no AVX2, no VNNI, no F16C): the generic integer dot products, fp16
    converted by tail.h's __gnu_h2f_ieee, the kernels run by tinygrad as on such a CPU."""
    from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

    return ClangJITCompiler(["x86_64", "x86-64"])


def products(ggml_type: int, n: int, k: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the kernels' x @ W^T, ggml's scheme's, float64's) for random W and x."""
    raw, w = random_rows(ggml_type, n, k, seed=7)
    x = np.random.default_rng(8).standard_normal((b, k)).astype(np.float32)
    x[:, :32] *= 20  # one block with a large value: its scale differs from the others'
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, n, k).numpy()
    return got, ggml_int8.product(x, w, TYPES[ggml_type].kernel_block), x.astype(np.float64) @ w.T.astype(np.float64)


def check(ggml_type: int, n: int, k: int, b: int) -> None:
    got, scheme, exact = products(ggml_type, n, k, b)
    scale = np.abs(exact).max()
    # the int8 rounding moves the products by ~1e-3..1e-2 of their size: 1e-5 tells the schemes apart
    assert np.abs(scheme - exact).max() > 1e-4 * scale
    np.testing.assert_allclose(got, scheme, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("ggml_type", INT8, ids=type_name)
@pytest.mark.parametrize("n, k, b", [(37, 256, 1), (11, 512, 2), (36, 768, 11)])
def test_the_integer_path_is_ggmls_scheme(ggml_type, n, k, b):
    check(ggml_type, n, k, b)


@pytest.mark.parametrize("ggml_type", INT8, ids=type_name)
def test_prefill_chunks_at_the_edges_of_the_blocks(ggml_type):
    """A chunk of 128 rows of x (four blocks of 32, tiles of a few weight rows against a few rows of x, 37 weight rows:
    not a multiple of a tile) is ggml's scheme, and each row the same floats as in a chunk of 1, 7, 8 or 33 rows (a
    row alone, a tile's or a pass's last rows, a lone last row) and as alone (the one-row product: a row at a tile's
    first, middle or last place, or past the tiles)."""
    n, k = 37, 512
    check(ggml_type, n, k, 128)
    raw, _ = random_rows(ggml_type, n, k, seed=7)
    x = np.random.default_rng(9).standard_normal((128, k)).astype(np.float32)
    chunk = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, n, k).numpy()
    for b in (1, 7, 8, 33):
        assert np.array_equal(cpu_kernels.matmul(Tensor(x[:b]), Tensor(raw), ggml_type, n, k).numpy(), chunk[:b])
    for i in (3, 8, 31, 32, 127):
        one = cpu_kernels.matmul(Tensor(x[i:i + 1]), Tensor(raw), ggml_type, n, k).numpy()
        assert np.array_equal(one[0], chunk[i]), i
    for b in (7, 33):  # the chunks' own last rows, past their tiles
        assert np.array_equal(cpu_kernels.matmul(Tensor(x[128 - b:]), Tensor(raw), ggml_type, n, k).numpy(),
                              chunk[128 - b:])


@pytest.mark.parametrize("ggml_type", INT8, ids=type_name)
def test_the_generic_integer_dot_products_are_ggmls_scheme(ggml_type, generic):
    check(ggml_type, 13, 512, 3)


def _avx2():
    """A compiler for this CPU as if it had no AVX-512 or VNNI: an AVX2 CPU's integer paths."""
    from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler

    return ClangJITCompiler([cpu_kernels._compiler("CPU").arch, "native", "-avx512f", "-avx512vnni", "-avxvnni"])


@pytest.fixture
def avx2_build(monkeypatch):
    """The kernels compiled as for an AVX2 CPU without AVX-512 or VNNI (its integer paths), for the test's
    duration."""
    portable = _avx2()
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda device: portable)
    cpu_kernels._binary.cache_clear()
    yield
    cpu_kernels._binary.cache_clear()


@pytest.mark.skipif(not AVX512, reason="this CPU has no AVX-512: its native build is AVX2's")
@pytest.mark.parametrize("ggml_type", INT8, ids=type_name)
def test_avx2s_integer_dot_products_are_ggmls_scheme(ggml_type, avx2_build):
    check(ggml_type, 13, 512, 3)


def test_x_all_zero_and_extreme_blocks_quantize_as_ggml():
    """A zero block (d 0), a block whose largest value is negative (Q8_K's sign), ties at .5 of a step."""
    x = np.zeros((1, 512), np.float32)
    x[0, 256:] = np.linspace(-3, 1, 256, dtype=np.float32)
    x[0, 300] = -5.0
    d, q = ggml_int8.quantize_q8_k(x)
    assert d[0, 0] == 0 and not q[0, 0].any()
    assert d[0, 1] > 0 and q[0, 1, 300 - 256] == -127  # iscale = -127 / max: the largest |x| maps to -127 sign-kept
    d0, q0 = ggml_int8.quantize_q8_0(np.array([[127.0, 0.5, -0.5, 1.5] + [0.0] * 28], np.float32))
    assert list(q0[0, 0, :4]) == [127, 1, -1, 2]  # roundf: ties away from zero
    raw, w = random_rows(12, 5, 512, seed=9)  # Q4_K
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), 12, 5, 512).numpy()
    np.testing.assert_allclose(got, ggml_int8.product(x, w, 256), rtol=0, atol=1e-5 * np.abs(got).max())


def test_pp_exact_selects_the_float_path(monkeypatch):
    raw, w = random_rows(12, 9, 512, seed=10)
    x = np.random.default_rng(11).standard_normal((2, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    monkeypatch.setenv("PP_EXACT", "1")
    assert cpu_kernels.numerics() == "float"
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), 12, 9, 512).numpy()
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    monkeypatch.delenv("PP_EXACT")
    assert cpu_kernels.numerics() == "int8"
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), 12, 9, 512).numpy()
    assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()  # the integer path, not the float one


def test_by_default_only_the_types_where_it_pays_take_the_integer_path(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "INT8_EVERY_TYPE", False)
    taken = {TYPES[t].name for t in INT8 if cpu_kernels.uses_int8("matmul", t)}
    # Q4_1 and Q5_1 too, since their own product (c/matmul_min.h) is faster than their float path at every size
    assert taken == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert not cpu_kernels.uses_int8("gather", 12)
    monkeypatch.setenv("PP_EXACT", "1")
    assert not any(cpu_kernels.uses_int8("matmul", t) for t in INT8)


@pytest.mark.parametrize("ggml_type", [3, 7], ids=type_name)  # Q4_1, Q5_1
@pytest.mark.parametrize("b", [1, 8, 40])  # a decode step, a batch of them, a prefill chunk
def test_q4_1_and_q5_1_take_the_integer_path_by_default(ggml_type, b, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "INT8_EVERY_TYPE", False)
    got, scheme, exact = products(ggml_type, 37, 512, b)
    np.testing.assert_allclose(got, scheme, rtol=0, atol=1e-5 * np.abs(exact).max())
    assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()  # the integer path, not the float one


@pytest.mark.parametrize("ggml_type", [8, 12], ids=type_name)  # Q8_0 (x as Q8_0: ties away), Q4_K (Q8_K: to even)
def test_ties_round_as_ggml_in_the_kernels(ggml_type):
    """x whose scaled values fall on .5 exactly: each block's largest |x| is 127 (Q8_0's d = 1) or -127 (Q8_K's
    iscale = 1), the others k + 0.5: Q8_0 rounds them away from zero, Q8_K to even."""
    k, qk = 512, TYPES[ggml_type].kernel_block
    x = np.tile((np.arange(qk) % 40 - 20 + 0.5).astype(np.float32), k // qk)
    x[::qk] = 127.0 if qk == 32 else -127.0
    x = x[None]
    raw, w = random_rows(ggml_type, 7, k, seed=12)
    got = cpu_kernels.matmul(Tensor(x), Tensor(raw), ggml_type, 7, k).numpy()
    want = ggml_int8.product(x, w, qk)
    nudge = np.float32(1e-3) * np.sign(x)
    nudge[:, ::qk] = 0  # the scales stay
    other = ggml_int8.product(x - nudge, w, qk)  # the ties broken toward zero: other ints
    assert np.abs(want - other).max() > 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def _quantizes(outs: list[Tensor]) -> list[str]:
    """The names of the kernels that quantize x (``q8_<block>_<k>``) among those that realize ``outs``, in order."""
    names = [call.src[0].arg.name for call in outs[0].schedule_linear(*outs[1:]).src]
    return [name for name in names if re.fullmatch(r"q8_\d+_\d+", name)]


def test_products_of_one_x_quantize_it_once_per_block_size():
    """q, k and v (gate and up) of one x: x's int8 blocks made once for every product that takes blocks of that size
    (here two Q8_0 products, 32 values, and a Q4_K, 256), each product's values those it has alone."""
    from pp_worker.worker.engines.weights import Linear, products
    from pp_worker.worker.gguf.tensors import PackedWeight

    rows = [(t, random_rows(t, n, 512, seed=n)) for t, n in ((8, 32), (8, 16), (12, 16))]
    layers = [Linear(PackedWeight(Tensor(raw).realize(), t, raw.shape[:1] + (512,)), None, "c")
              for t, (raw, _) in rows]
    xs = np.random.default_rng(3).standard_normal((3, 512)).astype(np.float32)
    x = Tensor(xs).realize()
    # a schedule only looked at leaves its outputs' buffers unwritten: the values come from graphs of their own
    assert _quantizes(products(x, *layers)) == ["q8_32_512", "q8_256_512"]
    assert [name for layer in layers for name in _quantizes([layer(x)])] == ["q8_32_512", "q8_32_512", "q8_256_512"]
    together = [out.numpy() for out in products(x, *layers)]
    for a, layer, (_, (_, values)) in zip(together, layers, rows, strict=True):
        np.testing.assert_array_equal(a, layer(x).numpy())
        np.testing.assert_allclose(a, xs @ values.T.astype(np.float32), rtol=0.05, atol=0.05 * np.abs(a).max())
