"""A session's attention over its KV pages as one hand-written C kernel, for decode and prefill on the CPU.

tinygrad runs a decode token's attention as five kernels a block, each on one thread: the scores, the softmax's
max, sum and scaling, and the weighted values. The scores kernel reads the cache through tinygrad's view of the
transposed, GQA-repeated slice, with a division and a remainder by the symbolic length per element: on the bench
model at position 100 a block's attention took 0.1 ms, a third of a stage's decode call (bench/NOTES.md). This
kernel does all of it in one pass per key head: each key and value, read once as 16-wide vectors, serves every
query head of its group, with an online softmax (running max and sum, rescaled per chunk of keys) so no buffer
grows with the position. The key heads (and a prefill call's tokens) split over the threads.

The keys and values live in the stage's pool of pages (`engines.kvcache`): the kernel reads a session's through its
page table, one int32 row per session of a (sessions, max_pages) buffer, so it reads only the pages the session
holds, and the compiled forward stays one JIT whichever pages those are (the table's contents change per call, not
its buffer).

Same math as tinygrad's `scaled_dot_product_attention` in float32 (q . k / sqrt(head_dim), softmax, weighted sum
of values), summed in another order: results agree to rounding, not bit for bit (the tests compare with numpy).
Its C is ``c/attention.c``; it runs through `kernels.launch`, with the position as a variable of the compiled
forward, like the products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.helpers import CPU_COUNT

from pp_worker.worker.cpu.kernels import launch, unit

CHUNK = 128  # keys scored per step of the online softmax

CACHE_TYPES: dict[DType, tuple[str, int]] = {dtypes.float32: ("float", 0), dtypes.float16: ("__fp16", 1)}


def supported(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel covers these heads: whole 16-float vectors per head, whole groups per key head."""
    return head_dim % 16 == 0 and n_heads % n_kv_heads == 0


@dataclass(frozen=True)
class Shape:
    """What a kernel is compiled for: the heads, the tokens per call, the pool's page layout and dtype, threads."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    tokens: int
    rows: int  # blocks in a page
    page: int  # positions in a page
    max_pages: int  # entries in a session's row of the page table
    dtype: DType
    threads: int
    window: int = 0  # > 0: a sliding window, token t sees positions [start_pos + t - window + 1, start_pos + t]
    mix: bool = False  # each token at a position of its own, of the session in its row of the page table

    @property
    def name(self) -> str:
        return (f"attend_{self.n_heads}_{self.n_kv_heads}_{self.head_dim}_t{self.tokens}_r{self.rows}_p{self.page}"
                f"_m{self.max_pages}_{self.dtype.name}_{self.threads}" + (f"_w{self.window}" if self.window else "")
                + ("_mix" if self.mix else ""))


def source(s: Shape) -> str:
    ctype, half = CACHE_TYPES[s.dtype]
    defines = {"NAME": s.name, "PP_HEADS": s.n_heads, "PP_KV_HEADS": s.n_kv_heads, "PP_HEAD_DIM": s.head_dim,
               "PP_TOKENS": s.tokens, "PP_ROWS": s.rows, "PP_PAGE": s.page, "PP_MAX_PAGES": s.max_pages,
               "PP_CHUNK": CHUNK, "PP_THREADS": s.threads, "PP_WINDOW": s.window,
               "PP_SCALE": f"{math.sqrt(s.head_dim)!r}f", "CT": ctype,
               "IS_HALF": half, "PP_MIX": int(s.mix)}
    return unit(defines, ["common.h", "attention.c"])


def attend(q: Tensor, pool: Tensor, table: Tensor, row: int, table_row: int, start_pos: UOp,
           window: int = 0) -> Tensor:
    """Attention of T tokens' queries ``q`` (1, H, T, D) at positions start_pos .. start_pos + T - 1, token t over
    positions [0, start_pos + t] of block ``row`` of one session's pages of ``pool`` (pages, rows, 2, KvH, page, D),
    found through row ``table_row`` of ``table`` (sessions, max_pages) int32; with a ``window`` > 0 only over the
    last ``window`` of those positions (a sliding window: the keys before are not read). The store of these tokens'
    keys and
    values must come first (pass the pool after it): (1, T, H * D) float32."""
    _, n_heads, tokens, head_dim = q.shape
    _, rows, _, n_kv_heads, page, _ = pool.shape
    threads = max(1, min(CPU_COUNT.value, n_kv_heads * tokens))
    shape = Shape(n_heads, n_kv_heads, head_dim, tokens, rows, page, table.shape[-1], pool.dtype, threads,
                  window)
    out = Tensor.empty(tokens * n_heads * head_dim, dtype=dtypes.float32, device=q.device)
    qs = q.reshape(n_heads, tokens, head_dim).transpose(0, 1).cast(dtypes.float32).contiguous()  # (T, H, D)
    return launch(shape.name, source(shape), (out, pool, qs, table), (row, table_row), threads,
                  (start_pos,)).reshape(1, tokens, n_heads * head_dim)


def attend_rows(q: Tensor, pool: Tensor, table: Tensor, positions: Tensor, row: int, window: int = 0) -> Tensor:
    """`attend` for a mixed call's T rows (`CompiledStage`): row t's query (q (1, H, T, D)) at position
    ``positions[t]`` (int32 (T,)) over [0, positions[t]] of the session whose pages row t of ``table`` (T, max_pages)
    holds, block ``row``; the rows' keys and values stored first (`store_rows`: pass the pool after it)."""
    _, n_heads, tokens, head_dim = q.shape
    _, rows, _, n_kv_heads, page, _ = pool.shape
    threads = max(1, min(CPU_COUNT.value, n_kv_heads * tokens))
    shape = Shape(n_heads, n_kv_heads, head_dim, tokens, rows, page, table.shape[-1], pool.dtype, threads, window,
                  mix=True)
    out = Tensor.empty(tokens * n_heads * head_dim, dtype=dtypes.float32, device=q.device)
    qs = q.reshape(n_heads, tokens, head_dim).transpose(0, 1).cast(dtypes.float32).contiguous()  # (T, H, D)
    return launch(shape.name, source(shape), (out, pool, qs, table, positions), (row,), threads).reshape(
        1, tokens, n_heads * head_dim)


