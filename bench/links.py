"""Section 18, links: a pipeline whose stages sit behind a link (bench/relay.py: a one-way delay and a bandwidth cap in
front of each stage, in user space), decode rates at 0, 5 and 25 ms one way, 1 and 8 streams, with and without
speculative decoding (``--draft ngram``, ``--draft-model`` with the embedded model's Zen draft), on a repetitive task
and a free one; then the small real-shaped model (``smol``, SmolLM2-135M's shape) at 0 and 25 ms, 8 streams, plain
and ngram on the repetitive task.

    python -m bench.links                  # the embedded model, 2 stages, then smol; a table on stdout
    python -m bench.links --model smol --delays 0,25 --streams 8 --tasks repetitive --no-draft-model
    python -m bench.run --sections links   # the same rows in make bench's table

At 0 ms (without --rate-mbit) the stages run with no relay at all: local processes, as a user runs them on one machine,
with the schedule they get there (``--schedule auto``: lock-step on the CPU; behind the relay, a launcher, auto picks
``groups``). So "against plain at 0 ms" compares a delayed rate with the local one a user has. Every delay gets one
pipeline; its runs (task x streams, plain and each draft in turn, 3 rounds, 15 without delay: each arm's median rate,
and the median of the rounds' ratios against plain) go on it. A rate is the decoded tokens of a run (each generation's
tokens after its first) over the time from its first generation's first token to its last generation's last token. The
repetitive task asks for a text the prompt holds (the embedded model recites the Zen of Python, so its prompt is the Zen
and the start of it again); the free one gives a few words. A run's streams share their prompt, as clients sending one
document at once: the first computes it and the others fork its session (the driver's prefix reuse,
docs/driver.md); no run starts with the sessions of the run before it (`Pipeline.drop_cache`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pp_worker
from bench.models import ensure_model
from bench.rows import Row, render
from pp_worker.driver.draft import Draft
from pp_worker.driver.draft_model import DraftWorker
from pp_worker.driver.flags import DRAFT_MAX
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
SECTION = "18 decode through a delayed link (bench/relay.py, --draft ngram, --draft-model)"
ZEN_DRAFT = str(Path(pp_worker.__file__).parent / "data" / "zen-draft.gguf")  # the embedded model's vocabulary only
ARMS = ("plain", "ngram", "model")  # how each run drafts: not at all, --draft ngram, --draft-model
LOCAL = "0 ms: local stages, no relay (what one machine gives: lock-step on its CPU)"


@dataclass(frozen=True)
class LinksPlan:
    delays_ms: tuple[float, ...] = (0.0, 5.0, 25.0)
    streams: tuple[int, ...] = (1, 8)
    tokens: int = 48  # per generation
    rounds: int = 3  # plain and each draft in turn, this many times each: the median counts
    # rounds without delay (local stages: a round of the embedded model's takes ~0.1 s, and with 3 the ratio of two
    # arms doing the same work moved by 0.1x from run to run); None: ``rounds``
    local_rounds: int | None = 15
    stages: int = 2
    rate_mbit: float = 0.0  # the links' bandwidth cap (0: none)
    draft_max: int | None = None  # None: each arm's default as pp-pipeline has it (flags.DRAFT_MAX)
    model: str | None = None  # None: the embedded model; else a GGUF path or a bench/models preset ("smol", F16)
    tasks: tuple[str, ...] = ("repetitive", "free")
    draft_model: str | None = ZEN_DRAFT  # the --draft-model arm's file (None: no such arm)
    then: LinksPlan | None = None  # another model's runs, measured after these (their rows are named by it)


# smol's local rounds (~2 s a pair): with 5, one tree's row moved 1.32-1.62x between two runs; with 15,
# 1.52-1.57x (bench/NOTES.md)
SMOL = LinksPlan(delays_ms=(0.0, 25.0), streams=(8,), tokens=32, rounds=2, local_rounds=15, model="smol",
                 tasks=("repetitive",), draft_model=None)
FULL = LinksPlan(then=SMOL)
QUICK = LinksPlan(delays_ms=(0.0, 5.0), streams=(1, 2), tokens=12, rounds=1, local_rounds=None)


def launcher(delay_ms: float, rate_mbit: float) -> str | None:
    """The relay in front of each stage; None for no delay and no cap: local stages, as a user runs them on one
    machine (and the schedule they get there, ``auto``'s lock-step on the CPU), which is the local rate the rows
    compare the delayed ones with."""
    if not delay_ms and not rate_mbit:
        return None
    return f"{{python}} {RELAY} --delay-ms {delay_ms:g} --rate-mbit {rate_mbit:g} -- {{python}} -m pp_worker"


Trace = list[tuple[float, int, int, str, str]]  # Pipeline.trace: (time, stage, request id, op, "send" or "reply")


def counters(trace: Trace, gens: list[Generation], delay_s: float) -> dict[str, Any]:
    """What a run did, counted on the driver (a busy machine moves rates, not these): ``trips``, a generation's
    passes through the stages after its first token (decode steps and checks), mean over the generations, and the
    tokens a trip yields; ``first_spread_s``, the span's start until the last generation's first token (the other
    prompts' prefills, which the span holds); ``busy_share``, the span's share in which some stage computed. A stage
    serves its requests in order, so one computes from its arrival (sent + the link's delay), or the end of the one
    before, to its reply less the delay."""
    t0, t1 = min(g.t_first for g in gens), max(g.t_end for g in gens)
    first = {g.session: g.t_first for g in gens}
    trips = sum(1 for t, stage, rid, op, kind in trace if stage == 0 and kind == "send" and rid in first
                and t >= first[rid] and op in ("decode_step", "embed_and_forward"))
    busy: list[tuple[float, float]] = []
    for stage in {e[1] for e in trace}:
        replies: dict[tuple[int, str], list[float]] = {}
        for t, s, rid, op, kind in trace:
            if s == stage and kind == "reply":
                replies.setdefault((rid, op), []).append(t - delay_s)
        free = 0.0
        for t, s, rid, op, kind in trace:
            if s == stage and kind == "send" and replies.get((rid, op)):
                done = replies[(rid, op)].pop(0)
                busy.append((max(t + delay_s, free, t0), min(done, t1)))
                free = max(free, done)
    covered, end = 0.0, t0
    for a, b in sorted(busy):
        covered += max(0.0, b - max(a, end))
        end = max(end, b)
    decoded = sum(max(0, len(g.tokens) - 1) for g in gens)
    return {"trips": round(trips / len(gens), 1), "tokens_per_trip": round(decoded / trips, 2) if trips else None,
            "first_spread_s": round(max(first.values()) - t0, 3),
            "busy_share": round(covered / (t1 - t0), 2) if t1 > t0 else None}


def rate(gens: list[Generation]) -> float:
    decoded = sum(max(0, len(g.tokens) - 1) for g in gens)
    span = max(g.t_end for g in gens) - min(g.t_first for g in gens)
    return decoded / span if span > 0 else 0.0


def stamped(gens: list[Generation]) -> list[Generation]:
    """``gens``, each keeping when each of its tokens came (``times``, for `steady_rate`)."""
    for g in gens:
        g.times = []  # type: ignore[attr-defined]
        g.on_token = lambda g: g.times.append(g.t_end)  # type: ignore[attr-defined]
    return gens


def steady_rate(gens: list[Generation]) -> float:
    """tok/s once every stream decodes: the tokens that came after the last stream's first token, over the time from
    it to the last token. `rate`'s span also holds the later prompts' prefills (8 streams of a long prompt: half the
    span on smol), which no draft speeds up."""
    start, end = max(g.t_first for g in gens), max(g.t_end for g in gens)
    after = sum(1 for g in gens for t in g.times if t > start)  # type: ignore[attr-defined]
    return after / (end - start) if end > start else 0.0


def model_path(model: str | None) -> str | None:
    """A GGUF path, the bench's generated file for a preset name (``smol``: F16), or None (the embedded model)."""
    return model if model is None or "/" in model or model.endswith(".gguf") else str(ensure_model(model))


def one_delay(plan: LinksPlan, delay_ms: float) -> dict[str, Any]:
    """Every run at one delay, on one pipeline: {task: {streams: {arm: {tok_s, kept, drafted}}}} for the arms of
    ARMS the plan has (the draft model's when it names one)."""
    launch = Launch(plan.stages, model=model_path(plan.model), launcher=launcher(delay_ms, plan.rate_mbit),
                    env={"PP_WARMUP": "1", "PP_HEARTBEAT_S": "3600"})
    out: dict[str, Any] = {}
    rounds = (plan.local_rounds or plan.rounds) if not delay_ms and not plan.rate_mbit else plan.rounds
    worker = DraftWorker(plan.draft_model) if plan.draft_model else None
    arms = {"plain": None, "ngram": Draft("ngram", plan.draft_max or DRAFT_MAX["ngram"])}
    if worker is not None:
        arms["model"] = Draft("model", plan.draft_max or DRAFT_MAX["model"], worker)
    try:
        with Pipeline(launch, log=None) as p:
            p.run(make_generations(p, ["Beautiful is"], 4, Sampling()))  # first requests: nothing timed
            if worker is not None:  # the draft model's forwards compiled (each batch size at its first use: ~1 s
                # each on a fresh cache, which the stages' warmup (PP_WARMUP) does for theirs), nothing timed
                p.draft = arms["model"]
                p.run(make_generations(p, [TASKS[plan.tasks[0]]] * max(plan.streams), plan.tokens, Sampling()),
                      max(plan.streams))
            for task in plan.tasks:
                for n in plan.streams:
                    runs: dict[str, list[list[Generation]]] = {name: [] for name in arms}
                    counted: dict[str, dict[str, Any]] = {}
                    for _ in range(rounds):  # in turn, so that a busy moment of the machine hits all alike
                        for name, draft in arms.items():
                            p.drop_cache()  # no run finds the last one's sessions: its first computes the prompt
                            p.draft, p.trace = draft, []
                            gens = stamped(make_generations(p, [TASKS[task]] * n, plan.tokens, Sampling()))
                            runs[name].append(p.run(gens, n).generations)
                            counted[name] = counters(p.trace, runs[name][-1], delay_ms / 1000)
                            p.trace = None
                    out.setdefault(task, {})[str(n)] = {name: _summary(r) | counted[name] for name, r in runs.items()}
                    say(f"links: {plan.model or 'embedded'}, {delay_ms:g} ms, {task}, {n} stream(s): "
                        f"{out[task][str(n)]}")
    finally:
        if worker is not None:
            worker.close()
    return out


def _summary(rounds: list[list[Generation]]) -> dict[str, Any]:
    """The median round's rate, each round's, and the guesses of the last round (the same every round: greedy; its
    ``counters`` go with them)."""
    gens = rounds[-1]
    return {"tok_s": round(statistics.median(rate(r) for r in rounds), 1),
            "rounds_tok_s": [round(rate(r), 1) for r in rounds],
            "steady_tok_s": round(statistics.median(steady_rate(r) for r in rounds), 1),
            "drafted": sum(g.draft.proposed for g in gens if g.draft), "kept": sum(g.draft.accepted for g in gens if
                                                                                 g.draft)}


def measure(plan: LinksPlan) -> dict[str, Any]:
    out = {"plan": {"stages": plan.stages, "tokens": plan.tokens, "rate_mbit": plan.rate_mbit,
                    "draft_max": plan.draft_max, "model": plan.model or "embedded", "draft_model": plan.draft_model},
           "delays": {f"{d:g}": one_delay(plan, d) for d in plan.delays_ms}}
    if plan.then is not None:
        out["then"] = measure(plan.then)
    return out


def rows(raw: dict[str, Any] | None) -> list[Row]:
    """Per delay, task and streams: plain tok/s, each draft's, and each draft against plain (the issue's targets:
    ngram >= 1.5x on the repetitive task without delay, the Zen draft model >= 1.3x there, either >= 0.95x on the
    free task, ngram >= 2x for one stream at 5 ms) and, for 8 streams at the longest delay, their rate against
    their rate without delay (>= 0.8x). Another model's rows (``then``) follow, named by it."""
    delays = (raw or {}).get("delays") or {}
    if not delays:
        return [Row(SECTION, "links", None, "tok/s", note="not measured (section links not run, or it failed)")]
    plan = raw.get("plan") or {}  # type: ignore[union-attr]
    model = plan.get("model", "embedded")
    label = "" if model == "embedded" else f"{Path(model).name}, "
    out = []
    for delay, tasks in delays.items():
        for task, by_streams in tasks.items():
            for n, runs in by_streams.items():
                plain = runs["plain"]["tok_s"]
                name = f"{label}{delay} ms, {task}, {n} stream(s)"
                out.append(Row(SECTION, f"{name}: plain", plain, "tok/s", note=_counted(runs["plain"])))
                for arm in (a for a in ARMS[1:] if a in runs):
                    tok_s, flag = runs[arm]["tok_s"], "--draft ngram" if arm == "ngram" else "--draft-model"
                    note = f"kept {runs[arm]['kept']} of {runs[arm]['drafted']} guessed tokens; {_counted(runs[arm])}"
                    out.append(Row(SECTION, f"{name}: {flag}", tok_s, "tok/s", note=note))
                    out.append(Row(SECTION, f"{name}: {arm} / plain", _ratio(runs[arm], runs["plain"]), "x",
                                   target=_target(arm, float(delay), task, int(n)), note=_steady(runs[arm], runs)))
    out += _far_rows(delays, label, int(plan.get("stages", 2)))
    return out + (rows(raw["then"]) if raw and raw.get("then") else [])


def _ratio(run: dict[str, Any], plain: dict[str, Any]) -> float | None:
    """``run``'s rate against plain's: the median of the rounds' ratios (the arms of a round ran in turn, in the
    same seconds of the machine's load; the medians of ~1.5 ms steps moved the ratio of two arms doing the same work
    by 0.1x from run to run), or the medians' ratio for results measured before the rounds were kept."""
    mine, theirs = run.get("rounds_tok_s"), plain.get("rounds_tok_s")
    if mine and theirs and len(mine) == len(theirs) and all(theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    return run["tok_s"] / plain["tok_s"] if plain["tok_s"] else None


def _steady(run: dict[str, Any], runs: dict[str, Any]) -> str:
    """The same ratio once every stream decodes (`steady_rate`; "" for runs measured before it was)."""
    steady, plain = run.get("steady_tok_s"), runs["plain"].get("steady_tok_s")
    return f"once every stream decodes: {steady / plain:.2f}x" if steady and plain else ""


def _counted(run: dict[str, Any]) -> str:
    """A run's ``counters`` in words ("" for a run measured before they were)."""
    if "trips" not in run:
        return ""
    busy = "?" if run["busy_share"] is None else f"{run['busy_share']:.0%}"
    return (f"{run['trips']} trips a stream, {run['tokens_per_trip']} tokens a trip, stages busy {busy} of the "
            f"span, last first token at {run['first_spread_s']} s")


def _target(arm: str, delay: float, task: str, n: int) -> float | None:
    if task == "free":
        return 0.95
    if delay == 0:
        return 1.5 if arm == "ngram" else 1.3
    return 2.0 if arm == "ngram" and delay == 5 and n == 1 else None


def _far_rows(delays: dict[str, Any], label: str, stages: int) -> list[Row]:
    """8 streams at the longest delay against plain without delay, i.e. on local stages (no relay, ``launcher``):
    requests in flight overlap the delay (plain, and each draft: tokens per trip can make up for the trips). Each
    note says what the links alone allow: a stream's step crosses each stage's link both ways, so it yields its
    tokens a trip at most once per 2 x stages x the delay, whatever the stages compute."""
    if "0" not in delays or len(delays) < 2:
        return []
    far = max(delays, key=float)
    out = []
    for task, by_streams in delays[far].items():
        for n, runs in by_streams.items():
            if int(n) > 1 and task in delays["0"]:
                local = delays["0"][task][n]["plain"]["tok_s"]
                for arm in (a for a in ARMS if a in runs):
                    there, per_trip = runs[arm]["tok_s"], runs[arm].get("tokens_per_trip")
                    note = LOCAL
                    if local and per_trip:
                        bound = int(n) * per_trip / (2 * stages * float(far) / 1000) / local
                        note += f"; the links allow at most {bound:.2f}x ({n} streams x {per_trip} tokens a trip " \
                                f"per {2 * stages} x {far} ms)"
                    out.append(Row(SECTION, f"{label}{far} ms, {task}, {n} streams, {arm}: against plain at 0 ms",
                                   local and there / local, "x", target=0.8, note=note))
    return out


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.links", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0 and 5 ms, 1 and 2 streams, 12 tokens, one round")
    ap.add_argument("--model", help="only this model's runs: embedded, a bench preset (smol) or a GGUF path "
                    "(default: the embedded model, then smol)")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="bandwidth cap of each link (default: none)")
    ap.add_argument("--delays", help="one-way delays in ms, e.g. 0,25")
    ap.add_argument("--streams", help="streams per run, e.g. 1,8")
    ap.add_argument("--tasks", help="repetitive, free or both (comma-separated)")
    ap.add_argument("--tokens", type=int, help="tokens per generation")
    ap.add_argument("--rounds", type=int, help="rounds of each arm at every delay (default: 15 without delay, 3 "
                    "with one)")
    ap.add_argument("--draft-max", type=int, help="--draft-max of each draft arm (default: pp-pipeline's)")
    ap.add_argument("--no-draft-model", action="store_true", help="no --draft-model arm (the Zen draft shares "
                    "only the embedded model's vocabulary)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    given: dict[str, Any] = {}
    if args.model:  # another model than the embedded one has no draft model of its vocabulary here
        given = {"model": None, "then": None} if args.model == "embedded" else \
            {"model": args.model, "then": None, "draft_model": None}
    if args.delays:
        given["delays_ms"] = tuple(float(d) for d in args.delays.split(","))
    if args.streams:
        given["streams"] = tuple(int(n) for n in args.streams.split(","))
    if args.tasks:
        given["tasks"] = tuple(args.tasks.split(","))
        if unknown := set(given["tasks"]) - TASKS.keys():
            ap.error(f"--tasks: {', '.join(sorted(unknown))}: not one of {', '.join(TASKS)}")
    given |= {k: v for k, v in (("tokens", args.tokens), ("rounds", args.rounds), ("draft_max", args.draft_max)) if v}
    if args.rounds:
        given["local_rounds"] = None
    if args.no_draft_model:
        given["draft_model"] = None
    plan = LinksPlan(**{**plan.__dict__, **given, "rate_mbit": args.rate_mbit})
    print(render(rows(measure(plan))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
