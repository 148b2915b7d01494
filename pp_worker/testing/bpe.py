"""Deterministic byte-level BPE tokenizer building, in the GGUF `gpt2` format.

`build_vocab` trains on a text and returns a `Vocab` whose ids both tinygrad's SimpleTokenizer and llama.cpp
encode alike; `builtin_text` is the fixed training text that `modelgen` uses, so the same arguments always give
the same vocabulary. Words are split as the vocabulary's pre-tokenizer (`tokenizer.ggml.pre`) will split them:
llama-bpe by the regex below (tinygrad's spelling), any other name by llama.cpp's regexes as the worker applies
them (`text.pretok`), so no token spans what the encoder keeps apart.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import heapq
import io
import re
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pp_worker.worker.text.detokenizer import byte_symbols

if TYPE_CHECKING:
    from gguf import GGUFWriter
    from tokenizers.pre_tokenizers import PreTokenizer

DEFAULT_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


@dataclass(frozen=True)
class Vocab:
    """A GGUF `gpt2`-model vocabulary: tokens are GPT-2 byte-symbol strings, ids are list positions."""

    tokens: list[str]
    token_types: list[int]  # 1 = normal, 3 = control (special)
    merges: list[str]  # "left right" in GPT-2 byte symbols, in rank order
    bos_id: int
    eos_id: int
    pre: str = "llama-bpe"  # tokenizer.ggml.pre: how text is split into words before merging

    def write_tokenizer(self, writer: GGUFWriter) -> None:
        """The tokenizer keys of a GGUF (not add_bos/add_eos: the model's writer decides those)."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)


def _spell(token: bytes) -> str:
    """A token's bytes in GPT-2 byte symbols, as GGUF stores tokens and merges."""
    sym = byte_symbols()
    return "".join(sym[c] for c in token)


def _category_class(prefix: str) -> str:
    """A regex character-class body matching every code point whose Unicode category starts with `prefix`."""
    ranges: list[tuple[int, int]] = []
    for cp in range(0x323B0):  # one past the last L/N/Z code point, as in tinygrad and llama.cpp
        if unicodedata.category(chr(cp)).startswith(prefix):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(re.escape(chr(a)) + ("" if a == b else "-" + re.escape(chr(b))) for a, b in ranges)


@functools.cache
def _word_regex() -> re.Pattern[str]:
    # llama3 / llama-bpe pre-tokenizer, spelled like tinygrad's SimpleTokenizer (\s, \p{L}, \p{N} expanded)
    ws, num, let = r"\t\n\x0b\x0c\r\x85" + _category_class("Z"), _category_class("N"), _category_class("L")
    return re.compile(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
        f"[^\\r\\n{num}{let}]?[{let}]+|[{num}]{{1,3}}| ?[^{ws}{num}{let}]+[\\r\\n]*|"
        f"[{ws}]*[\\r\\n]+|[{ws}]+(?![^{ws}])|[{ws}]+"
    )


def pretokenize(text: str, pre: str = "llama-bpe") -> list[str]:
    """Split text into the words a ``pre`` tokenizer encodes separately (merges never cross them)."""
    if pre == "llama-bpe":
        return _word_regex().findall(text)
    return [w for w, _ in _split_by(pre).pre_tokenize_str(text)]


@functools.cache
def _split_by(pre: str) -> PreTokenizer:
    """llama.cpp's regexes for ``pre`` as the worker's tokenizer applies them, without the byte mapping."""
    from tokenizers import Regex, pre_tokenizers

    from pp_worker.worker.text.pretok import pre_tokenizer

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                    for r in pre_tokenizer(pre).regexes])