def store_rows(k: Tensor, v: Tensor, pool: Tensor, table: Tensor, positions: Tensor, row: int) -> Tensor:
    """The pool after a mixed call's T rows' keys and values (k, v (1, KvH, T, D)) went into block ``row`` of their
    sessions' pages, row t at position ``positions[t]`` of the session in row t of ``table`` (``c/kv_rows.c``)."""
    _, n_kv_heads, tokens, head_dim = k.shape
    _, rows, _, _, page, _ = pool.shape
    ctype, _ = CACHE_TYPES[pool.dtype]
    name = f"kv_store_{n_kv_heads}_{head_dim}_t{tokens}_r{rows}_p{page}_m{table.shape[-1]}_{pool.dtype.name}"
    defines = {"NAME": name, "STORE": 1, "PP_KV_HEADS": n_kv_heads, "PP_HEAD_DIM": head_dim, "PP_TOKENS": tokens,
               "PP_ROWS": rows, "PP_PAGE": page, "PP_MAX_PAGES": table.shape[-1], "CT": ctype}
    kv = [t.cast(dtypes.float32).contiguous() for t in (k, v)]
    return launch(name, unit(defines, ["common.h", "kv_rows.c"]), (pool, *kv, positions, table), (row,), 1)


def rope_rows(rope: Tensor, positions: Tensor) -> Tensor:
    """Rows ``positions`` (int32 (T,)) of a RoPE table (max_context, W): a mixed call's rows' angles, (T, W)."""
    (tokens,), (length, width) = positions.shape, rope.shape
    name = f"rope_rows_{width}_t{tokens}"
    out = Tensor.empty(tokens, width, dtype=dtypes.float32, device=rope.device)
    src = unit({"NAME": name, "STORE": 0, "PP_W": width, "PP_TOKENS": tokens}, ["common.h", "kv_rows.c"])
    return launch(name, src, (out, rope, positions), (length,), 1)
