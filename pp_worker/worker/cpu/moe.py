"""The CPU's mixture-of-experts product: the routed experts' rows of one packed (E, N, K) GGUF tensor, and nothing
else of it, multiplied with each (token, expert) slot's input. Its C is ``c/moe.c``, assembled like every kernel
(`kernels.unit`: common.h, the type's decoders and one-row products, then the kernel) and launched through
`kernels.launch`, so TinyJit captures it and the compiled forwards replay it like any other."""

from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.helpers import CPU_COUNT

from pp_worker.worker.cpu.kernels import ROWS, launch, source
from pp_worker.worker.gguf.types import TYPES


def matmul(x: Tensor, ids: Tensor, raw: Tensor, ggml_type: int, n_experts: int, n: int, k: int,
           xdiv: int) -> Tensor:
    """(M, n) float32: row m = ``x[m // xdiv]`` (k) times expert ``ids[m]``'s (n, k) matrix transposed, the experts
    held as ``raw``: their GGUF bytes, (n_experts * n, row_bytes). ``ids`` (M,) int32, each in [0, n_experts)."""
    m = ids.shape[0]
    threads = max(1, min(CPU_COUNT.value, n // ROWS))
    out = Tensor.empty(m, n, dtype=dtypes.float32, device=x.device)
    xs = x.reshape(-1, k).cast(dtypes.float32)
    name = f"{TYPES[ggml_type].name.lower()}_moe_{k}"
    return launch(name, source("moe", ggml_type, k, name), (out, raw, xs, ids.cast(dtypes.int32).contiguous()),
                  (n, m, xdiv, n_experts, threads), threads)
