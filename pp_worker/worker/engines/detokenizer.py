"""Token ids -> text from the GGUF vocabulary alone, for the last stage.

The last stage only detokenizes. tinygrad's SimpleTokenizer, which the first stage needs for encoding, also
compiles a pre-tokenizer regex over every Unicode letter and digit (tens of MiB; bench/NOTES.md). Decoding
needs none of it, only each token's bytes: GPT-2's byte symbols for normal tokens (type 1), the UTF-8 of the
token's text for the others (control and special tokens), exactly as SimpleTokenizer.decode does - except the BOS,
which is never shown (the first stage may put it in front of every prompt).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable
from typing import Any

NORMAL = 1  # tokenizer.ggml.token_type of a normal (byte-level BPE) token


@functools.cache
def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte, indexed by byte value (token id b is byte b)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # bytes that stand for themselves
    shifted = iter(range(256, 512))  # the rest map to U+0100.. in byte order
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


class Detokenizer:
    def __init__(self, tokens: list[str], token_types: list[int], hidden: Iterable[int] = ()):
        to_byte = {symbol: b for b, symbol in enumerate(byte_symbols())}
        self._bytes = [bytes(to_byte[c] for c in tok) if kind == NORMAL else tok.encode()
                       for tok, kind in zip(tokens, token_types, strict=True)]
        for i in hidden:  # tokens that decode to nothing
            self._bytes[i] = b""

    @staticmethod
    def from_gguf_kv(kv: dict[str, Any]) -> Detokenizer:
        bos = kv.get("tokenizer.ggml.bos_token_id")
        return Detokenizer(kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"],
                           hidden=() if bos is None else (bos,))

    def decode(self, ids: list[int]) -> str:
        """Invalid UTF-8 (a character split across tokens) becomes U+FFFD, as in SimpleTokenizer."""
        return b"".join(self._bytes[i] for i in ids).decode(errors="replace")

    def decode_partial(self, ids: list[int]) -> tuple[str, int]:
        """For streaming: (the text of ``ids`` up to the last one after which no UTF-8 character is unfinished, how
        many ids follow that one). Sending those again, first, with the next ids, and so on, the pieces add up to
        exactly ``decode`` of all the ids: a character split across tokens is held back, never replaced."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces, done = [], 0
        for n, i in enumerate(ids, start=1):
            pieces.append(decoder.decode(self._bytes[i]))
            if not decoder.getstate()[0]:  # no byte of an unfinished character held: a clean cut
                done = n
        return "".join(pieces[:done]), len(ids) - done
