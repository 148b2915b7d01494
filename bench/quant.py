"""Sections 9 and 10: quantized files as people run them, and llama.cpp on the same files.

9 (``quant``): the bench model as F16, Q8_0, Q4_K_M- and Q3_K_M-like mixes and IQ4_XS, each on a live 2-stage
pipeline: decode in rounds taken in turn (every pipeline, then llama.cpp on every file, in each round), a 512-token
prefill, start-up to ready with PP_WARMUP off (the load), and each stage's peak RSS. 10 (``qrss``): the 0.73B
"rss" model as Q8_0, Q4_0 and Q4_K_M on 2 and 4 stages, each stage's peak RSS against its tensors' bytes in the
file plus tinygrad's idle floor. llama.cpp needs ``make peers``; without it those rows say so.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import models, peer, pipe, rss, solo


@dataclass(frozen=True)
class QuantPlan:
    preset: str = "bench"
    # issue 17's targets are on Q8_0 and Q4_K_M; Q3_K_M and IQ4_XS (kept packed too) are measured beside them
    dtypes: tuple[str, ...] = ("F16", "Q8_0", "Q4_K_M", "Q3_K_M", "IQ4_XS")
    peers: tuple[str, ...] = ("F16", "Q8_0", "Q4_K_M", "Q3_K_M", "IQ4_XS")  # llama.cpp on these files
    threads: int = 2  # llama.cpp's threads: the machine's 2 cores
    # many short rounds: this VM's speed swings ~2x over seconds, so each round's files are best measured close
    # together (~0.5 s a round); 72 rounds put the median of the rounds' ratios within ~±0.05 by sampling, where
    # 24 left ±0.07-0.13 and flipped targets this close between runs (bench/NOTES.md)
    decode: int = 32
    rounds: int = 72
    load_rounds: int = 9  # a load is ~0.2 s of fixed costs (imports, tokenizer, device): the bytes are a few ms
    prefill_reps: int = 3
    rss_preset: str = "rss"
    rss_dtypes: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_K_M")
    rss_stages: tuple[int, ...] = (2, 4)


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def measure(plan: QuantPlan, prompts: dict[str, list[str]], decode_ids: list[int], prefill: tuple[int, str],
            max_context: int) -> dict[str, Any]:
    """Section 9 (see the module docstring); ``prompts`` as `bench.run.Bench` builds them, ``prefill`` the
    (token count, text) of the long prompt."""
    files = {dt: models.ensure_model(plan.preset, dtype=dt) for dt in plan.dtypes}
    load_s, ready_s = _load_rounds(files, plan.load_rounds)
    out: dict[str, Any] = {"file_bytes": {dt: f.stat().st_size for dt, f in files.items()}, "load_s": load_s,
                           "ready_s": ready_s, "prefill_tokens": prefill[0]}
    with contextlib.ExitStack() as stack:
        pipes = {dt: stack.enter_context(pipe.start(f, 2)) for dt, f in files.items()}
        peers = _peers(stack, files, plan, decode_ids, max_context)
        out["peers_skipped"] = None if peers or not plan.peers else "llama.cpp not built: run make peers"
        for dt, p in pipes.items():
            say(f"quantized files: {dt}, 2 stages, warm-up generation")
            pipe.run_traced(p, prompts["warm"][:1], 8)
        out["rounds"] = decode_rounds(pipes, peers, prompts["decode"][0], decode_ids, plan.rounds, plan.decode,
                                      "quantized files")
        out["prefill_s"] = {}
        for dt, p in pipes.items():
            say(f"quantized files: {dt}, a {prefill[0]}-token prompt's first token x {plan.prefill_reps}")
            out["prefill_s"][dt] = pipe.time_to_first_token(p, prefill[1], plan.prefill_reps)
        out["peak_rss_mb"] = {dt: pipe.peak_rss(p) for dt, p in pipes.items()}
        build = peer.build_name(b) if (b := peer.default_build()) else ""
        out["peer_info"] = {dt: f"{build} build: {s.ready.get('system_info')}" for dt, s in peers.items()}
    return out


def _load_rounds(files: dict[str, Path], rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The load of a 2-stage pipeline (PP_WARMUP off), starts taken in turn, each round starting with the next file
    (so no file always follows the same one): the slower stage's own load time (its ready line's ``load_ms``:
    header, tokenizer, tensors), and its time from process start to ready (``uptime_ms``: imports and the device
    too, the same for every file)."""
    load: dict[str, list[float]] = {dt: [] for dt in files}
    ready: dict[str, list[float]] = {dt: [] for dt in files}
    names = list(files)
    for r in range(rounds):
        for dt in names[r % len(names):] + names[:r % len(names)]:
            f = files[dt]
            say(f"quantized files: load round {r + 1} of {rounds}, {dt}")
            with pipe.start(f, 2, {"PP_WARMUP": "0"}) as p:
                lines = [st.ready or {} for st in p.stages]
                load[dt].append(max(line.get("load_ms", 0) for line in lines) / 1000)
                ready[dt].append(max(line.get("uptime_ms", 0) for line in lines) / 1000)
    return load, ready


