"""What a guessed token costs the Zen draft model (``--draft-model``) in the driver's process and as two local worker
processes (``--draft-processes``), measured in the same run; then what each gives on the embedded model, 0 ms,
against plain decoding, with ``--draft-max`` 3 and 7.

    python -m bench.draft_cost                # both parts, a few minutes on 2 cores
    python -m bench.draft_cost --no-pipeline  # the per-token costs only

The per-token part times the draft model's own calls on its thread (``DraftWorker.next_tokens``): one session guessing
one token (a one-token forward on each of its two stages), 8 sessions one token each (one batched forward a stage), a
32-token feed (a prompt's window) and 8 new sessions' first feeds of 32 tokens, the two modes in turn so that a busy
moment of the machine hits both alike. The pipeline part runs bench.links's tasks with each arm in turn, several rounds:
the median counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

from bench.links import TASKS, ZEN_DRAFT, rate, say
from pp_worker.driver.draft import Draft
from pp_worker.driver.draft_model import DraftWorker
from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch

MODES = {"in-process": False, "processes": True}


def on_thread(worker: DraftWorker, work: Any) -> Any:
    """``work()`` run on the draft model's thread (where its stages may be called), its result."""
    done, out = threading.Event(), []

    def job() -> None:
        try:
            out.append(work())
        finally:
            done.set()
    worker.submit(job)
    assert done.wait(600)
    return out[0]


def per_token(worker: DraftWorker, calls: int) -> dict[str, float]:
    """ms per call: one session's one-token guess, 8 sessions' (one batch), a 32-token feed (again, at position 0),
    8 new sessions' first 32-token feeds (8 generations starting: each evicts a session held before)."""
    def timed(asks_at: Any) -> float:
        t0 = time.perf_counter()
        for i in range(calls):
            worker.next_tokens(asks_at(i))
        return (time.perf_counter() - t0) / calls * 1000

    def run() -> dict[str, float]:
        sessions = range(1, 9)
        worker.next_tokens([(s, (list(range(5, 37)), 0)) for s in sessions])  # every session holds 32 tokens
        return {"one": timed(lambda i: [(1, ([9], 32 + i % 64))]),
                "eight": timed(lambda i: [(s, ([9], 32 + i % 64)) for s in sessions]),
                "feed32": timed(lambda i: [(1, (list(range(5, 37)), 0))]),
                "open8x32": timed(lambda i: [(100 + 8 * i + s, (list(range(5, 37)), 0)) for s in sessions])}
    return on_thread(worker, run)


def draft_workers(env: dict[str, str]) -> dict[str, DraftWorker]:
    """The Zen draft in each mode, holding 8 sessions (``env``: more settings for its stages, e.g. PP_THREADS)."""
    return {name: DraftWorker(ZEN_DRAFT, env={"PP_MAX_SESSIONS": "8", **env}, processes=p)
            for name, p in MODES.items()}


def costs(rounds: int, calls: int, env: dict[str, str]) -> dict[str, dict[str, float]]:
    workers = draft_workers(env)
    try:
        for worker in workers.values():
            per_token(worker, 20)  # warm: each batch size compiled
        got: dict[str, list[dict[str, float]]] = {name: [] for name in workers}
        for _ in range(rounds):
            for name, worker in workers.items():
                got[name].append(per_token(worker, calls))
    finally:
        for worker in workers.values():
            worker.close()
    return {name: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]} for name, runs in got.items()}


def pipeline_rates(rounds: int, tokens: int, streams: tuple[int, ...], env: dict[str, str]) -> dict[str, Any]:
    """tok/s of each arm (plain; the draft in-process at k 3 and 7; as processes at k 3), per task and streams."""
    workers = draft_workers(env)
    arms = {"plain": None, "in-process k3": Draft("model", 3, workers["in-process"]),
            "in-process k7": Draft("model", 7, workers["in-process"]),
            "processes k3": Draft("model", 3, workers["processes"])}
    out: dict[str, Any] = {}
    try:
        with Pipeline(Launch(2, env={"PP_WARMUP": "1", "PP_HEARTBEAT_S": "3600"}), log=None) as p:
            p.run(make_generations(p, ["Beautiful is"], 4, Sampling()))  # first requests: nothing timed
            for task in TASKS:
                for n in streams:
                    got: dict[str, list[float]] = {name: [] for name in arms}
                    kept: dict[str, str] = {}
                    for _ in range(rounds):
                        for name, draft in arms.items():
                            p.draft = draft
                            gens = p.run(make_generations(p, [TASKS[task]] * n, tokens, Sampling()), n).generations
                            got[name].append(rate(gens))
                            if draft is not None:
                                kept[name] = _kept(gens)
                    plain = statistics.median(got["plain"])
                    out[f"{task} x{n}"] = {name: {"tok_s": round(statistics.median(r), 1),
                                                   "vs_plain": round(statistics.median(r) / plain, 2),
                                                   "rounds": [round(x, 1) for x in r], "kept": kept.get(name, "")}
                                           for name, r in got.items()}
                    say(f"draft_cost: {task}, {n} stream(s): {out[f'{task} x{n}']}")
    finally:
        for worker in workers.values():
            worker.close()
    return out


def _kept(gens: list[Any]) -> str:
    return f"{sum(g.draft.accepted for g in gens)} of {sum(g.draft.proposed for g in gens)} kept"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.draft_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200, help="calls per per-token timing")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per generation in the pipeline part")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--draft-threads", type=int, help="PP_THREADS of the draft's stages (default: every CPU)")
    ap.add_argument("--no-pipeline", action="store_true")
    args = ap.parse_args(argv)
    env = {"PP_THREADS": str(args.draft_threads)} if args.draft_threads else {}
    print("ms per call (median of rounds):", costs(args.rounds, args.calls, env))
    if not args.no_pipeline:
        for row, arms in pipeline_rates(args.rounds, args.tokens, tuple(int(n) for n in args.streams.split(",")),
                                        env).items():
            print(f"{row}: " + "; ".join(f"{arm} {r['tok_s']} tok/s {r['vs_plain']}x {r['kept']}".strip()
                                          for arm, r in arms.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
