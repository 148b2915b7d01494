"""Deterministic generator of small llama-architecture GGUF models for tests, benches and demos.

The same arguments always give a byte-identical file: the tokenizer is trained deterministically on a
built-in text (a byte-level BPE for any `tokenizer.ggml.pre` name, or a SentencePiece vocabulary), the weights
come from a seeded numpy generator, and the `gguf` package writes no timestamps. Files load in tinygrad
(`Transformer.from_gguf`, byte-level BPE only) and llama.cpp. RoPE scaling (llama3 `rope_freqs.weight`, linear,
yarn) is optional (`rope_scaling.RopeScaling`).

    python -m pp_worker.testing.modelgen OUT.gguf --preset tiny --seed 0 --dtype F16 [--tokenizer spm|smollm|...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the tokenizers the generated models carry
from pp_worker.testing.bpe import Vocab, build_vocab, builtin_text
from pp_worker.testing.encode import FILE_TYPES, encode_tensor, finish
from pp_worker.testing.rope_scaling import RopeScaling
from pp_worker.testing.spm import SpmVocab, build_spm_vocab

SPM = "spm"  # `tokenizer` value for a SentencePiece vocabulary; any other is a byte-level BPE's pre name


@dataclass(frozen=True)
class LlamaSpec:
    """Llama architecture hyper-parameters (the vocabulary size comes from the `Vocab`)."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 160
    context_length: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    vocab_size: int = 0  # > 0: the vocabulary padded to this size with reserved control tokens (`padded`)
    arch: str = "llama"  # or, Q/K rows in HF order (NEOX rope): "qwen2" (Q/K/V biases), "qwen3" (Q/K norms),
    # "qwen3moe" (Q/K norms, experts required)
    n_experts: int = 0  # > 0: a mixture of experts, each of ffn_dim, in place of the dense feed-forward
    n_experts_used: int = 0  # experts routed per token (top-k)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# name -> (spec, n_merges); vocab size = 256 bytes + n_merges + 3 specials
PRESETS: dict[str, tuple[LlamaSpec, int]] = {
    "tiny": (LlamaSpec(), 253),  # vocab 512, ~0.24M params
    "small": (LlamaSpec(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352), 509),  # vocab 768, ~0.93M
    "bench": (LlamaSpec(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, context_length=1024), 1741),  # ~27M
    # every width a multiple of 256, so every K-quant type applies to every matrix (vocab 768, ~5.1M params)
    "kq": (LlamaSpec(dim=256, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=768, context_length=512), 509),
    # weights that dwarf tinygrad's idle floor, for the bench's per-stage peak-RSS rows (1.4 GiB F16)
    "rss": (LlamaSpec(dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=5632, context_length=2048), 1741),
    # TinyLlama-1.1B's shape (2.2 GB F16): the DRAM-bound bench model, its stages' shares far beyond any L3
    "tinyllama": (LlamaSpec(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, context_length=2048,
                            vocab_size=32000), 1741),
    # SmolLM2-135M's shape (30 blocks, dim 576, 3 KV heads, tied embeddings, context 8192): pp-serve's memory bench
    "smol": (LlamaSpec(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, context_length=8192,
                       vocab_size=49152, tie_embeddings=True), 1741),
    # mixtures of experts (8 experts, top-2): Mixtral-style experts in a llama file, and a qwen3moe
    "moe-llama": (LlamaSpec(ffn_dim=64, n_experts=8, n_experts_used=2), 253),
    "qwen3moe": (LlamaSpec(ffn_dim=64, n_experts=8, n_experts_used=2, arch="qwen3moe"), 253),
    # dense qwen2 and qwen3 with widths of 256, so that K-quants apply to every matrix
    "qwen2-kq": (LlamaSpec(dim=256, n_layers=4, ffn_dim=512, arch="qwen2"), 509),
    "qwen3-kq": (LlamaSpec(dim=256, n_layers=4, ffn_dim=512, arch="qwen3"), 509),
    # widths of 256, so that K-quants apply to every matrix
    "qwen3moe-kq": (LlamaSpec(dim=256, n_layers=4, ffn_dim=256, n_experts=8, n_experts_used=2, arch="qwen3moe"), 509),
    # the bench's: 16 experts, top-2, and the dense model of the same dims and total parameters (ffn 16 x 512)
    "qwen3moe-bench": (LlamaSpec(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=512, context_length=1024,
                                 n_experts=16, n_experts_used=2, arch="qwen3moe"), 1741),
    "qwen3moe-bench-dense": (LlamaSpec(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=16 * 512,
                                       context_length=1024), 1741),
}

QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# a whole file of one type (TQ2_0: one the worker dequantizes at load), or a mix: Q4_K_M and Q3_K_M as llama.cpp
# makes them, MIXED cycling every kept type over the matrices
DTYPES = ("F32", "F16", *QUANT_TYPES, "TQ2_0", "Q4_K_M", "Q3_K_M", "MIXED")


# ---------------------------------------------------------------- weights


def tensor_shapes(spec: LlamaSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (out_features, in_features), in the order the file stores them."""
    d, kv = spec.dim, spec.n_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab_size, d)}
    for i in range(spec.n_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (d, d),
            f"blk.{i}.attn_k.weight": (kv, d),
            f"blk.{i}.attn_v.weight": (kv, d),
            f"blk.{i}.attn_output.weight": (d, d),
            f"blk.{i}.ffn_norm.weight": (d,),
        }
        if spec.arch in ("qwen3", "qwen3moe"):
            shapes |= {f"blk.{i}.attn_q_norm.weight": (spec.head_dim,), f"blk.{i}.attn_k_norm.weight": (spec.head_dim,)}
        if spec.arch == "qwen2":
            shapes |= {f"blk.{i}.attn_q.bias": (d,), f"blk.{i}.attn_k.bias": (kv,), f"blk.{i}.attn_v.bias": (kv,)}
        if spec.n_experts:  # llama.cpp's names: the router, then (E, out, in) tensors
            e = spec.n_experts
            shapes |= {f"blk.{i}.ffn_gate_inp.weight": (e, d), f"blk.{i}.ffn_gate_exps.weight": (e, spec.ffn_dim, d),
                       f"blk.{i}.ffn_up_exps.weight": (e, spec.ffn_dim, d),
                       f"blk.{i}.ffn_down_exps.weight": (e, d, spec.ffn_dim)}
        else:
            shapes |= {f"blk.{i}.ffn_gate.weight": (spec.ffn_dim, d), f"blk.{i}.ffn_up.weight": (spec.ffn_dim, d),
                       f"blk.{i}.ffn_down.weight": (d, spec.ffn_dim)}
    shapes["output_norm.weight"] = (d,)
    if not spec.tie_embeddings:
        shapes["output.weight"] = (vocab_size, d)
    return shapes


def param_count(spec: LlamaSpec, vocab_size: int) -> int:
    return sum(int(np.prod(s)) for s in tensor_shapes(spec, vocab_size).values())


def _init_std(name: str, shape: tuple[int, ...], spec: LlamaSpec) -> float:
    # unit-variance embeddings; projections keep O(1) activations; the residual writers (attn_output, ffn_down)
    # are damped by depth so the stream does not grow; the head is scaled up so logits spread over ~+-10
    if name == "token_embd.weight":
        return 1.0
    if name == "output.weight":
        return 3.0 / np.sqrt(shape[1])
    if name.endswith("ffn_gate_inp.weight"):  # router logits spread over a few units: clear top-k choices
        return 2.0 / np.sqrt(shape[-1])
    damp = 1.0 / np.sqrt(2 * spec.n_layers) if name.endswith(("attn_output.weight", "ffn_down.weight",
                                                              "ffn_down_exps.weight")) else 1.0
    return damp / np.sqrt(shape[-1])


def random_weights(spec: LlamaSpec, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights keyed by GGUF name, HF layout: (out, in) rows, Q/K rows in half-split rope order."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in tensor_shapes(spec, vocab_size).items():
        if name.endswith(".bias"):  # qwen2's Q/K/V biases: of the products' own size, so a missing one would show
            weights[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        elif len(shape) == 1:  # RMSNorm gains: near 1 but not exactly, so a missing gain would show
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (_init_std(name, shape, spec) * rng.standard_normal(shape)).astype(np.float32)
    return weights


# ---------------------------------------------------------------- GGUF


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split rope rows -> GGUF interleaved rows, exactly as llama.cpp's convert_hf_to_gguf `permute`."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_types(spec: LlamaSpec, vocab_size: int, dtype: str) -> dict[str, str]:
    """GGUF tensor name -> the type it is stored as in a ``dtype`` file. Norms stay F32 (as llama.cpp keeps them);
    a matrix whose rows are not whole blocks of its type is stored F16 instead."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    types = {}
    matrices = [n for n, shape in tensor_shapes(spec, vocab_size).items() if len(shape) >= 2]
    for name, shape in tensor_shapes(spec, vocab_size).items():
        if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):  # llama.cpp's quantize keeps routers F32 too
            types[name] = "F32"
        elif dtype == "Q4_K_M":
            types[name] = _q4_k_m(name, spec.n_layers)
        elif dtype == "Q3_K_M":
            types[name] = _q3_k_m(name, spec.n_layers)
        elif dtype == "MIXED":  # every type in turn: any two consecutive blocks hold all of them
            types[name] = ("F16", *QUANT_TYPES)[matrices.index(name) % (len(QUANT_TYPES) + 1)]
        else:
            types[name] = dtype
        block = GGML_QUANT_SIZES[GGMLQuantizationType[types[name]]][0]
        if shape[-1] % block:
            types[name] = "F16"
    return types


