"""Uneven splits (``--split``): which blocks each stage holds, given as counts or planned from each host's memory.

Before any stage loads, every stage is started once with ``PP_PROBE=1`` through the same launcher (local, ssh,
Ray): it answers with one line - its host's free memory, the model's block count and each block's bytes, what the
first and the last stage hold besides their blocks (worker.probe) - and exits. The plan is then checked against
the model (the counts must add up to its blocks, none may be 0, each stage's weights must fit in its host's free
memory) and each stage is started with ``PP_LAYERS=START:END``. ``--split auto`` gives each stage blocks in
proportion to its host's free memory: of the contiguous splits, the one whose fullest host is least full.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pp_worker.driver.stage_proc import Launch, Stage, stop_all, wait_io
from pp_worker.wire import parse_object

AUTO = "auto"
Split = str | tuple[int, ...]  # "auto" or blocks per stage
Probe = dict[str, Any]  # a stage's probe line


class SplitError(Exception):
    """The split cannot be planned or does not fit the model or the hosts; the message says which stage and why."""


def parse_split(text: str, num_stages: int) -> Split:
    """``auto`` or ``N1,N2,...`` (one positive count per stage) -> the split. Raises ValueError."""
    if text == AUTO:
        return AUTO
    words = text.split(",")
    if not all(w.isascii() and w.isdigit() for w in words):
        raise ValueError(f"expected 'auto' or blocks per stage as N1,N2,... (ASCII digits), got {text!r}")
    counts = tuple(int(w) for w in words)
    if len(counts) != num_stages:
        raise ValueError(f"{len(counts)} counts for {num_stages} stages ({text!r})")
    if 0 in counts:
        raise ValueError(f"stage {counts.index(0)} would hold 0 blocks ({text!r}): every stage needs at least one")
    return counts


def ranges_of(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Blocks per stage -> each stage's half-open range, end to end from block 0."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def check_ranges(ranges: list[tuple[int, int]], total: int) -> None:
    """Ranges must cover [0, total) in order, each non-empty, with no gap or overlap. Raises SplitError."""
    expected = 0
    for stage, (start, end) in enumerate(ranges):
        if start != expected:
            what = "a gap" if start > expected else "an overlap"
            raise SplitError(f"stage {stage}'s blocks [{start}, {end}) leave {what} after block {expected}")
        if end <= start:
            raise SplitError(f"stage {stage} would hold no blocks ([{start}, {end}))")
        expected = end
    if expected != total:
        raise SplitError(f"the split covers {expected} blocks; the model has {total} (the counts must add up to it)")


def stage_bytes(probe: Probe, stage: int, num_stages: int, start: int, end: int) -> int:
    """The weights a stage holding [start, end) loads: its blocks, plus the embedding on the first stage and the
    output norm and head on the last."""
    extra = probe["first_bytes"] if stage == 0 else probe["last_bytes"] if stage == num_stages - 1 else 0
    return sum(probe["block_bytes"][start:end]) + extra


def plan(split: Split, probes: list[Probe]) -> list[tuple[int, int]]:
    """Each stage's block range, checked against the model and against each host's free memory."""
    total, n = probes[0]["total_blocks"], len(probes)
    if any(p["total_blocks"] != total for p in probes):
        raise SplitError(f"the stages see different models (block counts {[p['total_blocks'] for p in probes]})")
    if n > total:
        raise SplitError(f"{n} stages for a model of {total} blocks: every stage needs at least one")
    ranges = ranges_of(auto_counts(probes) if split == AUTO else split)  # type: ignore[arg-type]
    check_ranges(ranges, total)
    for stage, (start, end) in enumerate(ranges):
        need, free = stage_bytes(probes[0], stage, n, start, end), probes[stage].get("free_bytes")
        if isinstance(free, int) and need > free:
            raise SplitError(f"stage {stage}'s host has no room: blocks [{start}, {end}) need {_mib(need)} MiB of "
                             f"weights, it has {_mib(free)} MiB free")
    return ranges


def auto_counts(probes: list[Probe]) -> tuple[int, ...]:
    """Blocks per stage in proportion to each host's free memory: the contiguous split that minimises the largest
    share of a host's free memory its stage's weights take (the head counted with the last stage, the embedding
    with the first). A host without room is reported by `plan`."""
    free = [p.get("free_bytes") for p in probes]
    if not all(isinstance(f, int) and f > 0 for f in free):
        bad = next(i for i, f in enumerate(free) if not (isinstance(f, int) and f > 0))
        raise SplitError(f"stage {bad}'s host does not report its free memory; give --split N1,N2,... instead")
    low, high = 0.0, sum(probes[0]["block_bytes"]) + probes[0]["first_bytes"] + probes[0]["last_bytes"]
    high = high / min(free) + 1.0  # type: ignore[type-var]
    best = _greedy(probes, high)
    for _ in range(64):  # bisect the fill ratio: the greedy split fits below it or not
        mid = (low + high) / 2
        counts = _greedy(probes, mid)
        if counts is None:
            low = mid
        else:
            high, best = mid, counts
    assert best is not None, "every stage fits at the ratio that puts the whole model on the smallest host"
    return best


def _greedy(probes: list[Probe], ratio: float) -> tuple[int, ...] | None:
    """Blocks per stage such that no stage's weights pass ``ratio`` x its host's free memory, each stage taking
    as many as fit (which leaves the most room to the later ones), or None when no such split exists."""
    p, n = probes[0], len(probes)
    total, counts, start = p["total_blocks"], [], 0
    for stage, probe in enumerate(probes):
        cap = ratio * probe["free_bytes"]
        end = total if stage == n - 1 else start + 1
        while stage < n - 1 and end < total - (n - 1 - stage) and stage_bytes(p, stage, n, start, end + 1) <= cap:
            end += 1
        if stage_bytes(p, stage, n, start, end) > cap:
            return None
        counts.append(end - start)
        start = end
    return tuple(counts)


def probe_stages(launch: Launch, timeout: float, cancel: Any = None) -> list[Probe]:
    """Start every stage with ``PP_PROBE=1`` through ``launch`` and collect their probe lines (they exit after)."""
    probing = dataclasses.replace(launch, env={**launch.env, "PP_PROBE": "1"}, split=None)
    stages: list[Stage] = []
    try:
        stages += [Stage(i, probing) for i in range(launch.num_stages)]
        return _collect(stages, time.monotonic() + timeout, cancel)
    except OSError as e:  # the launcher's program does not exist
        raise SplitError(f"cannot start stage {len(stages)} to probe it: {e}") from e
    finally:
        stop_all(stages, grace_s=2.0)


def _collect(stages: list[Stage], deadline: float, cancel: Any) -> list[Probe]:
    found: dict[int, Probe] = {}
    while len(found) < len(stages):
        if time.monotonic() > deadline:
            late = next(st for st in stages if st.index not in found)
            raise SplitError(f"stage {late.index} gave no probe line within --load-timeout\n{late.stderr_tail()}")
        r = wait_io([st for st in stages if not st.eof], 1.0, [cancel.wake_fd] if cancel else [])
        if cancel:
            cancel.check(r)
        for st in stages:
            if st.out_fd not in r:
                continue
            for line in st.read_lines():
                if (obj := parse_object(line)) is not None and obj.get("status") == "probe":
                    found[st.index] = obj
            if st.eof and st.index not in found:
                raise SplitError(f"stage {st.index} could not be probed: it {st.exit_description()}\n"
                                 f"{st.stderr_tail()}")
    return [found[i] for i in range(len(stages))]


def with_layers(launch: Launch, ranges: list[tuple[int, int]]) -> Launch:
    """The launch whose stages load those ranges (``PP_LAYERS``)."""
    return dataclasses.replace(launch, split=None, layers=tuple(ranges))


def describe(ranges: list[tuple[int, int]], probes: list[Probe]) -> str:
    n = len(ranges)
    return "; ".join(f"stage {i}: blocks [{a}, {b}), {_mib(stage_bytes(probes[0], i, n, a, b))} MiB of weights, "
                     f"{_mib(p.get('free_bytes'))} MiB free" for i, ((a, b), p) in enumerate(zip(ranges, probes,
                                                                                                   strict=True)))


def _mib(n: object) -> str:
    return f"{n / 2**20:.1f}" if isinstance(n, int) else "?"
