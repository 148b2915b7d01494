"""A many-core host as a user runs it: a pipeline of worker processes against llama.cpp's ``llama-bench``.

`bench.memwall` compares against llama-cpp-python from ``make peers``; a borrowed machine (the device tool's, with
no network) has neither that venv nor the time to build it, but builds ``llama-bench`` from the same llama.cpp tree
in ~90 s. Each file is a row: a 2-stage pipeline of local worker processes, each stage on every CPU (PP_THREADS'
default), and ``llama-bench`` (token generation after an empty prompt, ``-t`` threads), in rounds taken in turn;
a round's ratio is taken within it, and the row's is the median. ``llama-bench`` starts afresh every round (the file
stays in the page cache): its own warm-up run precedes what it reports.

    python -m bench.manycore --llama-bench /path/to/llama-bench --threads 16 --dtypes Q4_K_M,F16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench import memwall, models, pipe
from bench.quant import say
from pp_worker.driver.pipeline import Pipeline


def llama_bench_tps(binary: Path, model: Path, threads: int, decode: int) -> float:
    """One ``llama-bench`` run: its mean tokens/s over one generation of ``decode`` tokens."""
    cmd = [str(binary), "-m", str(model), "-p", "0", "-n", str(decode), "-t", str(threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def measure_row(p: Pipeline, path: Path, binary: Path, threads: int, rounds: int, decode: int,
                prompt: str) -> dict[str, Any]:
    """The warm pipeline ``p`` (on ``path``) and ``llama-bench`` on ``path``, decoding in rounds taken in turn."""
    out: dict[str, Any] = {"model": path.name, "pp2_tps": [], "peer_tps": [], "ratios": [],
                           "ready_threads": [(st.ready or {}).get("threads") for st in p.stages]}
    pipe.run_traced(p, [prompt], 4)
    for r in range(rounds):
        say(f"manycore {path.name}: round {r + 1} of {rounds}, 2 stages then llama-bench -t {threads}")
        ours = pipe.decode_rate(p, prompt, decode).tps
        theirs = llama_bench_tps(binary, path, threads, decode)
        out["pp2_tps"].append(round(ours, 2))
        out["peer_tps"].append(round(theirs, 2))
        out["ratios"].append(round(ours / theirs, 4))
    out["ratio"] = statistics.median(out["ratios"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.manycore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", required=True, type=Path, help="llama.cpp's llama-bench, built for this CPU")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-bench's -t")
    ap.add_argument("--dtypes", default="Q4_K_M,F16", help="the files, as memwall names them")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args(argv)
    if not os.access(args.llama_bench, os.X_OK):  # before any file is made or pipeline started
        ap.error(f"no llama-bench to run at {args.llama_bench} (bench/NOTES.md: how to build it)")
    plan = memwall.MemwallPlan()  # memwall's model and prompt length: its rows and these compare
    f16 = models.ensure_model(plan.preset, dtype="F16", isolated=True)
    prompt = models.fixed_length_prompts(f16, plan.prompt_tokens, 1)[0]
    rows = {}
    for dtype in args.dtypes.split(","):
        path, maker = memwall.ensure_file(plan.preset, dtype)
        with pipe.start(path, 2) as p:
            row = measure_row(p, path, args.llama_bench, args.threads, args.rounds, args.decode, prompt)
        rows[dtype] = row | {"quantizer": maker}
    print(json.dumps({"cpus": len(os.sched_getaffinity(0)), "llama_bench_threads": args.threads, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
