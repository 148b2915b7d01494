"""Token ids -> text from the GGUF vocabulary alone, for the last stage.

The last stage only detokenizes, so it builds no encoder (a tokenizer library, a pre-tokenizer regex): decoding
needs only each token's bytes, looked up in a table built once, as llama.cpp's token_to_piece gives them:
- normal tokens: byte-level BPE ("gpt2") spells bytes with GPT-2's printable symbols; SentencePiece ("llama")
  writes a space as U+2581;
- byte tokens "<0xXX>" (SentencePiece's byte fallback): that byte;
- control, unknown and user-defined tokens: their text (a chat template's markers stay visible), except the BOS,
  which is never shown (the first stage may put it in front of every prompt);
- unused tokens: nothing.
No leading space is stripped: a generation's text continues its prompt, so " world" keeps its space.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable
from typing import Any

from pp_worker.worker.text.vocab import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED, bos_token, token_types


@functools.cache
def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte, indexed by byte value (token id b is byte b)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # bytes that stand for themselves
    shifted = iter(range(256, 512))  # the rest map to U+0100.. in byte order
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def token_bytes(token: str, kind: int, spm: bool, to_byte: dict[str, int]) -> bytes:
    """The bytes one token stands for (see the module docstring)."""
    if kind == NORMAL:
        if spm:
            return token.replace(SPACE, " ").encode()
        if all(c in to_byte for c in token):
            return bytes(to_byte[c] for c in token)
        return token.encode()  # not byte-level spelled: its text, as llama.cpp would print it
    if kind == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    if kind in (CONTROL, UNKNOWN, USER_DEFINED, BYTE):
        return token.encode()
    return b""  # unused or undefined: llama.cpp prints nothing


class Detokenizer:
    def __init__(self, tokens: list[str], token_types: list[int], hidden: Iterable[int] = (), spm: bool = False):
        to_byte = {symbol: b for b, symbol in enumerate(byte_symbols())}
        self._bytes = [token_bytes(tok, kind, spm, to_byte) for tok, kind in zip(tokens, token_types, strict=True)]
        for i in hidden:  # tokens that decode to nothing
            self._bytes[i] = b""

    @staticmethod
    def from_gguf_kv(kv: dict[str, Any]) -> Detokenizer:
        model = kv.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: gpt2, llama)")
        bos, _ = bos_token(kv)
        return Detokenizer(kv["tokenizer.ggml.tokens"], token_types(kv), hidden=() if bos is None else (bos,),
                           spm=model == "llama")

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
