"""Tests for pp_worker.testing.modelgen: determinism, tokenizer, and tinygrad vs the independent fp64 reference
(pp_worker.testing.npref).

Measured on the tiny preset (seeds 0-2, 21 positions, logit std ~3.0-3.1, |logit| <= ~13), tinygrad (HALF=1:
weights cast to fp16, fp32 activations) vs npref (float64 on the file's exact weights): max |dlogit| 6.8-7.3e-3 F32,
3.6-4.0e-3 F16, 5.6-6.0e-3 Q8_0 (at most 2.35e-3 x std(logits)); mean 0.7-1.1e-3 (<= 3.8e-4 x std). F32 is not the
closest because tinygrad rounds F32 weights to fp16 at load. We allow max 4e-3 x std and mean 1e-3 x std; a greedy
step must agree whenever the reference's top-2 margin exceeds twice the max allowed error (then no logit error
within tolerance can flip the argmax). All 16 greedy steps agreed in every measured case.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pp_worker.testing import bpe
from pp_worker.testing import modelgen as mg
from pp_worker.testing.encode import encode_tensor
from pp_worker.testing.npref import RefModel
from pp_worker.worker.text.detokenizer import byte_symbols

DTYPES = ("F32", "F16", "Q8_0")
MAX_REL, MEAN_REL = 4e-3, 1e-3  # logit error bounds, as a fraction of std(logits)
N_STEPS = 16
PROMPT_TEXT = "Beautiful is better than"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("modelgen")
    return {dt: mg.generate(out / f"tiny-{dt}.gguf", "tiny", seed=0, dtype=dt) for dt in DTYPES}


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from tinygrad.llm.cli import SimpleTokenizer
    from tinygrad.llm.gguf import gguf_load

    kv, _ = gguf_load(tiny_models["F16"])
    return SimpleTokenizer.from_gguf_kv(kv)


def tinygrad_logits(path, tokens: list[int]) -> np.ndarray:
    """(T, vocab) logits of the whole sequence, the blocks run in a plain loop as a pipeline stage does."""
    from tinygrad import Tensor
    from tinygrad.llm.model import Transformer

    model, _ = Transformer.from_gguf(path)
    x = model.token_embd(Tensor([tokens])).float()  # (1, T, D)
    for block in model.blk:
        x = block(x, 0)
    return model.output(model.output_norm(x)).numpy()[0].astype(np.float64)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)
    return top[..., -1] - top[..., -2]


def assert_greedy_agrees(ours: list[int], ref: list[int], ref_step_logits: np.ndarray, max_err: float) -> None:
    """Tokens must match up to the first step whose reference margin is within 2*max_err (a legitimate tie)."""
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            margin = top2_margin(ref_step_logits[step])
            assert margin <= 2 * max_err, f"step {step}: {a} != {b} with a clear reference margin {margin:.4f}"
            return


# ---------------------------------------------------------------- determinism and file layout


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_seed_is_byte_identical(tmp_path, tiny_models, dtype):
    mg.builtin_vocab.cache_clear()  # retrain the vocabulary too, not just reuse the cached one
    again = mg.generate(tmp_path / "again.gguf", "tiny", seed=0, dtype=dtype)
    assert again.read_bytes() == tiny_models[dtype].read_bytes()


def test_other_families_are_byte_identical_too(tmp_path, tiny_models):
    from pp_worker.testing.rope_scaling import RopeScaling, llama3_rope_factors

    rope = RopeScaling(type="yarn", factor=4.0, original_context_length=64,
                       freq_factors=llama3_rope_factors(16, 10000.0, 4.0, original_context=32))
    kinds = {"spm": {"tokenizer": mg.SPM, "rope": rope}, "smollm": {"tokenizer": "smollm"}}
    first = {k: mg.generate(tmp_path / f"{k}-1.gguf", "tiny", **kw).read_bytes() for k, kw in kinds.items()}
    mg.builtin_vocab.cache_clear()
    for k, kw in kinds.items():
        assert mg.generate(tmp_path / f"{k}-2.gguf", "tiny", **kw).read_bytes() == first[k], k
    assert first["smollm"] != tiny_models["F16"].read_bytes()
    scaling = RefModel.from_gguf(tmp_path / "spm-1.gguf").rope_scaling  # what was written reads back
    assert scaling.yarn_original_context == 64 and scaling.freq_scale == 0.25 and len(scaling.freq_factors) == 8


def test_different_seed_differs(tmp_path, tiny_models):
    other = mg.generate(tmp_path / "seed1.gguf", "tiny", seed=1, dtype="F16")
    assert other.read_bytes() != tiny_models["F16"].read_bytes()


def test_preset_sizes():
    for name, (spec, n_merges) in mg.PRESETS.items():
        vocab = mg.builtin_vocab(n_merges)
        assert len(vocab.tokens) == 256 + n_merges + 3, f"{name}: built-in text ran out of pairs"
        assert spec.dim % spec.n_heads == 0 and spec.n_heads % spec.n_kv_heads == 0
    assert 0.1e6 <= mg.param_count(*_spec_and_vocab("tiny")) <= 0.3e6
    assert 0.7e6 <= mg.param_count(*_spec_and_vocab("small")) <= 1.3e6
    assert 20e6 <= mg.param_count(*_spec_and_vocab("bench")) <= 40e6
    kq = mg.PRESETS["kq"][0]
    assert kq.dim % 256 == 0 and kq.ffn_dim % 256 == 0  # every K-quant type fits every matrix


def _spec_and_vocab(preset: str) -> tuple[mg.LlamaSpec, int]:
    spec, n_merges = mg.PRESETS[preset]
    return spec, len(mg.builtin_vocab(n_merges).tokens)


def test_vocab_layout():
    vocab = mg.build_vocab(mg.builtin_text(), 100)
    sym = byte_symbols()
    assert vocab.tokens[:256] == sym and len(set(sym)) == 256  # id b is byte b
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert vocab.tokens[-3:] == list(bpe.DEFAULT_SPECIALS) and vocab.token_types[-3:] == [3, 3, 3]
    assert set(vocab.token_types[:-3]) == {1}
    assert (vocab.bos_id, vocab.eos_id) == (356, 357)
    known = set(vocab.tokens)
    for merge in vocab.merges:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known


def test_q_k_permute_inverts_tinygrad_unpermute():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)  # 4 heads of head_dim 8, in_features 3
    permuted = mg.permute_rope_rows(w, 4)
    # tinygrad at load: "n (h two) d -> n (two h) d"
    back = permuted.reshape(4, 4, 2, 3).transpose(0, 2, 1, 3).reshape(32, 3)
    np.testing.assert_array_equal(back, w)


def test_q8_0_matches_ggml_reference_rounding():
    from gguf import GGMLQuantizationType

    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    x[0, :32] = np.linspace(-1, 1, 32, dtype=np.float32) * 12.7  # exact .5 cases: round half away from zero
    data, qtype = encode_tensor(x, "Q8_0")
    assert qtype == GGMLQuantizationType.Q8_0
    blocks = data.reshape(-1, 34)
    d = np.abs(x.reshape(-1, 32)).max(-1, keepdims=True) / np.float32(127)  # ggml: float d = amax / 127
    q = np.trunc(x.reshape(-1, 32) * (np.float32(1) / d) + np.copysign(np.float32(0.5), x.reshape(-1, 32)))  # roundf
    np.testing.assert_array_equal(blocks[:, :2].copy().view(np.float16), d.astype(np.float16))
    np.testing.assert_array_equal(blocks[:, 2:].copy().view(np.int8), q.astype(np.int8))


@pytest.mark.parametrize("type_name, levels", [("Q2_K", 3), ("Q3_K", 7), ("Q4_K", 15), ("Q5_K", 31), ("Q6_K", 63)])
def test_k_quant_packer_round_trips_through_gguf_dequantize(type_name, levels):
    """The test-only packer (testing.kquants), read back by the gguf package's own dequantizer: every value within
    one step of its sub-block (range / levels, plus the 6-bit rounding of the scales), and zeros stay zero."""
    from gguf import GGMLQuantizationType, quants

    from pp_worker.testing import kquants

    x = np.random.default_rng(5).standard_normal((6, 512)).astype(np.float32)
    x[0, :256] = 0.0  # a block of zeros: no division by a zero scale
    data, qtype = encode_tensor(x, type_name)
    assert qtype == GGMLQuantizationType[type_name] and data.shape == (6, 2 * kquants.BLOCK_BYTES[type_name])
    back = quants.dequantize(data, qtype).reshape(x.shape)
    sub = 32 if type_name in ("Q4_K", "Q5_K") else 16
    step = np.ptp(x.reshape(-1, sub), -1).max() / levels
    assert np.abs(back - x).max() <= step and np.all(back[0, :256] == 0)
    assert np.sqrt(((back - x) ** 2).mean()) < step / 2


@pytest.mark.parametrize("type_name, block, qs", [("IQ4_NL", 18, 2), ("IQ4_XS", 136, 8)])
def test_iq4_packers_round_trip_through_gguf_dequantize(type_name, block, qs):
    """Every value within half the widest gap between the 16 levels (12 steps of its block's or sub-block's scale)
    of where it was, or, past the level at the far end from the block's largest magnitude (113 steps, where the
    largest lands on -127 or, IQ4_XS's scales being rounded to 6 bits, near it), within its distance to that level;
    zeros stay zero."""
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    x[0] = 0.0
    data, qtype = encode_tensor(x, type_name)
    assert qtype == GGMLQuantizationType[type_name] and data.size == x.size // (32 if block == 18 else 256) * block
    back = quants.dequantize(data, qtype).reshape(-1, 32)
    probe = data.reshape(-1, block).copy()
    probe[:, qs:] = 0  # every index on level 0 (-127): the values are -127 times each sub-block's scale
    step = np.abs(quants.dequantize(probe, qtype).reshape(-1, 32)[:, 0]) / 127
    err, peak = np.abs(back - x.reshape(-1, 32)).max(-1), np.abs(x.reshape(-1, 32)).max(-1)
    # the steps themselves, bounded by the input: each sub-block's largest magnitude on -127 (fp16's rounding of d;
    # IQ4_XS's 6-bit scales are multiples of d, a 31st of its block's largest scale: within d / 2); steps of zero, as
    # a packer writing zero scales would give, fail here rather than loosen the bound below
    block_peak = np.repeat(np.abs(x.reshape(-1, 32 if block == 18 else 256)).max(-1), 1 if block == 18 else 8)
    slack = peak / 127 * 1e-3 if block == 18 else block_peak / 127 / 31 / 2 * 1.01
    assert np.all(np.abs(step - peak / 127) <= slack + 1e-7)
    bound = np.maximum(12 * step, peak - 113 * step)
    assert np.all(err <= bound * (1 + 1e-3) + 1e-6) and np.all(back[:8] == 0)


def test_tq2_0_packer_round_trips_through_gguf_dequantize():
    """Ternary: every value within half its block's largest magnitude of where it was, the largest exact to fp16."""
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(7).standard_normal((3, 512)).astype(np.float32)
    data, qtype = encode_tensor(x, "TQ2_0")
    back = quants.dequantize(data, qtype).reshape(-1, 256)
    peak = np.abs(x.reshape(-1, 256)).max(-1, keepdims=True)
    assert qtype == GGMLQuantizationType.TQ2_0 and set(np.unique(np.round(back / peak, 2))) <= {-1.0, 0.0, 1.0}
    assert np.all(np.abs(back - x.reshape(-1, 256)) <= peak / 2 * (1 + 1e-3))


