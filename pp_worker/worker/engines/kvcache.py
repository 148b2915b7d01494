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

from pp_worker.worker.cpu import attention as cpu_attention
from pp_worker.worker.device import device_kind
from pp_worker.worker.hostio import filled

KVCache = Tensor  # (n_blocks, 2, 1, KvH, max_context, Hd), blocks in the stage's order
KV_DTYPES: dict[str, DType] = {"float32": dtypes.float32, "float16": dtypes.float16}


def default_kv_dtype(device: str) -> str:
    """float32 on the CPU (no memory to save that matters, and it stays what tinygrad's own blocks use); float16
    on accelerators, whose memory the caches compete for with the weights."""
    return "float32" if device_kind(device) == "CPU" else "float16"


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
        return filled(self.shape, self.dtype)

    def release(self, cache: KVCache) -> None:
        if len(self._free) < self.keep:
            self._free.append(cache)


class CacheBlock(TransformerBlock):
    """tinygrad's TransformerBlock, storing keys and values in the cache's own dtype, and able to step several
    sessions at once (`step_batch`).

    tinygrad 0.13.0 stores the float32 ``Tensor.stack(k, v)`` into ``cache_kv`` uncast. Into a float16 cache the
    CPU's C compiler converts silently, but CUDA renders a vectorized store as ``half2 = float2``, which NVRTC
    refuses. `_attention` is tinygrad's, split in two (`_heads`, `_attend`) so the batched step reuses it, with
    one change: the cast marked below (tests/test_kvcache.py fails if tinygrad's own version changes, so the copy
    cannot drift unnoticed). ``cache_kv`` is the session's whole cache, this block's the row ``kv_row`` of it: one
    token's attention on the CPU (`c_attention`) is a C kernel that reads the row after the store.
    """

    kv_row = 0  # this block's row in a session's cache (its index in the stage)
    c_attention = False  # whether one token's attention runs as `cpu_attention`'s kernel (the CPU's C kernels)

    def _attention(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        c = self.config
        q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        B, T, _ = x.shape
        gate = None
        if c.attn_output_gate:
            qg = q.reshape(B, T, c.n_heads, 2, c.head_dim)
            q, gate = qg[:, :, :, 0, :], qg[:, :, :, 1, :].reshape(B, T, c.n_heads * c.head_dim)
        attn = self._attend(*self._heads(q, k, v, start_pos), self.cache_kv, start_pos)
        return self.attn_output(attn if gate is None else (attn * gate.sigmoid()))

    def step_batch(self, x: Tensor, caches: list[Tensor], positions: list[UOp]) -> Tensor:
        """One token of each of B sessions: ``x`` (B, 1, D), session b's cache ``caches[b]`` (the whole session's;
        this block's is its row `kv_row`) at ``positions[b]``. The projections and the feed-forward run batched (one
        pass over the weights); the attention runs per session, over its own cache and length."""
        assert not self.config.attn_output_gate, "no supported architecture gates its attention output"
        h = self.attn_norm(x)
        q, k, v = self.attn_q(h), self.attn_k(h), self.attn_v(h)
        rows = [self._attend(*self._heads(q[b:b + 1], k[b:b + 1], v[b:b + 1], pos), cache, pos)
                for b, (cache, pos) in enumerate(zip(caches, positions, strict=True))]
        h = x + self.attn_output(rows[0].cat(*rows[1:]))
        return (h + self._feed_forward(self.ffn_norm(h))).contiguous()

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, start_pos: int | UOp) -> tuple[Tensor, Tensor, Tensor]:
        """Projections (B, T, *) -> roped heads: q (B, H, T, Hd), k and v (B, KvH, T, Hd)."""
        c = self.config
        if c.qk_norm and c.qk_norm != c.head_dim:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        B, T = q.shape[0], q.shape[1]
        q = q.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm == c.head_dim:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        freqs = self.freqs_cis[start_pos:start_pos + T]
        q = apply_rope(q[..., :c.rope_dim], freqs).cat(q[..., c.rope_dim:], dim=-1)
        k = apply_rope(k[..., :c.rope_dim], freqs).cat(k[..., c.rope_dim:], dim=-1)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Tensor, start_pos: int | UOp) -> Tensor:
        """Store k and v at [start_pos, start_pos + T) of this block's row of ``cache`` (a session's, all blocks)
        and attend over [0, start_pos + T): (B, T, H*Hd). One token on the C kernels' CPU: `cpu_attention`."""
        B, _, T, _ = q.shape
        new_kv = Tensor.stack(k, v).cast(cache.dtype)  # the change: a no-op for a float32 cache
        slot = cache[self.kv_row, :, :, :, start_pos:start_pos + T, :]
        stored = Tensor(cache.uop.after(slot.uop.store(new_kv.uop)))
        if self.c_attention and B == 1 and T == 1 and isinstance(start_pos, UOp):
            return cpu_attention.attend(q, stored, self.kv_row, start_pos)
        assigned_kv = stored[self.kv_row]
        k = assigned_kv[0, :, :, 0:start_pos + T, :]  # (B, KvH, start_pos + T, Hd)
        v = assigned_kv[1, :, :, 0:start_pos + T, :]
        mask = Tensor.full((1, 1, T, start_pos + T), float("-inf"), dtype=q.dtype, device=q.device,
                           buffer=False).triu(start_pos + 1) if resolve(T != 1) else None
        attn = q.scaled_dot_product_attention(k, v, attn_mask=mask, enable_gqa=True)  # (B, H, T, Hd)
        return attn.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * Hd)
