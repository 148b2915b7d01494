"""The bench's models (generated once into ``bench/models/``), each stage's share of them, and fixed-length prompts.

``modelgen`` is deterministic, so a file already in the cache is the same file and is reused.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pp_worker.testing.modelgen import builtin_text, generate
from pp_worker.worker.gguf.header import GGUFHeader, TensorInfo, read_header
from pp_worker.worker.shard import Shard

CACHE = Path(__file__).resolve().parent / "models"
KV_BYTES = 2  # the KV pages are float16, the CPU's default (PP_KV_DTYPE; make bench runs on the CPU)
WEIGHT_BYTES = 2  # a weight held as fp16 values (HALF=1): tinygrad's own way with every type, and norm gains here


def ensure_model(preset: str, seed: int = 0, dtype: str = "F16", *, isolated: bool = False) -> Path:
    """The cached model file, generated first if missing; ``isolated``: in a child process, so a big model's
    float32 weights (4 bytes a parameter, all held at once by ``generate``) never stay in this one's memory."""
    path = CACHE / f"{preset}-s{seed}-{dtype}.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)  # a fresh checkout has none (it is ignored by git)
        tmp = path.with_suffix(".tmp")
        if isolated:
            subprocess.run([sys.executable, "-m", "pp_worker.testing.modelgen", str(tmp), "--preset", preset,
                            "--seed", str(seed), "--dtype", dtype], check=True, capture_output=True, timeout=900)
        else:
            generate(tmp, preset=preset, seed=seed, dtype=dtype)
        tmp.rename(path)  # a run killed half-way never leaves a truncated model behind
    return path


@dataclass(frozen=True)
class ModelFacts:
    params: int
    file_bytes: int
    n_blocks: int
    n_kv_heads: int
    head_dim: int
    context: int

    def kv_bytes(self, blocks: int, max_context: int) -> int:
        """One session's KV cache over ``blocks`` blocks: (2, 1, KvH, max_context, Hd) float32 per block."""
        return blocks * 2 * self.n_kv_heads * max_context * self.head_dim * KV_BYTES


def facts(path: Path) -> ModelFacts:
    h = read_header(path)
    arch = h.kv["general.architecture"]
    n_heads, dim = h.kv[f"{arch}.attention.head_count"], h.kv[f"{arch}.embedding_length"]
    return ModelFacts(params=sum(t.n_elements for t in h.tensors.values()), file_bytes=path.stat().st_size,
                      n_blocks=h.kv[f"{arch}.block_count"], n_kv_heads=h.kv[f"{arch}.attention.head_count_kv"],
                      head_dim=dim // n_heads, context=h.kv[f"{arch}.context_length"])


def stage_shares(path: Path, num_stages: int, max_context: int) -> list[tuple[int, int]]:
    """(weight bytes in memory, one session's KV bytes) of each stage, as the stage loader splits the model and
    holds it on the CPU: matrices as the file's bytes (a type with a kernel), norm gains as fp16."""
    h, f = read_header(path), facts(path)
    out = []
    for stage in range(num_stages):
        shard = Shard.of(stage, num_stages, f.n_blocks)
        weights = sum(_held(h.tensors[n]) for n in _stage_tensors(h, shard))
        out.append((weights, f.kv_bytes(shard.end - shard.start, max_context)))
    return out


def file_shares(path: Path, num_stages: int) -> list[int]:
    """Each stage's tensors' bytes in the file: its share of the file."""
    h, f = read_header(path), facts(path)
    return [sum(h.tensors[n].nbytes or 0 for n in _stage_tensors(h, Shard.of(stage, num_stages, f.n_blocks)))
            for stage in range(num_stages)]


def _held(t: TensorInfo) -> int:
    from pp_worker.worker.cpu.kernels import supported

    if len(t.shape) == 2 and supported(t.ggml_type, t.shape[1]):
        return t.nbytes or 0
    return t.n_elements * WEIGHT_BYTES


def _stage_tensors(h: GGUFHeader, shard: Shard) -> list[str]:
    names = [n for n in h.tensors if n.startswith("blk.") and shard.start <= int(n.split(".")[1]) < shard.end]
    if shard.is_first:
        names.append("token_embd.weight")
    if shard.is_last:
        names += ["output_norm.weight", "output.weight" if "output.weight" in h.tensors else "token_embd.weight"]
    return names


def fixed_length_prompts(path: Path, n_tokens: int, count: int) -> list[str]:
    """``count`` distinct prompts that each tokenize to exactly ``n_tokens`` tokens with this model's tokenizer.

    Windows of the built-in text are decoded and re-encoded (a window can re-tokenize differently at its
    edges), sliding the start until the length comes out right.
    """
    tok = tokenizer(path)
    text = builtin_text()
    ids = tok.encode(text * (1 + (n_tokens * (count + 1)) // max(1, len(tok.encode(text)))))
    prompts: list[str] = []
    start = 0
    while len(prompts) < count and start + n_tokens <= len(ids):
        candidate = tok.decode(ids[start:start + n_tokens])
        if len(tok.encode(candidate)) == n_tokens and candidate not in prompts:
            prompts.append(candidate)
            start += max(1, n_tokens // 4) if n_tokens > 4 else 7
        else:
            start += 1
    if len(prompts) < count:
        raise ValueError(f"could not build {count} prompts of {n_tokens} tokens from the built-in text")
    return prompts


@functools.cache
def tokenizer(path: Path) -> Any:
    """tinygrad's tokenizer for this GGUF (the one the stage workers use)."""
    from tinygrad.llm.cli import SimpleTokenizer  # tinygrad only here: the rest of the bench driver stays light

    return SimpleTokenizer.from_gguf_kv(read_header(path).kv)
