"""Section 18, links: a pipeline whose stages sit behind a link (bench/relay.py: a one-way delay and a bandwidth cap in
front of each stage, in user space), decode rates at 0, 5 and 25 ms one way, 1 and 8 streams, with and without
speculative decoding (``--draft ngram``), on a repetitive task and a free one.

    python -m bench.links                  # the embedded model, 2 stages; a table on stdout
    python -m bench.run --sections links   # the same rows in make bench's table

Every delay gets one pipeline; its runs (task x streams, plain and ngram in turn, 3 rounds: the median counts) go
on it. A rate is the decoded tokens of a run (each generation's tokens after its first) over the time from its first
generation's first token to its last generation's last token. The repetitive task asks for a text the prompt
holds (the embedded model recites the Zen of Python, so its prompt is the Zen and the start of it again); the free
one gives a few words.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.rows import Row, render
from pp_worker.driver.draft import Draft
from pp_worker.driver.generation import Generation, Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch

RELAY = Path(__file__).resolve().parent / "relay.py"
ZEN = """The Zen of Python, by Tim Peters

Beautiful is better than ugly.
Explicit is better than implicit.
Simple is better than complex.
Complex is better than complicated.
Flat is better than nested.
Sparse is better than dense.
Readability counts.
Special cases aren't special enough to break the rules.
Although practicality beats purity.
Errors should never pass silently.
Unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess.
There should be one-- and preferably only one --obvious way to do it.
Although that way may not be obvious at first unless you're Dutch.
Now is better than never.
Although never is often better than *right* now.
If the implementation is hard to explain, it's a bad idea.
If the implementation is easy to explain, it may be a good idea.
Namespaces are one honking great idea -- let's do more of those!
"""
TASKS = {"repetitive": f"{ZEN}\nThe Zen of Python, by Tim Peters\n\nBeautiful is", "free": "Errors should never"}
SECTION = "18 decode through a delayed link (bench/relay.py, --draft ngram)"


@dataclass(frozen=True)
class LinksPlan:
    delays_ms: tuple[float, ...] = (0.0, 5.0, 25.0)
    streams: tuple[int, ...] = (1, 8)
    tokens: int = 48  # per generation
    rounds: int = 3  # plain and ngram in turn, this many times each: the median counts
    stages: int = 2
    rate_mbit: float = 0.0  # the links' bandwidth cap (0: none)
    draft_max: int = 4
    model: str | None = None  # None: the embedded model


QUICK = LinksPlan(delays_ms=(0.0, 5.0), streams=(1, 2), tokens=12, rounds=1)


def launcher(delay_ms: float, rate_mbit: float) -> str:
    return f"{{python}} {RELAY} --delay-ms {delay_ms:g} --rate-mbit {rate_mbit:g} -- {{python}} -m pp_worker"


def rate(gens: list[Generation]) -> float:
    decoded = sum(max(0, len(g.tokens) - 1) for g in gens)
    span = max(g.t_end for g in gens) - min(g.t_first for g in gens)
    return decoded / span if span > 0 else 0.0


def one_delay(plan: LinksPlan, delay_ms: float) -> dict[str, Any]:
    """Every run at one delay, on one pipeline: {task: {streams: {"plain"|"ngram": {tok_s, kept, drafted}}}}."""
    launch = Launch(plan.stages, model=plan.model, launcher=launcher(delay_ms, plan.rate_mbit),
                    env={"PP_WARMUP": "1", "PP_HEARTBEAT_S": "3600"})
    out: dict[str, Any] = {}
    with Pipeline(launch, log=None) as p:
        p.run(make_generations(p, ["Beautiful is"], 4, Sampling()))  # first requests: nothing timed
        for task, prompt in TASKS.items():
            for n in plan.streams:
                runs: dict[str, list[list[Generation]]] = {"plain": [], "ngram": []}
                for _ in range(plan.rounds):  # in turn, so that a busy moment of the machine hits both alike
                    for name, draft in (("plain", None), ("ngram", Draft("ngram", plan.draft_max))):
                        p.draft = draft
                        runs[name].append(p.run(make_generations(p, [prompt] * n, plan.tokens, Sampling()),
                                                n).generations)
                out.setdefault(task, {})[str(n)] = {name: _summary(r) for name, r in runs.items()}
                say(f"links: {delay_ms:g} ms, {task}, {n} stream(s): {out[task][str(n)]}")
    return out


def _summary(rounds: list[list[Generation]]) -> dict[str, Any]:
    """The median round's rate, each round's, and the guesses of the last round (the same every round: greedy)."""
    gens = rounds[-1]
    return {"tok_s": round(statistics.median(rate(r) for r in rounds), 1),
            "rounds_tok_s": [round(rate(r), 1) for r in rounds],
            "drafted": sum(g.draft.proposed for g in gens if g.draft), "kept": sum(g.draft.accepted for g in gens if
                                                                                 g.draft)}


def measure(plan: LinksPlan) -> dict[str, Any]:
    return {"plan": {"stages": plan.stages, "tokens": plan.tokens, "rate_mbit": plan.rate_mbit,
                     "draft_max": plan.draft_max, "model": plan.model or "embedded"},
            "delays": {f"{d:g}": one_delay(plan, d) for d in plan.delays_ms}}


def rows(raw: dict[str, Any] | None) -> list[Row]:
    """Per delay, task and streams: plain and ngram tok/s, and ngram against plain (the issue's targets: >= 1.5x on
    the repetitive task without delay, >= 0.95x on the free one, >= 2x for one stream at 5 ms) and, for 8 streams
    at the longest delay, their rate against their rate without delay (>= 0.8x)."""
    delays = (raw or {}).get("delays") or {}
    if not delays:
        return [Row(SECTION, "links", None, "tok/s", note="not measured (section links not run, or it failed)")]
    out = []
    for delay, tasks in delays.items():
        for task, by_streams in tasks.items():
            for n, runs in by_streams.items():
                plain, ngram = runs["plain"]["tok_s"], runs["ngram"]["tok_s"]
                name = f"{delay} ms, {task}, {n} stream(s)"
                out.append(Row(SECTION, f"{name}: plain", plain, "tok/s"))
                note = f"kept {runs['ngram']['kept']} of {runs['ngram']['drafted']} guessed tokens"
                out.append(Row(SECTION, f"{name}: --draft ngram", ngram, "tok/s", note=note))
                out.append(Row(SECTION, f"{name}: ngram / plain", plain and ngram / plain, "x",
                               target=_target(float(delay), task, int(n))))
    out += _far_rows(delays)
    return out


def _target(delay: float, task: str, n: int) -> float | None:
    if task == "free":
        return 0.95
    if delay == 0:
        return 1.5
    return 2.0 if delay == 5 and n == 1 else None


def _far_rows(delays: dict[str, Any]) -> list[Row]:
    """8 streams at the longest delay against the same without delay: requests in flight overlap the delay."""
    if "0" not in delays or len(delays) < 2:
        return []
    far = max(delays, key=float)
    out = []
    for n in delays[far].get("free", {}):
        if int(n) > 1:
            local, there = delays["0"]["free"][n]["plain"]["tok_s"], delays[far]["free"][n]["plain"]["tok_s"]
            out.append(Row(SECTION, f"{far} ms, free, {n} streams, plain: against 0 ms", local and there / local, "x",
                           target=0.8))
    return out


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.links", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0 and 5 ms, 1 and 2 streams, 12 tokens, one round")
    ap.add_argument("--model", help="GGUF path (default: the embedded model)")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="bandwidth cap of each link (default: none)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else LinksPlan()
    plan = LinksPlan(**{**plan.__dict__, "model": args.model, "rate_mbit": args.rate_mbit})
    print(render(rows(measure(plan))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
