"""The last stage's detokenizer decodes exactly as tinygrad's SimpleTokenizer, without building its encoder."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad.llm.cli import SimpleTokenizer

from pp_worker.testing.bpe import build_vocab
from pp_worker.testing.modelgen import builtin_text
from pp_worker.worker.text.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def vocab_kv() -> dict:
    vocab = build_vocab(builtin_text() + " héllo wörld — 日本語 🙂", 300)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": vocab.tokens,
            "tokenizer.ggml.token_type": vocab.token_types,
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


def test_a_character_split_across_tokens_is_held_back() -> None:
    vocab = build_vocab("é 日本", 0)  # no merges: token id b is the byte b
    ours = Detokenizer(vocab.tokens, vocab.token_types)
    e_acute = list("é".encode())  # [0xC3, 0xA9]
    assert ours.decode_partial([ord("x"), e_acute[0]]) == ("x", 1)  # "x" is done, the half é waits
    assert ours.decode_partial([e_acute[0], e_acute[1], ord("y")]) == ("éy", 0)
    three = list("日".encode())
    assert ours.decode_partial(three[:2]) == ("", 2)


def test_streamed_pieces_add_up_to_the_whole_text(vocab_kv: dict) -> None:
    """As the driver streams: each call sends the ids held back last time plus the new ones."""
    ours = Detokenizer.from_gguf_kv(vocab_kv)
    n = len(vocab_kv["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(1)
    held_back = 0
    for _ in range(200):
        ids = rng.integers(0, n, size=int(rng.integers(1, 40))).tolist()
        ids += rng.integers(128, 256, size=3).tolist()  # lone bytes >= 0x80: halves of characters
        pieces, start = [], 0
        for end in sorted(set(rng.integers(1, len(ids) + 1, size=5).tolist()) | {len(ids)}):
            text, pending = ours.decode_partial(ids[start:end])
            pieces.append(text)
            start = end - pending
            held_back += pending
        pieces.append(ours.decode(ids[start:]))  # the end of the generation: whatever is left, as it is
        assert "".join(pieces) == ours.decode(ids)
    assert held_back > 0  # the examples did split characters
