"""Deterministic SentencePiece-style vocabularies (GGUF `tokenizer.ggml.model = "llama"`), in pure Python.

The shape of a sentencepiece BPE model such as Llama 2's: <unk>, <s>, </s>, user-defined pieces, the 256 <0xXX>
byte pieces, then the learned pieces by merge rank (score -rank), then the single characters by frequency (the
lowest scores). Training splits text the sentencepiece way: a space prefix per line, spaces as U+2581 starting
each word, digits alone. Text outside the training alphabet (emoji, CJK) is left to byte fallback.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pp_worker.testing.bpe import builtin_text
from pp_worker.worker.text.vocab import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED

if TYPE_CHECKING:
    from gguf import GGUFWriter

EXTRA_TEXT = "Grüße aus Köln, naïve café. Καλημέρα κόσμε. Привет, мир! Numbers 1234 5678 90.\n"


@dataclass(frozen=True)
class SpmVocab:
    """A GGUF `llama`-model vocabulary, written as llama.cpp's convert_hf_to_gguf writes a sentencepiece one."""

    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 0
    add_space_prefix: bool = True  # sentencepiece's add_dummy_prefix

    def write_tokenizer(self, writer: GGUFWriter) -> None:
        """The tokenizer keys (not add_bos/add_eos: the model's writer decides those)."""
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        writer.add_unk_token_id(self.unk_id)
        if not self.add_space_prefix:
            writer.add_add_space_prefix(False)


def _words(text: str) -> Counter[str]:
    """Training words: per line a space prefix, each word starting with U+2581, digits alone, runs of spaces kept
    as whitespace-only words (sentencepiece's split_digits, allow_whitespace_only_pieces)."""
    words: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.strip():
            continue
        cur = ""
        for ch in SPACE + line.replace(" ", SPACE):
            if ch == SPACE or ch.isdigit() or (cur and cur[-1].isdigit()):
                if cur and not (ch == SPACE and cur == SPACE):
                    words[cur] += 1
                    cur = ""
            cur += ch
        if cur:
            words[cur] += 1
    return words


def _merge(seq: list[str], a: str, b: str) -> list[str]:
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def _learn(words: Counter[str], n_merges: int) -> list[str]:
    """Classic BPE on characters: the most frequent adjacent pair first (ties: the smallest pair)."""
    seqs = {w: list(w) for w in words}
    learned: list[str] = []
    known = {ch for w in words for ch in w}
    while len(learned) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, s in seqs.items():
            for pair in zip(s, s[1:], strict=False):
                pairs[pair] += words[w]
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if a + b not in known:
            known.add(a + b)
            learned.append(a + b)
        seqs = {w: _merge(s, a, b) for w, s in seqs.items()}
    return learned


def build_spm_vocab(n_merges: int = 300, text: str | None = None, user_defined: tuple[str, ...] = ("<|user|>",),
                    add_space_prefix: bool = True) -> SpmVocab:
    """Train on ``text`` (default: the generator's built-in text plus a multilingual line); same arguments, same
    vocabulary."""
    words = _words(builtin_text() + EXTRA_TEXT * 3 if text is None else text)
    learned = _learn(words, n_merges)
    chars = Counter({ch: 0 for w in words for ch in w})
    for w, n in words.items():
        for ch in w:
            chars[ch] += n
    singles = [ch for ch, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])) if ch not in learned]
    head = ["<unk>", "<s>", "</s>", *user_defined, *(f"<0x{b:02X}>" for b in range(256))]
    head_types = [UNKNOWN, CONTROL, CONTROL] + [USER_DEFINED] * len(user_defined) + [BYTE] * 256
    body = learned + singles
    return SpmVocab(head + body, [0.0] * len(head) + [-float(i) for i in range(len(body))],
                    head_types + [NORMAL] * len(body), add_space_prefix=add_space_prefix)
