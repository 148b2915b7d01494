"""Mixture-of-experts blocks (`qwen3moe`, and Mixtral-style experts in `llama` files): tinygrad's TransformerBlock
attention with a routed feed-forward, as llama.cpp's ``build_moe_ffn`` computes it for these families:

    p = softmax(x W_router^T)                   over the E experts, float32
    sel = the k largest p; w = p[sel]           (``expert_used_count`` = k)
    w = s * w / sum(w)                          llama.cpp normalizes for both families whatever the file says (a
                                                 file with ``expert_weights_norm`` false is refused, not misrun);
                                                 s: ``expert_weights_scale`` where set (not 0), else 1
    y = sum_j w_j * down_j(silu(gate_j(x)) * up_j(x))

Each of ``ffn_gate_exps``, ``ffn_up_exps`` and ``ffn_down_exps`` stays one buffer of its GGUF type (`Experts`), read
only by this stage. On the CPU's C kernels a product reads only the routed experts' rows (`cpu.moe`): the forward
writes the chosen ids into a small buffer and the kernel reads them there, so the compiled graph is the same every
call whatever the routing; tokens of a batch or a prefill chunk routed to the same expert share one pass over its
rows. Elsewhere (and for fp16 values) the routed experts' matrices are gathered by tinygrad ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinygrad import Tensor, dtypes
from tinygrad.llm.model import pairwise_topk

from pp_worker.worker.cpu import moe as cpu_moe
from pp_worker.worker.engines.kvcache import CacheBlock
from pp_worker.worker.engines.weights import Linear, dequantize
from pp_worker.worker.gguf.header import ModelLoadError, read_data
from pp_worker.worker.gguf.tensors import PackedWeight, TensorSource
from pp_worker.worker.gguf.types import F32
from pp_worker.worker.hostio import filled

if TYPE_CHECKING:
    from tinygrad.llm.model import TransformerConfig

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MOE_ARCHS = ("llama", "qwen3moe")  # where experts are supported: routed experts only (no shared expert)


def check_experts(arch: str, kv: dict[str, Any]) -> None:
    """Refuse, by name, the mixture-of-experts variants this worker does not run."""
    n, used = kv.get(f"{arch}.expert_count", 0), kv.get(f"{arch}.expert_used_count", 0)
    if arch == "qwen3moe" and n <= 0:
        raise ModelLoadError("qwen3moe file without qwen3moe.expert_count")
    if n <= 0:
        return
    if arch not in MOE_ARCHS:
        raise ModelLoadError(f"unsupported {arch} variant: mixture of experts ({n} experts); experts run in "
                             f"{', '.join(MOE_ARCHS)} files")
    if not 0 < used <= n:
        raise ModelLoadError(f"{arch}.expert_used_count must be in 1..{n}, got {used}")
    if kv.get(f"{arch}.expert_shared_count", 0) or kv.get(f"{arch}.expert_shared_feed_forward_length", 0):
        raise ModelLoadError(f"unsupported {arch} variant: shared experts")
    if not kv.get(f"{arch}.expert_weights_norm", True):
        raise ModelLoadError(f"unsupported {arch} variant: unnormalized expert weights (llama.cpp normalizes the "
                             f"routed experts' weights of {arch} files)")
    if kv.get(f"{arch}.expert_gating_func", 1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"unsupported {arch} variant: expert gating function "
                             f"{kv[f'{arch}.expert_gating_func']} (softmax only)")


def config_fields(arch: str, kv: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields of a mixture of experts (empty for a dense file): the hidden width is the expert's."""
    n = kv.get(f"{arch}.expert_count", 0)
    if n <= 0:
        return {}
    hidden = kv.get(f"{arch}.expert_feed_forward_length", kv.get(f"{arch}.feed_forward_length", 0))
    return {"num_experts": n, "num_experts_per_tok": kv[f"{arch}.expert_used_count"], "hidden_dim": hidden,
            "norm_topk_prob": True, "routed_scaling_factor": kv.get(f"{arch}.expert_weights_scale", 0.0) or 1.0}