def test_q4_k_m_mixes_as_llama_cpp_does():
    spec, vocab_size = _spec_and_vocab("kq")
    types = mg.tensor_types(spec, vocab_size, "Q4_K_M")
    n = spec.n_layers  # 6: n / 8 is 0, so use_more_bits holds for blocks 2 (every third) and 5 (and the last eighth)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(n)] == ["Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K"]
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(n)] == [types[f"blk.{i}.ffn_down.weight"] for i in range(n)]
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(n)} == {"Q4_K"} and types["blk.0.attn_norm.weight"] == "F32"


def test_q3_k_m_mixes_as_llama_cpp_does():
    spec, vocab_size = _spec_and_vocab("kq")
    types = mg.tensor_types(spec, vocab_size, "Q3_K_M")
    n = spec.n_layers  # 6: n / 16 is 0, so every ffn_down is Q4_K
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q3_K"
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(n)] == ["Q5_K", "Q5_K"] + ["Q4_K"] * (n - 2)
    assert {types[f"blk.{i}.{m}.weight"] for i in range(n) for m in ("ffn_down", "attn_output")} == {"Q4_K"}
    assert {types[f"blk.{i}.{m}.weight"] for i in range(n) for m in ("attn_q", "attn_k", "ffn_gate", "ffn_up")} == \
        {"Q3_K"}


