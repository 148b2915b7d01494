"""The last stage's detokenizer decodes exactly as tinygrad's SimpleTokenizer, without building its encoder."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad.llm.cli import SimpleTokenizer

from pp_worker.testing.bpe import build_vocab
from pp_worker.testing.modelgen import builtin_text
from pp_worker.worker.engines.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def vocab_kv() -> dict:
    vocab = build_vocab(builtin_text() + " héllo wörld — 日本語 🙂", 300)
    return {"tokenizer.ggml.tokens": vocab.tokens, "tokenizer.ggml.token_type": vocab.token_types,
            "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.eos_token_id": vocab.eos_id}


def test_random_id_sequences_decode_as_simple_tokenizer(vocab_kv: dict) -> None:
    reference, ours = SimpleTokenizer.from_gguf_kv(vocab_kv), Detokenizer.from_gguf_kv(vocab_kv)
    rng = np.random.default_rng(0)
    n = len(vocab_kv["tokenizer.ggml.tokens"])
    for _ in range(300):  # random ids split UTF-8 characters too: both must replace them the same way
        ids = rng.integers(0, n, size=int(rng.integers(0, 20))).tolist()
        assert ours.decode(ids) == reference.decode(ids)


def test_encoded_text_with_special_tokens_round_trips(vocab_kv: dict) -> None:
    text = "héllo wörld — 日本語 🙂<|eot_id|> Beautiful is better than ugly.<|end_of_text|>"
    ids = SimpleTokenizer.from_gguf_kv(vocab_kv).encode(text)
    assert Detokenizer.from_gguf_kv(vocab_kv).decode(ids) == text


def test_the_bos_is_never_shown(vocab_kv: dict) -> None:
    bos = vocab_kv["tokenizer.ggml.tokens"].index("<|begin_of_text|>")
    ours = Detokenizer.from_gguf_kv({**vocab_kv, "tokenizer.ggml.bos_token_id": bos})
    ids = SimpleTokenizer.from_gguf_kv(vocab_kv).encode("Beautiful<|eot_id|>")
    assert ours.decode([bos, *ids]) == ours.decode(ids) == "Beautiful<|eot_id|>"  # other control tokens stay
