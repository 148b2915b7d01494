"""Gemma 3 against llama.cpp on the same generated files (needs ``make peers``):

- the tokenizer: pp_worker's ids equal llama.cpp's (BOS added, special tokens parsed) on chat-formatted text;
- the formulas: llama.cpp's logits at every position of a 40-token prompt (longer than the sliding window) against
  the float64 reference (`npref.Gemma3Ref`): the largest difference, and whether every argmax agrees;
- the engine: 2 stages' greedy tokens against llama.cpp's greedy tokens from the same prompt.

    .venv/bin/python -m bench.gemma3_peer [--dtypes F32 Q8_0 Q4_K]

Also run by ``make bench``'s section 14 (``moe``), whose table gives a row per file; alone, one line of JSON per
file on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench import peer

N_GREEDY = 8
DTYPES = ["F32", "Q8_0", "Q4_K"]
TEXTS = ["<start_of_turn>user\nBeautiful is better than ugly.<end_of_turn>\n<start_of_turn>model\n",
         "Flat is better than nested. Grüße ☃"]
PEER_SIDE = """
import json, sys
from llama_cpp import Llama
ask = json.load(sys.stdin)
llm = Llama(model_path=ask["model"], n_ctx=128, logits_all=True, verbose=False, n_threads=1, n_batch=128, seed=0)
tokens = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in ask["texts"]]
llm.reset()
llm.eval(ask["prompt"])
logits = [list(map(float, row)) for row in llm.scores[:len(ask["prompt"])]]
greedy = []
for t in llm.generate(ask["prompt"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
    greedy.append(int(t))
    if len(greedy) == ask["n"]:
        break
json.dump({"tokens": tokens, "logits": logits, "greedy": greedy}, sys.stdout)
"""


def check(path: Path, prompt: list[int]) -> dict[str, object]:
    from pp_worker.testing.chain import Chain
    from pp_worker.testing.npref import Gemma3Ref
    from pp_worker.worker.gguf.header import read_header
    from pp_worker.worker.text.tokenizer import Tokenizer

    ask = {"model": str(path), "texts": TEXTS, "prompt": prompt, "n": N_GREEDY}
    done = subprocess.run([str(peer.PEERS_PYTHON), "-c", PEER_SIDE], input=json.dumps(ask), capture_output=True,
                          text=True, check=True)
    theirs = json.loads(done.stdout)
    tok = Tokenizer.from_gguf_kv(read_header(path).kv)
    ref = Gemma3Ref.from_gguf(path).logits(prompt)
    logits = np.asarray(theirs["logits"])
    tokens, _ = Chain(path, 2, 64).generate(0, prompt, N_GREEDY)
    return {"file": path.name,
            "tokenizer_equal": all(tok.encode(t) == ids for t, ids in zip(TEXTS, theirs["tokens"], strict=True)),
            "max_abs_logit_diff_vs_float64": round(float(np.abs(logits - ref).max()), 5),
            "argmax_equal": bool((logits.argmax(-1) == ref.argmax(-1)).all()),
            "greedy_equal": tokens == theirs["greedy"], "pp_worker": tokens, "llama.cpp": theirs["greedy"]}


def checks(dtypes: list[str]) -> list[dict[str, object]]:
    """`check` of a generated gemma3 file of each of ``dtypes`` (needs ``make peers``)."""
    from pp_worker.testing import gemma3gen

    prompt = [int(t) for t in np.random.default_rng(0).integers(5, 500, 40)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            preset = "gemma3-kq" if dtype.startswith(("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")) else "gemma3"
            path = gemma3gen.generate(Path(tmp) / f"{preset}-{dtype}.gguf", preset, seed=0, dtype=dtype)
            out.append(check(path, prompt))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gemma3_peer", description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=DTYPES)
    args = ap.parse_args(argv)
    if not peer.available():
        print("llama.cpp not built: run make peers", file=sys.stderr)
        return 1
    for result in checks(args.dtypes):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
