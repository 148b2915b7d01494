"""The model's tokens as a grammar's matcher (``worker.grammar``, llguidance) needs them: each id's bytes, which are
special, the end-of-sequence ids, and an encoder. Here, in the text room, so an engine can build one without importing
the grammar (which stands above the engines)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pp_worker.worker.text.detokenizer import byte_symbols, token_bytes
from pp_worker.worker.text.vocab import CONTROL, USER_DEFINED, token_types


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance needs to know about the model's tokens: each id's bytes (a control token's text behind a
    0xff byte, llama.cpp's convention for special tokens), the end-of-sequence ids, and an encoder for the few
    strings llguidance tokenizes itself."""

    tokens: list[bytes]
    special: list[int]
    eos: list[int]
    encode: Callable[[str], list[int]]

    @staticmethod
    def from_gguf_kv(kv: dict[str, Any], eos: list[int], encode: Callable[[str], list[int]]) -> Vocabulary:
        """The GGUF's tokens as the last stage decodes them (`text.detokenizer`), control tokens marked special."""
        names, types = kv["tokenizer.ggml.tokens"], token_types(kv)
        spm, to_byte = kv.get("tokenizer.ggml.model") == "llama", {s: b for b, s in enumerate(byte_symbols())}
        special = [i for i, (name, kind) in enumerate(zip(names, types, strict=True))
                   if kind == CONTROL or kind == USER_DEFINED and name.startswith("<") and name.endswith(">")]
        tokens = [token_bytes(name, kind, spm, to_byte) for name, kind in zip(names, types, strict=True)]
        for i in special:
            tokens[i] = b"\xff" + names[i].encode()
        return Vocabulary(tokens, special, eos, encode)
