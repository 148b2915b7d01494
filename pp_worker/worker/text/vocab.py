"""What the GGUF says about its vocabulary that both ends need: token types and the BOS rule (llama.cpp's).

Importing this module is cheap: the first stage's encoder (`tokenizer`) and the last stage's decoder
(`detokenizer`) both build on it, and only the encoder needs a tokenizer library.
"""

from __future__ import annotations

from typing import Any

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's stand-in for " " inside tokens

# BPE ("gpt2") vocabularies whose pre-tokenizer makes llama.cpp add a BOS when the GGUF has no add_bos_token:
# the llama3 family, tekken and chameleon (src/llama-vocab.cpp, llama_vocab::impl::load)
BOS_BY_DEFAULT_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                      "jina-v5-nano", "tekken", "chameleon")


def token_types(kv: dict[str, Any]) -> list[int]:
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return list(types)


def bos_token(kv: dict[str, Any]) -> tuple[int | None, bool]:
    """(BOS id or None, whether tokenizing adds it), by llama.cpp's rule: the GGUF's tokenizer.ggml.add_bos_token
    when present; otherwise yes for SentencePiece ("llama") and WordPiece ("bert") vocabularies and for BPE
    ("gpt2") ones whose pre-tokenizer is in BOS_BY_DEFAULT_PRE, no for the rest. The id is
    tokenizer.ggml.bos_token_id, or 1 for a SentencePiece vocabulary without one (llama.cpp's default); without
    an id nothing is added."""
    model = kv.get("tokenizer.ggml.model")
    bos = kv.get("tokenizer.ggml.bos_token_id", 1 if model == "llama" else None)
    if "tokenizer.ggml.add_bos_token" in kv:
        add = bool(kv["tokenizer.ggml.add_bos_token"])
    else:
        add = model in ("llama", "bert") or (model == "gpt2" and kv.get("tokenizer.ggml.pre") in BOS_BY_DEFAULT_PRE)
    return bos, add and bos is not None
