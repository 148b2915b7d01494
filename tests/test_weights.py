"""How a stage holds and multiplies its weights (gguf_loader.TensorSource, engines.weights): a quantized matrix
stays as the file's bytes on every device, read by the compiled forward with nothing expanded into memory of its
own; on the CPU F16 matrices too, multiplied by the C kernels (cpu.kernels), whose outputs agree with
tinygrad's own products within float32 rounding; the dequantize-at-load path agrees within fp16 rounding; Q/K
rows un-permuted on the host exactly as tinygrad's `Transformer.from_gguf` does on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import Ops, UOp

from pp_worker.testing.modelgen import PRESETS, builtin_vocab, random_weights, tensor_types, write_gguf
from pp_worker.worker.engines.kvcache import KVPool
from pp_worker.worker.engines.model import StageWeights, load_stage
from pp_worker.worker.engines.tinygrad_engine import CompiledStage
from pp_worker.worker.engines.weights import Embedding, Linear, default_kernels
from pp_worker.worker.gguf.header import read_header
from pp_worker.worker.gguf.tensors import PackedWeight, unpermute_rows

MAX_CONTEXT = 32
PROMPT = 7  # one call of each rung of the ladder (4, 2, 1), then decode


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("weights")
    spec, n_merges = PRESETS["tiny"]
    vocab = builtin_vocab(n_merges)
    weights = random_weights(spec, len(vocab.tokens), 0)
    return {dt: write_gguf(d / f"tiny-{dt}.gguf", spec, weights, vocab, dt) for dt in ("F16", "Q8_0", "Q4_1")}


def _matrices(w: StageWeights) -> dict[str, Tensor | PackedWeight]:
    out: dict[str, Tensor | PackedWeight] = {}
    for j, block in enumerate(w.blocks):
        i = w.shard.start + j
        out |= {f"blk.{i}.{k}.weight": v.weight for k, v in vars(block).items() if isinstance(v, Linear)}
    if w.token_embd is not None:
        out["token_embd.weight"] = w.token_embd.weight
    if w.output is not None:
        out["output.weight"] = w.output.weight
    return out


def _buffers(t: Tensor) -> list[UOp]:
    return [u for u in t.uop.toposort() if u.op is Ops.BUFFER]


def _run(w: StageWeights, decode_steps: int = 4) -> tuple[CompiledStage, list[np.ndarray]]:
    """A prompt of PROMPT tokens (or rows), then ``decode_steps`` decode calls (the JIT captures and replays)."""
    pool = KVPool(w.config, len(w.blocks), w.config.max_context, 1)  # one page: a whole context
    stage = CompiledStage(w, pool, 4)
    rng = np.random.default_rng(1)
    n = PROMPT + decode_steps
    values = rng.integers(0, w.config.vocab_size, n).astype(np.int32) if w.shard.is_first else \
        rng.standard_normal((n, w.config.dim)).astype(np.float16)
    outs, pos = [], 0
    for size in (4, 2, 1, *[1] * decode_steps):
        outs.append(stage.run(values[pos:pos + size], pos, (0, pos), [0]).numpy().astype(np.float32))
        pos += size
    return stage, outs


def test_a_stage_loads_without_initialising_weights_it_replaces(models, monkeypatch):
    """tinygrad's nn.Linear starts from random weights (a threefry graph per matrix, ~70% of a small stage's load);
    the loader's blocks never make them, and every projection a block has is one of the file's matrices."""
    from tinygrad import nn

    def refuse(*args, **kwargs):
        raise AssertionError("a random initialisation while loading")

    monkeypatch.setattr(Tensor, "uniform", refuse)
    tinygrads = nn.Linear
    w = load_stage(str(models["Q8_0"]), 0, 2, MAX_CONTEXT)
    assert nn.Linear is tinygrads  # tinygrad's own again once the blocks are made
    for block in w.blocks:
        assert not any(isinstance(v, nn.Linear) for v in vars(block).values())
        assert sum(isinstance(v, Linear) for v in vars(block).values()) == 7


def test_the_cpu_runs_the_c_kernels_and_other_devices_tinygrads():
    assert default_kernels("CPU") == default_kernels("CPU:LLVM") == "c"
    assert default_kernels("CUDA") == default_kernels("NV") == default_kernels("METAL") == "tinygrad"


@pytest.mark.parametrize("dtype", ["F16", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("stage", [0, 1])
def test_cpu_matrices_are_the_files_bytes_read_by_the_jit(models, dtype, stage):
    w = load_stage(str(models[dtype]), stage, 2, MAX_CONTEXT)  # the default on the CPU: kernels "c"
    header = read_header(models[dtype])
    compiled, _ = _run(w)
    read = compiled.decode.buffers()
    matrices = _matrices(w)
    assert len(matrices) == 7 * len(w.blocks) + 1
    for name, m in matrices.items():
        info = header.tensors[name]
        assert isinstance(m, PackedWeight) and m.ggml_type == info.ggml_type, name
        (buf,) = _buffers(m.raw)  # its own buffer: the file's bytes, nothing converted
        assert buf.dtype == dtypes.uint8 and m.raw.nbytes() == info.nbytes, name
        assert name == "token_embd.weight" or buf.buffer in read, f"the decode JIT does not read {name}'s buffer"
    held = w.describe()
    assert held["kernels"] == "c" and held["weights_converted"] == {}
    gains = [header.tensors[name] for name in w.loaded if len(header.tensors[name].shape) == 1]  # F32 norms, as held
    assert gains and all(g.ggml_type == 0 for g in gains)
    assert held["weight_bytes"] == sum(header.tensors[n].nbytes for n in matrices) + sum(g.nbytes for g in gains)


@pytest.mark.parametrize("dtype", ["F16", "Q4_1"])
@pytest.mark.parametrize("stage", [0, 1])
def test_c_kernels_agree_with_tinygrads_products(models, dtype, stage):
    path = str(models[dtype])
    (_, c), (_, tg) = (_run(load_stage(path, stage, 2, MAX_CONTEXT, kernels=k)) for k in ("c", "tinygrad"))
    for a, b in zip(c, tg, strict=True):  # prefill calls and decode steps: the same terms summed in another order
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
        if stage == 1:
            assert a.argmax() == b.argmax()


def test_tinygrads_stacked_products_agree_with_the_c_kernels(tmp_path, monkeypatch):
    """tinygrad's kernels stack q, k and v into one matrix, or q and k where v's type differs (Q4_K_M's Q6_K
    attn_v in some blocks; here Q8_0 beside Q4_1), and gate with up: the same products as the C kernels'."""
    from pp_worker.testing import modelgen

    def v_apart(spec, vocab_size, dtype):  # every block's attn_v Q8_0, the other matrices Q4_1
        types = tensor_types(spec, vocab_size, dtype)
        return {n: "Q8_0" if n.endswith("attn_v.weight") else t for n, t in types.items()}

    monkeypatch.setattr(modelgen, "tensor_types", v_apart)
    spec, n_merges = PRESETS["tiny"]
    vocab = builtin_vocab(n_merges)
    path = write_gguf(tmp_path / "v-apart.gguf", spec, random_weights(spec, len(vocab.tokens), 0), vocab, "Q4_1")
    for stage in (0, 1):
        tg = load_stage(str(path), stage, 2, MAX_CONTEXT, kernels="tinygrad")
        assert all(b.qkv_split[2] == 0 and b.attn_v.weight.ggml_type == 8 and hasattr(b, "ffn_gate_up")
                   for b in tg.blocks)
        (_, c), (_, t) = (_run(w) for w in (load_stage(str(path), stage, 2, MAX_CONTEXT, kernels="c"), tg))
        for a, b in zip(c, t, strict=True):  # the same terms summed in another order
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)


