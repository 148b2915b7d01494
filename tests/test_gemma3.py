"""Gemma 3 (``gemma3``) on generated models, against the float64 reference written from its formulas
(`npref.Gemma3Ref`): 2 and 3 stages, the CPU's C kernels (the sliding window inside the C attention) and tinygrad's
kernels (the window as a mask), prompts longer than the sliding window through prefill chunks and through decode
steps, batched decode, interleaved sessions, a quantized file, the SentencePiece tokenizer with Gemma's settings,
and real worker processes through the driver.

The generated model (`gemma3gen`) has 8 blocks, 7 sliding over a window of 12 positions and one global (block 5),
head_dim 32 != dim / n_heads, tied embeddings. Each comparison also checks that the reference without the window
differs by far more than the tolerance, so an engine ignoring the window fails.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from spm_ref import SpmReference
from tinygrad import Tensor, UOp, dtypes

from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing import gemma3gen
from pp_worker.testing.chain import Chain, step_batch, wire_rows
from pp_worker.testing.npref import Gemma3Ref
from pp_worker.worker.cpu import attention as cpu_attention
from pp_worker.worker.engines.gemma3 import attention_scale, is_sliding, sliding_window
from pp_worker.worker.engines.model import eos_token_ids
from pp_worker.worker.gguf.header import ModelLoadError, read_header
from pp_worker.worker.text.tokenizer import Tokenizer

MAX_CONTEXT = 64
ATOL = 3e-2  # as the other families: fp16 weights, fp16 KV and stage boundaries against float64
WINDOW = gemma3gen.PRESETS["gemma3"].sliding_window
WINDOW_MIN_DIFF = 1.0  # the reference without the window differs by more (measured ~6.8 on these prompts)
SEED = 0
PROMPT = [int(t) for t in np.random.default_rng(0).integers(5, 500, 40)]  # > WINDOW, > one prefill chunk of 32
N_STEPS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma3gen.generate(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", seed=SEED)


@pytest.fixture(scope="module")
def ref(model: Path) -> Gemma3Ref:
    return Gemma3Ref.from_gguf(model)


@pytest.fixture(scope="module")
def chain2(model: Path) -> Chain:
    return Chain(model, 2, MAX_CONTEXT, max_sessions=3, max_batch=2)


def check_generation(chain: Chain, ref: Gemma3Ref, rid: int = 0, prompt: list[int] = PROMPT) -> list[int]:
    """Greedy from ``prompt`` (one prefill, then decode): every step's logits within ATOL of the reference's at
    the same context, every pick the reference's argmax, and the window visibly mattering."""
    tokens, logits = chain.generate(rid, prompt, N_STEPS)
    context = prompt + tokens[:-1]
    want = ref.logits(context)[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=ATOL)
    assert tokens == [int(a) for a in want.argmax(-1)]
    unwindowed = replace(ref, use_window=False).logits(context)[len(prompt) - 1:]
    assert np.abs(want - unwindowed).max() > WINDOW_MIN_DIFF
    return tokens


def test_the_model_has_both_kinds_of_block(ref):
    assert [is_sliding(i) for i in range(ref.n_layers)] == [True] * 5 + [False] + [True] * 2
    assert ref.head_dim != ref.weights["token_embd.weight"].shape[1] // ref.n_heads
    assert "output.weight" not in ref.weights  # tied


def test_two_stages_match_the_reference_past_the_window(chain2, ref):
    assert len(chain2.boundaries) == 1
    tokens = check_generation(chain2, ref)
    assert len(set(tokens)) > 1
    chain2.release(0)


def test_decode_steps_past_the_window(chain2, ref):
    """The prompt fed one token a call (decode's JIT at every position up to 2x the window), each step's logits
    against the reference."""
    prompt = PROMPT[:2 * WINDOW + 3]
    want = ref.logits(prompt)
    for pos, token in enumerate(prompt):
        np.testing.assert_allclose(chain2.step(1, [token], pos), want[pos], rtol=0, atol=ATOL)
    chain2.release(1)


