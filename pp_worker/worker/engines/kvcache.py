"""The KV caches of one stage: per session, one (n_blocks, 2, 1, KvH, max_context, Hd) tensor (block j's cache is
its row j), in a dtype chosen per device; a pool that allocates them and hands a released session's cache to the
next session instead of allocating again; and the block that stores into a cache of any dtype.

One tensor rather than one per block: the cache is a JIT argument, and tinygrad prepares every tensor argument on
every call (~60 us each on the development machine), so a 16-block stage would pay that 16 times per token.

A cache's stale contents never matter: a session only attends to the positions [0, length) it wrote itself.

fp16 caches halve the memory a session holds. Attention still computes in float32 (tinygrad's
scaled_dot_product_attention promotes q @ k to float32), so only the stored keys and values are rounded.
"""

from __future__ import annotations

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.llm.model import TransformerBlock, TransformerConfig, apply_rope
from tinygrad.uop.ops import resolve

KVCache = Tensor  # (n_blocks, 2, 1, KvH, max_context, Hd), blocks in the stage's order
KV_DTYPES: dict[str, DType] = {"float32": dtypes.float32, "float16": dtypes.float16}


def default_kv_dtype(device: str) -> str:
    """float32 on the CPU (no memory to save that matters, and it stays what tinygrad's own blocks use); float16
    on accelerators, whose memory the caches compete for with the weights."""
    return "float32" if device.split(":")[0] == "CPU" else "float16"


class KVPool:
    """Allocates KV caches in ``dtype`` and keeps released ones for reuse (at most ``keep`` of them)."""

    def __init__(self, config: TransformerConfig, n_blocks: int, keep: int, dtype: DType = dtypes.float32):
        self.shape = (n_blocks, 2, 1, config.n_kv_heads, config.max_context, config.head_dim)
        self.keep, self.dtype = keep, dtype
        self._free: list[KVCache] = []
        self.allocated = 0  # caches made so far (reuse keeps this at the peak number of sessions)

    @property
    def session_bytes(self) -> int:
        """Bytes of one session's caches."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def acquire(self) -> KVCache:
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return Tensor.zeros(*self.shape, dtype=self.dtype).contiguous().realize()

    def release(self, cache: KVCache) -> None:
        if len(self._free) < self.keep:
            self._free.append(cache)


class CacheBlock(TransformerBlock):
    """tinygrad's TransformerBlock, storing keys and values in the cache's own dtype.

    tinygrad 0.13.0 stores the float32 ``Tensor.stack(k, v)`` into ``cache_kv`` uncast. Into a float16 cache the
    CPU's C compiler converts silently, but CUDA renders a vectorized store as ``half2 = float2``, which NVRTC
    refuses. `_attention` is tinygrad's, copied, with one change: the cast marked below
    (tests/test_kvcache.py fails if tinygrad's own version changes, so the copy cannot drift unnoticed).
    """

    def _attention(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        c = self.config
        q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        if c.qk_norm and c.qk_norm != c.head_dim:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        B, T, _ = x.shape
        if c.attn_output_gate:
            qg = q.reshape(B, T, c.n_heads, 2, c.head_dim)
            q, gate = qg[:, :, :, 0, :], qg[:, :, :, 1, :].reshape(B, T, c.n_heads * c.head_dim)
        q = q.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Hd)
        k = k.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        v = v.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        if c.qk_norm == c.head_dim:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        freqs = self.freqs_cis[start_pos:start_pos + T]
        q = apply_rope(q[..., :c.rope_dim], freqs).cat(q[..., c.rope_dim:], dim=-1)
        k = apply_rope(k[..., :c.rope_dim], freqs).cat(k[..., c.rope_dim:], dim=-1)
        new_kv = Tensor.stack(k, v).cast(self.cache_kv.dtype)  # the change: a no-op for a float32 cache
        slot = self.cache_kv[:, :, :, start_pos:start_pos + T, :]
        assigned_kv = Tensor(self.cache_kv.uop.after(slot.uop.store(new_kv.uop)))
        k = assigned_kv[0, :, :, 0:start_pos + T, :]  # (B, KvH, start_pos + T, Hd)
        v = assigned_kv[1, :, :, 0:start_pos + T, :]
        mask = Tensor.full((1, 1, T, start_pos + T), float("-inf"), dtype=x.dtype, device=x.device,
                           buffer=False).triu(start_pos + 1) if resolve(T != 1) else None
        attn = q.scaled_dot_product_attention(k, v, attn_mask=mask, enable_gqa=True)  # (B, H, T, Hd)
        attn = attn.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * Hd)
        return self.attn_output(attn if not c.attn_output_gate else (attn * gate.sigmoid()))
