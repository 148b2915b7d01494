"""The tinygrad engine: one pipeline stage's blocks, compiled with TinyJit, one KV cache per generation.

Compute per stage (fp16 on the wire between stages):
  first:  x = token_embd(tokens).float()   -> blocks -> x.half()
  middle: x = hidden.float()               -> blocks -> x.half()
  last:   x = hidden.float()               -> blocks -> output(output_norm(x[last position])).float()

Two TinyJits trace the same function: ``decode`` (one token, concrete T=1) and ``prefill`` (a symbolic number of
tokens up to PREFILL_CHUNK; longer prompts go in chunks). The position is a symbolic ``start_pos`` variable bound
per call, so after warm-up a step compiles nothing and runs no Python per block. Each session's KV caches are
explicit JIT arguments: the JIT swaps argument buffers on replay, whereas a cache swapped in as a block attribute
would silently keep the buffer it captured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from tinygrad import Tensor, TinyJit, UOp, dtypes

from pp_worker.worker.engines.base import ModelInfo
from pp_worker.worker.engines.gguf_loader import StageWeights, eos_token_ids, load_stage
from pp_worker.worker.engines.kvcache import KVPool
from pp_worker.worker.engines.rope import freqs_cis
from pp_worker.worker.engines.sessions import SessionTable
from pp_worker.worker.engines.vocab import bos_token

if TYPE_CHECKING:
    from tinygrad.device import Buffer

PREFILL_CHUNK = 32  # tokens per prefill JIT call, as Transformer.generate
WARMUP_SESSION = -1  # request ids are >= 0, so the scratch session never collides with a real one


def _buffer(t: Tensor) -> Buffer:
    buf = t.uop.base.realized
    assert buf is not None, "expected a realized tensor"
    return buf


class InputBuffer:
    """A persistent realized input the JITs read; writing it costs microseconds, a new Tensor milliseconds."""

    def __init__(self, shape: tuple[int, ...], dtype: object):
        self.tensor = Tensor.zeros(*shape, dtype=dtype).contiguous().realize()
        self.np_dtype = np.dtype(self.tensor.dtype.fmt)
        buf = _buffer(self.tensor)
        # the condition under which Buffer.as_memoryview can hand out the device memory itself (CPU)
        self.zero_copy = hasattr(buf.allocator, "_as_buffer") and buf.options is None
        self.staging = None if self.zero_copy else np.zeros(buf.size, dtype=self.np_dtype)

    def write(self, values: np.ndarray) -> None:
        buf = _buffer(self.tensor)
        if self.staging is None:  # as_memoryview also waits for kernels still reading the buffer
            view = np.frombuffer(buf.as_memoryview(force_zero_copy=True), dtype=self.np_dtype)
            view[: values.size] = values.reshape(-1)
        else:
            self.staging[: values.size] = values.reshape(-1)
            buf.copyin(memoryview(self.staging).cast("B"))


def _leading_bytes(t: Tensor, nbytes: int) -> bytes:
    """The first ``nbytes`` of a realized output (a prefill output's shape is symbolic, its buffer full size)."""
    return bytes(_buffer(t).as_memoryview(allow_zero_copy=True)[:nbytes])


class CompiledStage:
    """This stage's forward, traced by a decode JIT and a prefill JIT, with persistent input buffers."""

    def __init__(self, w: StageWeights):
        self.w, cfg = w, w.config
        self.start_pos = UOp.variable("start_pos", 0, cfg.max_context - 1)
        self.n_tokens = UOp.variable("n_tokens", 1, PREFILL_CHUNK)
        dtype, row = (dtypes.int32, ()) if w.shard.is_first else (dtypes.float16, (cfg.dim,))
        self.decode_in = InputBuffer((1, 1, *row), dtype)  # (1, 1) tokens or (1, 1, D) hidden
        self.prefill_in = InputBuffer((1, PREFILL_CHUNK, *row), dtype)
        self.decode = TinyJit(self._forward)
        self.prefill = TinyJit(self._forward)
        # normally set by TransformerBlock._init_state, which is skipped because we set cache_kv ourselves
        freqs = freqs_cis(w.rope, cfg.max_context).realize()  # with the model's RoPE scaling, unlike tinygrad's
        for block in w.blocks:
            block.freqs_cis = freqs

    def _forward(self, inp: Tensor, caches: list[Tensor], start_pos: UOp) -> Tensor:
        w = self.w
        x = w.token_embd(inp).float() if w.token_embd is not None else inp.float()  # (1, T, D)
        for block, cache in zip(w.blocks, caches, strict=True):
            block.cache_kv = cache  # the argument's buffer: the JIT substitutes each call's session cache
            x = block(x, start_pos)
        for block in w.blocks:  # the graph holds the caches now; a block must not keep a released session's
            del block.cache_kv
        if w.output is None:
            return x.half()  # (1, T, D)
        T = x.shape[1]
        # head on the last position only: returning logits[:, -1] would hand back a view whose offset (T-1)
        # is frozen at capture, so a prefill JIT replayed with another length would read the wrong row
        x = x.shrink((None, (T - 1, T), None))  # (1, 1, D)
        return w.output(w.output_norm(x))[:, 0, :].float()  # (1, V)

    def run(self, values: np.ndarray, caches: list[Tensor], position: int, n: int) -> Tensor:
        """One call of at most PREFILL_CHUNK tokens (``values``: n token ids or (n, D) fp16) at ``position``."""
        pos = self.start_pos.bind(position)
        if n == 1:
            self.decode_in.write(values)
            return self.decode(self.decode_in.tensor, caches, pos)
        self.prefill_in.write(values)
        return self.prefill(self.prefill_in.tensor[:, : self.n_tokens.bind(n)], caches, pos)


class TinygradEngine:
    """engines.base.Engine on tinygrad; loads only this stage's tensors from the GGUF file."""

    def __init__(self, model: str, stage: int, num_stages: int, *, max_context: int | None = None,
                 max_sessions: int = 8, emit: Callable[..., None] = lambda kind, **f: None):
        self._w = load_stage(model, stage, num_stages, max_context, emit=emit)
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
        self._stage = CompiledStage(self._w)
        self.kv_pool = KVPool(cfg, len(self._w.blocks), keep=max_sessions)
        self._sessions = SessionTable(max_sessions, cfg.max_context, self.kv_pool, emit)

    @property
    def loaded_tensors(self) -> dict[str, int]:
        """GGUF tensor name -> bytes this stage read from the file (nothing else was read)."""
        return dict(self._w.loaded)

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

    # ---- forward ops

    def embed_and_forward(self, session: int, tokens: list[int], position: int) -> bytes:
        assert self.shard.is_first, "embed_and_forward runs on the first stage"
        ids = np.asarray(tokens, dtype=np.int32)
        return b"".join(self._run(session, ids, position, len(tokens), self._hidden_bytes))

    def forward_range(self, session: int, hidden: bytes, position: int, seq_len: int) -> bytes:
        assert not (self.shard.is_first or self.shard.is_last), "forward_range runs on middle stages"
        return b"".join(self._run(session, self._hidden(hidden, seq_len), position, seq_len, self._hidden_bytes))

    def forward_logits(self, session: int, hidden: bytes, position: int, seq_len: int) -> np.ndarray:
        assert self.shard.is_last, "forward_logits runs on the last stage"
        outs = self._run(session, self._hidden(hidden, seq_len), position, seq_len, lambda t, n: t)
        return outs[-1].numpy().reshape(-1)  # (V,) float32 of the last position

    # ---- sessions

    def release(self, session: int) -> bool:
        return self._sessions.release(session)

    def sessions(self) -> dict[int, int]:
        return self._sessions.positions()

    def warmup(self) -> None:
        """Compile both JITs (a JIT captures on its second call) on a scratch session, then drop it."""
        cfg = self._w.config
        if cfg.max_context < 4:
            return
        n = 2
        fake = np.zeros(n, np.int32) if self.shard.is_first else np.zeros((n, cfg.dim), np.float16)
        for _ in range(2):
            self._run(WARMUP_SESSION, fake, 0, n, lambda t, k: None)  # prefill JIT
        for p in (n, n + 1):
            self._run(WARMUP_SESSION, fake[:1], p, 1, lambda t, k: None)
        self._sessions.release(WARMUP_SESSION)

    # ---- internals

    def _hidden(self, hidden: bytes, seq_len: int) -> np.ndarray:
        assert len(hidden) == seq_len * self.info.hidden_dim * 2, "the protocol layer checks the payload size"
        return np.frombuffer(hidden, dtype="<f2").reshape(seq_len, self.info.hidden_dim)  # (T, D)

    def _hidden_bytes(self, out: Tensor, n: int) -> bytes:
        return _leading_bytes(out, n * self.info.hidden_dim * 2)  # (1, n, D) fp16

    def _run(self, rid: int, values: np.ndarray, position: int, seq_len: int, take: Callable) -> list:
        """Check the session rules, then run ``values`` through the stage in chunks; ``take(out, n)`` per chunk."""
        session = self._sessions.begin(rid, position, seq_len)
        results = []
        for start in range(0, seq_len, PREFILL_CHUNK):
            n = min(PREFILL_CHUNK, seq_len - start)
            out = self._stage.run(values[start:start + n], session.cache, position + start, n)
            results.append(take(out, n))
        self._sessions.commit(session, position, seq_len)
        return results
