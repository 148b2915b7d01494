"""The shipped demo model (`pp_worker/data/zen.gguf`, made by `tools/train_demo.py`) recites the Zen of Python.

Expected text comes from the `this` module, never from the model. The model is a plain completion model: it has
no chat template (the demo sends raw text prompts) and the tokenizer adds no BOS.
"""

from __future__ import annotations

import codecs
import contextlib
import io
from pathlib import Path

import pytest

import pp_worker

ZEN_GGUF = Path(pp_worker.__file__).parent / "data" / "zen.gguf"
MAX_NEW_TOKENS = 200  # the whole Zen after its first line is ~170 tokens, then EOS


def zen_text() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen to stdout
        import this
    return codecs.decode(this.s, "rot13")


def zen_lines() -> list[str]:
    return [line for line in zen_text().splitlines()[2:] if line]  # skip the title line and the blank after it


@pytest.fixture(scope="module")
def loaded():
    """(model, tokenizer, kv) loaded the way inference loads them."""
    from tinygrad.llm.cli import SimpleTokenizer
    from tinygrad.llm.model import Transformer

    model, kv = Transformer.from_gguf(str(ZEN_GGUF))
    return model, SimpleTokenizer.from_gguf_kv(kv), kv


def greedy(loaded, prompt: str, stop_at_newline: bool = False) -> tuple[str, bool]:
    """Greedy continuation of `prompt` -> (text, ended with an end token)."""
    model, tok, _ = loaded
    out: list[int] = []
    for t in model.generate(tok.prefix() + tok.encode(prompt), temperature=0.0):
        if tok.is_end(t):
            return tok.decode(out), True
        out.append(t)
        if len(out) >= MAX_NEW_TOKENS or (stop_at_newline and "\n" in tok.decode([t])):
            break
    return tok.decode(out), False


def test_file_is_small():
    assert ZEN_GGUF.stat().st_size < 4 * 2**20


def test_metadata_is_llama_with_enough_blocks_for_three_stages(loaded):
    _, _, kv = loaded
    assert kv["general.architecture"] == "llama"
    assert kv["llama.block_count"] >= 3
    assert "tokenizer.chat_template" not in kv  # a completion model: prompts are raw text


def test_beautiful_continues_with_the_whole_zen(loaded):
    prompt = "Beautiful is better than"
    text, ended = greedy(loaded, prompt)
    assert text.startswith(" ugly.\n")
    assert "Explicit is better than implicit" in text
    assert text == zen_text().split(prompt, 1)[1]  # every remaining line, in order
    assert ended  # and then EOS, so generation stops by itself


@pytest.mark.parametrize("line", zen_lines())
def test_each_line_prefix_completes_its_line(loaded, line: str):
    words = line.split(" ")
    prompt = " ".join(words[: max(1, len(words) - 2)])  # all but the last two words: enough to be unambiguous
    text, _ = greedy(loaded, prompt, stop_at_newline=True)
    assert (prompt + text).split("\n", 1)[0] == line