def _merge_word(word: list[int], a: int, b: int, new: int) -> list[int]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _learn_tokens(word_counts: Counter[bytes], n_merges: int) -> list[bytes]:
    """Classic BPE: repeatedly merge the most frequent adjacent pair (ties: smallest ids).

    Returns every token by id: the 256 single bytes, then the learned ones in merge order. Pair counts are kept
    incrementally (a heap with stale entries skipped) so ~2000 merges take well under a second.
    """
    toks = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(toks)}
    words = [list(w) for w in sorted(word_counts)]
    counts = [word_counts[w] for w in sorted(word_counts)]
    pair_count: Counter[tuple[int, int]] = Counter()
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)

    heap: list[tuple[int, int, int]] = []  # (-count, left id, right id): most frequent first, then smallest ids

    def account(wi: int, sign: int) -> None:
        w = words[wi]
        for p in zip(w, w[1:], strict=False):
            pair_count[p] += sign * counts[wi]
            heapq.heappush(heap, (-pair_count[p], p[0], p[1]))
            if sign > 0:
                where[p].add(wi)

    for wi in range(len(words)):
        account(wi, +1)
    while len(toks) < 256 + n_merges and heap:
        neg, a, b = heapq.heappop(heap)
        if pair_count[(a, b)] != -neg or neg == 0:
            continue  # stale entry
        new_bytes = toks[a] + toks[b]
        if new_bytes not in index:  # else: a second spelling of a known token, merge without a new id
            index[new_bytes] = len(toks)
            toks.append(new_bytes)
        for wi in sorted(where.pop((a, b))):
            account(wi, -1)
            words[wi] = _merge_word(words[wi], a, b, index[new_bytes])
            account(wi, +1)
    return toks


def _merge_list(tokens: list[bytes]) -> list[str]:
    """Every way to split each learned token into two known tokens, grouped in token-id order.

    tinygrad merges any adjacent pair whose concatenation is a token (lowest id first); listing all splits,
    ranked by the id of their result, makes llama.cpp's rank-ordered BPE do the same.
    """
    known = set(tokens)
    merges = []
    for tok in tokens[256:]:
        for k in range(1, len(tok)):
            if tok[:k] in known and tok[k:] in known:
                merges.append(_spell(tok[:k]) + " " + _spell(tok[k:]))
    return merges


def build_vocab(text: str, n_merges: int, specials: tuple[str, ...] = DEFAULT_SPECIALS,
                pre: str = "llama-bpe") -> Vocab:
    """Byte-level BPE trained deterministically on `text`.

    Ids: 0..255 are the single bytes *by byte value* (token b is GPT-2's symbol for byte b), then the learned
    tokens in merge order (tinygrad merges by lowest token id), then `specials` (type 3; the first is BOS, the
    second EOS). Words are pre-split the ``pre`` way and special strings are cut out first, as the encoders do.
    Fewer than `n_merges` tokens are learned only if the text runs out of pairs.
    """
    if len(specials) < 2:
        raise ValueError(f"specials must name at least BOS and EOS, got {specials!r}")
    pieces = re.split("|".join(map(re.escape, specials)), text)
    word_counts = Counter(w.encode() for piece in pieces for w in pretokenize(piece, pre))
    byte_tokens = _learn_tokens(word_counts, n_merges)
    normal = [_spell(t) for t in byte_tokens]
    return Vocab(
        tokens=normal + list(specials),
        token_types=[1] * len(normal) + [3] * len(specials),
        merges=_merge_list(byte_tokens),
        bos_id=len(normal),
        eos_id=len(normal) + 1,
        pre=pre,
    )


def builtin_text() -> str:
    """The fixed training text (~7.5 kB, room for ~1960 merges).

    The Zen of Python four times (so its words are merged first), its rot13 source, then every Latin, IPA, Greek
    and Cyrillic letter in U+00C0..U+04FF and each distinct word of their Unicode names, for multi-byte tokens
    and enough distinct pairs for the bench vocabulary. Unicode names never change once assigned.
    """
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen; stdout may be a protocol stream
        import this
    zen = codecs.decode(this.s, "rot13")
    letters = [chr(cp) for cp in range(0xC0, 0x500) if unicodedata.category(chr(cp)).startswith("L")]
    name_words = sorted({w for c in letters for w in unicodedata.name(c).lower().split()})
    return "\n\n".join([zen] * 4 + [this.s, " ".join(letters), " ".join(name_words)]) + "\n"