def test_tinygrad_kernels_keep_quantized_weights_packed_and_expand_nothing(models):
    """Off the CPU a quantized matrix stays packed and tinygrad's dequantize expression is fused into the kernels
    reading it: no buffer of the compiled forward is as large as an expanded weight."""
    w = load_stage(str(models["Q8_0"]), 1, 2, MAX_CONTEXT, kernels="tinygrad")
    compiled, _ = _run(w)
    packed = {n: m for n, m in _matrices(w).items() if isinstance(m, PackedWeight)}
    assert packed and all(m.ggml_type == 8 for m in packed.values())
    # every Q8_0 tensor of the file held packed, q/k/v and gate/up each stacked into one matrix (one product a token)
    assert sum(m.raw.nbytes() for m in packed.values()) == sum(n for t, n in w.held.values() if t == "Q8_0")
    assert {n.split(".")[2] for n in packed if n.startswith("blk.")} == {"attn_qkv", "attn_output", "ffn_gate_up",
                                                                         "ffn_down"}
    smallest = min(m.shape[0] * m.shape[1] * 2 for m in packed.values())  # a weight's fp16 size, at the least
    weights = {b.buffer for m in packed.values() for b in _buffers(m.raw)}
    read = compiled.decode.buffers()
    assert weights <= read  # the packed bytes are what the compiled forward reads
    assert max(b.nbytes for b in read - weights) < smallest


