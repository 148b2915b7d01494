"""Deterministic generator of small llama-architecture GGUF models for tests, benches and demos.

The same arguments always give a byte-identical file: the tokenizer is a byte-level BPE trained
deterministically on a built-in text, the weights come from a seeded numpy generator, and the
`gguf` package writes no timestamps. Files load in tinygrad (`Transformer.from_gguf`) and llama.cpp.

    python -m pp_worker.modelgen OUT.gguf --preset tiny --seed 0 --dtype F16
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import functools
import heapq
import io
import os
import re
import sys
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# name -> (spec, n_merges); vocab size = 256 bytes + n_merges + 3 specials
PRESETS: dict[str, tuple[LlamaSpec, int]] = {
    "tiny": (LlamaSpec(), 253),  # vocab 512, ~0.24M params
    "small": (LlamaSpec(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352), 509),  # vocab 768, ~0.93M
    "bench": (LlamaSpec(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, context_length=1024), 1741),  # ~27M
}

DTYPES = ("F32", "F16", "Q8_0")
DEFAULT_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


# ---------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class Vocab:
    """A GGUF `gpt2`-model vocabulary: tokens are GPT-2 byte-symbol strings, ids are list positions."""

    tokens: list[str]
    token_types: list[int]  # 1 = normal, 3 = control (special)
    merges: list[str]  # "left right" in GPT-2 byte symbols, in rank order
    bos_id: int
    eos_id: int


@functools.cache
def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte, indexed by byte value (token id b is byte b)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # bytes that stand for themselves
    shifted = iter(range(256, 512))  # the rest map to U+0100.. in byte order
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def _category_class(prefix: str) -> str:
    """A regex character-class body matching every code point whose Unicode category starts with `prefix`."""
    ranges: list[tuple[int, int]] = []
    for cp in range(0x323B0):  # one past the last L/N/Z code point, as in tinygrad and llama.cpp
        if unicodedata.category(chr(cp)).startswith(prefix):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(re.escape(chr(a)) + ("" if a == b else "-" + re.escape(chr(b))) for a, b in ranges)


@functools.cache
def _word_regex() -> re.Pattern[str]:
    # llama3 / llama-bpe pre-tokenizer, spelled like tinygrad's SimpleTokenizer (\s, \p{L}, \p{N} expanded)
    ws, num, let = r"\t\n\x0b\x0c\r\x85" + _category_class("Z"), _category_class("N"), _category_class("L")
    return re.compile(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
        f"[^\\r\\n{num}{let}]?[{let}]+|[{num}]{{1,3}}| ?[^{ws}{num}{let}]+[\\r\\n]*|"
        f"[{ws}]*[\\r\\n]+|[{ws}]+(?![^{ws}])|[{ws}]+"
    )


def pretokenize(text: str) -> list[str]:
    """Split text into the words a llama-bpe tokenizer encodes separately (merges never cross them)."""
    return _word_regex().findall(text)


def _merge_word(word: list[int], a: int, b: int, new: int) -> list[int]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _learn_tokens(word_counts: Counter[bytes], n_merges: int) -> list[bytes]:
    """Classic BPE: repeatedly merge the most frequent adjacent pair (ties: smallest ids), return new tokens in order.

    Pair counts are kept incrementally (a heap with stale entries skipped) so ~2000 merges take well under a second.
    """
    toks = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(toks)}
    words = [list(w) for w in sorted(word_counts)]
    counts = [word_counts[w] for w in sorted(word_counts)]
    pair_count: Counter[tuple[int, int]] = Counter()
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)

    heap: list[tuple[int, int, int]] = []  # (-count, left id, right id): most frequent first, then smallest ids

    def account(wi: int, sign: int) -> None:
        w = words[wi]
        for p in zip(w, w[1:], strict=False):
            pair_count[p] += sign * counts[wi]
            heapq.heappush(heap, (-pair_count[p], p[0], p[1]))
            if sign > 0:
                where[p].add(wi)

    for wi in range(len(words)):
        account(wi, +1)
    learned: list[bytes] = []
    while len(learned) < n_merges and heap:
        neg, a, b = heapq.heappop(heap)
        if pair_count[(a, b)] != -neg or neg == 0:
            continue  # stale entry
        new_bytes = toks[a] + toks[b]
        if new_bytes not in index:  # else: a second spelling of a known token, merge without a new id
            index[new_bytes] = len(toks)
            toks.append(new_bytes)
            learned.append(new_bytes)
        for wi in sorted(where.pop((a, b))):
            account(wi, -1)
            words[wi] = _merge_word(words[wi], a, b, index[new_bytes])
            account(wi, +1)
    return learned


def _merge_list(tokens: list[bytes]) -> list[str]:
    """Every way to split each learned token into two known tokens, grouped in token-id order.

    tinygrad merges any adjacent pair whose concatenation is a token (lowest id first); listing all splits,
    ranked by the id of their result, makes llama.cpp's rank-ordered BPE do the same.
    """
    sym = byte_symbols()
    known = set(tokens)
    merges = []
    for tok in tokens[256:]:
        for k in range(1, len(tok)):
            if tok[:k] in known and tok[k:] in known:
                merges.append("".join(sym[c] for c in tok[:k]) + " " + "".join(sym[c] for c in tok[k:]))
    return merges


def build_vocab(text: str, n_merges: int, specials: tuple[str, ...] = DEFAULT_SPECIALS) -> Vocab:
    """Byte-level BPE trained deterministically on `text`.

    Ids: 0..255 are the single bytes *by byte value* (token b is GPT-2's symbol for byte b), then the learned
    tokens in merge order (tinygrad merges by lowest token id), then `specials` (type 3; the first is BOS, the
    second EOS). Words are pre-split the llama-bpe way and special strings are cut out first, as the encoders do.
    Fewer than `n_merges` tokens are learned only if the text runs out of pairs.
    """
    if len(specials) < 2:
        raise ValueError(f"specials must name at least BOS and EOS, got {specials!r}")
    pieces = re.split("|".join(map(re.escape, specials)), text)
    word_counts = Counter(w.encode() for piece in pieces for w in pretokenize(piece))
    byte_tokens = [bytes([b]) for b in range(256)] + _learn_tokens(word_counts, n_merges)
    sym = byte_symbols()
    normal = ["".join(sym[c] for c in t) for t in byte_tokens]
    return Vocab(
        tokens=normal + list(specials),
        token_types=[1] * len(normal) + [3] * len(specials),
        merges=_merge_list(byte_tokens),
        bos_id=len(normal),
        eos_id=len(normal) + 1,
    )


def builtin_text() -> str:
    """The fixed training text (~7.5 kB, room for ~1960 merges).

    The Zen of Python four times (so its words are merged first), its rot13 source, then every Latin, IPA, Greek
    and Cyrillic letter in U+00C0..U+04FF and each distinct word of their Unicode names, for multi-byte tokens
    and enough distinct pairs for the bench vocabulary. Unicode names never change once assigned.
    """
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen; stdout may be a protocol stream
        import this
    zen = codecs.decode(this.s, "rot13")
    letters = [chr(cp) for cp in range(0xC0, 0x500) if unicodedata.category(chr(cp)).startswith("L")]
    name_words = sorted({w for c in letters for w in unicodedata.name(c).lower().split()})
    return "\n\n".join([zen] * 4 + [this.s, " ".join(letters), " ".join(name_words)]) + "\n"


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
            f"blk.{i}.ffn_gate.weight": (spec.ffn_dim, d),
            f"blk.{i}.ffn_up.weight": (spec.ffn_dim, d),
            f"blk.{i}.ffn_down.weight": (d, spec.ffn_dim),
        }
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
    damp = 1.0 / np.sqrt(2 * spec.n_layers) if name.endswith(("attn_output.weight", "ffn_down.weight")) else 1.0
    return damp / np.sqrt(shape[1])


def random_weights(spec: LlamaSpec, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights keyed by GGUF name, HF layout: (out, in) rows, Q/K rows in half-split rope order."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in tensor_shapes(spec, vocab_size).items():
        if len(shape) == 1:  # RMSNorm gains: near 1 but not exactly, so a missing gain would show
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (_init_std(name, shape, spec) * rng.standard_normal(shape)).astype(np.float32)
    return weights


# ---------------------------------------------------------------- GGUF


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split rope rows -> GGUF interleaved rows, exactly as llama.cpp's convert_hf_to_gguf `permute`."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode_tensor(w: np.ndarray, dtype: str) -> tuple[np.ndarray, object | None]:
    """-> (array to store, raw GGML type or None). Norms (1-D) stay F32 as llama.cpp keeps them."""
    from gguf import GGMLQuantizationType, quants

    if w.ndim == 1 or dtype == "F32":
        return w.astype(np.float32), None
    if dtype == "Q8_0" and w.shape[-1] % 32 == 0:
        # gguf.quants.Q8_0 is documented bit-exact with ggml's quantize_row_q8_0_ref (roundf, d = amax/127)
        return quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    return w.astype(np.float16), None


def _add_metadata(writer, spec: LlamaSpec, vocab: Vocab, dtype: str, chat_template: str | None, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[dtype])  # llama_ftype ALL_F32 / MOSTLY_F16 / MOSTLY_Q8_0
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
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    if "<|eot_id|>" in vocab.tokens:
        writer.add_eot_token_id(vocab.tokens.index("<|eot_id|>"))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    path: str | Path,
    spec: LlamaSpec,
    weights: dict[str, np.ndarray],
    vocab: Vocab,
    dtype: str = "F16",
    chat_template: str | None = None,
    name: str = "pp-worker-test",
) -> Path:
    """Write a llama GGUF. `weights` are HF layout (see `random_weights`); Q/K rows are permuted to GGUF order here."""
    from gguf import GGUFWriter

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    shapes = tensor_shapes(spec, len(vocab.tokens))
    if set(weights) != set(shapes):
        missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
        raise ValueError(f"weights: missing {missing}, unexpected {extra}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # readers of a shared model dir never see half a file
    writer = GGUFWriter(tmp, "llama")
    _add_metadata(writer, spec, vocab, dtype, chat_template, name)
    for tname, shape in shapes.items():  # fixed order, whatever the dict order
        w = np.asarray(weights[tname], dtype=np.float32)
        if w.shape != shape:
            raise ValueError(f"{tname}: shape {w.shape}, expected {shape}")
        if tname.endswith(("attn_q.weight", "attn_k.weight")):
            w = permute_rope_rows(w, spec.n_heads if "attn_q" in tname else spec.n_kv_heads)
        data, raw_dtype = _encode_tensor(w, dtype)
        writer.add_tensor(tname, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


@functools.cache
def builtin_vocab(n_merges: int) -> Vocab:
    """The vocabulary `generate` uses (cached: shared object, do not mutate)."""
    return build_vocab(builtin_text(), n_merges)


def generate(path: str | Path, preset: str = "tiny", seed: int = 0, dtype: str = "F16") -> Path:
    """Write the `preset` model with weights from `seed`; the same arguments give a byte-identical file."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    spec, n_merges = PRESETS[preset]
    vocab = builtin_vocab(n_merges)
    weights = random_weights(spec, len(vocab.tokens), seed)
    return write_gguf(path, spec, weights, vocab, dtype=dtype, name=f"pp-worker-{preset}-s{seed}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pp_worker.modelgen", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPES, default="F16")
    args = ap.parse_args(argv)
    path = generate(args.out, args.preset, args.seed, args.dtype)
    spec, n_merges = PRESETS[args.preset]
    n_vocab = len(builtin_vocab(n_merges).tokens)
    print(
        f"{path}: {args.preset} {args.dtype} vocab={n_vocab} params={param_count(spec, n_vocab)} "
        f"bytes={path.stat().st_size}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
