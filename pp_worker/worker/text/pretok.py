"""llama.cpp's BPE pre-tokenizers: `tokenizer.ggml.pre` -> the regexes that cut text into words before merging.

llama.cpp (src/llama-vocab.cpp) maps the GGUF's pre name to a LLAMA_VOCAB_PRE_TYPE_* and the type to a *list* of
regexes; `unicode_regex_split` applies them in turn, each splitting every piece the previous one left and keeping
both the matches and the text between them (Hugging Face: `Split(Regex(r), behavior="isolated")` per regex).
The spellings are llama.cpp's adapted ones ((?i:...) written out as [sS] and so on), valid Oniguruma syntax.

Names not listed here are refused, as llama.cpp refuses them ("unknown pre-tokenizer type"): guessing a split
would encode text into ids the model never saw, silently. A missing key means "default", as in llama.cpp.
Checked against llama.cpp itself for every name listed (1,000 random texts each): /work/notes/tokenizers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
          r"((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Escaped on purpose: NFC normalisation (an editor, a copy) maps some of these code points (U+1F7D, U+1FBE, U+1FD3,
# U+1FDB, U+2126, U+212A) to others and turns ranges into empty ones, which Oniguruma rejects.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-"
    "\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57"
    "\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-"
    "\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-"
    "\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-"
    "\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
DEEPSEEK_LLM = ["[\r\n]", _DEEPSEEK_LETTERS, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                "\\s+$", _CJK, "\\p{N}+"]
DEEPSEEK_CODER = ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}"]
DEEPSEEK3 = ["\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
             "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
             "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]
FALCON = ["[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2, "[0-9][0-9][0-9]"]
STARCODER = ["\\p{N}", GPT2]
BLOOM = [" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"]
DEFAULT = ["[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]"]


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole word that is a token is taken as it is (llama3 family, tekken)


def _pre(*regexes: str, ignore_merges: bool = False) -> PreTokenizer:
    return PreTokenizer(regexes, ignore_merges)


_LLAMA3 = _pre(LLAMA3, ignore_merges=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], _pre(LLAMA3)),
    "default": _pre(*DEFAULT),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "roberta-bpe", "jina-v1-en",
                     "jina-v2-code", "trillion", "granite-docling"], _pre(GPT2)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"], _pre(QWEN2)),
    "qwen35": _pre(QWEN35),
    "deepseek-llm": _pre(*DEEPSEEK_LLM),
    "deepseek-coder": _pre(*DEEPSEEK_CODER),
    "deepseek-v3": _pre(*DEEPSEEK3),
    "falcon": _pre(*FALCON),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2", "smollm", "command-r"],
                    _pre(*STARCODER)),
    "tekken": _pre(TEKKEN, ignore_merges=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2"], _pre(GPT4O)),
    **dict.fromkeys(["bloom", "gpt3-finnish", "poro-chat"], _pre(*BLOOM)),
}


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer of a `tokenizer.ggml.pre` value; ValueError naming an unknown one."""
    if not name:  # llama.cpp warns that generation quality will be degraded and uses "default"
        return PRE_TOKENIZERS["default"]
    if name not in PRE_TOKENIZERS:
        raise ValueError(f"unknown pre-tokenizer {name!r} (tokenizer.ggml.pre); known: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[name]
