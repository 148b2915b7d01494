"""The KV caches of one stage: per session, one (2, 1, KvH, max_context, Hd) tensor per block, and a pool that
allocates them and hands a released session's caches to the next session instead of allocating again.

A cache's stale contents never matter: a session only attends to the positions [0, length) it wrote itself.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.llm.model import TransformerConfig

KVCache = list[Tensor]  # one per block of the stage, in block order


class KVPool:
    """Allocates KV caches in ``dtype`` and keeps released ones for reuse (at most ``keep`` of them)."""

    def __init__(self, config: TransformerConfig, n_blocks: int, keep: int, dtype: DType = dtypes.float32):
        self.shape = (2, 1, config.n_kv_heads, config.max_context, config.head_dim)
        self.n_blocks, self.keep, self.dtype = n_blocks, keep, dtype
        self._free: list[KVCache] = []
        self.allocated = 0  # caches made so far (reuse keeps this at the peak number of sessions)

    @property
    def session_bytes(self) -> int:
        """Bytes of one session's caches."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize * self.n_blocks

    def acquire(self) -> KVCache:
        if self._free:
            return self._free.pop()
        cache = [Tensor.zeros(*self.shape, dtype=self.dtype).contiguous() for _ in range(self.n_blocks)]
        Tensor.realize(*cache)
        self.allocated += 1
        return cache

    def release(self, cache: KVCache) -> None:
        if len(self._free) < self.keep:
            self._free.append(cache)
