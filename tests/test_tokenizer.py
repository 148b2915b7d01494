"""The first stage's tokenizer and the last stage's detokenizer on generated vocabularies, against references that
share no code with them:
- byte-level BPE, llama-bpe: tinygrad's own SimpleTokenizer (which agrees with llama.cpp there);
- byte-level BPE, qwen2 / smollm / gpt-2: the pre-tokenizer regexes written out here from the models' own
  tokenizer.json spellings (Python `re`, categories expanded) and a textbook rank-ordered BPE;
- SentencePiece: `spm_ref`, a port of llama.cpp's algorithm (highest score first; the worker merges by rank);
- every one of the 59 pre-tokenizer names: decode(encode(text)) == text.
"""

from __future__ import annotations

import dataclasses
import random
import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest
from spm_ref import SpmReference
from tinygrad.llm.cli import SimpleTokenizer

from pp_worker.testing.bpe import build_vocab, builtin_text
from pp_worker.testing.modelgen import PRESETS, SPM, builtin_vocab, generate, random_weights, write_gguf
from pp_worker.worker.engines.tinygrad_engine import TinygradEngine
from pp_worker.worker.gguf.header import ModelLoadError, read_header
from pp_worker.worker.text.detokenizer import Detokenizer
from pp_worker.worker.text.pretok import PRE_TOKENIZERS
from pp_worker.worker.text.tokenizer import Tokenizer
from pp_worker.worker.text.vocab import bos_token

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
SPM_SPECIALS = ("<s>", "</s>", "<unk>", "<|user|>")
# words of the training text plus what it lacks: odd whitespace, digit runs, contractions, other scripts, emoji
POOL = (" ", "  ", "   ", "\n", "\n\n", "\t", " \n ", ".", ",", "!", "?", "'s", "'ll", "'T", "-", "...", "\"", "(",
        "0", "7", "12", "123", "4567", "3.14", "é", "ß", "Ω", "λ", "ж", "日本", "語", "☃", "🙂", "👍🏽", "\u00a0",
        "\u2003", "\u200b", "\r\n", "A", "x", "ﬁ", "e\u0301", "$", "<", ">", "|", "<s", "s>", "_")


def random_texts(n: int, seed: int, specials: tuple[str, ...] = (), pool: tuple[str, ...] = POOL) -> list[str]:
    rng = random.Random(seed)
    words = builtin_text().split()
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            parts.append(rng.choice(words) if r < 0.5 else rng.choice(specials) if r > 0.9 and specials
                         else rng.choice(pool))
            if rng.random() < 0.6:
                parts.append(" ")
        texts.append("".join(parts))
    return texts


def kv_of(path: Path) -> dict:
    return dict(read_header(path).kv)


# numbers, so that pre-tokenizers that split digits differently train different vocabularies
NUMBERS = " ".join(str(n) for n in random.Random(0).choices(range(100_000), k=300)) + "\n"


def write_model(path: Path, vocab) -> Path:
    spec = PRESETS["tiny"][0]
    return write_gguf(path, spec, random_weights(spec, len(vocab.tokens), 0), vocab)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("vocabs")
    out = {pre: write_model(d / f"{pre}.gguf", build_vocab(builtin_text() + NUMBERS, 400, pre=pre))
           for pre in ("llama-bpe", "qwen2", "smollm")}
    out["bench"] = write_model(d / "bench.gguf", builtin_vocab(PRESETS["bench"][1]))  # the bench model's vocabulary
    out[SPM] = generate(d / "spm.gguf", "tiny", tokenizer=SPM, add_bos=None)  # no add_bos key: SPM's default
    return out


# ---------------------------------------------------------------- byte-level BPE


@pytest.mark.parametrize("name", ["llama-bpe", "bench"])
def test_llama_bpe_encodes_as_tinygrads_simple_tokenizer(models, name):
    kv = kv_of(models[name])
    ours, reference = Tokenizer.from_gguf_kv(kv), SimpleTokenizer.from_gguf_kv(kv)
    for text in random_texts(600, seed=1, specials=SPECIALS):
        assert ours.encode(text, add_special=False) == reference.encode(text), repr(text)


@cache
def category(prefix: str) -> str:
    """A `re` character-class body for every code point whose Unicode category starts with ``prefix``."""
    cps = [cp for cp in range(0x323B0) if unicodedata.category(chr(cp)).startswith(prefix)]
    runs, start = [], cps[0]
    for a, b in zip(cps, cps[1:] + [-1], strict=True):
        if b != a + 1:
            runs.append(re.escape(chr(start)) + ("" if start == a else "-" + re.escape(chr(a))))
            start = b
    return "".join(runs)


