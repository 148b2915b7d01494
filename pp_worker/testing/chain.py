"""N stage engines in one process, hidden states passed along as the real pipeline's workers send them (float16
where it holds them, `q8.emit`): the harness of the exactness tests and of `bench.gpu` (greedy generation, logits of
every step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pp_worker.worker import q8
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine


def on_wire(engine: TinygradEngine, hidden: bytes | memoryview, wire: str = "f16") -> bytes:
    """``engine``'s hidden-state output as the next stage reads it from a worker whose ``PP_WIRE_DTYPE`` is
    ``wire``: float16 bytes (float32 past float16's range), float32 bytes, or q8 decoded to float16."""
    dim = engine.info.hidden_dim
    payload, dtype = q8.emit(hidden, engine.hidden_dtype, wire, dim)
    return q8.decode(bytes(payload), len(payload) // (dim + q8.SCALE_BYTES), dim) if dtype == "q8" else bytes(payload)


def wire_rows(engine: TinygradEngine, hidden: bytes | memoryview, wire: str = "f16") -> list[bytes]:
    """A batched step's (B, D) output as B rows, each `on_wire`."""
    width = engine.info.hidden_dim * (4 if engine.hidden_dtype == "f32" else 2)
    return [on_wire(engine, hidden[i * width:(i + 1) * width], wire) for i in range(len(hidden) // width)]


def step_batch(engine: Any, sessions: list[int], positions: list[int], inputs: list[int] | list[bytes]) \
        -> Any:
    """One token for each session in one batched forward (`Engine.forward_batch`): a token id each on the first
    stage, one row each elsewhere; (B, D) rows or (B, V) logits."""
    ones = [1] * len(sessions)
    return engine.forward_batch(sessions, positions, [[t] for t in inputs] if engine.shard.is_first else inputs, ones)


class Chain:
    """``num_stages`` engines on one GGUF; ``kw`` goes to every engine (prefill_chunk, kv_dtype...). Its engines
    compile every prefill size a prompt needs (``every_size``) unless told otherwise: the tests cover each size.
    ``wire``: the workers' PP_WIRE_DTYPE (`on_wire`)."""

    def __init__(self, path: Path | str, num_stages: int, max_context: int, wire: str = "f16", **kw: Any):
        kw.setdefault("every_size", True)
        self.wire = wire
        self.engines = [TinygradEngine(str(path), s, num_stages, max_context=max_context, **kw)
                        for s in range(num_stages)]

    @property
    def boundaries(self) -> set[int]:
        """The first block of every stage but the first: where the hidden state crosses the wire."""
        return {e.shard.start for e in self.engines[1:]}

    def step(self, rid: int, tokens: list[int], position: int) -> np.ndarray:
        """(V,) float32 logits of the last of ``tokens``, run at ``position`` of session ``rid``."""
        return self.engines[-1].forward_logits(rid, self._hidden(rid, tokens, position), position,
                                               len(tokens)).copy()  # engines reuse buffers

    def rows(self, rid: int, tokens: list[int], position: int) -> np.ndarray:
        """(T, V) float32 logits of every one of ``tokens`` (a check of drafted tokens: `forward_rows`)."""
        return self.engines[-1].forward_rows(rid, self._hidden(rid, tokens, position), position, len(tokens)).copy()

    def batch(self, rids: list[int], tokens: list[list[int]], positions: list[int]) -> np.ndarray:
        """(R, V) float32 logits of every row of one batched forward (`forward_batch`) on every stage, through the
        wire: session ``rids[b]``'s ``tokens[b]`` from ``positions[b]``, session after session."""
        rows = [len(t) for t in tokens]
        ends = np.cumsum(rows).tolist()
        out: Any = self.engines[0].forward_batch(rids, positions, tokens, rows)
        for before, e in zip(self.engines, self.engines[1:], strict=False):
            wired = wire_rows(before, out, self.wire)
            out = e.forward_batch(rids, positions, [b"".join(wired[end - n:end]) for n, end in zip(rows, ends,
                                                                                                 strict=True)], rows)
        return np.array(out)  # a copy: engines reuse buffers

    def _hidden(self, rid: int, tokens: list[int], position: int) -> bytes:
        """What the last stage receives for ``tokens``: every stage before it run, through the wire."""
        h = on_wire(self.engines[0], self.engines[0].embed_and_forward(rid, tokens, position), self.wire)
        for e in self.engines[1:-1]:
            h = on_wire(e, e.forward_range(rid, h, position, len(tokens)), self.wire)
        return h

    def release(self, rid: int) -> None:
        for e in self.engines:
            e.release(rid)

    def fork(self, rid: int, source: int, positions: int) -> list[int]:
        """Each stage's `Engine.fork` of ``source``'s first ``positions`` into ``rid``: the positions each copied."""
        return [e.fork(rid, source, positions) for e in self.engines]

    def generate(self, rid: int, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
        """``n`` greedy tokens after ``prompt`` and the logits each was the argmax of."""
        logits = [self.step(rid, prompt, 0)]
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            logits.append(self.step(rid, [out[-1]], len(prompt) + len(out) - 1))
            out.append(int(logits[-1].argmax()))
        return out, logits