def test_dequantize_at_load_holds_fp16_and_agrees_within_fp16_rounding(models):
    packed_w = load_stage(str(models["Q8_0"]), 1, 2, MAX_CONTEXT)
    loaded_w = load_stage(str(models["Q8_0"]), 1, 2, MAX_CONTEXT, keep_quantized=False)
    assert all(m.ggml_type == 1 for m in _matrices(loaded_w).values())  # F16 rows for the C kernels
    spec, n_merges = PRESETS["tiny"]
    types = tensor_types(spec, len(builtin_vocab(n_merges).tokens), "Q8_0")
    want = sum(types[name] == "Q8_0" for name in _matrices(loaded_w))
    assert loaded_w.describe()["weights_converted"] == {"Q8_0": want}
    (_, a), (_, b) = _run(packed_w), _run(loaded_w)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-2)  # the fp16 rounding of each dequantized weight
        assert x.argmax() == y.argmax()


@pytest.mark.parametrize("kernels", ["c", "tinygrad"])
def test_embedding_lookup_decodes_the_rows_it_gathers(models, kernels):
    w = load_stage(str(models["Q4_1"]), 0, 2, MAX_CONTEXT, kernels=kernels)
    embd = w.token_embd
    assert isinstance(embd, Embedding) and isinstance(embd.weight, PackedWeight)
    from gguf import GGMLQuantizationType, quants

    info = read_header(models["Q4_1"]).tensors["token_embd.weight"]
    raw = np.fromfile(models["Q4_1"], np.uint8, info.nbytes, offset=info.offset).reshape(info.shape[0], -1)
    ids = np.array([[5, 0, w.config.vocab_size - 1, 5]], np.int32)
    want = quants.dequantize(raw[ids[0]], GGMLQuantizationType.Q4_1).reshape(1, 4, -1)
    np.testing.assert_allclose(embd(Tensor(ids)).numpy(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("keep", [0, 2])
def test_unpermute_rows_matches_tinygrad_rearrange(keep):
    n_heads, head_dim, dim = 3, 8, 5
    w = np.arange(n_heads * head_dim * dim, dtype=np.float32).reshape(n_heads * head_dim, dim)
    t = Tensor(w).reshape(n_heads, head_dim, dim)  # Transformer.from_gguf's rearrange, on the device
    roped = t[:, keep:].rearrange("n (h two) d -> n (two h) d", two=2)
    want = (t[:, :keep].cat(roped, dim=1) if keep else roped).reshape(-1, dim).numpy()
    assert np.array_equal(unpermute_rows(w, n_heads, keep), want)


def test_packed_q_rows_are_unpermuted_as_whole_rows(models):
    """llama's Q/K rows are un-permuted on packed rows: each row's blocks move whole, so the packed weight
    decodes to exactly the un-permuted dequantized weight."""
    from gguf import GGMLQuantizationType, quants

    w = load_stage(str(models["Q8_0"]), 0, 2, MAX_CONTEXT)
    q = w.blocks[0].attn_q.weight
    info = read_header(models["Q8_0"]).tensors["blk.0.attn_q.weight"]
    raw = np.fromfile(models["Q8_0"], np.uint8, info.nbytes, offset=info.offset).reshape(info.shape[0], -1)
    want = unpermute_rows(quants.dequantize(raw, GGMLQuantizationType.Q8_0).reshape(info.shape), w.config.n_heads)
    got = quants.dequantize(q.raw.numpy(), GGMLQuantizationType.Q8_0).reshape(info.shape)
    assert np.array_equal(got, want)
