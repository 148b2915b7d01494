"""How a stage multiplies by its matrices: a weight is either fp16 values or the GGUF file's own bytes, and a
product runs either through the hand-written CPU kernels (`cpu_kernels`) or through tinygrad's own ops.

- ``kernels="c"`` (the CPU's default): every matrix whose type has a kernel is held as its file bytes
  (`PackedWeight`), F16 included, and every product, one token or a prefill chunk, is one C kernel that decodes
  the rows as it reads them. The embedding lookup decodes only the rows it gathers.
- ``kernels="tinygrad"`` (other devices): F16 weights are native fp16 buffers, as before; a quantized weight stays
  packed and is expanded by a tinygrad expression inside the compiled forward (`dequantize`), which tinygrad
  fuses into the kernels that read it.

Either way a quantized weight is never expanded into memory of its own: a stage holds its share of the file.
"""

from __future__ import annotations

from tinygrad import Tensor

from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.device import device_kind
from pp_worker.worker.gguf.tensors import PackedWeight

KERNELS = ("c", "tinygrad")


def default_kernels(device: str) -> str:
    """"c" on the CPU, "tinygrad" elsewhere (the C kernels are CPU code)."""
    return "c" if device_kind(device) == "CPU" else "tinygrad"


def dequantize(raw: Tensor, ggml_type: int, k: int) -> Tensor:
    """Rows of GGUF bytes (..., row_bytes) -> (..., k) values, as a lazy tinygrad expression (fused by the JIT into
    the kernels that read it). Float32 for the quantized types, float16 for F16."""
    from tinygrad.llm.gguf import ggml_data_to_tensor

    lead = raw.shape[:-1]
    n = 1
    for d in lead:
        n *= d
    return ggml_data_to_tensor(raw.reshape(-1), n * k, ggml_type).reshape(*lead, k)


def gather_rows(table: Tensor, idx: Tensor) -> Tensor:
    """Rows ``idx`` (...) of ``table`` (n, w) by a one-hot sum, in the table's own dtype (as tinygrad's nn.Embedding
    does: no gather instruction on every device): (..., w)."""
    hot = Tensor.arange(table.shape[0], device=table.device) == idx.unsqueeze(-1)  # (..., n)
    return hot.unsqueeze(-1).where(table, 0).sum(-2, dtype=table.dtype)


class Linear:
    """y = x W^T (+ bias), W (n, k): a projection or the head. Output float32."""

    def __init__(self, weight: Tensor | PackedWeight, bias: Tensor | None = None, kernels: str = "tinygrad"):
        self.weight, self.bias, self.kernels = weight, bias, kernels

    def __call__(self, x: Tensor, shared: dict[tuple[int, int], Tensor] | None = None) -> Tensor:
        """(..., k) -> (..., n); ``shared``: what `products` shares between products of one x (the C kernels' int8
        blocks of x)."""
        w = self.weight
        if not isinstance(w, PackedWeight):
            return x.linear(w.transpose(), self.bias)
        if self.kernels == "c":
            y = cpu_kernels.matmul(x, w.raw, w.ggml_type, *w.shape, w.group, shared)
            return y if self.bias is None else y + self.bias
        return x.linear(dequantize(w.raw, w.ggml_type, w.shape[1]).transpose(), self.bias)


def products(x: Tensor, *layers: Linear) -> list[Tensor]:
    """Each layer's product of the same ``x`` (q, k and v; gate and up), x quantized once for all of them where the C
    kernels' integer path takes it so (one kernel where there were one a product: 3-6 us each a block of a decode
    call, bench/NOTES.md)."""
    shared: dict[tuple[int, int], Tensor] = {}
    return [layer(x, shared) for layer in layers]


def stacked(*layers: Linear) -> Linear | None:
    """One `Linear` whose rows are those of ``layers`` in order (one product, one kernel, where there were one a
    layer: q, k and v; gate and up), realized; None where they cannot share one matrix: held differently (fp16
    values and packed bytes, or two packed types), or some with a bias and some without. A row's dot product is the
    same either way."""
    from tinygrad import Tensor

    weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    bias = None if biases[0] is None else Tensor.cat(*biases).realize()  # type: ignore[arg-type]
    if all(isinstance(w, Tensor) for w in weights) and len({w.dtype for w in weights}) == 1:  # type: ignore[union-attr]
        return Linear(Tensor.cat(*weights).realize(), bias, layers[0].kernels)  # type: ignore[arg-type]
    if (all(isinstance(w, PackedWeight) for w in weights) and len({(w.ggml_type, w.group) for w in weights}) == 1  # type: ignore[union-attr]
            and all(w.shape[0] % max(1, w.group) == 0 for w in weights)):  # type: ignore[union-attr]  # whole groups
        raw = Tensor.cat(*(w.raw for w in weights)).realize()  # type: ignore[union-attr]
        rows = sum(w.shape[0] for w in weights)  # type: ignore[union-attr]
        return Linear(PackedWeight(raw, weights[0].ggml_type, (rows, weights[0].shape[1]), weights[0].group), bias,  # type: ignore[union-attr]
                      layers[0].kernels)
    return None


class Embedding:
    """Token ids (...) -> their rows of the (vocab, dim) table, float32 (...,  dim)."""

    def __init__(self, weight: Tensor | PackedWeight, kernels: str = "tinygrad"):
        self.weight, self.kernels = weight, kernels

    def __call__(self, idx: Tensor) -> Tensor:
        w = self.weight
        if not isinstance(w, PackedWeight):
            return gather_rows(w, idx).float()
        if self.kernels == "c":
            return cpu_kernels.gather(idx, w.raw, w.ggml_type, *w.shape)
        return dequantize(gather_rows(w.raw, idx), w.ggml_type, w.shape[1]).float()  # only the gathered rows
