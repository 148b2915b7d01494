"""Load one stage's slice of a GGUF model: only the tensors its blocks (and embedding or head) need.

tinygrad's `Transformer.from_gguf` copies the whole file into memory, which defeats pipeline parallelism. Here
the header is parsed with bounds checks (`gguf_file`), and each needed tensor's bytes are read from its offset into
its own realized buffer, one tensor at a time, in its final layout, llama's Q/K rows un-permuted on the host exactly
as `from_gguf` does (a packed row's blocks move whole). A matrix whose type has a kernel stays as the file's bytes
(`weights.PackedWeight`: F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): on the CPU F16 too, since the C
kernels read every type (`weights`); elsewhere F16 is a native fp16 buffer. Any other type (and every tensor when
``keep_quantized`` is off, the reference path of the tests) is dequantized once, here, with tinygrad's
`ggml_data_to_tensor`, and cast to fp16 (`HALF=1`, tinygrad's default); norm gains are always fp16 values. A model
given by URL is read the same way from a sparse cache file that `fetch` fills with the header and this stage's
tensors only.

Context: ``max_context = min(requested or context_length, context_length, cap)`` with ``cap`` 4096 by default.
Every session holds a KV cache of max_context positions per block, so an uncapped 128k-context model would need
gigabytes per generation.

tinygrad is imported inside the functions that need it; `ModelLoadError` and `read_header` (from `gguf_file`)
are importable from here too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pp_worker.worker.engines.detokenizer import Detokenizer
from pp_worker.worker.engines.fetch import RemoteFile, is_url
from pp_worker.worker.engines.gguf_file import GGUFHeader, ModelLoadError, TensorInfo, read_data, read_header, type_name
from pp_worker.worker.engines.hostio import filled, return_freed_heap
from pp_worker.worker.engines.rope import RopeParams
from pp_worker.worker.engines.tokenizer import Tokenizer
from pp_worker.worker.shard import Shard

if TYPE_CHECKING:
    from tinygrad import Tensor, nn
    from tinygrad.dtype import DType
    from tinygrad.llm.model import TransformerBlock, TransformerConfig

    from pp_worker.worker.engines.kvcache import CacheBlock
    from pp_worker.worker.engines.weights import Embedding, Linear, PackedWeight

B = TypeVar("B", bound="TransformerBlock")
CONTEXT_CAP = 4096
GGML_F32, GGML_F16 = 0, 1  # ggml type ids of float32 and float16 data
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")  # plain attention + dense FFN, tinygrad's TransformerBlock
END_TOKEN_NAMES = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
                   "</s>", "<end_of_turn>")


# ---------------------------------------------------------------- file


def resolve_model(model: str) -> Path | str:
    """A local .gguf path, or the URL of one: given as such (http:// or https://), or a name from
    tinygrad.llm.cli.models. A URL's stage fetches only its own bytes (`fetch`)."""
    if is_url(model):
        return model
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from tinygrad.llm.cli import models

    if model not in models:
        raise ModelLoadError(f"model file not found: {model} (not a file, nor an http(s) URL, nor one of tinygrad's "
                             f"model names: {', '.join(sorted(models))})")
    return models[model]


def open_header(model: str, emit: Callable[..., None]) -> GGUFHeader:
    """The header of a local file, or of a URL's (fetched into the cache, which then serves its tensors)."""
    where = resolve_model(model)
    return read_header(where) if isinstance(where, Path) else RemoteFile(where, emit).open()


def stage_tensors(header: GGUFHeader, shard: Shard) -> list[TensorInfo]:
    """Every tensor this stage reads: its blocks', the embedding on the first stage, the output norm and head
    (or the embedding, when tied) on the last, and the RoPE factors."""
    blocks = tuple(f"blk.{i}." for i in range(shard.start, shard.end))
    wanted = {"rope_freqs.weight"} | ({"token_embd.weight"} if shard.is_first else set())
    if shard.is_last:
        wanted |= {"output_norm.weight", "output.weight" if "output.weight" in header.tensors else "token_embd.weight"}
    return [t for name, t in header.tensors.items() if name in wanted or name.startswith(blocks)]


# ---------------------------------------------------------------- config


def _meta(kv: dict[str, Any], key: str) -> Any:
    if key not in kv:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    return kv[key]


def check_architecture(kv: dict[str, Any]) -> str:
    arch = _meta(kv, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r}: this worker runs {', '.join(SUPPORTED_ARCHS)} "
                             f"(plain attention, dense feed-forward)")
    if kv.get(f"{arch}.expert_count", 0) > 0:
        raise ModelLoadError(f"unsupported {arch} variant: mixture of experts ({kv[f'{arch}.expert_count']} experts)")
    return arch