def test_mixed_files_hold_every_type_in_any_two_consecutive_blocks():
    spec, vocab_size = _spec_and_vocab("kq")
    types = mg.tensor_types(spec, vocab_size, "MIXED")
    for i in range(spec.n_layers - 1):
        pair = (f"blk.{i}.", f"blk.{i + 1}.")
        held = {t for name, t in types.items() if name.startswith(pair) and "norm" not in name}
        assert held == {"F16", *mg.QUANT_TYPES}, i


def test_main_writes_file(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert mg.main([str(out), "--preset", "tiny", "--seed", "2", "--dtype", "Q8_0"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
    assert capsys.readouterr().out == ""  # the summary goes to stderr


# ---------------------------------------------------------------- tokenizer


def test_pretokenize_matches_tinygrad(tokenizer):
    texts = [mg.builtin_text(), "héllo wörld — 日本語 🙂", "I'LL don't  x\n\n  y\t\tz 12345 3.14 ¡ay! ", "a\r\n\r\nb  "]
    for text in texts:
        assert bpe.pretokenize(text) == tokenizer._split_to_word.findall(text)


ROUND_TRIP_TEXTS = ["héllo wörld — 日本語 🙂", "Beautiful is better than ugly.\n", " x  \n\t🙂🙂 1234567 ǅ Ωμέγα"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_merges_and_specials(tokenizer):
    vocab = mg.builtin_vocab(mg.PRESETS["tiny"][1])
    text = "Beautiful is better than ugly."
    assert len(tokenizer.encode(text)) < len(text.encode()) // 2  # the learned merges are used
    bos, eos, eot = (vocab.tokens.index(s) for s in bpe.DEFAULT_SPECIALS)
    ids = tokenizer.encode("<|begin_of_text|>hi<|eot_id|>é<|end_of_text|>")
    assert ids[0] == bos and ids[-1] == eos and eot in ids
    assert tokenizer.decode(ids) == "<|begin_of_text|>hi<|eot_id|>é<|end_of_text|>"
    assert tokenizer.prefix() == []  # add_bos_token = false
    assert tokenizer.is_end(eos) and tokenizer.is_end(eot)


def rank_bpe(word: bytes, ranks: dict[tuple[bytes, bytes], int], vocab: dict[bytes, int]) -> list[int]:
    """llama.cpp's llama-bpe word encoder: whole-word lookup (ignore_merges), else lowest-rank merge, leftmost first."""
    if word in vocab:
        return [vocab[word]]
    parts = [bytes([b]) for b in word]
    while pairs := [(ranks[p], i) for i, p in enumerate(zip(parts, parts[1:], strict=False)) if p in ranks]:
        _, i = min(pairs)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return [vocab[p] for p in parts]


def test_merges_list_encodes_like_tinygrad(tokenizer):
    """llama.cpp ranks merges by list position, tinygrad by result token id: the written merges make them agree."""
    vocab = mg.builtin_vocab(mg.PRESETS["tiny"][1])
    to_bytes = {sym: b for b, sym in enumerate(byte_symbols())}

    def decode(s: str) -> bytes:
        return bytes(to_bytes[c] for c in s)

    ranks = {(decode(m.split(" ")[0]), decode(m.split(" ")[1])): r for r, m in enumerate(vocab.merges)}
    ids = {decode(t): i for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)) if kind == 1}
    text, rng = mg.builtin_text(), np.random.default_rng(0)
    for start, length in zip(rng.integers(0, len(text) - 200, 200), rng.integers(1, 200, 200), strict=True):
        chunk = text[start : start + length] + ROUND_TRIP_TEXTS[int(start) % 3]
        want = [t for w in bpe.pretokenize(chunk) for t in rank_bpe(w.encode(), ranks, ids)]
        assert tokenizer.encode(chunk) == want, chunk


# ---------------------------------------------------------------- numerics: tinygrad vs the fp64 reference


def test_gguf_q_k_order_matches_hf_layout(tiny_models):
    """The F32 file (GGUF-order Q/K, interleaved rope) computes what the HF-layout weights do with half-split rope."""
    spec, n_merges = mg.PRESETS["tiny"]
    weights = mg.random_weights(spec, len(mg.builtin_vocab(n_merges).tokens), seed=0)
    hf = RefModel.from_weights(weights, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.norm_eps, spec.rope_theta)
    tokens = [5, 300, 301, 40, 7, 99, 400]
    np.testing.assert_allclose(RefModel.from_gguf(tiny_models["F32"]).logits(tokens), hf.logits(tokens), atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tinygrad_logits_match_reference(tiny_models, tokenizer, dtype):
    ref = RefModel.from_gguf(tiny_models[dtype])
    prompt = tokenizer.encode(PROMPT_TEXT)
    seq = prompt + ref.greedy(prompt, N_STEPS)
    want = ref.logits(seq)  # (T, V) float64
    got = tinygrad_logits(tiny_models[dtype], seq)
    err, scale = np.abs(got - want), want.std()
    assert err.max() <= MAX_REL * scale, f"max |dlogit| {err.max():.2e} vs std {scale:.2f}"
    assert err.mean() <= MEAN_REL * scale, f"mean |dlogit| {err.mean():.2e} vs std {scale:.2f}"
    steps = slice(len(prompt) - 1, len(seq) - 1)  # logits that chose each generated token
    assert_greedy_agrees(list(got[steps].argmax(-1)), seq[len(prompt) :], want[steps], MAX_REL * scale)
    assert len(set(seq[len(prompt) :])) > 3, "greedy decoding collapsed onto a few tokens"


def test_tinygrad_generate_matches_reference(tiny_models, tokenizer):
    """tinygrad's own KV-cached, jitted decode loop gives the reference's greedy tokens."""
    from tinygrad.llm.model import Transformer

    path = tiny_models["F16"]
    ref = RefModel.from_gguf(path)
    prompt = tokenizer.encode(PROMPT_TEXT)
    want = ref.greedy(prompt, N_STEPS)
    model, _ = Transformer.from_gguf(path)
    stream = model.generate(list(prompt))
    got = [next(stream) for _ in range(N_STEPS)]
    step_logits = ref.logits(prompt + want)[len(prompt) - 1 : -1]
    assert_greedy_agrees(got, want, step_logits, MAX_REL * step_logits.std())


def test_tied_embeddings(tmp_path):
    spec = mg.LlamaSpec(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, tie_embeddings=True)
    vocab = mg.builtin_vocab(mg.PRESETS["tiny"][1])
    weights = mg.random_weights(spec, len(vocab.tokens), seed=4)
    assert "output.weight" not in weights
    path = mg.write_gguf(tmp_path / "tied.gguf", spec, weights, vocab, dtype="F16")
    tokens = [5, 300, 301, 40, 7]
    want = RefModel.from_gguf(path).logits(tokens)
    assert np.abs(tinygrad_logits(path, tokens) - want).max() <= MAX_REL * want.std()
