"""The exactness reference for pipelines: one process holding ALL blocks, casting the hidden state to fp16 and
back at the same block boundaries as an N-stage chain (what crossing the wire does).

It uses tinygrad's own whole-file loader (`Transformer.from_gguf`) and its blocks with their own KV caches:
nothing of pp_worker's engine. That loader casts every tensor to fp16; the engine keeps the 1-D ones (norm gains)
in float32, as ggml does, so they are put back here as the `gguf` package reads them from the file. Prefill is
eager with a concrete length; decode is a TinyJit with a symbolic position. With ``kv_dtype`` the blocks get
caches of that dtype, which tinygrad's own attention stores into uncast (on the CPU, C converts each value as a
cast would).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader
from tinygrad import Tensor, TinyJit, UOp
from tinygrad.dtype import DType
from tinygrad.llm.model import Transformer, precompute_freqs_cis
from tinygrad.nn.state import get_state_dict, load_state_dict


class SameCastReference:
    """One process, all blocks, fp16 casts at the chain's boundaries (see the module docstring)."""

    def __init__(self, path: Path, max_context: int, kv_dtype: DType | None = None):
        self.model, _ = Transformer.from_gguf(str(path), max_context, realize=True)
        names = get_state_dict(self.model).keys()
        gains = {t.name: Tensor(np.array(t.data, np.float32)) for t in GGUFReader(path).tensors
                 if len(t.shape) == 1 and t.name in names}
        load_state_dict(self.model, gains, strict=False, verbose=False)
        if kv_dtype is not None:  # what _init_state makes, but in kv_dtype
            c = self.model.blk[0].config
            freqs = precompute_freqs_cis(c.rope_dim, max_context, c.rope_theta).realize()
            for block in self.model.blk:
                block.cache_kv = Tensor.zeros(2, 1, c.n_kv_heads, max_context, c.head_dim, dtype=kv_dtype)
                block.cache_kv = block.cache_kv.contiguous().realize()
                block.freqs_cis = freqs
        self.start_pos = UOp.variable("start_pos", 0, max_context - 1)
        self.decoders: dict[frozenset[int], TinyJit] = {}

    def _forward(self, tokens: Tensor, start_pos, boundaries: frozenset[int]) -> Tensor:
        m = self.model
        x = m.token_embd(tokens).float()
        for i, block in enumerate(m.blk):
            if i in boundaries:
                x = x.half().float()  # what crossing the wire does
            x = block(x, start_pos)
        return m.output(m.output_norm(x))[:, -1, :].float()

    def generate(self, prompt: list[int], n: int, boundaries: set[int]) -> tuple[list[int], list[np.ndarray]]:
        b = frozenset(boundaries)
        decode = self.decoders.setdefault(b, TinyJit(lambda t, p: self._forward(t, p, b)))
        logits = [self._forward(Tensor([prompt], dtype="int32"), 0, b).numpy()[0]]
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            pos = self.start_pos.bind(len(prompt) + len(out) - 1)
            logits.append(decode(Tensor([[out[-1]]], dtype="int32"), pos).numpy()[0].copy())
            out.append(int(logits[-1].argmax()))
        return out, logits
