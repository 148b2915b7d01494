"""The CPU's C kernels (engines.cpu_kernels) against the `gguf` package's numpy dequantizer, for every block type:
products for one row, a few, and a prefill chunk's worth, row counts that do not split evenly over the threads,
inside a TinyJit (captured, then replayed with new inputs), and the embedding gather."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from tinygrad import Tensor, TinyJit

from pp_worker.worker.engines import cpu_kernels
from pp_worker.worker.engines.gguf_file import type_name

TYPES = sorted(cpu_kernels.BLOCKS)
SCALES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}  # fp16 fields


def random_rows(ggml_type: int, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw (n, row bytes) uint8, its values (n, k) by gguf): random bytes, with the fp16 scales made finite."""
    rng = np.random.default_rng(seed)
    qk, bb = cpu_kernels.BLOCKS[ggml_type]
    if ggml_type == 1:
        raw = rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
        return raw, raw.view(np.float16).astype(np.float32)
    raw = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
    for off in SCALES[ggml_type]:
        raw[:, :, off:off + 2] = rng.uniform(0.001, 0.05, (n, k // qk)).astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(n, -1)
    return raw, quants.dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(n, k)


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("n, k, b", [(37, 256, 1), (64, 512, 3), (36, 768, 32)])
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


def test_supported_needs_whole_blocks():
    assert cpu_kernels.supported(8, 64) and cpu_kernels.supported(1, 160)
    assert not cpu_kernels.supported(12, 128) and not cpu_kernels.supported(8, 48)
    assert not cpu_kernels.supported(16, 256)  # IQ2_XXS: no kernel, dequantized at load
    assert cpu_kernels.row_bytes(14, 512) == 2 * 210 and cpu_kernels.row_bytes(1, 64) == 128