def _peers(stack: contextlib.ExitStack, files: dict[str, Path], plan: QuantPlan, ids: list[int],
           max_context: int) -> dict[str, solo.Solo]:
    if not peer.available():
        return {}
    out = {}
    for dt in plan.peers:
        say(f"llama.cpp ({plan.threads} threads) on the {dt} file")
        s = solo.Solo(str(files[dt]), "", max_context, f"llama.cpp {dt}",
                      command=peer.command(files[dt], plan.threads, max_context))
        stack.callback(s.close)
        out[dt] = s
    return out


def decode_rounds(pipes: dict[str, Any], peers: dict[str, solo.Solo], prompt: str, ids: list[int], rounds: int,
                  decode: int, what: str, stages: int = 2) -> list[dict[str, float]]:
    """Each round: every pipeline (keyed "pp<stages> <name>") then every peer ("llama.cpp <name>") decodes
    ``decode`` tokens; tokens/s of each."""
    out = []
    for r in range(rounds):
        say(f"{what}: decode round {r + 1} of {rounds}")
        row = {f"pp{stages} {name}": pipe.decode_rate(p, prompt, decode).tps for name, p in pipes.items()}
        row |= {f"llama.cpp {name}": pipe.Tokens(s.decode_times(ids, decode)).tps for name, s in peers.items()}
        out.append(row)
    return out


def median_ratio(rounds: list[dict[str, float]], a: str, b: str) -> float | None:
    """The median over rounds of rounds[a] / rounds[b] (both measured in the same round)."""
    ratios = [r[a] / r[b] for r in rounds if r.get(a) and r.get(b)]
    return statistics.median(ratios) if ratios else None


# ---------------------------------------------------------------- section 10: peak RSS of quantized stages


def big_rss(plan: QuantPlan, prompt_of: Callable[[Path], str]) -> dict[str, Any]:
    """Each stage's peak RSS on the rss model in every ``plan.rss_dtypes``, on ``plan.rss_stages`` stages."""
    rplan = rss.RssPlan(preset=plan.rss_preset)
    out: dict[str, Any] = {"max_context": rplan.max_context}
    for dt in plan.rss_dtypes:
        say(f'peak RSS, "{plan.rss_preset}" model as {dt} (generated once into bench/models/ if missing)')
        model = models.ensure_model(plan.rss_preset, dtype=dt, isolated=True)
        text = prompt_of(model)
        entry: dict[str, Any] = {"file_bytes": model.stat().st_size, "idle": solo.run_json(["--idle"])}
        for n in plan.rss_stages:
            say(f"{plan.rss_preset} {dt}: {n} stages")
            entry[f"pp{n}"] = rss.stage_peaks(model, n, text, rplan) | {
                "file_share": models.file_shares(model, n), "kv": [kv for _, kv in
                                                                   models.stage_shares(model, n, rplan.max_context)]}
        out[dt] = entry
    return out