def _q4_k_m(name: str, n_layers: int) -> str:
    """llama.cpp's Q4_K_M choice: Q6_K for the head, and for attn_v and ffn_down in the blocks where
    `use_more_bits` holds (the first and last eighth, and every third between); Q4_K everywhere else."""
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        i = int(name.split(".")[1])
        if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def _q3_k_m(name: str, n_layers: int) -> str:
    """llama.cpp's Q3_K_M choice for a llama: Q6_K for the head, Q4_K for attn_output, attn_v Q5_K in the first two
    blocks and Q4_K after, ffn_down Q5_K in the first sixteenth of the blocks and Q4_K after; Q3_K everywhere else."""
    if name == "output.weight":
        return "Q6_K"
    if name.startswith("blk."):
        i = int(name.split(".")[1])
        if name.endswith("attn_output.weight"):
            return "Q4_K"
        if name.endswith("attn_v.weight"):
            return "Q5_K" if i < 2 else "Q4_K"
        if name.endswith(("ffn_down.weight", "ffn_down_exps.weight")):
            return "Q5_K" if i < n_layers // 16 else "Q4_K"
    return "Q3_K"


def _add_metadata(writer, spec: LlamaSpec, vocab: Vocab | SpmVocab, dtype: str, chat_template: str | None, name: str,
                  add_bos: bool | None) -> None:
    writer.add_name(name)
    if dtype in FILE_TYPES:
        writer.add_file_type(FILE_TYPES[dtype])
    writer.add_quantization_version(2)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.dim)
    writer.add_block_count(spec.n_layers)
    writer.add_feed_forward_length(spec.ffn_dim)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_rope_dimension_count(spec.head_dim)
    if spec.n_experts:
        writer.add_expert_count(spec.n_experts)
        writer.add_expert_used_count(spec.n_experts_used)
        writer.add_expert_feed_forward_length(spec.ffn_dim)
        if spec.arch == "qwen3moe":
            writer.add_expert_weights_norm(True)
    vocab.write_tokenizer(writer)
    if "<|eot_id|>" in vocab.tokens:
        writer.add_eot_token_id(vocab.tokens.index("<|eot_id|>"))
    if add_bos is not None:  # absent: the tokenizer's default rule decides (llama.cpp's, see text.vocab)
        writer.add_add_bos_token(add_bos)
        writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    path: str | Path,
    spec: LlamaSpec,
    weights: dict[str, np.ndarray],
    vocab: Vocab | SpmVocab,
    dtype: str = "F16",
    chat_template: str | None = None,
    name: str = "pp-worker-test",
    add_bos: bool | None = False,
    rope: RopeScaling | None = None,
) -> Path:
    """Write a llama GGUF. `weights` are HF layout (see `random_weights`); Q/K rows are permuted to GGUF order here.
    ``add_bos`` is tokenizer.ggml.add_bos_token: whether a tokenizer puts the BOS in front of every text (None:
    no key). ``rope``: RoPE scaling keys and the llama3 rope_freqs.weight tensor."""
    from gguf import GGUFWriter

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    shapes = tensor_shapes(spec, len(vocab.tokens))
    types = tensor_types(spec, len(vocab.tokens), dtype)
    if set(weights) != set(shapes):
        missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
        raise ValueError(f"weights: missing {missing}, unexpected {extra}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # readers of a shared model dir never see half a file
    writer = GGUFWriter(tmp, spec.arch)
    _add_metadata(writer, spec, vocab, dtype, chat_template, name, add_bos)
    if rope is not None:
        rope.write(writer)
    for tname, shape in shapes.items():  # fixed order, whatever the dict order
        w = np.asarray(weights[tname], dtype=np.float32)
        if w.shape != shape:
            raise ValueError(f"{tname}: shape {w.shape}, expected {shape}")
        if spec.arch == "llama" and tname.endswith(("attn_q.weight", "attn_k.weight")):  # qwen's stay HF order
            w = permute_rope_rows(w, spec.n_heads if "attn_q" in tname else spec.n_kv_heads)
        data, raw_dtype = encode_tensor(w, types[tname])
        writer.add_tensor(tname, data, raw_dtype=raw_dtype)
    return finish(writer, tmp, path)


@functools.cache
def builtin_vocab(n_merges: int, tokenizer: str = "llama-bpe") -> Vocab | SpmVocab:
    """The vocabulary `generate` uses (cached: shared object, do not mutate): SentencePiece for ``tokenizer`` "spm",
    else byte-level BPE split by the ``tokenizer`` pre-tokenizer."""
    if tokenizer == SPM:
        return build_spm_vocab(n_merges)
    return build_vocab(builtin_text(), n_merges, pre=tokenizer)


def padded(vocab: Vocab | SpmVocab, size: int) -> Vocab | SpmVocab:
    """``vocab`` with reserved control tokens appended up to ``size`` tokens, as Llama 3 reserves 256: the rows of a
    real model's embedding and head that text never reaches (the built-in text teaches ~2K tokens)."""
    extra = size - len(vocab.tokens)
    if extra <= 0:
        return vocab
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(extra)]
    types = [3] * extra  # CONTROL
    if isinstance(vocab, SpmVocab):
        return dataclasses.replace(vocab, tokens=vocab.tokens + reserved, scores=vocab.scores + [0.0] * extra,
                                   token_types=vocab.token_types + types)
    return dataclasses.replace(vocab, tokens=vocab.tokens + reserved, token_types=vocab.token_types + types)


