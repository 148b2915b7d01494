"""Measurements on a real pipeline of pp_worker processes, through the driver API.

Per-token times come from the driver's trace: the moment each ``forward_and_sample`` reply (one token) reaches
the driver. Decode rates are taken between a generation's first token (which ends its prefill) and its last.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.solo import vmhwm_mb
from pp_worker.driver.pipeline import Pipeline, RunStats, Sampling, make_generations
from pp_worker.driver.stage_proc import Launch

QUIET = {"PP_WARMUP": "1", "PP_HEARTBEAT_S": "3600"}  # compiled before ready; no heartbeat lines mid-measurement


@dataclass
class Tokens:
    """Arrival times (driver clock, seconds) of one generation's tokens; the first ends the prefill."""

    times: list[float]

    @property
    def decoded(self) -> int:
        return max(0, len(self.times) - 1)

    @property
    def tps(self) -> float:
        span = self.times[-1] - self.times[0] if self.times else 0.0
        return self.decoded / span if span > 0 else 0.0

    @property
    def p50_ms(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return statistics.median(gaps) * 1000 if gaps else 0.0


PINNED = "{python} -m bench.pinned"  # each stage on one CPU of its own, or sharing one by halves (bench.pinned)


def start(model: Path, stages: int, env: dict[str, str] | None = None, launcher: str | None = None) -> Pipeline:
    """A warm pipeline (PP_WARMUP=1) of local worker processes on ``model`` (``launcher``: started through it)."""
    launch = Launch(stages, model=str(model), env={**QUIET, **(env or {})}, launcher=launcher)
    return Pipeline(launch, load_timeout=900.0, step_timeout=600.0, log=None)


def run_traced(p: Pipeline, prompts: list[str], max_tokens: int, concurrency: int = 1,
               keep_trace: bool = False) -> tuple[RunStats, list[Tokens]]:
    """Run the prompts (``concurrency`` in flight); the stats and each generation's token arrival times. With
    ``keep_trace`` the driver's trace stays in ``p.trace`` for the caller."""
    p.trace = []
    try:
        stats = p.run(make_generations(p, prompts, max_tokens, Sampling()), concurrency)
        last = len(p.stages) - 1
        times: dict[int, list[float]] = {g.request_id: [] for g in stats.generations}
        for t, stage, rid, op, kind in p.trace:
            if stage == last and op == "forward_and_sample" and kind == "reply" and rid in times:
                times[rid].append(t)
    finally:
        if not keep_trace:
            p.trace = None
    return stats, [Tokens(times[g.request_id]) for g in stats.generations]


def decode_rate(p: Pipeline, prompt: str, decode: int) -> Tokens:
    """One generation of ``decode`` tokens after the first; its token times."""
    return run_traced(p, [prompt], decode + 1)[1][0]


@dataclass
class Aggregate:
    tps: float  # tokens/s while all K generations were decoding
    overall_tps: float  # every token (prefills included) over the whole wall time
    window_s: float
    tokens_in_window: int


def aggregate_rate(p: Pipeline, prompts: list[str], decode: int) -> Aggregate:
    """All ``prompts`` in flight at once; the aggregate decode rate over the window in which all of them decode
    (from the latest first token to the earliest last token), so prefills and the ramp-down are left out."""
    stats, gens = run_traced(p, prompts, decode + 1, concurrency=len(prompts))
    w0, w1 = max(g.times[0] for g in gens), min(g.times[-1] for g in gens)
    count = sum(1 for g in gens for t in g.times if w0 < t <= w1)
    window = w1 - w0
    return Aggregate(count / window if window > 0 else 0.0, stats.tokens / stats.wall_s, window, count)


def time_to_first_token(p: Pipeline, prompt: str, reps: int) -> list[float]:
    """Seconds from the generation's start (its tokenize request) to its first token, ``reps`` fresh sessions."""
    return [run_traced(p, [prompt], 1)[0].generations[0].ttft_s for _ in range(reps)]


PREFILL_OPS = ("embed_and_forward", "forward_range", "forward_and_sample")


@dataclass
class Prefill:
    stage_s: list[float]  # each stage's prefill time with the prompt sent whole (its send to its reply)
    whole_ttft_s: float  # time to first token with the prompt sent whole
    pipelined_ttft_s: float  # ... and pipelined through the stages in chunks (the stages' prefill_chunk)
    stage_cpu_s: list[float]  # CPU time of each stage's process over the run with the prompt sent whole
    cores: int  # CPUs the stages may run on (all of this machine's they share)

    @property
    def ratio(self) -> float:
        """Pipelined time to first token over the sum of the stages' prefill times (1 = no overlap at all)."""
        return self.pipelined_ttft_s / sum(self.stage_s)

    @property
    def cores_busy(self) -> float:
        """How busy the stages kept the cores they share while prefilling one after the other (the prompt sent
        whole): 1 leaves pipelining no idle core to fill, only what stops competing for them saves."""
        return sum(self.stage_cpu_s) / (self.cores * sum(self.stage_s))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def prefill_overlap(p: Pipeline, prompt: str) -> Prefill:
    """One prompt sent whole, then pipelined; fresh sessions each time."""
    override = p._chunk_override
    try:
        p._chunk_override = 0
        cpu0 = [cpu_seconds(st.proc.pid) for st in p.stages]
        stats, _ = run_traced(p, [prompt], 1, keep_trace=True)
        cpu = [cpu_seconds(st.proc.pid) - c for st, c in zip(p.stages, cpu0, strict=True)]
        trace = p.trace or []
        rid = stats.generations[0].request_id
        forward = [(t, s, d) for t, s, r, op, d in trace if r == rid and op in PREFILL_OPS]
        sends = {s: t for t, s, d in forward if d == "send"}
        replies = {s: t for t, s, d in forward if d == "reply"}
        stage_s = [replies[s] - sends[s] for s in sorted(sends)]
        whole = stats.generations[0].ttft_s
        p._chunk_override = None
        pipelined = run_traced(p, [prompt], 1)[0].generations[0].ttft_s
    finally:
        p._chunk_override, p.trace = override, None
    cores = set().union(*(os.sched_getaffinity(st.proc.pid) for st in p.stages))
    return Prefill(stage_s, whole, pipelined, cpu, len(cores))


def peak_rss(p: Pipeline) -> list[float | None]:
    """VmHWM of each stage's process (local children, so /proc has them)."""
    return [vmhwm_mb(st.proc.pid) for st in p.stages]


def greedy_tokens(p: Pipeline, prompts: list[str], n: int) -> list[list[int]]:
    """Each prompt's first ``n`` greedy tokens (fewer where it ends at an EOS), all prompts in flight at once."""
    stats = p.run(make_generations(p, prompts, n, Sampling()), concurrency=len(prompts))
    return [g.tokens for g in stats.generations]


@dataclass
class Agreement:
    """How far two runs' greedy tokens agree, per prompt, over ``n`` positions (a position both runs left empty,
    having stopped at an EOS, counts as agreeing)."""

    n: int
    first_divergence: list[int] = field(default_factory=list)  # identical tokens before the first difference
    identical: list[int] = field(default_factory=list)  # positions holding the same token, divergence or not

    @property
    def prefix_fraction(self) -> float:
        return sum(self.first_divergence) / (self.n * len(self.first_divergence)) if self.first_divergence else 0.0

    @property
    def overall_fraction(self) -> float:
        return sum(self.identical) / (self.n * len(self.identical)) if self.identical else 0.0


def agreement(reference: list[list[int]], other: list[list[int]], n: int) -> Agreement:
    a = Agreement(n)
    for ref, got in zip(reference, other, strict=True):
        same = [_at(ref, i) == _at(got, i) for i in range(n)]
        a.first_divergence.append(same.index(False) if False in same else n)
        a.identical.append(sum(same))
    return a


def _at(tokens: list[int], i: int) -> int | None:
    return tokens[i] if i < len(tokens) else None