def context_length(kv: dict[str, Any], requested: int | None, cap: int = CONTEXT_CAP) -> int:
    """min(requested or the model's context_length, context_length, cap): see the module docstring."""
    trained = _meta(kv, f"{kv['general.architecture']}.context_length")
    if requested is not None and requested < 1:
        raise ModelLoadError(f"max_context must be >= 1, got {requested}")
    return min(requested or trained, trained, cap)


def build_config(header: GGUFHeader, max_context: int) -> TransformerConfig:
    """The TransformerConfig that `Transformer.from_gguf` builds, for the plain-attention archs."""
    from tinygrad.llm.model import TransformerConfig

    kv, tensors = header.kv, header.tensors
    arch = check_architecture(kv)
    n_heads, dim = _meta(kv, f"{arch}.attention.head_count"), _meta(kv, f"{arch}.embedding_length")
    head_dim = kv.get(f"{arch}.attention.key_length", dim // n_heads)
    q_norm = tensors.get("blk.0.attn_q_norm.weight")
    return TransformerConfig(
        num_blocks=_meta(kv, f"{arch}.block_count"), dim=dim, hidden_dim=_meta(kv, f"{arch}.feed_forward_length"),
        n_heads=n_heads, n_kv_heads=kv.get(f"{arch}.attention.head_count_kv", n_heads),
        norm_eps=_meta(kv, f"{arch}.attention.layer_norm_rms_epsilon"),
        vocab_size=len(_meta(kv, "tokenizer.ggml.tokens")), head_dim=head_dim,
        rope_theta=kv.get(f"{arch}.rope.freq_base", 10000.0),
        rope_dim=kv.get(f"{arch}.rope.dimension_count", head_dim),
        v_head_dim=kv.get(f"{arch}.attention.value_length", head_dim), max_context=max_context,
        qk_norm=q_norm.shape[0] if q_norm is not None else 0, qkv_bias="blk.0.attn_q.bias" in tensors)


def eos_token_ids(kv: dict[str, Any]) -> list[int]:
    """tokenizer.ggml.eos_token_id / eot_token_id plus the well-known end-of-turn tokens present in the vocab."""
    ids = {kv[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in kv}
    tokens = kv.get("tokenizer.ggml.tokens", [])
    ids |= {i for i, tok in enumerate(tokens) if tok in END_TOKEN_NAMES}
    return sorted(ids)


# ---------------------------------------------------------------- tensors


@dataclass
class TensorSource:
    """Reads single tensors out of the file into their own realized device buffers, in their final layout, and
    remembers which (``loaded``: name -> bytes read) and what each holds (``held``: name -> (type, bytes);
    ``converted``: name -> the file's type, for matrices turned into fp16 values at load).

    ``kernels`` ("c" or "tinygrad", see `weights`) decides how matrices are held: with "c" every fp16 buffer is a
    uint8 buffer (the C kernels, and tinygrad's CPU kernels, read those fastest), and F16 matrices stay packed too."""

    header: GGUFHeader
    half: bool = True
    kernels: str = "tinygrad"
    keep_quantized: bool = True
    loaded: dict[str, int] = field(default_factory=dict)
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    converted: dict[str, str] = field(default_factory=dict)

    def matrix(self, name: str, shape: tuple[int, ...], heads: tuple[int, int] | None = None) -> Tensor | PackedWeight:
        """A weight matrix of ``shape`` (n, k): its file bytes (`PackedWeight`) when its type has a kernel and
        the stage keeps it (see the class); else fp16 values, packed as F16 rows when the C kernels run."""
        from tinygrad import dtypes

        from pp_worker.worker.engines import cpu_kernels
        from pp_worker.worker.engines.weights import PackedWeight, tinygrad_expands

        info = self._info(name)
        if info.shape != shape:
            raise ModelLoadError(f"{self.header.path}: tensor {name} has shape {info.shape}, expected {shape}")
        c = self.kernels == "c"
        keep = c if info.ggml_type == GGML_F16 else self.keep_quantized
        # the C kernels read their types; tinygrad's expressions (`weights.dequantize`) only the types it expands
        if keep and cpu_kernels.supported(info.ggml_type, shape[1]) and (c or tinygrad_expands(info.ggml_type)):
            raw = self._raw(info.nbytes, self._filler(info, heads)).reshape(shape[0], -1)
            self.loaded[name] = info.nbytes
            self.held[name] = (type_name(info.ggml_type), info.nbytes)
            return PackedWeight(raw, info.ggml_type, shape)
        if info.ggml_type != GGML_F16:
            self.converted[name] = type_name(info.ggml_type)
        raw = self.tensor(name, heads, raw=True)
        if c and raw.dtype == dtypes.uint8 and cpu_kernels.supported(GGML_F16, shape[1]):
            return PackedWeight(raw.reshape(shape[0], -1), GGML_F16, shape)
        return self._view(raw, shape)

    def tensor(self, name: str, heads: tuple[int, int] | None = None, raw: bool = False) -> Tensor:
        """(GGUF dims reversed) tensor, fp16 when ``half``, realized. ``heads=(n_heads, keep)``: GGUF's
        interleaved-rope Q/K rows un-permuted (`unpermute_rows`). F16 data is read straight into its final
        buffer; other types are dequantized by tinygrad once, here. ``raw``: an fp16 tensor held in a uint8
        buffer (see the class) is returned as that uint8 buffer."""
        from tinygrad import dtypes

        info = self._info(name)
        self.loaded[name] = info.nbytes
        dtype = dtypes.float16 if self.half else dtypes.float32
        if dtype == dtypes.float16 and info.ggml_type == GGML_F16:  # already what we keep: no staging copy, no cast
            fill = self._filler(info, heads)
        else:
            values = self._dequantized(info, dtype)
            values = unpermute_rows(values, *heads) if heads else values

            def fill(mv: memoryview) -> None:
                np.frombuffer(mv, np.uint8)[:] = values.reshape(-1).view(np.uint8)
        nbytes = math.prod(info.shape) * dtype.itemsize
        self.held[name] = ("F16" if dtype == dtypes.float16 else "F32", nbytes)
        if self.kernels == "c" and dtype == dtypes.float16:
            t = self._raw(nbytes, fill)
            return t if raw else self._view(t, info.shape)
        return filled(info.shape, dtype, fill)

    def _filler(self, info: TensorInfo, heads: tuple[int, int] | None) -> Callable[[memoryview], None]:
        """Writes ``info``'s file bytes into a buffer, rows un-permuted in place when ``heads`` (whole rows move, so
        packed rows of any block type move as fp16 rows do)."""
        def fill(mv: memoryview) -> None:
            self._read(info, mv)
            if heads:
                rows = np.frombuffer(mv, np.uint8).reshape(info.shape[0], -1)  # (rows, row bytes), writes through
                rows[:] = unpermute_rows(rows, *heads)
        return fill

    def _info(self, name: str) -> TensorInfo:
        info = self.header.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.header.path}: tensor {name} is missing")
        if info.nbytes is None:
            raise self._unreadable(info)
        return info

    def _unreadable(self, info: TensorInfo) -> ModelLoadError:
        return ModelLoadError(f"{self.header.path}: tensor {info.name} has GGML type {info.ggml_type} "
                              f"({type_name(info.ggml_type)}), which this worker cannot read")

    def _dequantized(self, info: TensorInfo, dtype: DType) -> np.ndarray:
        """Any GGML type -> ``dtype`` values (shape ``info.shape``), by tinygrad's dequantizer and cast; float32 and
        float16 data by numpy's cast (the same rounding): a stage's first tinygrad kernels, scheduled and compiled
        here for the norms' gains, cost a restart ~0.3 s (bench/NOTES.md). The types tinygrad lacks (Q2_K, Q3_K,
        IQ4_NL, TQ2_0...) by the `gguf` package's numpy version of ggml's ``dequantize_row_*``."""
        from tinygrad import dtypes
        from tinygrad.llm.gguf import ggml_data_to_tensor

        from pp_worker.worker.engines.weights import tinygrad_expands

        if info.ggml_type in (GGML_F32, GGML_F16) or not tinygrad_expands(info.ggml_type):
            data = np.empty(info.nbytes, np.uint8)
            self._read(info, memoryview(data))
            if info.ggml_type in (GGML_F32, GGML_F16):
                values = data.view(np.float32 if info.ggml_type == GGML_F32 else np.float16)
            else:
                from gguf import GGMLQuantizationType, quants

                try:
                    values = quants.dequantize(data, GGMLQuantizationType(info.ggml_type))
                except NotImplementedError:  # Q8_1, Q8_K: ggml's types for activations, never a model's weights
                    raise self._unreadable(info) from None
            return values.reshape(info.shape).astype(np.float16 if dtype == dtypes.float16 else np.float32)

        raw = self._raw(info.nbytes, lambda mv: self._read(info, mv))
        return ggml_data_to_tensor(raw, info.n_elements, info.ggml_type).reshape(info.shape).cast(dtype).numpy()

    @staticmethod
    def _raw(nbytes: int, fill: Callable[[memoryview], None]) -> Tensor:
        """A new realized uint8 buffer of ``nbytes``, filled by ``fill(its bytes)``: in place on the CPU
        (`hostio.filled`; a numpy copy plus a device copy per tensor used to stay resident)."""
        from tinygrad import dtypes

        return filled((nbytes,), dtypes.uint8, fill)

    @staticmethod
    def _view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A uint8 buffer of fp16 bytes viewed as the fp16 tensor of ``shape`` (other tensors as they are)."""
        from tinygrad import dtypes

        return t.bitcast(dtypes.float16).reshape(shape) if t.dtype == dtypes.uint8 else t

    def _read(self, info: TensorInfo, mv: memoryview) -> None:
        if read_data(self.header, info.offset, mv) != info.nbytes:
            raise ModelLoadError(f"{self.header.path}: truncated file: tensor {info.name} is short of data")


def unpermute_rows(w: np.ndarray, n_heads: int, keep: int = 0) -> np.ndarray:
    """GGUF interleaved-rope rows -> half-split rows per head (the first ``keep`` rows of a head are not roped),
    the same rearrange as `Transformer.from_gguf` ("n (h two) d -> n (two h) d"), on the host, once."""
    w = w.reshape(n_heads, w.shape[0] // n_heads, -1)  # (H, Hd, D)
    n, hd, d = w.shape
    roped = w[:, keep:].reshape(n, (hd - keep) // 2, 2, d).transpose(0, 2, 1, 3).reshape(n, hd - keep, d)
    return np.concatenate([w[:, :keep], roped], axis=1).reshape(n * hd, d)


def unweighted_block(cls: type[B], config: TransformerConfig) -> B:
    """A block of class ``cls`` (tinygrad's TransformerBlock or a subclass) whose projections have shapes but no
    values yet. tinygrad's ``nn.Linear`` starts from ``Tensor.uniform``, whose threefry graph takes ~15-25 ms a
    matrix to build: 70% of loading the bench model's stage, seconds on a 32-block stage, all for weights the
    loader replaces. While the block is made, ``nn.Linear`` is a subclass whose weight is ``Tensor.empty``
    (nothing allocated); nothing else is made then (the loader runs on one thread)."""
    from tinygrad import Tensor, nn

    class ShapedLinear(nn.Linear):
        def __init__(self, in_features: int, out_features: int, bias: bool = True):
            self.weight = Tensor.empty(out_features, in_features)
            self.bias = Tensor.empty(out_features) if bias else None

    real, nn.Linear = nn.Linear, ShapedLinear  # type: ignore[misc]
    try:
        return cls(config)
    finally:
        nn.Linear = real  # type: ignore[misc]


def load_block(source: TensorSource, config: TransformerConfig, i: int) -> CacheBlock:
    """Block ``i`` (absolute index, ``blk.{i}.*`` in the file), each weight in its own realized buffer; its
    projections are `weights.Linear` over matrices as `TensorSource.matrix` holds them."""
    from tinygrad import nn

    from pp_worker.worker.engines.kvcache import CacheBlock
    from pp_worker.worker.engines.weights import Linear

    block = unweighted_block(CacheBlock, config)
    heads: dict[str, tuple[int, int]] = {}
    if source.header.kv["general.architecture"] == "llama":
        heads = {"attn_q": (config.n_heads, config.head_dim - config.rope_dim), "attn_k": (config.n_kv_heads, 0)}
    linears = {name: layer for name, layer in vars(block).items() if isinstance(layer, nn.Linear)}
    gains = {k: source.tensor(f"blk.{i}.{k}") for k in nn.state.get_state_dict(block) if k.split(".")[0] not in linears}
    try:
        nn.state.load_state_dict(block, gains, strict=False, verbose=False, realize=False)
    except ValueError as e:
        raise ModelLoadError(f"block {i}: {e}") from e
    for name, layer in linears.items():
        bias = None if layer.bias is None else source.tensor(f"blk.{i}.{name}.bias")
        weight = source.matrix(f"blk.{i}.{name}.weight", layer.weight.shape, heads.get(name))
        setattr(block, name, Linear(weight, bias, source.kernels))
    return block


# ---------------------------------------------------------------- a stage


@dataclass
class StageWeights:
    """What one stage holds: its blocks (absolute indices start..end-1), embedding if first, head if last."""

    shard: Shard
    config: TransformerConfig
    kv: dict[str, Any]
    blocks: list[CacheBlock]  # blocks[j] is block shard.start + j
    token_embd: Embedding | None
    output_norm: nn.RMSNorm | None
    output: Linear | None
    tokenizer: Tokenizer | None  # on the first stage (encodes)
    detokenizer: Detokenizer | None  # on the last stage (decodes from a table; no tokenizer library)
    rope: RopeParams  # how every block rotates Q and K, scaling included
    loaded: dict[str, int]  # tensor name -> bytes read from the file
    path: Path
    kernels: str  # how products run: "c" (cpu_kernels) or "tinygrad" (`weights`)
    held: dict[str, tuple[str, int]] = field(default_factory=dict)  # tensor name -> (type held, bytes)
    converted: dict[str, str] = field(default_factory=dict)  # matrix name -> its file type, turned into fp16 at load

    def describe(self) -> dict[str, Any]:
        """The ready line's account of the weights: tensors per type held, bytes held, and the file types that
        were dequantized at load (tensor counts per type)."""
        held = Counter(kind for kind, _ in self.held.values())
        return {"kernels": self.kernels, "weights": dict(sorted(held.items())),
                "weight_bytes": sum(n for _, n in self.held.values()),
                "weights_converted": dict(sorted(Counter(self.converted.values()).items()))}


def load_stage(model: str, stage: int, num_stages: int, max_context: int | None = None, *,
               context_cap: int = CONTEXT_CAP, emit: Callable[..., None] = lambda kind, **fields: None,
               kernels: str | None = None, keep_quantized: bool = True) -> StageWeights:
    """Load stage ``stage`` of ``num_stages``: parse the header, then read only this stage's tensors. ``kernels``:
    how products run and matrices are held (`weights`; by default decided by the device); ``keep_quantized``
    False dequantizes every quantized matrix to fp16 at load (the reference the tests compare against)."""
    from tinygrad import Device, getenv

    from pp_worker.worker.engines.weights import KERNELS, default_kernels

    kernels = default_kernels(Device.DEFAULT) if kernels is None else kernels
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    header = open_header(model, lambda kind, **fields: emit(kind, **fields, stage_index=stage))
    check_architecture(header.kv)  # first, so an unsupported model is named as such
    config = build_config(header, context_length(header.kv, max_context, context_cap))
    try:
        shard = Shard.of(stage, num_stages, config.num_blocks)
    except ValueError as e:
        raise ModelLoadError(f"cannot split {config.num_blocks} blocks: {e}") from e
    if header.ensure is not None:  # a URL's: this stage's bytes in as few requests as they allow, with progress
        header.ensure([(t.offset, t.offset + (t.nbytes or 0)) for t in stage_tensors(header, shard)])
    # tokenizers first: building one peaks above what it keeps (freed heap goes back below), better before the weights
    tokenizer = _load_tokenizer(header.kv, Tokenizer.from_gguf_kv) if shard.is_first else None
    detokenizer = _load_tokenizer(header.kv, Detokenizer.from_gguf_kv) if shard.is_last else None
    return_freed_heap()
    source = TensorSource(header, half=bool(getenv("HALF", 1)), kernels=kernels, keep_quantized=keep_quantized)
    rope = RopeParams.from_gguf(header.kv, config.rope_dim, _rope_freqs(source))
    blocks = []
    for j, i in enumerate(range(shard.start, shard.end)):
        emit("loading", blocks_done=j, blocks_total=shard.end - shard.start, stage_index=stage)
        blocks.append(load_block(source, config, i))
    emit("loading", blocks_done=len(blocks), blocks_total=len(blocks), stage_index=stage)
    token_embd = _load_embedding(source, config) if shard.is_first else None
    output_norm, output = _load_head(source, config) if shard.is_last else (None, None)
    return StageWeights(shard, config, header.kv, blocks, token_embd, output_norm, output, tokenizer, detokenizer,
                        rope, source.loaded, header.path, kernels, source.held, source.converted)


def _rope_freqs(source: TensorSource) -> np.ndarray | None:
    """rope_freqs.weight (Llama 3.1+'s per-frequency RoPE factors) as float32, on every stage: every block ropes.
    Not through ``tensor()``: its fp16 cast would round the factors."""
    info = source.header.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.ggml_type != GGML_F32:
        raise ModelLoadError(f"{source.header.path}: rope_freqs.weight has GGML type {info.ggml_type}, expected F32")
    source.loaded[info.name] = info.n_elements * 4
    factors = np.empty(info.n_elements, np.float32)
    if read_data(source.header, info.offset, memoryview(factors).cast("B")) != factors.nbytes:
        raise ModelLoadError(f"{source.header.path}: truncated file: rope_freqs.weight is short of data")
    return factors


def _load_embedding(source: TensorSource, config: TransformerConfig) -> Embedding:
    from pp_worker.worker.engines.weights import Embedding

    return Embedding(source.matrix("token_embd.weight", (config.vocab_size, config.dim)), source.kernels)


def _load_head(source: TensorSource, config: TransformerConfig) -> tuple[nn.RMSNorm, Linear]:
    from tinygrad import nn

    from pp_worker.worker.engines.weights import Linear

    norm = nn.RMSNorm(config.dim, config.norm_eps)
    nn.state.load_state_dict(norm, {"weight": source.tensor("output_norm.weight")}, verbose=False, realize=False)
    # tied embeddings (e.g. Llama 3.2): no output.weight, the head is the embedding matrix
    name = "output.weight" if "output.weight" in source.header.tensors else "token_embd.weight"
    return norm, Linear(source.matrix(name, (config.vocab_size, config.dim)), None, source.kernels)


def _load_tokenizer(kv: dict[str, Any], build: Callable[[dict[str, Any]], Any]) -> Any:
    try:
        return build(kv)
    except Exception as e:  # KeyError, ValueError, or the tokenizer library's own on a malformed vocabulary
        raise ModelLoadError(f"cannot build the tokenizer: {type(e).__name__}: {e}") from e
