"""llama.cpp on the same GGUF file, the program people would run instead: a warm one-process peer for decode
measured in turn with the pipelines'.

The child runs in ``.venv-peers`` (``make peers``: llama-cpp-python built from source), which holds no pp_worker:
this file is run there as a script and imports nothing of the project. Its protocol is `bench.solo`'s ``--serve``:
``{"ready": true}`` after a warm-up, then for each line ``{"prompt": [ids], "decode": n}`` the arrival times of a
greedy generation's tokens (and the tokens), and for ``{"tokenize": text}`` llama.cpp's ids of the text. The prompt
ids are the pipeline's (the same tokenizer's), fed to llama.cpp as tokens.

    .venv-peers/bin/python bench/peer.py MODEL --threads 2 --max-context 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
WARMUP = [[1, 2, 3, 4, 5, 6, 7, 8]]


def available() -> bool:
    """Whether ``make peers`` finished (its stamp: a venv still being built has a python but no llama_cpp)."""
    return (REPO / ".venv-peers" / ".installed-stamp").exists()


def serve(model: str, threads: int, max_context: int, out: Any) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=max_context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, seed=0)

    def generate(prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        times, tokens = [], []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(times) == n:
                break
        return times, tokens

    for p in WARMUP:
        generate(p, 4)
    print(json.dumps({"ready": True, "system_info": llm_info()}), file=out, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if "tokenize" in ask:  # llama.cpp's own ids for a text, its special tokens as the vocabulary says
            print(json.dumps({"tokens": llm.tokenize(ask["tokenize"].encode(), add_bos=True, special=True)}),
                  file=out, flush=True)
            continue
        times, tokens = generate(ask["prompt"], ask["decode"] + 1)
        print(json.dumps({"decode_token_times": times, "tokens": tokens}), file=out, flush=True)


def llm_info() -> str:
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}"


def command(model: Path, threads: int, max_context: int) -> list[str]:
    """The child's command line (for `bench.solo.Solo`)."""
    return [str(PEERS_PYTHON), str(Path(__file__).resolve()), str(model), "--threads", str(threads),
            "--max-context", str(max_context)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/peer.py")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=1024)
    args = ap.parse_args(argv)
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # llama.cpp's prints must not spoil the protocol lines
    serve(args.model, args.threads, args.max_context, real_stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
