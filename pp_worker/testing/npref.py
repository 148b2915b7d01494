"""An independent float64 numpy llama forward pass, the reference the tinygrad engine is checked against; also
qwen3moe and Mixtral-style experts in llama files (llama.cpp's routing, from its formulas: `RefModel._moe`).

It reads GGUF files with `gguf.GGUFReader` and shares no code with tinygrad, the engine or modelgen: it
dequantizes F32/F16/Q8_0 itself, every other type with the `gguf` package's numpy dequantizer, and applies ggml's
rope (adjacent pairs, "normal" mode) to the raw GGUF Q/K weights, with ggml's RoPE scaling (`RopeScaling`:
rope_freqs.weight factors, linear, yarn) as ggml-cpu's rope_yarn computes it. Built from HF-layout weights
(`from_weights`) it uses HF's half-split rope instead, which checks the writer's permute. Every call recomputes the
whole sequence; the models are small. Used by the tests and by `bench.gpu`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

Q8_0_BLOCK = 34  # bytes per 32 weights: fp16 scale d, then 32 int8 q; weight = d * q


def dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF tensor bytes/values -> float64 array of numpy `shape` (GGUF dims reversed)."""
    if ggml_type == GGMLQuantizationType.F32:
        flat = np.asarray(data).view(np.float32).reshape(-1)
    elif ggml_type == GGMLQuantizationType.F16:
        flat = np.asarray(data).view(np.float16).reshape(-1)
    elif ggml_type == GGMLQuantizationType.Q8_0:
        blocks = np.frombuffer(np.asarray(data).tobytes(), dtype=np.uint8).reshape(-1, Q8_0_BLOCK)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float64)  # (n_blocks, 1)
        flat = (d * blocks[:, 2:].copy().view(np.int8)).reshape(-1)  # (n_blocks * 32,)
    else:  # Q4_0 ... Q6_K: the gguf package's own numpy implementation of ggml's dequantize_row_*
        from gguf import quants

        flat = quants.dequantize(np.asarray(data), ggml_type).reshape(-1)
    return flat.astype(np.float64).reshape(shape)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@dataclass(frozen=True)
class RopeScaling:
    """ggml's rope_ext parameters beyond the base (llama.cpp reads them from the GGUF; see `from_gguf`)."""

    freq_factors: np.ndarray | None = None  # rope_freqs.weight: pair i's angle is divided by factor i
    freq_scale: float = 1.0  # 1 / rope.scaling.factor for linear and yarn
    yarn_original_context: int = 0  # > 0: yarn, with this original context


