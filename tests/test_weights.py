"""How a stage holds its weights (gguf_loader.TensorSource): on the CPU, uint8 buffers viewed as fp16, which the
decode JIT reads directly; the same logits, bit for bit, as native fp16 buffers (the GPU layout and the CPU's old
one); Q/K rows un-permuted on the host exactly as tinygrad's `Transformer.from_gguf` does on the device. And how
the decode JIT multiplies by them on the CPU (engines.lanes): normed rows computed once, products summed in lanes,
within float32 rounding of tinygrad's own products; prefill unchanged, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, dtypes, nn
from tinygrad.engine.jit import get_call_arg_uops
from tinygrad.uop.ops import Ops, UOp

from pp_worker.testing.modelgen import PRESETS, builtin_vocab, random_weights, write_gguf
from pp_worker.worker.engines.gguf_loader import StageWeights, load_stage, packed_weights, unpermute_rows
from pp_worker.worker.engines.kvcache import KVPool
from pp_worker.worker.engines.lanes import LANES, LaneLinear
from pp_worker.worker.engines.tinygrad_engine import CompiledStage

MAX_CONTEXT = 32
PROMPT = 7  # one call of each rung of the ladder (4, 2, 1), then decode


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("weights")
    spec, n_merges = PRESETS["tiny"]
    vocab = builtin_vocab(n_merges)
    weights = random_weights(spec, len(vocab.tokens), 0)
    return {dt: write_gguf(d / f"tiny-{dt}.gguf", spec, weights, vocab, dt) for dt in ("F16", "Q8_0")}


def _params(w: StageWeights) -> dict[str, Tensor]:
    parts = {"blocks": w.blocks, "token_embd": w.token_embd, "output_norm": w.output_norm, "output": w.output}
    return {k: v for k, v in nn.state.get_state_dict({k: p for k, p in parts.items() if p is not None}).items()
            if not k.endswith("freqs_cis")}  # the rope table is the engine's, not a weight from the file


def _buffers(t: Tensor) -> list[UOp]:
    return [u for u in t.uop.toposort() if u.op is Ops.BUFFER]


def _run(w: StageWeights, decode_steps: int = 4) -> tuple[CompiledStage, list[np.ndarray]]:
    """A prompt of PROMPT tokens (or rows), then ``decode_steps`` decode calls (the JIT captures and replays)."""
    stage = CompiledStage(w, 4)
    cache = KVPool(w.config, len(w.blocks), 1).acquire()
    rng = np.random.default_rng(1)
    n = PROMPT + decode_steps
    values = rng.integers(0, w.config.vocab_size, n).astype(np.int32) if w.shard.is_first else \
        rng.standard_normal((n, w.config.dim)).astype(np.float16)
    outs, pos = [], 0
    for size in (4, 2, 1, *[1] * decode_steps):
        outs.append(stage.run(values[pos:pos + size], cache, pos).numpy().copy())
        pos += size
    return stage, outs


def test_cpu_packs_fp16_weights_and_gpus_do_not():
    assert packed_weights("CPU") and packed_weights("CPU:LLVM")
    assert not packed_weights("CUDA") and not packed_weights("NV") and not packed_weights("METAL")


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("stage", [0, 1])
def test_cpu_weights_are_uint8_buffers_read_by_the_jit_with_native_fp16_logits(models, dtype, stage):
    w = load_stage(str(models[dtype]), stage, 2, MAX_CONTEXT)  # the default: CPU -> packed
    compiled, packed = _run(w)
    read = set(compiled.decode.captured.linear.toposort())
    for name, p in _params(w).items():
        assert p.dtype == dtypes.float16, name
        (buf,) = _buffers(p)  # its own buffer, no copy in between
        assert buf.dtype == dtypes.uint8, f"{name} is held as {buf.dtype}"
        assert buf in read, f"the decode JIT does not read {name}'s buffer"
    native_w = load_stage(str(models[dtype]), stage, 2, MAX_CONTEXT, packed=False)  # the GPU's (and old CPU) way
    assert all(_buffers(p)[0].dtype == dtypes.float16 for p in _params(native_w).values())
    _, native = _run(native_w)
    for a, b in zip(packed, native, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("keep", [0, 2])
def test_unpermute_rows_matches_tinygrad_rearrange(keep):
    n_heads, head_dim, dim = 3, 8, 5
    w = np.arange(n_heads * head_dim * dim, dtype=np.float32).reshape(n_heads * head_dim, dim)
    t = Tensor(w).reshape(n_heads, head_dim, dim)  # Transformer.from_gguf's rearrange, on the device
    roped = t[:, keep:].rearrange("n (h two) d -> n (two h) d", two=2)
    want = (t[:, :keep].cat(roped, dim=1) if keep else roped).reshape(-1, dim).numpy()
    assert np.array_equal(unpermute_rows(w, n_heads, keep), want)


def test_cpu_stages_sum_decode_products_in_lanes_and_prefill_as_tinygrad(models):
    lanes_w, plain_w = (load_stage(str(models["F16"]), 0, 2, MAX_CONTEXT, lanes=n) for n in (None, 0))
    assert lanes_w.lanes == LANES and plain_w.lanes == 0  # None: the device's choice
    assert all(isinstance(b.ffn_down, LaneLinear) for b in lanes_w.blocks)
    (_, got), (_, plain) = _run(lanes_w), _run(plain_w)
    for a, b in zip(got[:2], plain[:2], strict=True):  # the prefill calls (4 and 2 tokens)
        assert np.array_equal(a, b)
    for a, b in zip(got[2:], plain[2:], strict=True):  # one token: another summation order, float32 rounding
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0, atol=4e-3)


def test_cpu_head_logits_within_float32_rounding_of_tinygrads_products(models):
    lanes_w, plain_w = (load_stage(str(models["F16"]), 1, 2, MAX_CONTEXT, lanes=n) for n in (None, 0))
    assert isinstance(lanes_w.output, LaneLinear)
    (_, got), (_, plain) = _run(lanes_w), _run(plain_w)
    for a, b in zip(got, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
        assert a.argmax() == b.argmax()


@pytest.mark.parametrize("lanes, readers", [(None, 1), (0, 2)])
def test_the_decode_jit_norms_a_row_once_for_all_projections_reading_it(models, lanes, readers):
    """tinygrad fuses the RMS norm into each product reading its output (q and k, v with them): per weight
    element. LaneLinear's contiguous input leaves one kernel that reads the norm's weight."""
    w = load_stage(str(models["F16"]), 1, 2, MAX_CONTEXT, lanes=lanes)
    compiled, _ = _run(w)
    (norm,) = _buffers(w.blocks[0].attn_norm.weight)
    calls = [c for c in compiled.decode.captured.linear.toposort() if c.op is Ops.CALL and c.src[0].op is Ops.PROGRAM]
    n = sum(any(a is norm for a in get_call_arg_uops(c)) for c in calls)
    assert n == readers if lanes is None else n >= readers
