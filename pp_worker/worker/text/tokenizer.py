"""Text -> token ids on the first stage, as llama.cpp tokenizes a prompt, on a Hugging Face `tokenizers` model
built from the GGUF's vocabulary.

Two vocabulary kinds (`tokenizer.ggml.model`):
- "gpt2", byte-level BPE (Llama 3, Qwen, SmolLM, ...): the GGUF's merges, the pre-tokenizer regexes of its
  `tokenizer.ggml.pre` (`pretok`), then GPT-2's byte symbols. llama.cpp and HF both merge the lowest-ranked pair
  first; the llama3 family and tekken take a word that is itself a token whole (`ignore_merges`).
- "llama", SentencePiece BPE (Llama 2, Mistral, TinyLlama): llama.cpp merges the adjacent pair whose result has
  the highest *score*. HF's BPE merges by rank, so every split of a token into two tokens becomes a merge ranked
  by the token's score (as transformers' SentencePiece converter does). Text is prefixed with a space (unless
  `add_space_prefix` is false) at its start and after each special token, spaces become U+2581, and characters
  no token covers fall back to their <0xXX> byte tokens.

Special tokens (control and unknown types) and user-defined ones are matched whole in the text before any of that
(llama.cpp's parse_special=true, what its server and CLI do with prompts), so a chat template's markers become
their ids. The BOS, when the model wants one (`vocab.bos_token`), is put first here, not by the HF model.

tinygrad's own SimpleTokenizer is not used: it applies the llama3 regex to every preset, refuses most pre names
and cannot read SentencePiece vocabularies (measured: /work/notes/tokenizers.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pp_worker.worker.text.pretok import pre_tokenizer
from pp_worker.worker.text.vocab import CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED, bos_token, token_types

if TYPE_CHECKING:
    import tokenizers


class Tokenizer:
    """Encodes text for one GGUF vocabulary (build it with ``from_gguf_kv``)."""

    def __init__(self, hf: tokenizers.Tokenizer, bos_id: int | None, add_bos: bool):
        self._hf, self.bos_id, self.add_bos = hf, bos_id, add_bos

    @staticmethod
    def from_gguf_kv(kv: dict[str, Any]) -> Tokenizer:
        """ValueError (naming the key) for a vocabulary kind or pre-tokenizer this cannot reproduce exactly."""
        model = kv.get("tokenizer.ggml.model")
        if model == "gpt2":
            hf = _byte_level_bpe(kv)
        elif model == "llama":
            hf = _sentencepiece(kv)
        else:
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: gpt2, llama)")
        _add_special_tokens(hf, kv["tokenizer.ggml.tokens"], token_types(kv))
        return Tokenizer(hf, *bos_token(kv))

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; the BOS first when the model wants one and ``add_special``."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_special and self.add_bos and self.bos_id is not None else ids


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {t: i for i, t in enumerate(tokens)}


def _byte_level_bpe(kv: dict[str, Any]) -> tokenizers.Tokenizer:
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    pre = pre_tokenizer(kv.get("tokenizer.ggml.pre"))
    merges = [tuple(m.split(" ", 1)) for m in kv["tokenizer.ggml.merges"]]  # byte symbols: no space inside
    hf = HFTokenizer(models.BPE(_vocab(kv["tokenizer.ggml.tokens"]), merges, ignore_merges=pre.ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # bytes -> GPT-2 byte symbols
    return hf


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split (left, right) of each normal token into two tokens, ranked by the token's score, highest first
    (ties: lower id): HF's lowest-rank-first BPE then merges as llama.cpp's highest-score-first one."""
    vocab = _vocab(tokens)
    order = sorted((i for i, k in enumerate(types) if k == NORMAL and len(tokens[i]) > 1),
                   key=lambda i: (-scores[i], i))
    return [(t[:k], t[k:]) for t in (tokens[i] for i in order) for k in range(1, len(t))
            if t[:k] in vocab and t[k:] in vocab]


def _sentencepiece(kv: dict[str, Any]) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers

    tokens = kv["tokenizer.ggml.tokens"]
    scores = kv.get("tokenizer.ggml.scores", [0.0] * len(tokens))
    unk = kv.get("tokenizer.ggml.unknown_token_id", 0)
    model = models.BPE(_vocab(tokens), spm_merges(tokens, scores, token_types(kv)), unk_token=tokens[unk],
                       fuse_unk=True, byte_fallback=True)
    hf = HFTokenizer(model)
    # no pre-tokenizer: SentencePiece merges across words. The normalizer runs on each piece of text between
    # special tokens, which is exactly where llama.cpp adds its space prefix.
    steps = [normalizers.Replace(" ", SPACE)]
    if kv.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    return hf


def _add_special_tokens(hf: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Matched whole in raw text (normalized=False): control/unknown tokens as special, user-defined as added."""
    from tokenizers import AddedToken

    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types, strict=True) if k in (CONTROL, UNKNOWN)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
