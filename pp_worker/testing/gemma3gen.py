"""Small deterministic Gemma 3 (``gemma3``) GGUF models for tests, written as llama.cpp's converter writes one.

What a real Gemma 3 file has and these keep: head_dim (``attention.key_length``) other than dim / n_heads, q/k norm
gains per head, four norms a block (their gains stored with Gemma's +1 already added, as the converter stores
them), tied embeddings (no output.weight), Q/K rows in HF order (no rope permutation: Gemma ropes NEOX-style),
``attention.sliding_window`` shorter than the test prompts with blocks of both kinds (block il slides unless
il % 6 == 5: 8 blocks give a global one between sliding ones), ``rope.local.freq_base`` for the sliding blocks
and a rope base plus a linear RoPE scaling for the global ones, and a SentencePiece vocabulary with add_bos, no
space prefix, and <start_of_turn> / <end_of_turn> pieces. The same arguments give a byte-identical file.

    python -m pp_worker.testing.modelgen OUT.gguf --preset gemma3 [--dtype Q8_0]
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCH = "gemma3"
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


@dataclass(frozen=True)
class GemmaSpec:
    dim: int = 64
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32  # not dim / n_heads (16): the attention scale and the shapes must come from key_length
    ffn_dim: int = 128
    context_length: int = 128
    sliding_window: int = 12
    rope_theta: float = 1_000_000.0  # global blocks
    rope_local_theta: float = 10_000.0  # sliding blocks
    rope_linear_factor: float = 2.0  # global blocks only (as Gemma 3 4B+: factor 8); 0: none
    norm_eps: float = 1e-6
    n_merges: int = 300


# every width of "gemma3-kq" a multiple of 256, so Q4_K applies to every matrix
PRESETS = {"gemma3": GemmaSpec(),
           "gemma3-kq": GemmaSpec(dim=256, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=64, ffn_dim=512)}


@functools.cache
def vocab(n_merges: int):  # -> SpmVocab (cached: shared, do not mutate)
    from pp_worker.testing.spm import build_spm_vocab

    return build_spm_vocab(n_merges, user_defined=TURN_TOKENS, add_space_prefix=False)


def tensor_shapes(spec: GemmaSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    d, q, kv = spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab_size, d)}
    for i in range(spec.n_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (q, d),
            f"blk.{i}.attn_q_norm.weight": (spec.head_dim,),
            f"blk.{i}.attn_k.weight": (kv, d),
            f"blk.{i}.attn_k_norm.weight": (spec.head_dim,),
            f"blk.{i}.attn_v.weight": (kv, d),
            f"blk.{i}.attn_output.weight": (d, q),
            f"blk.{i}.post_attention_norm.weight": (d,),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (spec.ffn_dim, d),
            f"blk.{i}.ffn_up.weight": (spec.ffn_dim, d),
            f"blk.{i}.ffn_down.weight": (d, spec.ffn_dim),
            f"blk.{i}.post_ffw_norm.weight": (d,),
        }
    shapes["output_norm.weight"] = (d,)
    return shapes


def random_weights(spec: GemmaSpec, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights. Embedding rows of std 0.4: times sqrt(dim) they are a few units, and as the tied
    head they spread the logits over several units. Norm gains near 1 but not exactly (a missing one would show);
    the post-norms' near 3, so that what the blocks add outweighs the token's own embedding (with gains near 1 the
    model mostly predicts its input token, and greedy decoding repeats one token)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in tensor_shapes(spec, vocab_size).items():
        if len(shape) == 1:
            gain = 3.0 if ".post_" in name else 1.0
            weights[name] = (gain * (1.0 + 0.2 * rng.standard_normal(shape))).astype(np.float32)
        else:
            std = 0.4 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
            weights[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return weights


def write_gguf(path: str | Path, spec: GemmaSpec, weights: dict[str, np.ndarray], dtype: str = "F16",
               name: str = "pp-worker-gemma3") -> Path:
    from gguf import GGUFWriter

    from pp_worker.testing import encode

    spm = vocab(spec.n_merges)
    shapes = tensor_shapes(spec, len(spm.tokens))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(tmp, ARCH)
    w.add_name(name)
    if dtype in encode.FILE_TYPES:
        w.add_file_type(encode.FILE_TYPES[dtype])
    w.add_quantization_version(2)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.dim)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_float32(f"{ARCH}.rope.local.freq_base", spec.rope_local_theta)
    if spec.rope_linear_factor:
        w.add_string(f"{ARCH}.rope.scaling.type", "linear")
        w.add_float32(f"{ARCH}.rope.scaling.factor", spec.rope_linear_factor)
    w.add_sliding_window(spec.sliding_window)
    spm.write_tokenizer(w)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_eot_token_id(spm.tokens.index("<end_of_turn>"))
    for tname, shape in shapes.items():
        a = np.asarray(weights[tname], dtype=np.float32)
        if a.shape != shape:
            raise ValueError(f"{tname}: shape {a.shape}, expected {shape}")
        kind = "F32" if len(shape) == 1 else dtype
        if kind not in ("F32", "F16"):
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

            if shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]:
                kind = "F16"
        data, raw_dtype = encode.encode_tensor(a, kind)
        w.add_tensor(tname, data, raw_dtype=raw_dtype)
    return encode.finish(w, tmp, path)


def generate(path: str | Path, preset: str = "gemma3", seed: int = 0, dtype: str = "F16") -> Path:
    """Write the ``preset`` Gemma 3 with weights from ``seed``."""
    spec = PRESETS[preset]
    n_vocab = len(vocab(spec.n_merges).tokens)
    return write_gguf(path, spec, random_weights(spec, n_vocab, seed), dtype, f"pp-worker-{preset}-s{seed}")
