"""Section "threads": one stage's decode call on 1 thread against every core (PP_THREADS), timed inside the stage.

The model is the DRAM-bound one (TinyLlama-1.1B's shape), as its F16 file (2.2 GB) and as llama.cpp's Q4_K_M of it
(`memwall.ensure_file`, the file people download): a stage's share streams from memory at every token, so this
measures what more threads buy where bandwidth, not L3, feeds the kernels. One thread already streams F16 near what
two can (its products do little per byte), so the F16 file shows the memory's limit and Q4_K_M what threads buy; the
other packed types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q3_K_M, Q2_K) how near F16's bytes/s each comes.
Each file and thread count runs in a process of its own (tinygrad's CPU_COUNT is process-wide and shapes the
compiled kernels), all loaded side by side; the rounds go through all of them, so all see the same load, and each
round's ratios are taken within the round: a count's against the first count, a file's bytes/s against the first
file's (``vs_first``: F16's is the memory's rate, so this says where each type's time goes). A bare read of memory
by each count (`bare_read`) runs in the same rounds: a stage that streams its weights gains no more from threads.

    python -m bench.threads          # the section alone
    python -m bench.threads --counts 1,2,4,8,16 --rounds 5 --calls 8   # a many-core machine's table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import memwall
from bench.bare_read import BareRead
from bench.quant import say


@dataclass(frozen=True)
class ThreadsPlan:
    preset: str = "tinyllama"
    # each file a row (memwall.ensure_file: llama.cpp's quantizer), F16 first: every packed type's bytes/s against
    # F16's (the memory's rate) in the same rounds (issue 51)
    dtypes: tuple[str, ...] = ("F16", "Q8_0", "Q4_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K_M",
                               "Q2_K")
    counts: tuple[int, ...] = (1, 2)  # PP_THREADS; 2 is every core of this machine
    rounds: int = 7
    calls: int = 12  # decode calls timed per round and thread count
    stage: tuple[int, int] = (1, 2)  # the last of 2 stages: half the blocks, the output norm and the head


def child(model: str, stage: int, num_stages: int, threads: int) -> None:
    """The last stage's engine on ``threads`` threads; each stdin line "n" times n decode calls (one session,
    positions from 0) and answers the calls' seconds as a JSON list."""
    import numpy as np

    from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

    engine = TinygradEngine(model, stage, num_stages, max_context=256, max_sessions=1, threads=threads)
    assert engine.shard.is_last, "the section times the last stage's decode call (forward_logits)"
    engine.warmup(full=False)
    hidden = np.random.default_rng(0).standard_normal(engine.info.hidden_dim).astype(np.float16).tobytes()
    about = engine.describe()
    print(json.dumps({"ready": about["threads"], "weight_bytes": about["weight_bytes"]}), flush=True)
    for line in sys.stdin:
        times = []
        for pos in range(int(line)):
            t0 = time.perf_counter()
            engine.forward_logits(7, hidden, pos, 1)
            times.append(time.perf_counter() - t0)
        engine.release(7)
        print(json.dumps(times), flush=True)


def measure(plan: ThreadsPlan) -> dict[str, Any]:
    """Every file's stage on every count at once, each in a process of its own, and a bare read of memory by each
    count (`bare_read`: the most a stage streaming its weights can gain from more threads here), all timed in the same
    rounds, so the files' rates compare (this VM's memory changes speed between phases)."""
    bare = BareRead()
    models = {dtype: memwall.ensure_file(plan.preset, dtype)[0] for dtype in plan.dtypes}
    say(f"threads: {', '.join(m.name for m in models.values())}, stage {plan.stage[0]} of {plan.stage[1]}, "
        f"PP_THREADS {plan.counts}")
    procs = {(d, n): subprocess.Popen([sys.executable, "-m", "bench.threads", "--child", str(m), *map(str, plan.stage),
                                       str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "PP_CACHE": "0"})
             for d, m in models.items() for n in plan.counts}
    try:
        lines = {key: json.loads(p.stdout.readline()) for key, p in procs.items()}  # type: ignore[union-attr]
        medians: dict[tuple[str, int], list[float]] = {key: [] for key in procs}
        reads: dict[int, list[float]] = {n: [] for n in plan.counts}
        for _ in range(plan.rounds):
            for key, p in procs.items():
                p.stdin.write(f"{plan.calls}\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
                medians[key].append(statistics.median(json.loads(p.stdout.readline())))  # type: ignore[union-attr]
            for n in plan.counts:
                reads[n].append(statistics.median(bare.gb_per_s(n) for _ in range(3)))
    finally:
        for p in procs.values():
            p.kill()
    files = {d: summary(plan, m, {n: lines[d, n] for n in plan.counts}, {n: medians[d, n] for n in plan.counts},
                        reads) for d, m in models.items()}
    first = plan.dtypes[0]
    for d in plan.dtypes[1:]:  # each file's bytes/s over the first's (F16: the memory's rate), round by round
        files[d]["vs_first"] = {str(n): round(statistics.median(
            (files[d]["weight_bytes"] / a) / (files[first]["weight_bytes"] / b)
            for a, b in zip(medians[d, n], medians[first, n], strict=True)), 3) for n in plan.counts}
    return {"threads": files}


def summary(plan: ThreadsPlan, model: Path, lines: dict[int, dict[str, Any]], medians: dict[int, list[float]],
            reads: dict[int, list[float]]) -> dict[str, Any]:
    """One file's row: its calls' medians per count and round, and the bare reads of the same rounds."""
    one, most = plan.counts[0], plan.counts[-1]
    # each count against the first, within each round; the last count's are the section's ratio
    ratios = {n: [a / b for a, b in zip(medians[one], v, strict=True)] for n, v in medians.items()}
    held = lines[one]["weight_bytes"]  # the stage's weights, every one of which a decode call reads
    return {"model": model.name, "file_bytes": model.stat().st_size, "weight_bytes": held,
            "ready_threads": {n: line["ready"] for n, line in lines.items()},
            "call_ms": {str(n): [round(x * 1000, 3) for x in v] for n, v in medians.items()},
            "gb_per_s": {str(n): round(held / statistics.median(v) / 1e9, 2) for n, v in medians.items()},
            "ratio": statistics.median(ratios[most]), "ratios": [round(r, 3) for r in ratios[most]],
            "gains": {str(n): round(statistics.median(r), 3) for n, r in ratios.items()},
            "read_gb_per_s": {str(n): round(statistics.median(v), 2) for n, v in reads.items()},
            "read_ratio": round(statistics.median(b / a for a, b in zip(reads[one], reads[most], strict=True)), 3),
            "cpus": len(os.sched_getaffinity(0))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,2", help="PP_THREADS values, the first the baseline (default 1,2)")
    ap.add_argument("--dtypes", default=",".join(ThreadsPlan.dtypes), help="the files, as memwall names them")
    ap.add_argument("--rounds", type=int, default=ThreadsPlan.rounds)
    ap.add_argument("--calls", type=int, default=ThreadsPlan.calls)
    args = ap.parse_args(argv)
    plan = ThreadsPlan(dtypes=tuple(args.dtypes.split(",")), counts=tuple(int(c) for c in args.counts.split(",")),
                       rounds=args.rounds, calls=args.calls)
    print(json.dumps(measure(plan), indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
