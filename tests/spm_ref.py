"""An independent, dependency-free port of llama.cpp's SentencePiece tokenizer: the reference for SPM encoding.

It shares no code with pp_worker and works the way llama.cpp does (src/llama-vocab.cpp, llm_tokenizer_spm_session
and llama_vocab::impl::tokenize), not the way the worker does (a Hugging Face BPE with merges derived from scores):
- special tokens (control, user-defined, unknown) are cut out of the text first, longest first;
- each remaining piece of text gets a " " prefix when add_space_prefix and it starts the text or follows a special
  token; then " " -> U+2581;
- symbols are characters; the adjacent pair whose concatenation is a token with the HIGHEST score merges first
  (ties: leftmost), until none is left;
- a symbol that is no token becomes its UTF-8 bytes' <0xXX> tokens.
This port agreed with llama.cpp itself on 4,500 random texts over three vocabularies (/work/notes/tokenizers.md).
"""

from __future__ import annotations

import heapq
from typing import Any

CONTROL, UNKNOWN, USER_DEFINED = 3, 2, 4


class SpmReference:
    def __init__(self, kv: dict[str, Any]):
        self.tokens: list[str] = list(kv["tokenizer.ggml.tokens"])
        self.scores: list[float] = list(kv["tokenizer.ggml.scores"])
        self.types: list[int] = list(kv["tokenizer.ggml.token_type"])
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.add_space_prefix = kv.get("tokenizer.ggml.add_space_prefix", True)
        self.specials = sorted((i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)),
                               key=lambda i: -len(self.tokens[i].encode()))

    def _partition(self, text: str) -> list[str | int]:
        pieces: list[str | int] = [text] if text else []
        for sid in self.specials:
            s, out = self.tokens[sid], []
            for piece in pieces:
                if isinstance(piece, int) or s not in piece:
                    out.append(piece)
                    continue
                for j, part in enumerate(piece.split(s)):
                    if j:
                        out.append(sid)
                    if part:
                        out.append(part)
            pieces = out
        return pieces

    def _merge(self, text: str, out: list[int]) -> None:
        sym = list(text)  # merged symbols grow in place; "" marks one merged into its left neighbour
        prev, nxt = list(range(-1, len(sym) - 1)), [*range(1, len(sym)), -1]
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)

        def offer(left: int, right: int) -> None:
            if left >= 0 and right >= 0 and (tid := self.ids.get(sym[left] + sym[right])) is not None:
                heapq.heappush(heap, (-self.scores[tid], left, right, len(sym[left]) + len(sym[right])))

        for i in range(1, len(sym)):
            offer(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue  # stale: one side changed since this pair was offered
            sym[left], sym[right] = sym[left] + sym[right], ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            offer(prev[left], left)
            offer(left, nxt[left])
        i = 0
        while i != -1:
            if (tid := self.ids.get(sym[i])) is not None:
                out.append(tid)
            else:
                out.extend(self.ids[f"<0x{b:02X}>"] for b in sym[i].encode())
            i = nxt[i]

    def encode(self, text: str) -> list[int]:
        """Ids without BOS/EOS, special tokens parsed (llama_tokenize(add_special=false, parse_special=true))."""
        out: list[int] = []
        after_special = True
        for piece in self._partition(text):
            if isinstance(piece, int):
                out.append(piece)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                piece = " " + piece
            self._merge(piece.replace(" ", "\u2581"), out)
            after_special = False
        return out
