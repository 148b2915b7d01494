"""N stage engines in one process, hidden states passed along as fp16 bytes as the real pipeline does: the harness
of the exactness tests and of `bench.gpu` (greedy generation, logits of every step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pp_worker.worker.engines.tinygrad_engine import TinygradEngine


class Chain:
    """``num_stages`` engines on one GGUF; ``kw`` goes to every engine (prefill_chunk, kv_dtype...). Its engines
    compile every prefill size a prompt needs (``every_size``) unless told otherwise: the tests cover each size."""

    def __init__(self, path: Path | str, num_stages: int, max_context: int, **kw: Any):
        kw.setdefault("every_size", True)
        self.engines = [TinygradEngine(str(path), s, num_stages, max_context=max_context, **kw)
                        for s in range(num_stages)]

    @property
    def boundaries(self) -> set[int]:
        """The first block of every stage but the first: where the hidden state crosses the wire."""
        return {e.shard.start for e in self.engines[1:]}

    def step(self, rid: int, tokens: list[int], position: int) -> np.ndarray:
        """(V,) float32 logits of the last of ``tokens``, run at ``position`` of session ``rid``."""
        h = self.engines[0].embed_and_forward(rid, tokens, position)
        for e in self.engines[1:-1]:
            h = e.forward_range(rid, bytes(h), position, len(tokens))
        return self.engines[-1].forward_logits(rid, bytes(h), position, len(tokens)).copy()  # engines reuse buffers

    def release(self, rid: int) -> None:
        for e in self.engines:
            e.release(rid)

    def generate(self, rid: int, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
        """``n`` greedy tokens after ``prompt`` and the logits each was the argmax of."""
        logits = [self.step(rid, prompt, 0)]
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            logits.append(self.step(rid, [out[-1]], len(prompt) + len(out) - 1))
            out.append(int(logits[-1].argmax()))
        return out, logits