def test_interleaved_and_batched_sessions_equal_solo(chain2, ref):
    """Two sessions stepped alternately, then together in one batched step (`GemmaBlock.step_batch`): the same
    logits as each alone, within rounding."""
    a, b = PROMPT, PROMPT[5:38]  # 40 and 33 tokens: the prefill sizes already compiled (32, 8, 1)
    solo = {rid: chain2.generate(rid, p, 3) for rid, p in ((0, a), (1, b))}
    chain2.release(0)
    chain2.release(1)
    outs: dict[int, list[int]] = {0: [], 1: []}
    logits: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for rid, p in ((0, a), (1, b)):
        logits[rid].append(chain2.step(rid, p, 0))
        outs[rid].append(int(logits[rid][-1].argmax()))
    for rid, p in ((0, a), (1, b), (0, a)):  # alternating decode steps
        logits[rid].append(chain2.step(rid, [outs[rid][-1]], len(p) + len(outs[rid]) - 1))
        outs[rid].append(int(logits[rid][-1].argmax()))
    first, last = chain2.engines
    at = [len(a) + 2, len(b) + 1]  # session 0 has 3 tokens, session 1 has 2: one batched step for 1's third
    hidden = step_batch(first, [0, 1], at, [outs[0][-1], outs[1][-1]])
    batched = step_batch(last, [0, 1], at, wire_rows(first, hidden)).copy()
    np.testing.assert_allclose(logits[0][:3], np.stack(solo[0][1]), rtol=0, atol=1e-4)
    np.testing.assert_allclose(logits[1][:2], np.stack(solo[1][1][:2]), rtol=0, atol=1e-4)
    assert outs[0][:3] == solo[0][0] and outs[1][:2] == solo[1][0][:2]
    np.testing.assert_allclose(batched[1], solo[1][1][2], rtol=0, atol=1e-3)
    np.testing.assert_allclose(batched[0], ref.logits(a + outs[0])[-1], rtol=0, atol=ATOL)
    chain2.release(0)
    chain2.release(1)


def test_three_stages_match_the_reference(model, ref):
    chain = Chain(model, 3, MAX_CONTEXT)
    assert len(chain.boundaries) == 2
    check_generation(chain, ref)


def test_tinygrad_kernels_mask_the_window(model, ref):
    """tinygrad's own attention (GPUs, PP_KERNELS=tinygrad): the window is a mask, on prefill calls (T > 1) and
    on decode (T = 1)."""
    chain = Chain(model, 2, MAX_CONTEXT, kernels="tinygrad", prefill_chunk=8)
    assert not any(b.c_attention for e in chain.engines for b in e._w.blocks)
    check_generation(chain, ref, prompt=PROMPT[:24])  # 3 calls of 8 (two JITs a stage: 8 and 1, to compile less)


@pytest.mark.parametrize("preset, dtype", [("gemma3", "Q8_0"), ("gemma3-kq", "Q4_K")])
def test_quantized(tmp_path, preset, dtype):
    """Packed weights read by the C kernels; the reference dequantizes the same file."""
    path = gemma3gen.generate(tmp_path / f"{dtype}.gguf", preset, seed=SEED, dtype=dtype)
    chain = Chain(path, 2, MAX_CONTEXT, every_size=False)  # single-token calls: no prefill JIT to compile
    for e in chain.engines:
        held = e._w.describe()["weights"]
        assert dtype in held and set(held) <= {dtype, "F16", "F32"}
    check_generation(chain, Gemma3Ref.from_gguf(path), prompt=PROMPT[:2 * WINDOW + 2])


# ---------------------------------------------------------------- the C attention's window


