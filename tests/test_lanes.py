"""One-token products as lane-interleaved partial sums (engines.lanes): the same products as tinygrad's within
float32 rounding, prefill rows through tinygrad's own matmul, and which devices use them."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes, nn

from pp_worker.worker.engines.lanes import LANES, LaneLinear, decode_lanes, use_lanes, with_lanes

RNG = np.random.default_rng(3)


def _weight(n: int, k: int) -> tuple[np.ndarray, Tensor]:
    w = RNG.standard_normal((n, k)).astype(np.float16)
    return w, Tensor(w.view(np.uint8)).realize().bitcast(dtypes.float16).reshape(n, k)  # the CPU's packed layout


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_one_token_products_match_float64_and_tinygrads_own(batch, bias):
    w64, w = _weight(48, 64)
    b64 = RNG.standard_normal(48).astype(np.float32)
    x = RNG.standard_normal((batch, 1, 64)).astype(np.float32)
    layer = LaneLinear(w, Tensor(b64) if bias else None)
    got = layer(Tensor(x)).numpy()
    want = x.astype(np.float64) @ w64.astype(np.float64).T + (b64 if bias else 0)
    assert got.shape == (batch, 1, 48)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    tinygrads = Tensor(x).linear(w.transpose(), Tensor(b64) if bias else None).numpy()
    np.testing.assert_allclose(got, tinygrads, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape, k", [((1, 5, 64), 64), ((2, 1, 66), 66)])
def test_prefill_rows_and_odd_widths_are_tinygrads_own_product(shape, k):
    _, w = _weight(40, k)  # 66 is not a multiple of LANES
    x = Tensor(RNG.standard_normal(shape).astype(np.float32))
    assert np.array_equal(LaneLinear(w, None)(x).numpy(), x.linear(w.transpose()).numpy())


def test_the_cpu_uses_lanes_and_other_devices_keep_tinygrads_matvec():
    assert decode_lanes("CPU") == decode_lanes("CPU:LLVM") == LANES > 1
    assert decode_lanes("CUDA") == decode_lanes("NV") == decode_lanes("METAL") == 0


def test_use_lanes_replaces_every_linear_by_one_over_the_same_tensors():
    class Block:
        def __init__(self) -> None:
            self.attn_q, self.ffn_up, self.attn_norm = nn.Linear(8, 4), nn.Linear(8, 16, bias=False), nn.RMSNorm(8)

    block, kept = Block(), Block()
    before = {k: v for k, v in vars(block).items()}
    use_lanes(block, LANES)
    use_lanes(kept, 0)
    for name in ("attn_q", "ffn_up"):
        got = getattr(block, name)
        assert isinstance(got, LaneLinear) and got.weight is before[name].weight and got.bias is before[name].bias
        assert isinstance(getattr(kept, name), nn.Linear)
    assert block.attn_norm is before["attn_norm"]
    head = nn.Linear(8, 3, bias=False)
    assert with_lanes(head, 0) is head and isinstance(with_lanes(head, 2), LaneLinear)