def _yarn(hd: int, theta: float, original_context: int, freq_scale: float) -> tuple[np.ndarray, float]:
    """ggml's rope_yarn: per pair, the weight of the unscaled angle, and the magnitude of cos and sin."""
    def corr_dim(n_rot: float) -> float:  # the pair whose wavelength makes n_rot turns in the original context
        return hd * np.log(original_context / (n_rot * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(0.0, np.floor(corr_dim(32.0))), min(hd - 1.0, np.ceil(corr_dim(1.0)))  # beta_fast, beta_slow
    y = (np.arange(hd // 2) - low) / max(0.001, high - low)
    return 1.0 - np.minimum(1.0, np.maximum(0.0, y)), 1.0 + 0.1 * np.log(1.0 / freq_scale)


def rope(x: np.ndarray, pos: np.ndarray, theta: float, interleaved: bool,
         scaling: RopeScaling = RopeScaling()) -> np.ndarray:
    """Rotate x (T, H, Hd) at positions pos (T,). Pair i is (2i, 2i+1) if interleaved (ggml), else (i, i + Hd/2)."""
    hd = x.shape[-1]
    unscaled = pos[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]  # (T, Hd/2)
    if scaling.freq_factors is not None:
        unscaled = unscaled / scaling.freq_factors[None, :]
    angle, magnitude = scaling.freq_scale * unscaled, 1.0
    if scaling.yarn_original_context:
        keep, magnitude = _yarn(hd, theta, scaling.yarn_original_context, scaling.freq_scale)
        angle = angle * (1 - keep) + unscaled * keep
    cos, sin = magnitude * np.cos(angle)[:, None, :], magnitude * np.sin(angle)[:, None, :]  # (T, 1, Hd/2)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : hd // 2], x[..., hd // 2 :])
    r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return np.stack([r1, r2], axis=-1).reshape(x.shape) if interleaved else np.concatenate([r1, r2], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Forward:
    """The whole-sequence forward both references share, over their own ``embed`` and ``_block``."""

    weights: dict[str, np.ndarray]
    n_layers: int
    norm_eps: float

    def embed(self, tokens: list[int]) -> np.ndarray:
        raise NotImplementedError

    def _block(self, i: int, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def run_blocks(self, x: np.ndarray, start: int, end: int) -> np.ndarray:
        """Blocks [start, end) over hidden states x (T, D) of the whole sequence from position 0."""
        for i in range(start, end):
            x = self._block(i, x)
        return x

    def head(self, x: np.ndarray) -> np.ndarray:
        out = self.weights.get("output.weight", self.weights["token_embd.weight"])  # tied if absent
        return rms_norm(x, self.weights["output_norm.weight"], self.norm_eps) @ out.T  # (T, V)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """(T, vocab) float64 logits for every position."""
        return self.head(self.run_blocks(self.embed(tokens), 0, self.n_layers))

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        """n greedy (argmax) continuation tokens of the prompt `tokens`."""
        seq = list(tokens)
        for _ in range(n):
            seq.append(int(np.argmax(self.logits(seq)[-1])))
        return seq[len(tokens) :]


@dataclass
class RefModel(Forward):
    weights: dict[str, np.ndarray]  # float64, numpy shapes (out, in)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    norm_eps: float
    rope_theta: float
    interleaved_rope: bool = True  # True for GGUF-order Q/K rows, False for HF (half-split) order
    rope_scaling: RopeScaling = RopeScaling()
    experts_used: int = 0  # a mixture of experts: the k experts routed per token (`_moe`)
    norm_experts: bool = True  # the k routing weights renormalized to sum 1 (llama.cpp's norm_w)
    experts_scale: float = 1.0  # then multiplied by expert_weights_scale where the file sets it (not 0)

    @staticmethod
    def from_gguf(path: str | Path) -> RefModel:
        reader = GGUFReader(str(path))

        def kv(key: str, default=None):
            return reader.fields[key].contents() if key in reader.fields else default

        arch = kv("general.architecture")
        assert arch in ("llama", "qwen2", "qwen3", "qwen3moe"), arch
        weights = {
            t.name: dequantize(t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors
        }
        return RefModel(
            weights,
            kv(f"{arch}.block_count"),
            kv(f"{arch}.attention.head_count"),
            kv(f"{arch}.attention.head_count_kv"),
            kv(f"{arch}.attention.layer_norm_rms_epsilon"),
            kv(f"{arch}.rope.freq_base"),
            interleaved_rope=arch == "llama",  # qwen's: llama.cpp's NEOX rope (rows as HF stores them)
            rope_scaling=RefModel._rope_scaling(kv, weights.pop("rope_freqs.weight", None)),
            experts_used=kv(f"{arch}.expert_used_count", 0),
            experts_scale=kv(f"{arch}.expert_weights_scale", 0.0) or 1.0,
        )

    @staticmethod
    def _rope_scaling(kv, freq_factors: np.ndarray | None) -> RopeScaling:
        """As llama.cpp reads the keys: no type means linear; factor 0 or absent means unscaled."""
        kind, factor = kv("llama.rope.scaling.type", "linear"), kv("llama.rope.scaling.factor", 0.0)
        if kind not in ("none", "linear", "yarn"):
            raise NotImplementedError(f"npref has no {kind} RoPE scaling")
        scale = 1.0 if kind == "none" or not factor else 1.0 / factor
        original = kv("llama.rope.scaling.original_context_length") or kv("llama.context_length")
        return RopeScaling(freq_factors, scale, original if kind == "yarn" else 0)

    @staticmethod
    def from_weights(
        weights: dict[str, np.ndarray],
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
    ) -> RefModel:
        """From HF-layout float weights keyed by GGUF name (Q/K rows half-split), e.g. modelgen.random_weights."""
        w64 = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        return RefModel(w64, n_layers, n_heads, n_kv_heads, norm_eps, rope_theta, interleaved_rope=False)

    def embed(self, tokens: list[int]) -> np.ndarray:
        return self.weights["token_embd.weight"][np.asarray(tokens)]  # (T, D)

    def _attention(self, i: int, x: np.ndarray) -> np.ndarray:
        w, T = self.weights, x.shape[0]
        q, k, v = (x @ w[f"blk.{i}.attn_{n}.weight"].T + w.get(f"blk.{i}.attn_{n}.bias", 0.0) for n in "qkv")  # qwen2
        q = q.reshape(T, self.n_heads, -1)  # (T, H, Hd)
        k, v = k.reshape(T, self.n_kv_heads, -1), v.reshape(T, self.n_kv_heads, -1)  # (T, KvH, Hd)
        if f"blk.{i}.attn_q_norm.weight" in w:  # qwen3: each head's q and k RMS-normed before the rope
            q = rms_norm(q, w[f"blk.{i}.attn_q_norm.weight"], self.norm_eps)
            k = rms_norm(k, w[f"blk.{i}.attn_k_norm.weight"], self.norm_eps)
        pos = np.arange(T, dtype=np.float64)
        q = rope(q, pos, self.rope_theta, self.interleaved_rope, self.rope_scaling)
        k = rope(k, pos, self.rope_theta, self.interleaved_rope, self.rope_scaling)
        group = self.n_heads // self.n_kv_heads  # query head h reads kv head h // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (T, H, Hd)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])  # (H, T, T)
        scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", p, v).reshape(T, -1)  # (T, H*Hd)
        return out @ w[f"blk.{i}.attn_output.weight"].T

    def _block(self, i: int, x: np.ndarray) -> np.ndarray:
        w = self.weights
        h = x + self._attention(i, rms_norm(x, w[f"blk.{i}.attn_norm.weight"], self.norm_eps))
        n = rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], self.norm_eps)
        if self.experts_used:
            return h + self._moe(i, n)
        ffn = silu(n @ w[f"blk.{i}.ffn_gate.weight"].T) * (n @ w[f"blk.{i}.ffn_up.weight"].T)
        return h + ffn @ w[f"blk.{i}.ffn_down.weight"].T

    def _moe(self, i: int, x: np.ndarray) -> np.ndarray:
        """Routed feed-forward over x (T, D): per token p = softmax(router x), the k largest p, renormalized to sum 1
        when ``norm_experts`` (llama.cpp: always, for llama and qwen3moe), times ``experts_scale``, and
        y = sum over those experts e of p_e * down_e(silu(gate_e x) * up_e x)."""
        w = self.weights
        logits = x @ w[f"blk.{i}.ffn_gate_inp.weight"].T  # (T, E)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            top = np.argsort(-p[t], kind="stable")[: self.experts_used]
            weight = self.experts_scale * p[t, top] / (p[t, top].sum() if self.norm_experts else 1.0)
            for e, we in zip(top, weight, strict=True):
                gate = w[f"blk.{i}.ffn_gate_exps.weight"][e] @ x[t]
                up = w[f"blk.{i}.ffn_up_exps.weight"][e] @ x[t]
                out[t] += we * (w[f"blk.{i}.ffn_down_exps.weight"][e] @ (silu(gate) * up))
        return out


# ---------------------------------------------------------------- Gemma 3


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


@dataclass
class Gemma3Ref(Forward):
    """Gemma 3 from its formulas (llama.cpp's gemma3 graph, sliding-window build), float64, whole sequence per call:
    x = E[tokens] * sqrt(D); per block, with n = rms(x) * attn_norm:
      q, k = rms(n Wq) * q_norm, rms(n Wk) * k_norm per head, roped NEOX-style (half-split pairs: Gemma's GGUF
      rows are HF-ordered) at base ``local_theta`` unscaled on a sliding block, else at ``rope_theta`` scaled;
      scores = q . k * scale, causal, and on a sliding block key p is seen from query t only when t - p < window;
      h = x + rms(attn Wo) * post_attention_norm; x = h + rms(ffn(rms(h) * ffn_norm)) * post_ffw_norm with
      ffn(y) = (gelu_tanh(y Wgate) * y Wup) Wdown;
    logits = rms(x) * output_norm @ E^T (tied). Block il slides unless il % 6 == 5 (llama.cpp's pattern)."""

    weights: dict[str, np.ndarray]
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    local_theta: float
    window: int
    scale: float
    global_scaling: RopeScaling = RopeScaling()
    use_window: bool = True  # False: every block global (the test's proof that the window matters)

    @staticmethod
    def from_gguf(path: str | Path) -> Gemma3Ref:
        reader = GGUFReader(str(path))

        def kv(key: str, default=None):
            return reader.fields[f"gemma3.{key}"].contents() if f"gemma3.{key}" in reader.fields else default

        assert reader.fields["general.architecture"].contents() == "gemma3"
        weights = {t.name: dequantize(t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
                   for t in reader.tensors}
        n_layers, dim, n_heads = kv("block_count"), kv("embedding_length"), kv("attention.head_count")
        head_dim = kv("attention.key_length", dim // n_heads)
        kind, factor = kv("rope.scaling.type", "linear"), kv("rope.scaling.factor", 0.0)
        if kind not in ("none", "linear"):
            raise NotImplementedError(f"Gemma3Ref has no {kind} RoPE scaling")
        scaling = RopeScaling(freq_scale=1.0 / factor if kind == "linear" and factor else 1.0)
        scale = 1.0 / np.sqrt(dim // n_heads if n_layers == 62 else head_dim)  # llama.cpp: the 27B's own scale
        return Gemma3Ref(weights, n_layers, n_heads, kv("attention.head_count_kv", n_heads), head_dim,
                         kv("attention.layer_norm_rms_epsilon"), kv("rope.freq_base", 10000.0),
                         kv("rope.local.freq_base", 10000.0), kv("attention.sliding_window"), scale, scaling)

    def sliding(self, i: int) -> bool:
        return self.use_window and i % 6 != 5

    def embed(self, tokens: list[int]) -> np.ndarray:
        w = self.weights["token_embd.weight"]
        return w[np.asarray(tokens)] * np.sqrt(w.shape[1])

    def _attention(self, i: int, x: np.ndarray) -> np.ndarray:
        w, T, eps = self.weights, x.shape[0], self.norm_eps
        q = rms_norm((x @ w[f"blk.{i}.attn_q.weight"].T).reshape(T, self.n_heads, -1), w[f"blk.{i}.attn_q_norm.weight"],
                     eps)
        k = rms_norm((x @ w[f"blk.{i}.attn_k.weight"].T).reshape(T, self.n_kv_heads, -1),
                     w[f"blk.{i}.attn_k_norm.weight"], eps)
        v = (x @ w[f"blk.{i}.attn_v.weight"].T).reshape(T, self.n_kv_heads, -1)
        pos = np.arange(T, dtype=np.float64)
        theta, scaling = (self.local_theta, RopeScaling()) if i % 6 != 5 else (self.rope_theta, self.global_scaling)
        q, k = rope(q, pos, theta, False, scaling), rope(k, pos, theta, False, scaling)
        group = self.n_heads // self.n_kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) * self.scale  # (H, T, T)
        t, s = np.arange(T)[:, None], np.arange(T)[None, :]
        seen = (s <= t) & ((t - s < self.window) if self.sliding(i) else True)
        scores = np.where(seen, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ w[f"blk.{i}.attn_output.weight"].T

    def _block(self, i: int, x: np.ndarray) -> np.ndarray:
        w, eps = self.weights, self.norm_eps
        a = self._attention(i, rms_norm(x, w[f"blk.{i}.attn_norm.weight"], eps))
        h = x + rms_norm(a, w[f"blk.{i}.post_attention_norm.weight"], eps)
        n = rms_norm(h, w[f"blk.{i}.ffn_norm.weight"], eps)
        f = (gelu_tanh(n @ w[f"blk.{i}.ffn_gate.weight"].T) * (n @ w[f"blk.{i}.ffn_up.weight"].T)) \
            @ w[f"blk.{i}.ffn_down.weight"].T
        return h + rms_norm(f, w[f"blk.{i}.post_ffw_norm.weight"], eps)
