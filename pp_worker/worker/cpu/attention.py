"""One token's attention over a session's KV cache as one hand-written C kernel, for decode on the CPU.

tinygrad runs a decode token's attention as five kernels a block, each on one thread: the scores, the softmax's
max, sum and scaling, and the weighted values. The scores kernel reads the cache through tinygrad's view of the
transposed, GQA-repeated slice, with a division and a remainder by the symbolic length per element: on the bench
model at position 100 a block's attention took 0.1 ms, a third of a stage's decode call (bench/NOTES.md). This
kernel does all of it in one pass per key head: each key and value, read once as 16-wide vectors, serves every
query head of its group, with an online softmax (running max and sum, rescaled per chunk of keys) so no buffer
grows with the position. The key heads split over the threads.

Same math as tinygrad's `scaled_dot_product_attention` in float32 (q . k / sqrt(head_dim), softmax, weighted sum
of values), summed in another order: results agree to rounding, not bit for bit (the tests compare with numpy).
Its C is ``c/attention.c``; it runs through `kernels.launch`, with the position as a variable of the compiled
forward, like the products.
"""

from __future__ import annotations

import math

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.helpers import CPU_COUNT

from pp_worker.worker.cpu.kernels import launch, unit

CHUNK = 128  # keys scored per step of the online softmax

CACHE_TYPES: dict[DType, tuple[str, int]] = {dtypes.float32: ("float", 0), dtypes.float16: ("__fp16", 1)}


def supported(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel covers these heads: whole 16-float vectors per head, whole groups per key head."""
    return head_dim % 16 == 0 and n_heads % n_kv_heads == 0


def source(name: str, n_heads: int, n_kv_heads: int, head_dim: int, max_context: int, dtype: DType,
           threads: int) -> str:
    ctype, half = CACHE_TYPES[dtype]
    defines = {"NAME": name, "PP_HEADS": n_heads, "PP_KV_HEADS": n_kv_heads, "PP_HEAD_DIM": head_dim,
               "PP_CONTEXT": max_context, "PP_CHUNK": CHUNK, "PP_THREADS": threads,
               "PP_SCALE": f"{math.sqrt(head_dim)!r}f", "CT": ctype, "IS_HALF": half}
    return unit(defines, ["common.h", "attention.c"])


def attend(q: Tensor, cache: Tensor, row: int, start_pos: UOp) -> Tensor:
    """Attention of one token's queries ``q`` (1, H, 1, D) over positions [0, start_pos] of block ``row`` of
    ``cache`` (rows, 2, 1, KvH, max_context, D), whose store of this token's key and value must come first (pass the
    cache after it): (1, 1, H * D) float32."""
    _, n_heads, _, head_dim = q.shape
    n_kv_heads, max_context = cache.shape[3], cache.shape[4]
    threads = max(1, min(CPU_COUNT.value, n_kv_heads))
    name = f"attend_{n_heads}_{n_kv_heads}_{head_dim}_{max_context}_{cache.dtype.name}_{threads}"
    src = source(name, n_heads, n_kv_heads, head_dim, max_context, cache.dtype, threads)
    out = Tensor.empty(n_heads * head_dim, dtype=dtypes.float32, device=q.device)
    qs = q.reshape(n_heads * head_dim).cast(dtypes.float32).contiguous()
    return launch(name, src, (out, cache, qs), (row,), threads, (start_pos,)).reshape(1, 1, n_heads * head_dim)
