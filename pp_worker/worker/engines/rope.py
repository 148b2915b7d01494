"""RoPE as llama.cpp computes it, scaling included: the table every block of a stage rotates Q and K with.

tinygrad's `precompute_freqs_cis(dim, end, theta)` knows only the base, so a model that stretches RoPE for long
contexts would drift from llama.cpp (by 2-3 logits on the test models). ggml (`ggml_rope_cache_init` and
`rope_yarn`), for rotary pair i of ``dim`` and position p:

    theta_extrap = p * base^(-2i/dim) / freq_factors[i]    # freq_factors: rope_freqs.weight (Llama 3.1+), else 1
    theta        = freq_scale * theta_extrap                # freq_scale = 1/factor for linear and yarn, else 1
    yarn only:     theta = theta*(1 - mix_i) + theta_extrap*mix_i, mix_i = 1 - clamp((i - lo)/(hi - lo), 0, 1)
                   (lo, hi: the pairs whose wavelengths fit beta_fast=32 / beta_slow=1 turns of the original
                   context), and cos, sin both scaled by mscale = 1 + 0.1 ln(factor)

tinygrad's `apply_rope` multiplies both halves of each head by cos and sin, so yarn's mscale folds into the table.
The table is built in float64 numpy (closer to exact than either float32 computation) and handed over as float32.
Scaling that llama.cpp would apply and this does not know is refused at load, never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pp_worker.worker.gguf.header import ModelLoadError

if TYPE_CHECKING:
    from tinygrad import Tensor

SCALING_TYPES = ("none", "linear", "yarn")
# rope.scaling.* keys understood here; "finetuned" is informational
SCALING_KEYS = ("type", "factor", "original_context_length", "finetuned")
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's defaults; the llama architecture reads no others
# keys accepted only at the value this module applies anyway: another value would change the numbers in a way not
# checked against llama.cpp, so it is refused by name, as is any key not listed (alpha, yarn_log_multiplier...)
NEUTRAL = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_beta_fast": YARN_BETA_FAST,
           "yarn_beta_slow": YARN_BETA_SLOW}


@dataclass(frozen=True)
class RopeParams:
    dim: int  # rotary dimensions per head (pairs: dim / 2)
    base: float = 10000.0
    freq_scale: float = 1.0
    yarn: bool = False
    original_context: int = 0  # yarn: the context the model was trained for
    freq_factors: tuple[float, ...] | None = None

    @staticmethod
    def from_gguf(kv: dict[str, Any], dim: int, freq_factors: np.ndarray | None = None) -> RopeParams:
        """From the GGUF's {arch}.rope.* keys (llama.cpp's defaults for absent ones) and rope_freqs.weight."""
        arch = kv["general.architecture"]
        scaling = {k.rsplit(".", 1)[1]: v for k, v in kv.items() if k.startswith(f"{arch}.rope.scaling.")}
        if unknown := sorted(k for k, v in scaling.items() if k not in SCALING_KEYS and NEUTRAL.get(k) != v):
            raise ModelLoadError(f"unsupported RoPE setting {arch}.rope.scaling.{unknown[0]}="
                                 f"{scaling[unknown[0]]!r} (understood: {', '.join(SCALING_KEYS)}, and "
                                 f"{', '.join(f'{k}={v}' for k, v in NEUTRAL.items())})")
        kind = scaling.get("type", "linear")  # llama.cpp's reading of a file without the key
        if kind not in SCALING_TYPES:
            raise ModelLoadError(f"unsupported RoPE scaling {kind!r} ({arch}.rope.scaling.type; supported: "
                                 f"{', '.join(SCALING_TYPES)})")
        factor = scaling.get("factor") or kv.get(f"{arch}.rope.scale_linear") or 0.0  # 0: not scaled
        if not (math.isfinite(factor) and factor >= 0):
            raise ModelLoadError(f"invalid RoPE scaling factor {factor!r} ({arch}.rope.scaling.factor)")
        if freq_factors is not None and np.shape(freq_factors) != (dim // 2,):
            raise ModelLoadError(f"rope_freqs.weight has shape {np.shape(freq_factors)}, expected ({dim // 2},)")
        return RopeParams(dim, float(kv.get(f"{arch}.rope.freq_base", 10000.0)),
                          1.0 if kind == "none" or factor == 0 else 1.0 / factor, yarn=kind == "yarn",
                          original_context=int(scaling.get("original_context_length")
                                               or kv.get(f"{arch}.context_length", 0)),
                          freq_factors=None if freq_factors is None else tuple(map(float, freq_factors)))


def _yarn_ramp(p: RopeParams) -> np.ndarray:
    """Per pair, how much of the unscaled angle yarn keeps: 1 for high frequencies, 0 for low ones."""
    def corr_dim(turns: float) -> float:
        return p.dim * math.log(p.original_context / (turns * 2 * math.pi)) / (2 * math.log(p.base))

    lo, hi = max(0.0, math.floor(corr_dim(YARN_BETA_FAST))), min(p.dim - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))
    return 1.0 - np.clip((np.arange(p.dim // 2) - lo) / max(0.001, hi - lo), 0.0, 1.0)


def rope_table(p: RopeParams, positions: int) -> np.ndarray:
    """(positions, dim) float64: cos of every pair's angle, then sin, magnitude included."""
    pair = np.arange(p.dim // 2, dtype=np.float64)
    factors = np.ones(p.dim // 2) if p.freq_factors is None else np.asarray(p.freq_factors, dtype=np.float64)
    extrap = np.arange(positions, dtype=np.float64)[:, None] * p.base ** (-2.0 * pair / p.dim) / factors  # (T, dim/2)
    theta, mscale = p.freq_scale * extrap, 1.0
    if p.yarn:
        mix = _yarn_ramp(p)
        theta = theta * (1 - mix) + extrap * mix
        mscale = 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    return np.concatenate([np.cos(theta), np.sin(theta)], axis=-1) * mscale


def freqs_cis(p: RopeParams, max_context: int) -> Tensor:
    """A drop-in for tinygrad's precompute_freqs_cis(dim, max_context, base): (max_context, dim) float32, realized
    (written in place on the CPU: `hostio.filled`)."""
    from tinygrad import dtypes

    from pp_worker.worker.hostio import filled

    table = rope_table(p, max_context).astype(np.float32)

    def fill(mv: memoryview) -> None:
        np.frombuffer(mv, np.float32)[:] = table.reshape(-1)

    return filled(table.shape, dtypes.float32, fill)
