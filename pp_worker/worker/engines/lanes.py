"""One-token products on the CPU as lane-interleaved partial sums: a decode step ~1.4x faster (bench/NOTES.md).

tinygrad's CPU kernels reduce a matvec row by row, one serial sum per output row (four rows at a time): one
multiply-add per element, each waiting on the last, so a decode step runs at 3-6 GB/s of weights on a machine that
streams ~26 GB/s (bench/NOTES.md). Splitting each row's K products into ``lanes`` interleaved sums,

    y[n] = sum_l sum_j W[n, j * lanes + l] * x[j * lanes + l]

gives the kernel ``lanes`` independent accumulators per row over contiguous weights. The input row is made
contiguous first: otherwise tinygrad fuses the RMS norm before the product into every matvec that reads it (q, k
and v recompute it per weight element). The sums are the same terms in another order, so results move at float32
rounding (the tests: logits within 1e-3, the same argmax), inside what the fp16 hidden state between stages moves.

Only rows of one token (decode, batched decode, the head on the last position); prefill keeps tinygrad's matmul.
Only on the CPU: GPU renderers reduce with their own thread groups, and this was not measured there.
"""

from __future__ import annotations

from tinygrad import Tensor, nn

from pp_worker.worker.engines.base import device_kind

LANES = 4  # bench model, 2 stages chained: 1 lane 18.0, 2 13.8, 4 13.4, 8 14.8 ms per token (and best at B = 4)


def decode_lanes(device: str) -> int:
    """How many lanes one-token products use on ``device``: LANES on the CPU, 0 (tinygrad's own matvec) elsewhere."""
    return LANES if device_kind(device) == "CPU" else 0


class LaneLinear:
    """nn.Linear's weight (N, K) and bias, with one-token products as ``lanes`` interleaved partial sums."""

    def __init__(self, weight: Tensor, bias: Tensor | None, lanes: int = LANES):
        self.weight, self.bias, self.lanes = weight, bias, lanes

    def __call__(self, x: Tensor) -> Tensor:  # (..., T, K) -> (..., T, N)
        n, k = self.weight.shape
        if x.shape[-2] != 1 or k % self.lanes:
            return x.linear(self.weight.transpose(), self.bias)
        w = self.weight.reshape(n, k // self.lanes, self.lanes)
        rows = x.contiguous().reshape(*x.shape[:-1], 1, k // self.lanes, self.lanes)  # (..., 1, 1, K/l, l)
        y = (rows * w).sum(-2).sum(-1)  # (..., 1, N, l) -> (..., 1, N)
        return y if self.bias is None else y + self.bias


def with_lanes(layer: nn.Linear, lanes: int) -> nn.Linear | LaneLinear:
    """``layer`` as a LaneLinear over the same tensors; 0 lanes: ``layer`` itself."""
    return LaneLinear(layer.weight, layer.bias, lanes) if lanes else layer


def use_lanes(module: object, lanes: int) -> None:
    """Replace each nn.Linear attribute of ``module`` (a block) by `with_lanes` of it, under the same name."""
    for name, layer in list(vars(module).items()):
        if isinstance(layer, nn.Linear):
            setattr(module, name, with_lanes(layer, lanes))
