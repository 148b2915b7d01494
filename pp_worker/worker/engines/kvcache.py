"""The KV memory of one stage: a pool of pages, each holding ``page`` positions of every block of the stage,
(n_pages, n_blocks, 2, KvH, page, Hd) in a dtype chosen per device; and the block that stores a token's keys and
values into a session's page and attends over the pages it holds.

A session holds the pages its positions fill (`sessions.SessionTable`: taken as it grows, given back on release,
eviction or rewind). The pool is one buffer the compiled forwards hold like a weight: what changes per call is
which page a call writes and at which offset (bound variables, as the position is), and on the CPU's C kernels the
session's page table (a small int32 buffer written before the call). On the CPU the buffer is mapped memory that the
OS backs only where it is written, so a stage's KV memory grows with the pages its sessions have used; a freed page
is reused before a new one is touched (`KVPool.take`).

The CPU's attention kernel reads a session's pages through its page table (`cpu.attention`), so there a page is
`PAGE` positions. tinygrad's own attention (its kernels: GPUs, ``PP_KERNELS=tinygrad``) cannot read through a table
without a gather over the whole pool, so there a page is a whole context (one page a session), indexed by the
page variable: the pool still caps and shares the memory, but a session's memory does not grow with use.

A page's stale contents never matter: a session only attends to the positions [0, length) it wrote itself.

fp16 pages halve the memory a session holds. Attention still computes in float32 (`_sdpa` computes q @ k in
float32, the C kernel converts each key), so only the stored keys and values are rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.llm.model import TransformerBlock, TransformerConfig, apply_rope
from tinygrad.uop.ops import resolve

from pp_worker.worker.cpu import attention as cpu_attention
from pp_worker.worker.cpu import kernels
from pp_worker.worker.device import device_kind
from pp_worker.worker.engines.weights import products
from pp_worker.worker.hostio import host_bytes

KV_DTYPES: dict[str, DType] = {"float32": dtypes.float32, "float16": dtypes.float16}
PAGE = 256  # positions per page where the attention reads through a page table (the CPU's C kernel)
DEFAULT_GPU_CONTEXT = 4096  # positions per slot a GPU's default pool holds (its pages are whole contexts)


def default_kv_dtype(device: str) -> str:
    """float16 everywhere: half the memory a session's pages take and half the bytes a decode step's attention
    reads. On the CPU it stays within the float64 reference's tolerance over long decodes, as float32 does (1,000
    tokens on the bench model: max |logit error| 5.3e-3 against 5.1e-3, the same greedy tokens; bench/NOTES.md);
    ``PP_KV_DTYPE=float32`` keeps the wider one."""
    return "float16"


def position_bytes(n_blocks: int, config: TransformerConfig, dtype: DType) -> int:
    """Bytes one position of one session takes over ``n_blocks`` blocks: a key and a value per KV head."""
    return n_blocks * 2 * config.n_kv_heads * config.head_dim * dtype.itemsize


class KVPool:
    """``n_pages`` pages of ``page`` positions of ``n_blocks`` blocks in ``dtype``, and which of them are free."""

    def __init__(self, config: TransformerConfig, n_blocks: int, page: int, n_pages: int,
                 dtype: DType = dtypes.float32, device: str | None = None):
        if n_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {n_pages}")
        self.shape = (n_pages, n_blocks, 2, config.n_kv_heads, page, config.head_dim)
        self.page, self.n_pages, self.dtype = page, n_pages, dtype
        self.page_bytes = page * position_bytes(n_blocks, config, dtype)
        # allocated, never written here: mapped memory is backed as pages are written (zeroing it would touch all)
        self.tensor = Tensor.empty(*self.shape, dtype=dtype, device=device)
        self.tensor.uop.base.buffer.ensure_allocated()
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: the page freed last (resident) goes out first
        self.touched = 0  # distinct pages handed out so far: the pool's resident part on the CPU

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.page_bytes

    def take(self) -> int:
        page = self._free.pop()
        self.touched = max(self.touched, page + 1)  # pages go out lowest first until one comes back
        return page

    def give(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, target) page's contents (a fork, `sessions.SessionTable.fork`): in place where the
        device memory is host memory (the CPU's), else through one host buffer a page (copyout, copyin)."""
        buf = self.tensor.uop.base.buffer
        size = self.page_bytes
        if (mem := host_bytes(buf)) is not None:
            for src, dst in pairs:
                mem[dst * size:(dst + 1) * size] = mem[src * size:(src + 1) * size]
            return
        staging = memoryview(bytearray(size))
        for src, dst in pairs:
            buf.view(size // self.dtype.itemsize, self.dtype, src * size).ensure_allocated().copyout(staging)
            buf.view(size // self.dtype.itemsize, self.dtype, dst * size).ensure_allocated().copyin(staging)


@dataclass(frozen=True)
class Slot:
    """Where a call stores its keys and values, and what its attention reads: the pool, the page written and the
    offset in it (variables bound per call), and on the C kernels the page tables (B, max_pages) with this
    session's row of them."""

    pool: Tensor
    page: UOp
    off: UOp
    table: Tensor | None = None
    table_row: int = 0


@dataclass(frozen=True)
class Mix:
    """What a mixed call's blocks share (`CompiledStage`: the rows of several sessions, several rows each, in one
    forward; the CPU's C kernels only): the pool, the page tables (T, max_pages) whose row t is row t's session's,
    the rows' positions (T,) int32, and each RoPE table's rows at those positions (by the table's id)."""

    pool: Tensor
    table: Tensor
    positions: Tensor
    ropes: dict[int, Tensor]


class CacheBlock(TransformerBlock):
    """tinygrad's TransformerBlock storing keys and values into pages of the stage's pool, in the pool's dtype, and
    able to step several sessions at once (`step_batch`).

    tinygrad 0.13.0 stores the float32 ``Tensor.stack(k, v)`` into ``cache_kv`` uncast. Into a float16 cache the
    CPU's C compiler converts silently, but CUDA renders a vectorized store as ``half2 = float2``, which NVRTC
    refuses. `_attention` is tinygrad's, split in two (`_heads`, `_attend`) so the batched step reuses it, with
    two changes: the cast marked below, and the store into a page of the pool (``kv``, set by the compiled stage
    while it traces) instead of ``cache_kv`` (tests/test_kvcache.py fails if tinygrad's own version changes, so the
    copy cannot drift unnoticed); and its scaled_dot_product_attention is `_sdpa`, one kernel fewer. One session's
    attention on the CPU (`c_attention`) is a C kernel that reads the session's pages through its page table after
    the store.
    """

    kv_row = 0  # this block's row in a page (its index in the stage)
    c_attention = False  # whether a session's attention runs as `cpu_attention`'s kernel (the CPU's C kernels)
    c_kernels = False  # whether the stage runs the CPU's C kernels: its feed-forward's activation is `kernels.silu_mul`
    window = 0  # > 0: a sliding window, the query at q sees the keys at [q - window + 1, q] (Gemma 3's local blocks)
    kv: Slot  # set while a forward is traced
    qkv_split: tuple[int, int, int] = ()  # type: ignore[assignment]  # set by `pack`: q, k, v rows of attn_qkv (v 0: apart)

    def pack(self) -> None:
        """tinygrad's kernels: q, k and v as one product (``attn_qkv``), gate and up as one (``ffn_gate_up``), each
        one kernel a token instead of one a matrix, where `weights.stacked` can stack them (the same type); where v's
        type differs (Q4_K_M's Q6_K attn_v in some blocks), q and k (v's product then runs in the KV store's kernel)."""
        from pp_worker.worker.engines.weights import stacked

        rows = (self.attn_q.weight.shape[0], self.attn_k.weight.shape[0], self.attn_v.weight.shape[0])
        if (qkv := stacked(self.attn_q, self.attn_k, self.attn_v)) is not None:
            self.qkv_split, self.attn_qkv = rows, qkv
            del self.attn_q, self.attn_k, self.attn_v
        elif (qk := stacked(self.attn_q, self.attn_k)) is not None:
            self.qkv_split, self.attn_qkv = (*rows[:2], 0), qk
            del self.attn_q, self.attn_k
        if (gate_up := stacked(self.ffn_gate, self.ffn_up)) is not None:
            self.ffn_gate_up = gate_up
            del self.ffn_gate, self.ffn_up

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The projections q, k, v of ``x``: one product where `pack` stacked them."""
        if not self.qkv_split:
            q, k, v = products(x, self.attn_q, self.attn_k, self.attn_v)
            return q, k, v
        nq, nk, nv = self.qkv_split
        y = self.attn_qkv(x).contiguous()  # the one product's output; the rest reads views of it
        return y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:] if nv else self.attn_v(x)

    def _init_state(self, x: Tensor) -> None:
        """Nothing: tinygrad's makes a ``cache_kv`` of its own and its RoPE table (the compiled stage sets the table
        with the model's scaling; the keys and values go to the pool)."""

    def _attention(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        c = self.config
        q, k, v = self._qkv(x)
        B, T, _ = x.shape
        gate = None
        if c.attn_output_gate:
            qg = q.reshape(B, T, c.n_heads, 2, c.head_dim)
            q, gate = qg[:, :, :, 0, :], qg[:, :, :, 1, :].reshape(B, T, c.n_heads * c.head_dim)
        attn = self._attend(*self._heads(q, k, v, start_pos), self.kv, start_pos)
        return self.attn_output(attn if gate is None else (attn * gate.sigmoid()))

    def _feed_forward(self, x: Tensor) -> Tensor:
        """tinygrad's; with the C kernels (`c_kernels`), silu(gate) * up as one C kernel (`kernels.silu_mul`); where
        `pack` stacked gate and up, their one product, and silu(gate) * up read inside ffn_down's kernel."""
        if hasattr(self, "ffn_gate_up"):
            h = self.ffn_gate_up(x).contiguous()
            return self.ffn_down(h[..., :self.config.hidden_dim].silu() * h[..., self.config.hidden_dim:])
        if self.c_kernels and not hasattr(self, "ffn_gate_exps") and kernels.silu_mul_fits(self.config.hidden_dim):
            return self.ffn_down(kernels.silu_mul(*products(x, self.ffn_gate, self.ffn_up)))
        return super()._feed_forward(x)

    def step_batch(self, x: Tensor, slots: list[Slot], positions: list[UOp]) -> Tensor:
        """One token of each of B sessions: ``x`` (B, 1, D), session b's keys and values at ``slots[b]``, its
        position ``positions[b]``. The projections and the feed-forward run batched (one pass over the weights); the
        attention runs per session, over its own pages and length."""
        assert not self.config.attn_output_gate, "no supported architecture gates its attention output"
        h = self.attn_norm(x)
        q, k, v = self._qkv(h)
        rows = [self._attend(*self._heads(q[b:b + 1], k[b:b + 1], v[b:b + 1], pos), slot, pos)
                for b, (slot, pos) in enumerate(zip(slots, positions, strict=True))]
        h = x + self.attn_output(rows[0].cat(*rows[1:]))
        return (h + self._feed_forward(self.ffn_norm(h))).contiguous()

    def step_rows(self, x: Tensor, mix: Mix) -> Tensor:
        """A mixed call's rows ``x`` (1, T, D), each at a position and of a session of its own (``mix``): the
        projections and the feed-forward as one prefill's, the keys and values of all rows stored before any row
        attends (a session's later row sees its earlier ones), each row's attention over its own session."""
        assert not self.config.attn_output_gate, "no supported architecture gates its attention output"
        h = x + self.attn_output(self._attend_rows(self.attn_norm(x), mix))
        return (h + self._feed_forward(self.ffn_norm(h))).contiguous()

    def _attend_rows(self, h: Tensor, mix: Mix) -> Tensor:
        """The attention of a mixed call's normed rows ``h`` (1, T, D), before the output projection: (1, T, H*Hd)."""
        q, k, v = self._heads(*self._qkv(h), 0, mix.ropes[id(self.freqs_cis)])
        stored = cpu_attention.store_rows(k, v, mix.pool, mix.table, mix.positions, self.kv_row)
        return cpu_attention.attend_rows(q, stored, mix.table, mix.positions, self.kv_row, self.window)

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, start_pos: int | UOp,
               freqs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Projections (B, T, *) -> roped heads: q (B, H, T, Hd), k and v (B, KvH, T, Hd); ``freqs``: the rows' RoPE
        angles where they are not the table's rows from ``start_pos`` on (a mixed call's)."""
        c = self.config
        if c.qk_norm and c.qk_norm != c.head_dim:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        B, T = q.shape[0], q.shape[1]
        q = q.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm == c.head_dim:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        freqs = self.freqs_cis[start_pos:start_pos + T] if freqs is None else freqs
        q = apply_rope(q[..., :c.rope_dim], freqs).cat(q[..., c.rope_dim:], dim=-1)
        k = apply_rope(k[..., :c.rope_dim], freqs).cat(k[..., c.rope_dim:], dim=-1)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, kv: Slot, start_pos: int | UOp) -> Tensor:
        """Store k and v (1, KvH, T, Hd) at offsets [off, off + T) of this block's row of page ``kv.page`` (the
        positions [start_pos, start_pos + T): a call never crosses a page) and attend over [0, start_pos + T):
        (1, T, H*Hd). On the C kernels' CPU through the session's page table (`cpu_attention`); else a page is the
        session's whole context."""
        B, _, T, _ = q.shape
        pool = kv.pool
        new_kv = Tensor.stack(k[0], v[0]).cast(pool.dtype)  # the change: a no-op for a float32 pool; (2, KvH, T, Hd)
        slot = pool[kv.page, self.kv_row, :, :, kv.off:kv.off + T, :]
        stored = Tensor(pool.uop.after(slot.uop.store(new_kv.uop)))
        if self.c_attention and kv.table is not None and isinstance(start_pos, UOp):
            return cpu_attention.attend(q, stored, kv.table, self.kv_row, kv.table_row, start_pos, self.window)
        assigned_kv = stored[kv.page, self.kv_row].unsqueeze(1)  # (2, 1, KvH, page, Hd)
        k = assigned_kv[0, :, :, 0:start_pos + T, :]  # (B, KvH, start_pos + T, Hd)
        v = assigned_kv[1, :, :, 0:start_pos + T, :]

        def full() -> Tensor:
            return Tensor.full((1, 1, T, start_pos + T), float("-inf"), dtype=q.dtype, device=q.device, buffer=False)

        mask = full().triu(start_pos + 1) if resolve(T != 1) else None
        if self.window:  # query t (at start_pos + t) does not see key j where j <= start_pos + t - window
            far = full().tril(start_pos - self.window)
            mask = far if mask is None else mask + far
        attn = _sdpa(q, k, v, mask)  # (B, H, T, Hd)
        return attn.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * Hd)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """tinygrad's scaled_dot_product_attention (grouped heads, float32 scores), normalised after the values' sum
    instead of before: softmax(s) @ v = (exp(s - max) @ v) / sum(exp(s - max)), so the exponentials are computed
    inside the kernels that sum them and no kernel writes the normalised weights (one kernel a block fewer)."""
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = q.matmul(k.transpose(-2, -1), dtype=dtypes.float32) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask
    e = (s - s.max(-1, keepdim=True)).exp()
    return (e @ v) / e.sum(-1, keepdim=True)


def uses_table(device: str, kernels: str, config: TransformerConfig) -> bool:
    """Whether this stage's attention reads pages through a page table (the CPU's C kernel), so a page is `PAGE`
    positions; else a page is a whole context."""
    return kernels == "c" and device_kind(device) == "CPU" and \
        cpu_attention.supported(config.n_heads, config.n_kv_heads, config.head_dim)