def windowed_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, window: int) -> np.ndarray:
    """float64: query heads q (H, D) at ``pos`` over keys/values (KvH, L, D) at [max(0, pos - window + 1), pos]."""
    n_heads, d = q.shape
    group, lo = n_heads // k.shape[0], max(0, pos - window + 1)
    out = []
    for h in range(n_heads):
        kk, vv = k[h // group, lo:pos + 1].astype(np.float64), v[h // group, lo:pos + 1].astype(np.float64)
        s = kk @ q[h].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out.append(p @ vv / p.sum())
    return np.concatenate(out)


@pytest.mark.parametrize("window", [1, 12, cpu_attention.CHUNK + 5])
def test_c_attention_reads_only_the_window(window):
    """Windows within a chunk and across chunks and pages (a page table of 3 pages of 2 chunks)."""
    page, rng = 2 * cpu_attention.CHUNK, np.random.default_rng(window)
    pool = (rng.standard_normal((3, 1, 2, 2, page, 32)) * 2).astype(np.float32)
    pages = [2, 0, 1]
    table = Tensor(np.array([pages], np.int32), dtype=dtypes.int32).realize()
    keys = np.concatenate([pool[p, 0, 0] for p in pages], axis=1)  # (KvH, L, D) in position order
    vals = np.concatenate([pool[p, 0, 1] for p in pages], axis=1)
    var = UOp.variable("start_pos", 0, 3 * page - 1)
    for tokens in (1, 3):
        for pos in (0, window - 1, window, cpu_attention.CHUNK + 3, page + 7, 3 * page - tokens):
            q = rng.standard_normal((1, 4, tokens, 32)).astype(np.float32)
            got = cpu_attention.attend(Tensor(q), Tensor(pool).realize(), table, 0, 0, var.bind(pos), window).numpy()
            for i in range(tokens):
                want = windowed_attention(q[0, :, i], keys, vals, pos + i, window)
                np.testing.assert_allclose(got[0, i], want, rtol=0, atol=3e-6 * np.abs(want).max())


# ---------------------------------------------------------------- tokenizer, errors, real workers


def test_tokenizer_as_llama_cpps(model):
    """Gemma's vocabulary settings: add_bos, no space prefix, the turn markers whole."""
    kv = read_header(model).kv
    tok = Tokenizer.from_gguf_kv(kv)
    text = "<start_of_turn>user\nBeautiful is better than ugly.<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text)
    bos, tokens = kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.tokens"]
    assert ids == [bos, *SpmReference(kv).encode(text)]
    start, end = tokens.index("<start_of_turn>"), tokens.index("<end_of_turn>")
    assert ids[1] == start and ids.count(end) == 1 and ids.count(start) == 2
    assert not tokens[ids[2]].startswith("\u2581")  # no space prefix after the marker
    assert end in eos_token_ids(kv)


def test_attention_scale_is_llama_cpps():
    from tinygrad.llm.model import TransformerConfig

    def config(blocks: int) -> TransformerConfig:
        return TransformerConfig(num_blocks=blocks, dim=5376, hidden_dim=1, n_heads=32, n_kv_heads=16, norm_eps=1e-6,
                                 vocab_size=1, head_dim=128, rope_theta=1.0, rope_dim=128,
                                 v_head_dim=128, max_context=1)

    assert attention_scale({}, config(34)) == pytest.approx(1 / np.sqrt(128))  # 1/sqrt(key_length)
    assert attention_scale({}, config(62)) == pytest.approx(1 / np.sqrt(168))  # the 27B's: 1/sqrt(dim / n_heads)


def test_a_missing_window_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="lacks a positive gemma3.attention.sliding_window"):
        sliding_window({})


def test_other_architectures_stay_a_clear_error(tmp_path, model):
    from pp_worker.worker.engines.model import check_architecture

    kv = dict(read_header(model).kv, **{"general.architecture": "gemma2"})
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gemma2'.*gemma3"):
        check_architecture(kv)


def test_real_workers_through_the_driver(model, ref):
    """Two generations in flight at once through 2 worker processes (their decode steps interleaved or batched):
    each one's tokens are the reference's greedy picks."""
    launch = Launch(2, model=str(model), env={"MAX_CONTEXT": str(MAX_CONTEXT)})
    texts = ["Flat is better than nested. " * 3, "<start_of_turn>user\nSparse is better than dense.<end_of_turn>\n"]
    with Pipeline(launch, log=None) as p:
        generations = p.run(make_generations(p, texts, 4, Sampling())).generations
    bos = read_header(model).kv["tokenizer.ggml.bos_token_id"]
    for g in generations:
        assert len(g.prompt_tokens) > WINDOW and g.prompt_tokens[0] == bos
        want = ref.logits(g.prompt_tokens + g.tokens[:-1])[len(g.prompt_tokens) - 1:]
        assert g.tokens == [int(a) for a in want.argmax(-1)][:len(g.tokens)]