def generate(path: str | Path, preset: str = "tiny", seed: int = 0, dtype: str = "F16", *,
             add_bos: bool | None = False, chat_template: str | None = None, tokenizer: str = "llama-bpe",
             rope: RopeScaling | None = None) -> Path:
    """Write the `preset` model with weights from `seed`; the same arguments give a byte-identical file. The
    `gemma3gen` presets ("gemma3", "gemma3-kq") write a Gemma 3 (its own vocabulary; the tokenizer arguments do not
    apply)."""
    from pp_worker.testing import gemma3gen

    if preset in gemma3gen.PRESETS:
        return gemma3gen.generate(path, preset, seed, dtype)
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    spec, n_merges = PRESETS[preset]
    vocab = padded(builtin_vocab(n_merges, tokenizer), spec.vocab_size)
    weights = random_weights(spec, len(vocab.tokens), seed)
    return write_gguf(path, spec, weights, vocab, dtype=dtype, name=f"pp-worker-{preset}-s{seed}", add_bos=add_bos,
                      chat_template=chat_template, rope=rope)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pp_worker.testing.modelgen", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output .gguf path")
    from pp_worker.testing import gemma3gen

    ap.add_argument("--preset", choices=sorted([*PRESETS, *gemma3gen.PRESETS]), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPES, default="F16")
    ap.add_argument("--add-bos", action="store_true", help="tokenizer.ggml.add_bos_token = true (default false)")
    ap.add_argument("--tokenizer", default="llama-bpe",
                    help="'spm' (SentencePiece) or a byte-level BPE's tokenizer.ggml.pre name (default llama-bpe)")
    args = ap.parse_args(argv)
    path = generate(args.out, args.preset, args.seed, args.dtype, add_bos=args.add_bos, tokenizer=args.tokenizer)
    if args.preset in gemma3gen.PRESETS:
        print(f"{path}: {args.preset} {args.dtype} bytes={path.stat().st_size}", file=sys.stderr)
        return 0
    spec, n_merges = PRESETS[args.preset]
    n_vocab = len(builtin_vocab(n_merges, args.tokenizer).tokens)
    print(
        f"{path}: {args.preset} {args.dtype} vocab={n_vocab} params={param_count(spec, n_vocab)} "
        f"bytes={path.stat().st_size}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
