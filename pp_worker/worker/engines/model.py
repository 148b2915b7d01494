"""One stage's model: the config from the GGUF's metadata, and its blocks, embedding and head built from the tensors
`gguf.tensors` reads (only this stage's share of the file).

Context: ``max_context = min(requested or context_length, context_length)``: the model's own by default. A session's
KV grows in pages as its positions do (`kvcache.KVPool`), so a long context costs only what is used; the engine
lowers a default context to what its KV pool can hold. tinygrad is imported inside the functions that need it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pp_worker.worker.engines.rope import RopeParams
from pp_worker.worker.gguf.header import GGUFHeader, ModelLoadError, read_data
from pp_worker.worker.gguf.tensors import TensorSource, open_header, stage_tensors
from pp_worker.worker.gguf.types import F32
from pp_worker.worker.hostio import return_freed_heap
from pp_worker.worker.shard import Shard
from pp_worker.worker.text.detokenizer import Detokenizer
from pp_worker.worker.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tinygrad import nn
    from tinygrad.llm.model import TransformerBlock, TransformerConfig

    from pp_worker.worker.engines.kvcache import CacheBlock
    from pp_worker.worker.engines.weights import Embedding, Linear

B = TypeVar("B", bound="TransformerBlock")
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3",  # plain attention + dense FFN, tinygrad's TransformerBlock
                   "gemma3",  # post-norms, GELU, sliding-window blocks (engines.gemma3)
                   "qwen3moe")  # routed experts (engines.moe; also in llama files)
END_TOKEN_NAMES = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
                   "</s>", "<end_of_turn>")


# ---------------------------------------------------------------- config


def _meta(kv: dict[str, Any], key: str) -> Any:
    if key not in kv:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    return kv[key]


def check_architecture(kv: dict[str, Any]) -> str:
    arch = _meta(kv, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r}: this worker runs {', '.join(SUPPORTED_ARCHS)} "
                             f"(plain attention; dense or routed-expert feed-forward)")
    from pp_worker.worker.engines.moe import check_experts

    check_experts(arch, kv)  # routed experts in llama and qwen3moe files; any other mixture of experts refused
    return arch


def context_length(kv: dict[str, Any], requested: int | None, cap: int | None = None) -> int:
    """min(requested or the model's context_length, context_length, cap): see the module docstring."""
    trained = _meta(kv, f"{kv['general.architecture']}.context_length")
    if requested is not None and requested < 1:
        raise ModelLoadError(f"max_context must be >= 1, got {requested}")
    return min(requested or trained, trained, cap or trained)


def build_config(header: GGUFHeader, max_context: int) -> TransformerConfig:
    """The TransformerConfig that `Transformer.from_gguf` builds, for the plain-attention archs."""
    from tinygrad.llm.model import TransformerConfig

    from pp_worker.worker.engines.moe import config_fields

    kv, tensors = header.kv, header.tensors
    arch = check_architecture(kv)
    n_heads, dim = _meta(kv, f"{arch}.attention.head_count"), _meta(kv, f"{arch}.embedding_length")
    head_dim = kv.get(f"{arch}.attention.key_length", dim // n_heads)
    q_norm = tensors.get("blk.0.attn_q_norm.weight")
    experts = config_fields(arch, kv)  # with the expert's hidden width
    return TransformerConfig(
        num_blocks=_meta(kv, f"{arch}.block_count"), dim=dim,
        hidden_dim=experts.pop("hidden_dim") if experts else _meta(kv, f"{arch}.feed_forward_length"),
        n_heads=n_heads, n_kv_heads=kv.get(f"{arch}.attention.head_count_kv", n_heads),
        norm_eps=_meta(kv, f"{arch}.attention.layer_norm_rms_epsilon"),
        vocab_size=len(_meta(kv, "tokenizer.ggml.tokens")), head_dim=head_dim,
        rope_theta=kv.get(f"{arch}.rope.freq_base", 10000.0),
        rope_dim=kv.get(f"{arch}.rope.dimension_count", head_dim),
        v_head_dim=kv.get(f"{arch}.attention.value_length", head_dim), max_context=max_context,
        qk_norm=q_norm.shape[0] if q_norm is not None else 0, qkv_bias="blk.0.attn_q.bias" in tensors,
        **experts)


def eos_token_ids(kv: dict[str, Any]) -> list[int]:
    """tokenizer.ggml.eos_token_id / eot_token_id plus the well-known end-of-turn tokens present in the vocab."""
    ids = {kv[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in kv}
    tokens = kv.get("tokenizer.ggml.tokens", [])
    ids |= {i for i, tok in enumerate(tokens) if tok in END_TOKEN_NAMES}
    return sorted(ids)


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

    from pp_worker.worker.engines.moe import EXPERT_TENSORS, load_experts
    from pp_worker.worker.engines.weights import Linear

    arch = source.header.kv["general.architecture"]
    block = unweighted_block(_block_class(arch, config), config)
    heads: dict[str, tuple[int, int]] = {}
    if source.header.kv["general.architecture"] == "llama":
        heads = {"attn_q": (config.n_heads, config.head_dim - config.rope_dim), "attn_k": (config.n_kv_heads, 0)}
    linears = {name: layer for name, layer in vars(block).items() if isinstance(layer, nn.Linear)}
    if config.num_experts:  # the router and the experts: `load_experts`
        linears.pop("ffn_gate_inp")
        load_experts(block, source, config, i)
    skip = set(linears) | set(EXPERT_TENSORS) | {"ffn_gate_inp"}
    gains = {k: source.tensor(f"blk.{i}.{k}") for k in nn.state.get_state_dict(block) if k.split(".")[0] not in skip}
    try:
        nn.state.load_state_dict(block, gains, strict=False, verbose=False, realize=False)
    except ValueError as e:
        raise ModelLoadError(f"block {i}: {e}") from e
    for name, layer in linears.items():
        bias = None if layer.bias is None else source.tensor(f"blk.{i}.{name}.bias")
        weight = source.matrix(f"blk.{i}.{name}.weight", layer.weight.shape, heads.get(name), product=True)
        setattr(block, name, Linear(weight, bias, source.kernels))
    if arch == "gemma3":
        from pp_worker.worker.engines import gemma3

        gemma3.configure(block, source.header.kv, config, i)  # type: ignore[arg-type]
    elif source.kernels == "tinygrad" and not config.num_experts:
        block.pack()  # fewer kernels a token on a GPU (docs/gpus.md)
    return block


def _block_class(arch: str, config: TransformerConfig) -> type[CacheBlock]:
    """The block of an architecture: tinygrad's TransformerBlock over the KV pool, Gemma 3's, or one whose
    feed-forward is routed over experts."""
    from pp_worker.worker.engines.kvcache import CacheBlock

    if config.num_experts:
        from pp_worker.worker.engines.moe import MoEBlock

        return MoEBlock
    if arch == "gemma3":
        from pp_worker.worker.engines.gemma3 import GemmaBlock

        return GemmaBlock
    return CacheBlock


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
               context_cap: int | None = None, emit: Callable[..., None] = lambda kind, **fields: None,
               kernels: str | None = None, keep_quantized: bool = True,
               layers: tuple[int, int] | None = None) -> StageWeights:
    """Load stage ``stage`` of ``num_stages``: parse the header, then read only this stage's tensors. ``kernels``:
    how products run and matrices are held (`weights`; by default decided by the device); ``keep_quantized``
    False dequantizes every quantized matrix to fp16 at load (the reference the tests compare against). ``layers``:
    this stage's block range (``PP_LAYERS``) instead of the even split."""
    from tinygrad import Device, getenv

    from pp_worker.worker.engines.weights import KERNELS, default_kernels

    kernels = default_kernels(Device.DEFAULT) if kernels is None else kernels
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    header = open_header(model, lambda kind, **fields: emit(kind, **fields, stage_index=stage))
    check_architecture(header.kv)  # first, so an unsupported model is named as such
    config = build_config(header, context_length(header.kv, max_context, context_cap))
    try:
        shard = Shard.of(stage, num_stages, config.num_blocks, layers)
    except ValueError as e:
        raise ModelLoadError(f"cannot split {config.num_blocks} blocks: {e}") from e
    if header.ensure is not None:  # a URL's: this stage's bytes in as few requests as they allow, with progress
        header.ensure([(t.offset, t.offset + (t.nbytes or 0)) for t in stage_tensors(header, shard)])
    # tokenizers first: building one peaks above what it keeps (freed heap goes back below), better before the weights
    tokenizer = _load_tokenizer(header.kv, Tokenizer.from_gguf_kv) if shard.is_first else None
    detokenizer = _load_tokenizer(header.kv, Detokenizer.from_gguf_kv) if shard.is_last else None
    return_freed_heap()
    from pp_worker.worker.cpu.kernels import group_rows

    source = TensorSource(header, half=bool(getenv("HALF", 1)), kernels=kernels, keep_quantized=keep_quantized,
                          group_rows=group_rows if kernels == "c" else None)
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
    Read into numpy, not through ``tensor()`` (a device buffer): `RopeParams` builds the RoPE table from it on the
    host."""
    info = source.header.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.ggml_type != F32:
        raise ModelLoadError(f"{source.header.path}: rope_freqs.weight has GGML type {info.ggml_type}, expected F32")
    source.loaded[info.name] = info.n_elements * 4
    factors = np.empty(info.n_elements, np.float32)
    if read_data(source.header, info.offset, memoryview(factors).cast("B")) != factors.nbytes:
        raise ModelLoadError(f"{source.header.path}: truncated file: rope_freqs.weight is short of data")
    return factors


def _load_embedding(source: TensorSource, config: TransformerConfig) -> Embedding:
    from pp_worker.worker.engines.weights import Embedding

    weight = source.matrix("token_embd.weight", (config.vocab_size, config.dim))
    if source.header.kv["general.architecture"] == "gemma3":
        from pp_worker.worker.engines.gemma3 import ScaledEmbedding

        return ScaledEmbedding(weight, source.kernels, config.dim)
    return Embedding(weight, source.kernels)


def _load_head(source: TensorSource, config: TransformerConfig) -> tuple[nn.RMSNorm, Linear]:
    from tinygrad import nn

    from pp_worker.worker.engines.weights import Linear

    norm = nn.RMSNorm(config.dim, config.norm_eps)
    nn.state.load_state_dict(norm, {"weight": source.tensor("output_norm.weight")}, verbose=False, realize=False)
    # tied embeddings (e.g. Llama 3.2): no output.weight, the head is the embedding matrix
    name = "output.weight" if "output.weight" in source.header.tensors else "token_embd.weight"
    return norm, Linear(source.matrix(name, (config.vocab_size, config.dim), product=True), None, source.kernels)


def _load_tokenizer(kv: dict[str, Any], build: Callable[[dict[str, Any]], Any]) -> Any:
    try:
        return build(kv)
    except Exception as e:  # KeyError, ValueError, or the tokenizer library's own on a malformed vocabulary
        raise ModelLoadError(f"cannot build the tokenizer: {type(e).__name__}: {e}") from e
