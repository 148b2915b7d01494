"""The tinygrad engine: one pipeline stage's blocks, compiled with TinyJit, one KV cache per generation.

Compute per stage, in float32 (the worker puts hidden states on the wire as float16 where they fit, `q8.emit`):
  first:  x = token_embd(tokens).float()   -> blocks -> x
  middle: x = hidden                       -> blocks -> x
  last:   x = hidden                       -> blocks -> output(output_norm(x[last position])).float()
          (a call of at most ROW_LOGITS tokens: every position's logits, which a check of drafted tokens reads)
Hidden states come in as float16 or float32 bytes (their length says which) and enter the JITs as float32.

One TinyJit per token count on a ladder: the largest prefill chunk (PP_PREFILL_CHUNK), the powers of two below
it, and 1 (decode). A request of n tokens runs as n's greedy split over the ladder (37 = 32 + 4 + 1). Token counts
are concrete in every JIT; only the position ``start_pos`` is a symbolic variable, bound per call, so after warm-up
a step compiles nothing. A symbolic token count is what failed on CUDA: tinygrad 0.13.0's CUDAGraph builds every
kernel node with all variables set to 0, so a grid of (n_tokens, 1, 1) becomes (0, 1, 1), "CUDA Error 1, invalid
argument" (tests/test_cuda_graph.py replays that check without a GPU). Concrete counts also give fixed kernels.

Every session's keys and values live in the stage's pool of pages (`kvcache.KVPool`), one buffer passed to every
JIT as an argument (a buffer the function writes but does not take as an argument is a copy in tinygrad 0.13's
capture at the first call, measured): what changes per call is bound variables (the position, the page written and
the offset in it) and, on the CPU's C kernels, the contents of a page-table buffer the JIT reads (the session's
pages), so one JIT serves every session and replays natively. A call never crosses a page (`_pieces`).
Replays skip tinygrad's per-call input preparation (`replay.Replay`): the arguments are always whole realized
buffers and bound variables.

Host <-> device copies (`hostio`): inputs go through one staging array per JIT, outputs come back into one reusable
host buffer; no allocation per call.

What depends on the device (prefill chunk, KV dtype, weight layout, decode lanes, pinned host memory) is decided by
one function each, here and in the modules named; a keyword argument (the worker's PP_* switch) overrides it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tinygrad import Context, Device, Tensor, UOp, dtypes, getenv, nn
from tinygrad.helpers import CPU_COUNT

from pp_worker.worker.compiled import jitcache
from pp_worker.worker.compiled.replay import CacheSlot, Replay
from pp_worker.worker.cpu import attention as cpu_attention
from pp_worker.worker.cpu import graph as cpu_graph
from pp_worker.worker.cpu import kernels as cpu_kernels
from pp_worker.worker.device import device_kind
from pp_worker.worker.engines.base import ModelInfo
from pp_worker.worker.engines.kvcache import (
    DEFAULT_GPU_CONTEXT,
    KV_DTYPES,
    PAGE,
    KVPool,
    Mix,
    Slot,
    default_kv_dtype,
    position_bytes,
    uses_table,
)
from pp_worker.worker.engines.model import StageWeights, eos_token_ids, load_stage
from pp_worker.worker.engines.pool import default_kv_bytes, mem_available, plan_pool
from pp_worker.worker.engines.rope import freqs_cis
from pp_worker.worker.engines.sessions import Session, SessionTable
from pp_worker.worker.gguf.types import TYPES
from pp_worker.worker.hostio import HostBuffer, InputBuffer, Outputs, pinned_allocator
from pp_worker.worker.text.tokenizer import Tokenizer
from pp_worker.worker.text.vocab import bos_token
from pp_worker.worker.text.vocabulary import Vocabulary

COMPILE_GUESS_S = 2.0  # compiling a JIT, until one is timed: a cold stage of the bench models (bench/NOTES.md)
ROW_LOGITS = 8  # the last stage's calls of at most this many tokens give every row's logits (a prompt's calls pay the
# head for at most 7 rows more): a check of k drafted tokens is then one forward of k + 1 rows, not k + 1 steps
MIX_ROWS = 64  # the most rows of a mixed call (`CompiledStage.mix`): 8 sessions' checks of 7 guesses each
WARMUP_SESSION = -1  # request ids are >= 0, so the scratch session never collides with a real one


def default_prefill_chunk(device: str, max_context: int | None = None) -> int:
    """256 tokens on the CPU (a KV page's positions, which a call never crosses): a 512-token prefill of a stage in
    256-token calls took 1.17-1.42x less time than in 32-token ones (the products' weights read, and every other
    kernel launched, 8 times less often; bench/NOTES.md, "Prefill"); at most the power of two at or below half of
    ``max_context`` (a call of the whole context could never be warmed up: its warm-up leaves no position to
    decode). 128 elsewhere: an accelerator reads each weight once per call, so a 512-token prompt costs 4 weight
    passes instead of 16, and the ladder stays at 8 JITs to warm up."""
    if device_kind(device) != "CPU":
        return 128
    half = max(1, (max_context or 512) // 2)
    return min(256, 1 << (half.bit_length() - 1))


def ladder(max_chunk: int) -> tuple[int, ...]:
    """The token counts that get a JIT, largest first: ``max_chunk``, every power of two below it, and 1."""
    sizes, p = {max_chunk}, 1
    while p < max_chunk:
        sizes.add(p)
        p *= 2
    return tuple(sorted(sizes, reverse=True))


def split(n: int, rungs: tuple[int, ...]) -> list[int]:
    """``n`` tokens as calls of ladder sizes, largest first: 37 -> [32, 4, 1] on the ladder of 32."""
    calls = []
    for size in rungs:  # rungs end in 1, so nothing is left over
        while n >= size:
            calls.append(size)
            n -= size
    return calls


def plan(n: int, rungs: tuple[int, ...], cost: dict[int, float]) -> list[int]:
    """``n`` rows of a mixed call as calls of ladder sizes: `split`'s, except where the rows left after a call could
    go as one call of a larger size, its rows past ``n`` repeating the last row, that costs less by ``cost`` (each
    size's call time as measured, seconds; none for a size not timed yet, which is then never a choice). Every call
    reads all the stage's weights, so on a CPU 56 rows ran as 32, 16 and 8 in 1.2x the time of one call of 64
    (bench/NOTES.md): the repeated rows are computed and dropped. The last size may exceed what is left."""
    if n <= 0:
        return []
    if n in rungs:  # more rows in as many calls never cost less (a noisy time might say so)
        return [n]
    down = next(r for r in rungs if r <= n)  # rungs end in 1
    rest = plan(n - down, rungs, cost)
    up = min((r for r in rungs if r > n), default=None)
    if up is not None and up in cost and all(r in cost for r in (down, *rest)) \
            and cost[up] < cost[down] + sum(cost[r] for r in rest):
        return [up]
    return [down, *rest]


class CompiledStage:
    """This stage's forward, traced by one JIT per ladder size, each with its persistent input buffer, over the
    stage's KV pool."""

    def __init__(self, w: StageWeights, pool: KVPool, max_chunk: int, max_batch: int = 1, beam: int = 0,
                 lean: bool = False, store: jitcache.Store | None = None, ident: tuple[Any, ...] = (),
                 table: bool = False):
        """``lean``: see `Replay` (a worker process's stage drops tinygrad's memos after each capture). ``store``:
        where compiled forwards are kept on disk (`jitcache`), their entries named by ``ident`` (what else shapes
        the kernels: the engine's settings) with the stage's config, the pool's shape and the JIT's size.
        ``table``: the attention reads pages through page tables (`kvcache.uses_table`)."""
        self.w, cfg, self.pool = w, w.config, pool
        self.store, self.ident = store, (*ident, repr(cfg), w.shard.start, w.shard.end, w.shard.is_first,
                                         w.shard.is_last, beam, pool.shape)
        self._named: jitcache.Named | None = None
        self.beam = beam  # tinygrad BEAM search width for the decode JIT's kernels; 0: tinygrad's own setting
        self.max_pages = -(-cfg.max_context // pool.page)  # pages one session holds at most: a page table's length
        self.start_pos = UOp.variable("start_pos", 0, cfg.max_context - 1)
        self.page, self.off = UOp.variable("page", 0, pool.n_pages - 1), UOp.variable("off", 0, pool.page - 1)
        self.rungs = ladder(min(max_chunk, cfg.max_context, pool.page))
        dtype, row = (dtypes.int32, ()) if w.shard.is_first else (dtypes.float32, (cfg.dim,))
        self.inputs = {n: InputBuffer((1, n, *row), dtype) for n in self.rungs}  # (1, n) ids or (1, n, D) hidden
        self.jits = {n: Replay(self._forward, lean, self._slot("prefill", n)) for n in self.rungs}
        # batched calls. With the C kernels' page tables (``table``), a mixed call: B rows in one (1, B) forward, each
        # of any session at any position (their positions and page tables are inputs, not variables), so the rows of
        # several sessions, several rows each (checks of drafted tokens), share one pass over the weights; B on a
        # ladder up to MIX_ROWS. Else B sessions' one-token steps, (B, 1), each with variables of its own.
        self.mix = table
        self.batch_rungs = ladder(max(max_batch, MIX_ROWS) if table and max_batch > 1 else max_batch)
        self.positions = [UOp.variable(f"pos{b}", 0, cfg.max_context - 1) for b in range(0 if table else max_batch)]
        self.pages = [UOp.variable(f"page{b}", 0, pool.n_pages - 1) for b in range(len(self.positions))]
        self.offs = [UOp.variable(f"off{b}", 0, pool.page - 1) for b in range(len(self.positions))]
        shape = (lambda b: (1, b, *row)) if table else (lambda b: (b, 1, *row))
        self.batch_inputs = {b: InputBuffer(shape(b), dtype) for b in self.batch_rungs if b > 1}
        self.row_positions = {b: InputBuffer((b,), dtypes.int32) for b in self.batch_inputs} if table else {}
        forward = self._forward_mix if table else self._forward_batch
        self.batch_jits = {b: Replay(forward, lean, self._slot("mix" if table else "batch", b))
                           for b in self.batch_rungs if b > 1}
        # the page tables the C attention reads: (B, max_pages) int32, one for the single-session JITs, one per batch
        # size (a row each); held by the JITs like a weight, written before each call
        self.tables = {b: InputBuffer((b, self.max_pages), dtypes.int32) for b in (1, *self.batch_inputs)} \
            if table else {}
        self.every_size = False  # see TinygradEngine
        self.on_demand = True  # compile a size at its first use when it pays (False: use only sizes compiled or kept)
        self.step_s = 0.0  # the last single-token call (`timed`); none yet: a prefill compiles no new size
        # a mixed call's time per batch size, its fastest (`plan`; a prefill call of as many rows counts too, see
        # `timed`): a busy moment slows every size alike, a noisy sample must not keep a size from being chosen
        self.batch_s: dict[int, float] = {}
        self.missed = dict.fromkeys(self.rungs, 0.0)  # per size not compiled: what its calls would have saved so far
        self.compile_s = COMPILE_GUESS_S  # the last size's first call that compiled (`timed`)
        # normally set by TransformerBlock._init_state, which is skipped because the blocks store into the pool
        tables: dict[Any, Tensor] = {}  # with the model's RoPE scaling, unlike tinygrad's; a block may have its own
        for j, block in enumerate(w.blocks):
            rope = getattr(block, "rope", None) or w.rope  # Gemma 3's sliding blocks rope with their own base
            if rope not in tables:
                tables[rope] = freqs_cis(rope, cfg.max_context)
            block.freqs_cis, block.kv_row, block.c_attention, block.c_kernels = tables[rope], j, table, w.kernels == "c"

    def _slot(self, kind: str, size: int) -> CacheSlot | None:
        return None if self.store is None else CacheSlot(self.store, jitcache.key(*self.ident, kind, size), self.named)

    def named(self) -> jitcache.Named:
        """This stage's persistent buffers by name: its weights (by tensor name) and the RoPE table."""
        if self._named is None:
            w, parts = self.w, {}
            for j, block in enumerate(w.blocks):
                parts |= {f"blk.{w.shard.start + j}.{k}": t for k, t in nn.state.get_state_dict(block).items()}
            for name, obj in (("token_embd", w.token_embd), ("output_norm", w.output_norm), ("output", w.output)):
                if obj is not None:
                    parts |= {f"{name}.{k}": t for k, t in nn.state.get_state_dict(obj).items()}
            parts |= {f"kv.table.{b}": t.tensor for b, t in self.tables.items()}
            parts |= {f"kv.positions.{b}": t.tensor for b, t in self.row_positions.items()}
            self._named = jitcache.Named.of(parts)
        return self._named

    @property
    def decode(self) -> Replay:
        return self.jits[1]

    @property
    def all_jits(self) -> list[Replay]:
        return [*self.jits.values(), *self.batch_jits.values()]

    def usable(self, n: int) -> tuple[int, ...]:
        """The ladder sizes a prefill of ``n`` tokens runs in: 1 (decode's), those compiled or kept on disk, and
        each other one whose calls would have saved, over this call and the earlier ones that ran without it, more
        time than compiling it costs (a call of r tokens replaces r single-token calls). On a cold stage of a small
        model a new size costs ~1-2 s of compiling, more than a short prompt's single-token calls (bench/NOTES.md);
        on a big model every single-token call reads all the stage's weights, and compiling soon pays. Counting the
        earlier calls is for what recurs: the checks of drafted tokens (a few rows, every round of a generation),
        a chat's short turns."""
        out = []
        for r in self.rungs:
            if r != 1 and r > n:  # no call of this size: nothing to weigh (a decode call asks the disk nothing)
                continue
            jit = self.jits[r]
            saves = (n // r) * (r - 1) * self.step_s  # the single-token calls its calls replace
            if r == 1 or jit.ready or jit.cached or (self.on_demand and (self.every_size
                                                                          or self.missed[r] + saves > self.compile_s)):
                out.append(r)
                n %= r
            else:
                self.missed[r] += saves
        return tuple(out)

    def batch_usable(self, compile: bool = True) -> tuple[int, ...]:
        """The batch sizes a batched step runs in: every one, each compiled at its first use; without `on_demand`
        (or ``compile``) only those compiled or kept on disk (the others' sessions go in smaller batches, down to the
        decode JIT)."""
        if self.on_demand and compile:
            return self.batch_rungs
        return tuple(b for b in self.batch_rungs if b == 1 or self.batch_jits[b].ready or self.batch_jits[b].cached)

    def pending(self) -> list[Replay]:
        """The JITs neither compiled nor kept on disk."""
        return [j for j in self.all_jits if not (j.ready or j.cached)]

    def timed(self, n: int, fresh: bool, seconds: float) -> None:
        """A call's time, input written to output taken: the cost of compiling when it was a size's first call
        (not read from the cache); else, for 1 token, of a single-token call (what `usable` weighs), and for any
        size that costs as a mixed call of as many rows (not past ROW_LOGITS on the last stage, where a mixed call
        pays the head on every row), that call's time as `plan` weighs it before mixed calls of the size have run."""
        if fresh:
            if not self.jits[n].restored:
                self.compile_s = seconds
            return
        if n == 1:
            self.step_s = seconds
        if n <= ROW_LOGITS or not self.w.shard.is_last:
            self.clocked(n, seconds)

    def clocked(self, n: int, seconds: float) -> None:
        """A call of ``n`` rows took ``seconds``, as `plan` weighs it: the size's fastest call so far."""
        self.batch_s[n] = min(self.batch_s.get(n, np.inf), seconds)

    @property
    def compiled(self) -> int:
        """How many of the JITs have captured (their kernels compiled): every one after `TinygradEngine.warmup`."""
        return sum(j.ready for j in self.all_jits)

    def _slots(self, pool: Tensor, size: int, pages: list[UOp], offs: list[UOp]) -> list[Slot]:
        table = self.tables[size].tensor if self.tables else None
        return [Slot(pool, page, off, table, b) for b, (page, off) in enumerate(zip(pages, offs,
                                                                                                  strict=True))]

    def _forward(self, inp: Tensor, pool: Tensor, start_pos: UOp, page: UOp, off: UOp) -> Tensor:
        w = self.w
        x = w.token_embd(inp).float() if w.token_embd is not None else inp  # (1, T, D)
        (slot,) = self._slots(pool, 1, [page], [off])
        for block in w.blocks:
            block.kv = slot  # what is stored and read where: variables and buffers the JIT holds
            x = block(x, start_pos)
        for block in w.blocks:
            del block.kv
        if w.output is None:
            return x.contiguous()  # (1, T, D) float32
        if x.shape[1] > ROW_LOGITS:  # T is fixed per JIT, so is -1
            x = x[:, -1:, :]
        return w.output(w.output_norm(x))[0].float()  # (T, V) or, past ROW_LOGITS, the last position's (1, V)

    def _forward_batch(self, inp: Tensor, pool: Tensor, *bound: UOp) -> Tensor:
        w = self.w
        b = inp.shape[0]
        positions, pages, offs = list(bound[:b]), list(bound[b:2 * b]), list(bound[2 * b:])
        x = w.token_embd(inp).float() if w.token_embd is not None else inp  # (B, 1, D)
        slots = self._slots(pool, b, pages, offs)
        for block in w.blocks:
            x = block.step_batch(x, slots, positions)
        if w.output is None:
            return x.contiguous()  # (B, 1, D) float32
        return w.output(w.output_norm(x))[:, 0, :].float()  # (B, V)

    def _forward_mix(self, inp: Tensor, pool: Tensor) -> Tensor:
        w, b = self.w, inp.shape[1]
        x = w.token_embd(inp).float() if w.token_embd is not None else inp  # (1, B, D)
        positions = self.row_positions[b].tensor
        ropes: dict[int, Tensor] = {}
        for block in w.blocks:  # each RoPE table's rows at the rows' positions, once (Gemma 3's local blocks: theirs)
            if id(block.freqs_cis) not in ropes:
                ropes[id(block.freqs_cis)] = cpu_attention.rope_rows(block.freqs_cis, positions)
        mix = Mix(pool, self.tables[b].tensor, positions, ropes)
        for block in w.blocks:
            x = block.step_rows(x, mix)
        if w.output is None:
            return x.contiguous()  # (1, B, D) float32
        return w.output(w.output_norm(x))[0].float()  # (B, V)

    def _write_tables(self, size: int, tables: list[list[int]]) -> None:
        if self.tables:
            rows = np.zeros((size, self.max_pages), np.int32)
            for b, pages in enumerate(tables):
                rows[b, :len(pages)] = pages
            self.tables[size].write(rows)

    def run_batch(self, values: np.ndarray, positions: list[int], where: list[tuple[int, int]],
                  tables: list[list[int]]) -> Tensor:
        """One token for each of B sessions (B a batch ladder size > 1): ``values`` B token ids or (B, D) rows,
        session b at ``positions[b]``, written at (page, offset) ``where[b]``, its pages ``tables[b]``. On a mixed
        stage (`mix`), B rows of any sessions, row b at ``positions[b]`` of the session whose pages are
        ``tables[b]`` (``where`` unused: the kernels find the page in the table)."""
        b = len(values)
        self.batch_inputs[b].write(values)
        self._write_tables(b, tables)
        if self.mix:
            self.row_positions[b].write(np.asarray(positions, np.int32))
            jit, args = self.batch_jits[b], [self.batch_inputs[b].tensor, self.pool.tensor]
            return out if (out := jit.replay(args, {})) is not None else jit(*args)
        jit, inp = self.batch_jits[b], self.batch_inputs[b].tensor
        variables = [*self.positions[:b], *self.pages[:b], *self.offs[:b]]
        numbers = [*positions, *(p for p, _ in where), *(o for _, o in where)]
        if (out := jit.replay([inp, self.pool.tensor], {v.expr: n for v, n in zip(variables, numbers, strict=True)})) \
                is not None:
            return out
        return jit(inp, self.pool.tensor, *(v.bind(n) for v, n in zip(variables, numbers, strict=True)))

    def run(self, values: np.ndarray, position: int, where: tuple[int, int], table: list[int]) -> Tensor:
        """One call on ``values`` (n token ids, or (n, D) float32 rows; n a ladder size) at ``position``, written at
        (page, offset) ``where`` (a call never crosses a page), the session's pages ``table``."""
        n = len(values)
        self.inputs[n].write(values)
        self._write_tables(1, [table])
        jit, inp = self.jits[n], self.inputs[n].tensor
        page, off = where
        values = {self.start_pos.expr: position, self.page.expr: page, self.off.expr: off}
        if (out := jit.replay([inp, self.pool.tensor], values)) is not None:
            return out
        # BEAM is read when kernels compile: the decode JIT's first call, which captures it (Replay); replays compile
        # nothing. Decode only: its kernels run every token, and each searched size costs minutes on a CPU.
        with Context(BEAM=self.beam) if n == 1 and self.beam else contextlib.nullcontext():
            return jit(inp, self.pool.tensor, self.start_pos.bind(position), self.page.bind(page), self.off.bind(off))


class TinygradEngine:
    """engines.base.Engine on tinygrad; loads only this stage's tensors from the GGUF file."""

    def __init__(self, model: str, stage: int, num_stages: int, *, max_context: int | None = None,
                 max_sessions: int = 8, prefill_chunk: int | None = None, kv_dtype: str | None = None,
                 max_batch: int = 8, beam: int = 0, kernels: str | None = None, keep_quantized: bool = True,
                 pinned_host: bool | None = None, lean: bool = False, every_size: bool = False,
                 threads: int | None = None, kv_bytes: int | None = None, host_stages: int = 1,
                 kv_page: int = PAGE, emit: Callable[..., None] = lambda kind, **f: None,
                 layers: tuple[int, int] | None = None):
        """None for ``prefill_chunk``, ``kv_dtype``, ``kernels``, ``pinned_host``, ``kv_bytes``: the device's default
        (`default_prefill_chunk`, `kvcache.default_kv_dtype`, `weights.default_kernels`, `hostio.default_pinned_host`,
        `pool.default_kv_bytes` over ``host_stages`` stages on this host). ``lean``: the worker process's setting,
        see `Replay`. ``every_size``: a prefill compiles each ladder size it needs at its first use (the exactness
        tests', so they cover every size), not only when it pays (`usable`). ``keep_quantized`` False dequantizes
        quantized matrices to fp16 at load (the tests' reference). ``threads``: the CPU threads every kernel splits
        over (tinygrad's CPU_COUNT, process-wide; None: as it is). ``kv_page``: positions in a page where the
        attention reads page tables (whole chunks of the C kernel's keys; the tests' smaller pages). A ``kv_bytes``
        cap that cannot hold one session (at ``max_context`` if given) raises `pool.PoolError`. ``layers``: this
        stage's block range where not the even split (``PP_LAYERS``)."""
        if threads is not None:
            CPU_COUNT.value = threads
        self.device = Device.DEFAULT
        Device[self.device]  # opened before the load's clock starts: its imports (~0.1 s) are no part of a file's load
        t0 = time.perf_counter()
        self._w = load_stage(model, stage, num_stages, max_context, emit=emit, kernels=kernels,
                             keep_quantized=keep_quantized, layers=layers)
        self.load_ms = round((time.perf_counter() - t0) * 1000)  # reading the header, tokenizer and tensors
        # on the CPU with its own kernels, JITs replay from one native call (cpu_graph); else tinygrad's graph
        self.native_graph = self._w.kernels == "c" and cpu_graph.install(self.device)
        self.kv_dtype = kv_dtype or default_kv_dtype(self.device)
        self.kv_pool, table = self._make_pool(max_context is not None, max_sessions, kv_bytes, host_stages, kv_page)
        cfg, kv = self._w.config, self._w.kv
        self.shard = self._w.shard
        bos, add_bos = bos_token(kv)
        eos, tokens = kv.get("tokenizer.ggml.eos_token_id"), kv["tokenizer.ggml.tokens"]
        self.info = ModelInfo(hidden_dim=cfg.dim, vocab_size=cfg.vocab_size, total_blocks=cfg.num_blocks,
                              eos_token_ids=eos_token_ids(kv), max_context=cfg.max_context,
                              name=kv.get("general.name") or kv.get("general.basename") or model,
                              chat_template=kv.get("tokenizer.chat_template"), bos_token_id=bos, add_bos=add_bos,
                              bos_token=None if bos is None else tokens[bos],
                              eos_token=None if eos is None else tokens[eos])
        self.max_sessions = max_sessions
        # a batch holds distinct sessions, each with a page of its own
        self.max_batch = max(1, min(max_batch, max_sessions, self.kv_pool.n_pages))
        root = jitcache.cache_root() if self.native_graph else None  # a restored table replays natively
        file = self._w.path.resolve().stat()
        ident = (str(self._w.path.resolve()), file.st_size, file.st_mtime_ns, self.device, self.kv_dtype,
                 self._w.kernels, getenv("HALF", 1), self.numerics)
        chunk = prefill_chunk or default_prefill_chunk(self.device, self._w.config.max_context)
        self._stage = CompiledStage(self._w, self.kv_pool, chunk,
                                    self.max_batch, beam, lean, None if root is None else jitcache.Store(root), ident,
                                    table)
        self._stage.every_size = every_size
        self._sessions = SessionTable(max_sessions, cfg.max_context, self.kv_pool, emit)
        self.hidden_dtype = "f32"  # of the hidden states it emits
        self._row_bytes = cfg.dim * 4  # one hidden row out
        out_bytes = cfg.vocab_size * 4 if self.shard.is_last else self._stage.rungs[0] * self._row_bytes
        self._host = HostBuffer(out_bytes, pinned_allocator(self.device, pinned_host))
        self._outputs = Outputs()

    def _make_pool(self, requested: bool, max_sessions: int, kv_bytes: int | None, host_stages: int,
                   page: int) -> tuple[KVPool, bool]:
        """The stage's KV pool (`pool.plan_pool`), with the config's context lowered to what it holds where the
        context was not asked for; and whether the attention reads it through page tables."""
        w = self._w
        cfg, dtype, n_blocks = w.config, KV_DTYPES[self.kv_dtype], len(w.blocks)
        table = uses_table(self.device, w.kernels, cfg)
        per_position = position_bytes(n_blocks, cfg, dtype)
        context = cfg.max_context
        if page % cpu_attention.CHUNK:
            raise ValueError(f"a page of {page} positions is not whole chunks of {cpu_attention.CHUNK} keys")
        if kv_bytes is None:
            if device_kind(self.device) == "CPU":
                kv_bytes = default_kv_bytes(mem_available(), per_position, context, max_sessions,
                                            w.describe()["weight_bytes"], host_stages, page if table else None)
            else:  # a device's free memory is not known here: every slot at the context GPUs had by default
                context = context if requested else min(context, DEFAULT_GPU_CONTEXT)
                kv_bytes = max_sessions * context * per_position
        plan = plan_pool(context, requested, kv_bytes, per_position, page if table else None)
        if plan.max_context != cfg.max_context:
            w.config = dataclasses.replace(cfg, max_context=plan.max_context)
            for block in w.blocks:
                block.config = w.config
        return KVPool(w.config, n_blocks, plan.page, plan.n_pages, dtype), table

    @property
    def loaded_tensors(self) -> dict[str, int]:
        """GGUF tensor name -> bytes this stage read from the file (nothing else was read)."""
        return dict(self._w.loaded)

    @property
    def numerics(self) -> str:
        """"int8" where some product of this stage quantizes x to int8 blocks (ggml's scheme: a matrix of a type the
        C kernels' integer path takes, `cpu.kernels.uses_int8`), "float" where every product is in float (PP_EXACT=1,
        no C kernels (tinygrad's own kernels dequantize), or only types without an integer path here, e.g. F16)."""
        if self._w.kernels != "c" or cpu_kernels.numerics() != "int8":
            return "float"
        by_name = {t.name: t.id for t in TYPES.values()}
        # the embedding is a product only as a tied head (the last stage); on stage 0 it is a row lookup
        head = self._w.shard.is_last
        products = {kind for name, (kind, _) in self._w.held.items() if name != "token_embd.weight" or head}
        return "int8" if any(cpu_kernels.uses_int8("matmul", by_name[k]) for k in products) else "float"

    def describe(self) -> dict[str, Any]:
        """What the ready line and `status` report about how this stage runs."""
        return {"device": self.device, "numerics": self.numerics, "prefill_chunk": self._stage.rungs[0],
                "max_batch": self.max_batch,
                "kv_dtype": self.kv_dtype, **self.kv_fields(), "beam": self._stage.beam, **self._w.describe(),
                "graph": "native" if self.native_graph else "tinygrad", "threads": CPU_COUNT.value,
                "pinned_host": self._host.pinned,
                "load_ms": self.load_ms,
                "jits": len(self._stage.all_jits), "jits_compiled": self._stage.compiled,
                "jits_cached": sum(j.restored for j in self._stage.all_jits),
                "jits_pending": len(self._stage.pending())}

    def defer_compiles(self) -> bool:
        """From now on use only the JITs compiled or kept on disk (`CompiledStage.on_demand` off), where there is a
        compiled-forward cache for a background compile to fill; True when some JIT is still to be compiled there."""
        if self._stage.store is None:
            return False
        self._stage.on_demand = False
        return bool(self._stage.pending())

    def cache_settings(self) -> dict[str, str]:
        """What a process compiling this stage's JITs into the cache must be told besides the worker's environment
        to name them the same (its KV pool, whose shape is in every entry's name)."""
        return {"PP_KV_BYTES": str(self.kv_pool.nbytes), "PP_KV_DTYPE": self.kv_dtype}

    def kv_fields(self) -> dict[str, int]:
        """The KV pool: its cap (``kv_bytes``), pages (positions and bytes each; used, free, and touched so far: on
        the CPU what is resident), and what one session at the full context takes."""
        pool = self.kv_pool
        return {"kv_bytes": pool.nbytes, "kv_page_positions": pool.page, "kv_page_bytes": pool.page_bytes,
                "kv_pages_used": pool.used, "kv_pages_free": pool.free, "kv_pages_touched": pool.touched,
                "kv_session_bytes": self._stage.max_pages * pool.page_bytes}

    # ---- tokenizer (encoding on the first stage, decoding on the last). The role, token ids and payload sizes
    # were checked by the protocol layer (worker.protocol, worker.dispatch): here they are preconditions.

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        assert self._w.tokenizer is not None, "tokenize runs on the first stage"
        return self._w.tokenizer.encode(text, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        assert self._w.detokenizer is not None, "detokenize runs on the last stage"
        return self._w.detokenizer.decode(tokens)

    def detokenize_partial(self, tokens: list[int]) -> tuple[str, int]:
        assert self._w.detokenizer is not None, "detokenize runs on the last stage"
        return self._w.detokenizer.decode_partial(tokens)

    def vocabulary(self) -> Vocabulary:
        """Last stage: the tokens a grammar's matcher masks (`worker.grammar`), read when the first grammar comes."""
        assert self.shard.is_last, "grammars run on the last stage"
        encoder = Tokenizer.from_gguf_kv(self._w.kv)
        return Vocabulary.from_gguf_kv(self._w.kv, self.info.eos_token_ids, lambda t: encoder.encode(t, False))

    # ---- forward ops. Outputs are views of the reusable host buffer: valid until the engine's next call.

    def embed_and_forward(self, session: int, tokens: list[int], position: int) -> memoryview:
        assert self.shard.is_first, "embed_and_forward runs on the first stage"
        if self._mixed(session, position, len(tokens)):
            return self.forward_batch([session], [position], [tokens], [len(tokens)], compile=False)  # type: ignore[return-value]
        self._sessions.new_step()
        return self._hidden_rows(session, np.asarray(tokens, dtype=np.int32), position)

    def forward_range(self, session: int, hidden: bytes, position: int, seq_len: int) -> memoryview:
        assert not (self.shard.is_first or self.shard.is_last), "forward_range runs on middle stages"
        if self._mixed(session, position, seq_len):
            return self.forward_batch([session], [position], [hidden], [seq_len], compile=False)  # type: ignore[return-value]
        self._sessions.new_step()
        return self._hidden_rows(session, self._hidden(hidden, seq_len), position)

    def forward_logits(self, session: int, hidden: bytes, position: int, seq_len: int) -> np.ndarray:
        assert self.shard.is_last, "forward_logits runs on the last stage"
        # past ROW_LOGITS rows a mixed call would pay the head on every row, the ladder's calls on their last one
        if seq_len <= ROW_LOGITS and self._mixed(session, position, seq_len):
            return self.forward_batch([session], [position], [hidden], [seq_len], compile=False)[-1]  # type: ignore[index]
        self._sessions.new_step()
        last: list[Tensor] = []
        self._run(session, self._hidden(hidden, seq_len), position, lambda out, start, n: last.append(out))
        view = self._host.view(last[-1].shape[0] * self.info.vocab_size * 4)
        self._outputs.copy(last[-1], view)  # the last call's last row of logits is the last position's
        return np.frombuffer(view, dtype=np.float32)[-self.info.vocab_size:]  # (V,)

    def forward_rows(self, session: int, hidden: bytes, position: int, seq_len: int) -> np.ndarray:
        """Last stage: blocks, output norm and head for every row, (T, V) float32 logits, row i position + i's (a
        check of drafted tokens), in calls of at most ROW_LOGITS tokens."""
        assert self.shard.is_last, "forward_rows runs on the last stage"
        if self._mixed(session, position, seq_len, most=ROW_LOGITS):
            return self.forward_batch([session], [position], [hidden], [seq_len], compile=False)  # type: ignore[return-value]
        self._sessions.new_step()
        width = self.info.vocab_size * 4
        out = self._host.view(seq_len * width)

        def take(logits: Tensor, start: int, n: int) -> None:
            self._outputs.copy(logits, out[start * width:(start + n) * width])

        self._run(session, self._hidden(hidden, seq_len), position, take, most=ROW_LOGITS)
        return np.frombuffer(out, dtype=np.float32).reshape(seq_len, -1)

    def _mixed(self, session: int, position: int, n: int, most: int = 0) -> bool:
        """Whether ``n`` rows of a held session (a chat's short turn, a check) go as a mixed call (`forward_batch`)
        rather than the prefill ladder's calls (of at most ``most`` rows where given): where the mixed sizes compiled
        run them in fewer calls (`plan`, by their timed calls: a 13-token turn as one call of 16, not 8 + 4 + 1; a
        16-row check on the last stage as one call, not two of ROW_LOGITS), each call a pass over all the weights. A
        new session's prompt takes the ladder."""
        stage = self._stage
        if not (stage.mix and 1 < n <= stage.batch_rungs[0] and self.can_batch(session, position, n)):
            return False
        ladder_calls = split(n, tuple(r for r in stage.rungs if r <= (most or n)))
        return len(plan(n, stage.batch_usable(compile=False), stage.batch_s)) < len(ladder_calls)

    def rewind(self, session: int, length: int) -> None:
        self._sessions.rewind(session, length)

    def can_batch(self, session: int, position: int, rows: int = 1) -> bool:
        return (rows == 1 or self._stage.mix) and self._sessions.holds(session, position, rows)

    def forward_batch(self, sessions: list[int], positions: list[int], inputs: list[list[int]] | list[bytes],
                      rows: list[int], compile: bool = True) -> memoryview | np.ndarray:
        """``rows[b]`` positions of each session from ``positions[b]`` (each `can_batch`), in as few forwards as the
        batch ladder allows (``compile`` False: only its sizes compiled or kept on disk): inputs are token id lists
        on the first stage, ``rows[b]`` float16 or float32 rows each elsewhere. Output: every row, session after
        session: (R, D) rows (`hidden_dtype`), or (R, V) float32 logits on the last stage. Several rows of a session
        need a mixed stage (`CompiledStage.mix`)."""
        assert len(set(sessions)) == len(sessions) and all(map(self.can_batch, sessions, positions, rows))
        self._sessions.new_step()
        cfg = self._w.config
        if self.shard.is_first:
            values = np.asarray([t for tokens in inputs for t in tokens], dtype=np.int32)  # type: ignore[union-attr]
        else:
            values = np.concatenate([self._hidden(h, n) for h, n in zip(inputs, rows, strict=True)])  # type: ignore[arg-type]
        # a session crossing into a new page may evict another to find it, never one of this batch
        held = [self._sessions.begin(rid, position, n, keep=sessions)
                for rid, position, n in zip(sessions, positions, rows, strict=True)]
        at = [(s, p + i) for s, p, n in zip(held, positions, rows, strict=True) for i in range(n)]
        width = cfg.vocab_size * 4 if self.shard.is_last else self._row_bytes
        out = self._host.view(len(at) * width)
        stage, start = self._stage, 0
        rungs = stage.batch_usable(compile)
        for b in plan(len(at), rungs, stage.batch_s) if stage.mix else split(len(at), rungs):
            n = min(b, len(at) - start)  # a padded call's rows past n repeat its last row (`plan`)
            part, feed = at[start:start + n] + at[start + n - 1:start + n] * (b - n), values[start:start + n]
            if b > n:
                feed = np.concatenate([feed, np.repeat(feed[-1:], b - n, axis=0)])
            fresh, t0 = not (stage.batch_jits[b] if b > 1 else stage.decode).ready, time.perf_counter()
            if b == 1:
                (session, position), = part
                result = stage.run(feed, position, self._where(session, position), session.pages)
            else:
                result = stage.run_batch(feed, [p for _, p in part], [self._where(s, p) for s, p in part],
                                         [s.pages for s, _ in part])
            self._outputs.copy(result, out[start * width:(start + n) * width])  # before a JIT is called again
            if not fresh:
                stage.clocked(b, time.perf_counter() - t0)
            start += n
        for session, position, n in zip(held, positions, rows, strict=True):
            self._sessions.commit(session, position, n)
        return np.frombuffer(out, dtype=np.float32).reshape(len(at), -1) if self.shard.is_last else out

    # ---- sessions

    def release(self, session: int, keep: bool = False) -> bool:
        return self._sessions.release(session, keep)

    def claim(self, session: int) -> int:
        return self._sessions.claim(session)

    def fork(self, session: int, source: int, positions: int) -> int:
        n, pairs = self._sessions.fork(session, source, positions)
        try:
            self.kv_pool.copy(pairs)
        except BaseException:
            self._sessions.release(session)
            raise
        return n

    def undo(self, session: int) -> None:
        self._sessions.undo(session)

    def reset(self) -> int:
        return self._sessions.reset()

    def sessions(self) -> dict[int, int]:
        return self._sessions.positions()

    def cached_sessions(self) -> list[int]:
        return self._sessions.cached()

    def warmup(self, full: bool = True) -> None:
        """Compile every JIT (a JIT captures at its first call) on scratch sessions, then drop them (their pages go
        back to the pool, to be reused first): each size of the prefill ladder, then each batch size (b rows over as
        few scratch sessions as a batch may hold, run twice). ``full`` False: only the decode JIT, which every
        generation needs at once (the worker's default before its ready line: the stages compile it side by side
        instead of one after the other at the first request)."""
        cfg, first = self._w.config, self.shard.is_first

        def fake(n: int) -> np.ndarray:
            return np.zeros(n, np.int32) if first else np.zeros((n, cfg.dim), np.float32)

        def ignore(out: Tensor, start: int, n: int) -> None:
            pass

        for n in self._stage.rungs if full else (1,):
            if n + 1 < cfg.max_context:  # decode runs at positions 1 and 2, past a one-token prefix
                for position in ((0, 0) if n > 1 else (0, 1, 2)):
                    self._run(WARMUP_SESSION, fake(n), position, ignore, rungs=(n,))
        self._sessions.release(WARMUP_SESSION)
        if not full:
            return
        for b in self._stage.batch_rungs[:-1]:  # b rows over as few sessions as a batch holds (a mixed stage's)
            per = -(-b // min(b, self.max_batch))
            rows = [per] * (b // per) + ([b % per] if b % per else [])
            if 1 + per + 1 > cfg.max_context:  # past a one-token prefix, and a position left to decode
                continue
            rids = [WARMUP_SESSION - i for i in range(len(rows))]
            try:
                for rid in rids:
                    self._run(rid, fake(1), 0, ignore)
                inputs: list[Any] = [[0] * n if first else bytes(n * self._row_bytes) for n in rows]
                for _ in range(3):  # the later calls replay what the first captured (timed: `plan`)
                    self.forward_batch(rids, [1] * len(rids), inputs, rows)
            finally:
                for rid in rids:
                    self._sessions.release(rid)

    # ---- internals

    def _hidden(self, hidden: bytes, seq_len: int) -> np.ndarray:
        """float16 or float32 bytes of (1, T, D) -> (T, D) float32 (float16 widens exactly)."""
        values = seq_len * self.info.hidden_dim
        assert len(hidden) in (2 * values, 4 * values), "the protocol layer checks the payload size"
        dtype = "<f4" if len(hidden) == 4 * values else "<f2"
        return np.frombuffer(hidden, dtype=dtype).reshape(seq_len, -1).astype(np.float32, copy=False)  # (T, D)

    def _hidden_rows(self, rid: int, values: np.ndarray, position: int) -> memoryview:
        """Run ``values`` and gather every call's (1, n, D) output rows in the host buffer."""
        rows = self._host.view(len(values) * self._row_bytes)
        row = self._row_bytes

        def take(out: Tensor, start: int, n: int) -> None:
            self._outputs.copy(out, rows[start * row:(start + n) * row])  # before the next call reuses ``out``

        self._run(rid, values, position, take)
        return rows

    def _run(self, rid: int, values: np.ndarray, position: int, take: Callable[[Tensor, int, int], None],
             rungs: tuple[int, ...] | None = None, most: int = 0) -> None:
        """Check the session rules (and find its pages), then run ``values`` through the stage in ladder-sized calls
        (``rungs``, by default `CompiledStage.usable`, of at most ``most`` tokens where given), none crossing a page;
        ``take(out, start, n)`` after each call, before the next one can overwrite its output."""
        seq_len = len(values)
        session = self._sessions.begin(rid, position, seq_len)
        start = 0
        for piece in _pieces(position, seq_len, self.kv_pool.page):
            for n in split(piece, rungs or self._stage.usable(min(piece, most or piece))):
                fresh, t0 = not self._stage.jits[n].ready, time.perf_counter()
                at = position + start
                take(self._stage.run(values[start:start + n], at, self._where(session, at), session.pages), start, n)
                self._stage.timed(n, fresh, time.perf_counter() - t0)
                start += n
        self._sessions.commit(session, position, seq_len)

    def _where(self, session: Session, position: int) -> tuple[int, int]:
        """The pool's page and the offset in it that hold ``position`` of ``session``."""
        page = self.kv_pool.page
        return session.pages[position // page], position % page


def _pieces(position: int, seq_len: int, page: int) -> list[int]:
    """The lengths of [position, position + seq_len) cut at page boundaries: 300 positions from 200 in pages of
    256 -> [56, 244]."""
    pieces, end = [], position + seq_len
    while position < end:
        stop = min(end, (position // page + 1) * page)
        pieces.append(stop - position)
        position = stop
    return pieces
