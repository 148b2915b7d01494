"""RoPE scaling for generated models: the GGUF keys and the llama3 `rope_freqs.weight` a converter would write.

Real models reach long contexts by stretching RoPE: Llama 3.1+ ship per-frequency factors as a tensor
(`rope_freqs.weight`), others set `{arch}.rope.scaling.type` = linear / yarn with a factor. To make the scaling
matter within a test's few dozen positions, tests use a small original context (e.g. 32) rather than 8192.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFWriter


@dataclass(frozen=True)
class RopeScaling:
    """What a GGUF says about RoPE beyond freq_base; None leaves a key out."""

    type: str | None = None  # {arch}.rope.scaling.type: "none", "linear", "yarn"... (absent: llama.cpp assumes linear)
    factor: float | None = None  # {arch}.rope.scaling.factor
    original_context_length: int | None = None  # {arch}.rope.scaling.original_context_length
    attn_factor: float | None = None  # {arch}.rope.scaling.attn_factor
    freq_factors: tuple[float, ...] | None = None  # the rope_freqs.weight tensor (head_dim / 2 floats)

    def write(self, writer: GGUFWriter, arch: str = "llama") -> None:
        """The keys and the tensor; call before the model's other tensors are added."""
        for key, value in (("type", self.type), ("factor", self.factor),
                           ("original_context_length", self.original_context_length),
                           ("attn_factor", self.attn_factor)):
            if value is None:
                continue
            if isinstance(value, str):
                writer.add_string(f"{arch}.rope.scaling.{key}", value)
            elif isinstance(value, int):
                writer.add_uint32(f"{arch}.rope.scaling.{key}", value)
            else:
                writer.add_float32(f"{arch}.rope.scaling.{key}", value)
        if self.freq_factors is not None:
            writer.add_tensor("rope_freqs.weight", np.asarray(self.freq_factors, dtype=np.float32))


def llama3_rope_factors(head_dim: int, rope_theta: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 8192) -> tuple[float, ...]:
    """rope_freqs.weight as convert_hf_to_gguf.py writes it for rope_type "llama3" (float32, head_dim/2): 1 for
    wavelengths under original/high_freq_factor, ``factor`` over original/low_freq_factor, and in between
    1/((1 - s)/factor + s) with s = (original/wavelength - low)/(high - low). Llama 3.1 8B: factor 8, 8192."""
    freqs = 1.0 / (np.float32(rope_theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(float(x) for x in np.asarray(out, dtype=np.float32))