def expand(pattern: str) -> re.Pattern[str]:
    """Oniguruma's \\p{L}, \\p{N} and \\s (White_Space) in Python `re` spelling."""
    ws = r"\t\n\x0b\x0c\r\x85" + category("Z")
    pattern = pattern.replace(r"[^\s", f"[^{ws}").replace(r"\s", f"[{ws}]").replace(r"\S", f"[^{ws}]")
    return re.compile(pattern.replace(r"\p{L}", category("L")).replace(r"\p{N}", category("N")))


# as the models' own tokenizer.json write them (Qwen2, SmolLM = StarCoder: digits split, then GPT-2's ByteLevel)
QWEN2 = (r"(?:'s|'S|'t|'T|'re|'RE|'Re|'rE|'ve|'VE|'Ve|'vE|'m|'M|'ll|'LL|'Ll|'lL|'d|'D)"
         r"|[^\r\n\p{L}\p{N}]?[\p{L}]+|[\p{N}]| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?[\p{L}]+| ?[\p{N}]+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SPLITS = {"qwen2": [QWEN2], "smollm": [r"[\p{N}]", GPT2], "gpt-2": [GPT2]}


def split_isolated(patterns: list[str], text: str) -> list[str]:
    """Each pattern cuts every piece into its matches and the text between them (HF's Split "isolated")."""
    pieces = [text]
    for p in map(expand, patterns):
        out = []
        for piece in pieces:
            at = 0
            for m in p.finditer(piece):
                out += [piece[at:m.start()], m.group()]
                at = m.end()
            out.append(piece[at:])
        pieces = [x for x in out if x]
    return pieces


def gpt2_symbols() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def rank_bpe(kv: dict, patterns: list[str], text: str) -> list[int]:
    """Specials cut out first, words split, then each word's lowest-ranked pair merged until none is left."""
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(kv["tokenizer.ggml.merges"])}
    specials = sorted((t for t, k in zip(tokens, types, strict=True) if k == 3), key=len, reverse=True)
    sym = gpt2_symbols()
    out: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if piece in ids and piece in specials:
            out.append(ids[piece])
            continue
        for word in split_isolated(patterns, piece):
            parts = [sym[b] for b in word.encode()]
            while len(parts) > 1:
                pairs = enumerate(zip(parts, parts[1:], strict=False))
                rank, i = min((ranks.get((a, b), 1 << 30), i) for i, (a, b) in pairs)
                if rank == 1 << 30:
                    break
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            out += [ids[p] for p in parts]
    return out


@pytest.mark.parametrize("pre", ["qwen2", "smollm", "gpt-2"])
def test_other_pre_tokenizers_encode_as_an_independent_rank_bpe(models, pre):
    kv = kv_of(models[pre if pre in models else "smollm"]) | {"tokenizer.ggml.pre": pre}
    ours = Tokenizer.from_gguf_kv(kv)
    for text in random_texts(600, seed=2, specials=SPECIALS):
        assert ours.encode(text, add_special=False) == rank_bpe(kv, SPLITS[pre], text), repr(text)


def test_the_vocabulary_follows_its_pre_tokenizer(models):
    """qwen2 and smollm split digits one by one: a vocabulary trained for them has no multi-digit token, the
    llama-bpe one (digits in threes) has; so each generated model is one its pre-tokenizer could have made."""
    def digit_runs(name: str) -> set[str]:
        return {t for t in kv_of(models[name])["tokenizer.ggml.tokens"] if len(t) > 1 and t.isdigit()}

    assert digit_runs("llama-bpe") and not digit_runs("qwen2") and not digit_runs("smollm")
    ours = Tokenizer.from_gguf_kv(kv_of(models["qwen2"]))
    assert len(ours.encode("2024", add_special=False)) == 4


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_round_trips(models, pre):
    kv = kv_of(models["bench"]) | {"tokenizer.ggml.pre": pre}
    ours, detok = Tokenizer.from_gguf_kv(kv), Detokenizer.from_gguf_kv(kv)
    for text in random_texts(60, seed=3):
        assert detok.decode(ours.encode(text, add_special=False)) == text, repr(text)


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    spec, n_merges = PRESETS["tiny"]
    vocab = dataclasses.replace(builtin_vocab(n_merges), pre="klingon")
    path = write_gguf(tmp_path / "klingon.gguf", spec, random_weights(spec, len(vocab.tokens), 0), vocab)
    with pytest.raises(ModelLoadError, match="cannot build the tokenizer: ValueError: unknown pre-tokenizer "
                                             "'klingon' \\(tokenizer.ggml.pre\\)"):
        TinygradEngine(str(path), 0, 2)
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_gguf_kv(kv_of(path) | {"tokenizer.ggml.model": "bert"})


