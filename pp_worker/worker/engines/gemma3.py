"""Gemma 3 (``gemma3``), as llama.cpp's gemma3 graph computes it (its iswa build: the files with a sliding window).

What differs from the plain-attention block (`kvcache.CacheBlock`):
- the token embedding is multiplied by sqrt(dim) (`ScaledEmbedding`);
- each block normalizes the attention's output and the feed-forward's output again before adding them to the
  residual stream (``post_attention_norm``, ``post_ffw_norm``), besides the usual pre-norms;
- q and k are RMS-normed per head (tinygrad's ``qk_norm``, the key_length-wide gains), the feed-forward is
  GELU(tanh)(gate) * up;
- the attention scale is 1/sqrt(key_length) (llama.cpp's: 1/sqrt(dim/n_heads) for the 62-block 27B), applied to q;
- most blocks attend over a sliding window of ``attention.sliding_window`` positions (the key at p is seen from the
  query at q when q - p < window), roped with their own base ``rope.local.freq_base`` (10000 by default) and no
  scaling; every 6th block (il % 6 == 5) attends over everything, roped as the file's other keys say.

GGUF's Gemma norm gains already hold the +1 of Gemma's RMSNorm (llama.cpp's converter adds it), so every norm is
a plain RMSNorm over the stored gains. Q and K rows are in the file's (HF, half-split) order, as for qwen: no
permutation at load. No final logit soft-capping: llama.cpp applies it only in its non-sliding build.
"""

from __future__ import annotations

import math
from typing import Any

from tinygrad import Tensor, UOp, nn
from tinygrad.llm.model import TransformerConfig

from pp_worker.worker.engines.kvcache import CacheBlock, Mix, Slot
from pp_worker.worker.engines.rope import RopeParams
from pp_worker.worker.engines.weights import Embedding, products
from pp_worker.worker.gguf.header import ModelLoadError

ARCH = "gemma3"
SWA_PATTERN = 6  # llama.cpp's set_swa_pattern(6): block il slides unless il % 6 == 5
LOCAL_ROPE_BASE = 10000.0  # llama.cpp's default for rope.local.freq_base
LARGE_BLOCKS = 62  # llama.cpp names a 62-block gemma3 27B and scales its attention by 1/sqrt(dim / n_heads)


def is_sliding(i: int) -> bool:
    """Whether block ``i`` (absolute index) attends over the sliding window."""
    return i % SWA_PATTERN < SWA_PATTERN - 1


def sliding_window(kv: dict[str, Any]) -> int:
    """The window of the sliding blocks; llama.cpp requires the key too."""
    key = f"{ARCH}.attention.sliding_window"
    if not isinstance(kv.get(key), int) or kv[key] < 1:
        raise ModelLoadError(f"gemma3: GGUF metadata lacks a positive {key} (got {kv.get(key)!r})")
    return kv[key]


def attention_scale(kv: dict[str, Any], config: TransformerConfig) -> float:
    """What q . k is multiplied by: llama.cpp's f_attention_scale."""
    if config.num_blocks == LARGE_BLOCKS:
        return 1.0 / math.sqrt(config.dim // config.n_heads)
    return 1.0 / math.sqrt(config.head_dim)


def local_rope(kv: dict[str, Any], dim: int) -> RopeParams:
    """The sliding blocks' RoPE: their own base, unscaled (llama.cpp's rope_freq_scale_train_swa = 1)."""
    return RopeParams(dim, float(kv.get(f"{ARCH}.rope.local.freq_base", LOCAL_ROPE_BASE)))


class GemmaBlock(CacheBlock):
    """A Gemma 3 block over the stage's KV pages: `CacheBlock` with the post-norms, the GELU feed-forward, q scaled
    to the model's attention scale, and (``window`` > 0) a sliding window with its own RoPE table (``rope``, which
    `tinygrad_engine.CompiledStage` turns into the block's table)."""

    q_scale = 1.0  # multiplies q: the attention divides by sqrt(head_dim) itself
    rope: RopeParams | None = None  # None: the stage's RoPE

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.post_attention_norm = nn.RMSNorm(config.dim, config.norm_eps)
        self.post_ffw_norm = nn.RMSNorm(config.dim, config.norm_eps)

    def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        h = x + self.post_attention_norm(self._attention(self.attn_norm(x), start_pos))
        return (h + self.post_ffw_norm(self._feed_forward(self.ffn_norm(h)))).contiguous()

    def _feed_forward(self, x: Tensor) -> Tensor:
        gate, up = products(x, self.ffn_gate, self.ffn_up)
        return self.ffn_down(gate.gelu().contiguous() * up)  # Tensor.gelu: the tanh form

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, start_pos: int | UOp,
               freqs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super()._heads(q, k, v, start_pos, freqs)
        return (q * self.q_scale if self.q_scale != 1.0 else q), k, v

    def step_batch(self, x: Tensor, slots: list[Slot], positions: list[UOp]) -> Tensor:
        h = self.attn_norm(x)
        q, k, v = self._qkv(h)
        rows = [self._attend(*self._heads(q[b:b + 1], k[b:b + 1], v[b:b + 1], pos), slot, pos)
                for b, (slot, pos) in enumerate(zip(slots, positions, strict=True))]
        h = x + self.post_attention_norm(self.attn_output(rows[0].cat(*rows[1:])))
        return (h + self.post_ffw_norm(self._feed_forward(self.ffn_norm(h)))).contiguous()

    def step_rows(self, x: Tensor, mix: Mix) -> Tensor:
        h = x + self.post_attention_norm(self.attn_output(self._attend_rows(self.attn_norm(x), mix)))
        return (h + self.post_ffw_norm(self._feed_forward(self.ffn_norm(h)))).contiguous()


def configure(block: GemmaBlock, kv: dict[str, Any], config: TransformerConfig, i: int) -> None:
    """Block ``i``'s own settings: its attention scale, and on a sliding block the window and the local RoPE."""
    block.q_scale = attention_scale(kv, config) * math.sqrt(config.head_dim)
    if is_sliding(i):
        block.window = sliding_window(kv)
        block.rope = local_rope(kv, config.rope_dim)


class ScaledEmbedding(Embedding):
    """Rows of the embedding times sqrt(dim), in float32 (llama.cpp scales the float32 rows it gathered)."""

    def __init__(self, weight: Any, kernels: str, dim: int):
        super().__init__(weight, kernels)
        self.scale = math.sqrt(dim)

    def __call__(self, idx: Tensor) -> Tensor:
        return super().__call__(idx) * self.scale