@dataclass
class Experts:
    """One (E, N, K) expert tensor: ``weight`` its GGUF bytes (`PackedWeight` of shape (E * N, K)) or fp16 values
    (E, N, K)."""

    weight: Tensor | PackedWeight
    n_experts: int
    n: int
    k: int
    kernels: str

    def __call__(self, x: Tensor, ids: Tensor, xdiv: int) -> Tensor:
        """(M, n) float32: slot m = ``x[m // xdiv]`` (k) through expert ``ids[m]`` (see `cpu.moe.matmul`)."""
        w = self.weight
        if isinstance(w, PackedWeight) and self.kernels == "c":
            return cpu_moe.matmul(x, ids, w.raw, w.ggml_type, self.n_experts, self.n, self.k, xdiv)
        m = ids.shape[0]
        rows = x.reshape(-1, 1, self.k).expand(m // xdiv, xdiv, self.k).reshape(m, 1, self.k).float()
        if isinstance(w, PackedWeight):  # only the routed experts' bytes, expanded by tinygrad's expression
            mats = dequantize(w.raw.reshape(self.n_experts, self.n, -1)[ids], w.ggml_type, self.k)
        else:
            mats = w[ids]
        return (rows @ mats.float().transpose(-1, -2)).reshape(m, self.n)


class MoEBlock(CacheBlock):
    """`CacheBlock` whose feed-forward is routed over experts (see the module docstring)."""

    ffn_gate_inp: Linear  # the router, float32 where the file stores it so (as llama.cpp keeps it)
    ffn_gate_exps: Experts
    ffn_up_exps: Experts
    ffn_down_exps: Experts

    def _feed_forward(self, x: Tensor) -> Tensor:
        c = self.config
        B, T, D = x.shape
        k = c.num_experts_per_tok
        probs = self.ffn_gate_inp(x.float()).float().softmax(-1)  # (B, T, E)
        weights, sel = pairwise_topk(probs, k)  # (B, T, k) each
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if c.routed_scaling_factor != 1.0:
            weights = weights * c.routed_scaling_factor
        ids = sel.reshape(B * T * k).cast(dtypes.int32).contiguous()
        h = x.reshape(B * T, D)
        act = self.ffn_gate_exps(h, ids, k).silu() * self.ffn_up_exps(h, ids, k)  # (B*T*k, hidden)
        down = self.ffn_down_exps(act.contiguous(), ids, 1).reshape(B, T, k, D)
        return (down * weights.unsqueeze(-1)).sum(2)


def load_experts(block: MoEBlock, source: TensorSource, config: TransformerConfig, i: int) -> None:
    """Block ``i``'s router and its three expert tensors, each one buffer as the file holds it."""
    e, d, h = config.num_experts, config.dim, config.hidden_dim
    tensors = source.header.tensors
    if f"blk.{i}.ffn_gate_exps.weight" not in tensors and f"blk.{i}.ffn_gate.0.weight" in tensors:
        raise ModelLoadError(f"{source.header.path}: experts stored one tensor each (blk.{i}.ffn_gate.0.weight..., "
                             f"an early Mixtral GGUF): this worker reads them as one tensor per projection "
                             f"(ffn_gate_exps...); convert the model again with a current llama.cpp")
    for name, (n, k) in zip(EXPERT_TENSORS, ((h, d), (h, d), (d, h)), strict=True):
        w = source.matrix(f"blk.{i}.{name}.weight", (e, n, k))
        setattr(block, name, Experts(w, e, n, k, source.kernels))
    block.ffn_gate_inp = Linear(_router(source, f"blk.{i}.ffn_gate_inp.weight", (e, d)), None, source.kernels)


def _router(source: TensorSource, name: str, shape: tuple[int, int]) -> Tensor | PackedWeight:
    """The router matrix: float32 values when the file stores F32 (an fp16 cast could flip a close routing choice
    the file's own precision makes), else as any matrix."""
    info = source.header.tensors.get(name)
    if info is None or info.ggml_type != F32:
        return source.matrix(name, shape)
    if info.shape != shape:
        raise ModelLoadError(f"{source.header.path}: tensor {name} has shape {info.shape}, expected {shape}")

    def fill(mv: memoryview) -> None:
        if read_data(source.header, info.offset, mv) != info.nbytes:
            raise ModelLoadError(f"{source.header.path}: truncated file: {name} is short of data")

    source.loaded[name] = info.nbytes
    source.held[name] = ("F32", info.nbytes)
    return filled(shape, dtypes.float32, fill, weight=True)