# ---------------------------------------------------------------- SentencePiece


@pytest.mark.parametrize("space_prefix", [True, False])
def test_sentencepiece_encodes_as_llama_cpp(models, space_prefix):
    kv = kv_of(models[SPM]) | {"tokenizer.ggml.add_space_prefix": space_prefix}
    ours, reference = Tokenizer.from_gguf_kv(kv), SpmReference(kv)
    texts = random_texts(1500, seed=4, specials=SPM_SPECIALS)
    for text in texts:
        assert ours.encode(text, add_special=False) == reference.encode(text), repr(text)
    tokens = kv["tokenizer.ggml.tokens"]
    ids = [i for t in texts for i in ours.encode(t, add_special=False)]
    assert any(tokens[i].startswith("<0x") for i in ids), "byte fallback never exercised"
    assert any(len(tokens[i]) > 2 for i in ids), "no merged piece used"


def test_sentencepiece_adds_its_bos_by_default_and_round_trips(models):
    kv = kv_of(models[SPM])
    assert "tokenizer.ggml.add_bos_token" not in kv and bos_token(kv) == (1, True)
    ours, detok = Tokenizer.from_gguf_kv(kv), Detokenizer.from_gguf_kv(kv)
    assert ours.encode("Beautiful is")[0] == 1 and ours.encode("Beautiful is", add_special=False)[0] != 1
    # the BOS is hidden, the space prefix shows: llama.cpp's token_to_piece, so a continuation keeps its space
    no_marker = tuple(p for p in POOL if "\u2581" not in p)  # an input U+2581 would come back as a space
    for text in random_texts(500, seed=5, pool=no_marker):
        assert detok.decode(ours.encode(text)) == (" " + text if text else ""), repr(text)  # "" has no prefix
    plain = Detokenizer.from_gguf_kv(kv | {"tokenizer.ggml.add_space_prefix": False})
    unprefixed = Tokenizer.from_gguf_kv(kv | {"tokenizer.ggml.add_space_prefix": False})
    assert plain.decode(unprefixed.encode("naïve café 🙂 日本")) == "naïve café 🙂 日本"


def test_sentencepiece_pieces():
    vocab = builtin_vocab(PRESETS["tiny"][1], SPM)
    detok = Detokenizer(vocab.tokens, vocab.token_types, hidden=(vocab.bos_id,), spm=True)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    assert detok.decode([ids["\u2581is"], ids["<0xE2>"], ids["<0x98>"], ids["<0x83>"]]) == " is☃"
    assert detok.decode([ids["<s>"], ids["</s>"], ids["<unk>"], ids["<|user|>"]]) == "</s><unk><|user|>"
    assert detok.decode_partial([ids["\u2581is"], ids["<0xE2>"], ids["<0x98>"]]) == (" is", 2)


# ---------------------------------------------------------------- BOS


BPE, SPM_KV = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": 5}, {"tokenizer.ggml.model": "llama"}


@pytest.mark.parametrize("kv, expected", [
    ({**BPE, "tokenizer.ggml.pre": "llama-bpe"}, (5, True)),  # Llama 3
    *[({**BPE, "tokenizer.ggml.pre": pre}, (5, True)) for pre in ("falcon-h1", "pixtral", "lfm2", "tekken")],
    *[({**BPE, "tokenizer.ggml.pre": pre}, (5, False)) for pre in ("qwen2", "smollm", "gpt-2", "deepseek-v3")],
    ({**BPE, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False}, (5, False)),  # flag wins
    ({**BPE, "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.add_bos_token": True}, (5, True)),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}, (None, False)),  # no id, no BOS
    ({**SPM_KV, "tokenizer.ggml.bos_token_id": 7}, (7, True)),  # SentencePiece: yes by default
    ({**SPM_KV, "tokenizer.ggml.bos_token_id": 7, "tokenizer.ggml.add_bos_token": False}, (7, False)),
    ({**SPM_KV}, (1, True)),  # llama.cpp's default SentencePiece BOS id
])
def test_bos_rule_is_llama_cpps(kv, expected):
    assert bos_token(kv) == expected


def test_build_vocab_for_a_pre_tokenizer_is_deterministic():
    a, b = (build_vocab(builtin_text(), 50, pre="smollm") for _ in range(2))
    assert a == b and a.pre == "smollm"
