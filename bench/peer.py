"""llama.cpp on the same GGUF file, the program people would run instead: a warm one-process peer for decode
measured in turn with the pipelines'.

The child runs in a venv of ``make peers`` (llama-cpp-python built from source), which holds no pp_worker: this file
is run there as a script and imports nothing of the project. Two builds may sit side by side (`BUILDS`):
``.venv-peers`` for AVX2, and ``.venv-peers-avx512`` (AVX-512 with those of VBMI, VNNI, BF16 the CPU that built it
has) where the CPU has AVX-512;
`default_build` picks the best one the CPU runs, and every row names the build it used.
Its protocol is `bench.solo`'s ``--serve``:
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
BUILDS = {"avx2": REPO / ".venv-peers", "avx512": REPO / ".venv-peers-avx512"}  # as the Makefile's peers target
PEERS_PYTHON = BUILDS["avx2"] / "bin" / "python"  # the AVX2 build: make peers always builds it
AVX512_FLAGS = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")  # ggml's GGML_AVX512
# the extensions the Makefile turns on where the CPU has them: a build needs the flags of those it was built with
EXTENSIONS = {"GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16",
              "GGML_AVX_VNNI": "avx_vnni"}
WARMUP = [[1, 2, 3, 4, 5, 6, 7, 8]]


def python(build: str) -> Path:
    return BUILDS[build] / "bin" / "python"


def extensions(build: str = "avx512") -> list[str]:
    """The CPU flags of the extensions ``build`` was made with (its ``.cmake-args``, written by ``make peers``)."""
    try:
        args = (BUILDS[build] / ".cmake-args").read_text().split()
    except OSError:
        return []
    return [flag for option, flag in EXTENSIONS.items() if f"-D{option}=ON" in args]


def build_name(build: str) -> str:
    """``AVX2``, or ``AVX-512`` with the extensions it was built with: ``AVX-512 (VBMI, VNNI)``."""
    if build == "avx2":
        return "AVX2"
    more = [f.removeprefix("avx512").removeprefix("_").upper().replace("_", "-") for f in extensions(build)]
    return "AVX-512" + (f" ({', '.join(more)})" if more else "")


def cpu_has_avx512(cpuinfo: str | None = None) -> bool:
    """Whether this CPU runs the AVX-512 build (every instruction set it is built with, in /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in (*AVX512_FLAGS, *extensions()))


def available(build: str | None = None) -> bool:
    """``build`` is built (None: any build this CPU runs)."""
    return default_build() is not None if build is None else built(build)


def default_build() -> str | None:
    """The fastest build there is that this CPU runs: AVX-512 where it can, else AVX2; None: no build."""
    if cpu_has_avx512() and built("avx512"):
        return "avx512"
    return "avx2" if built("avx2") else None


def built(build: str) -> bool:
    """Whether ``make peers`` finished ``build`` (its stamp: a venv still being built has a python, no llama_cpp)."""
    return (BUILDS[build] / ".installed-stamp").exists()


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


def command(model: Path, threads: int, max_context: int, build: str | None = None) -> list[str]:
    """The child's command line (for `bench.solo.Solo`), in ``build``'s venv (None: `default_build`)."""
    build = build or default_build() or "avx2"
    return [str(python(build)), str(Path(__file__).resolve()), str(model), "--threads", str(threads),
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
