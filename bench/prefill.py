"""Section 19 ("prefill", issue 51): a prompt's prefill, 2 stages against llama.cpp on the same file.

Each row is one file and one prompt length (pp128, pp512): a 2-stage pipeline (warm, every ladder size compiled) and
llama.cpp's one process (2 threads, ``n_batch`` 512) take the same prompt in turn, round after round, and the row's
ratio is the median of the rounds' ratios. A prompt's time is its time to first token: the prefill, the head on its
last token and one sampled token, on both sides. Each round's prompt is a new one (llama-cpp-python reuses the KV of
a prompt's longest prefix it already holds), the same ids on both sides. The files: TinyLlama-1.1B's shape
(`memwall.ensure_file`: F16 from modelgen, the rest by llama.cpp's quantizer) and a small model of SmolLM2-135M's
shape (dim 576, 30 blocks, vocabulary 49152), whose Q4_K_M holds Q5_0 where its rows are not whole 256-value blocks,
as real small models' files do. The AVX2 rows (``--avx2-files``; ``--no-avx2`` leaves them out): the pipeline's
kernels compiled by ``shared/tools/clang-no-avx512`` with fresh caches (`memwall.no_avx512_env`) against llama.cpp's
AVX2 build, as on an AVX2-only CPU.

    python -m bench.prefill                                      # the section alone, JSON on stdout
    python -m bench.prefill --files smol:F16,smol:Q4_K_M --lengths 512 --rounds 3 --no-avx2
    python -m bench.prefill --files "" --avx2-files tinyllama:Q4_K_M --lengths 512   # an AVX2 row alone
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import memwall, models, peer, pipe, solo
from bench.quant import say


@dataclass(frozen=True)
class PrefillPlan:
    files: tuple[tuple[str, str], ...] = (("smol", "F16"), ("smol", "Q4_K_M"), ("tinyllama", "F16"),
                                          ("tinyllama", "Q8_0"), ("tinyllama", "Q4_K_M"), ("tinyllama", "Q4_0"))
    lengths: tuple[int, ...] = (128, 512)
    threads: int = 2  # llama.cpp's: every core of this machine
    rounds: int = 3
    avx2_files: tuple[tuple[str, str], ...] = (("tinyllama", "F16"), ("tinyllama", "Q4_K_M"))  # issue 51's AVX2 rows
    extra_env: dict[str, str] = field(default_factory=dict)  # for the pipelines' workers (e.g. PP_PREFILL_CHUNK)


def ttft_s(s: solo.Solo, ids: list[int]) -> float:
    """llama.cpp's time to its first token for ``ids`` (its child's clock is this one's: CLOCK_MONOTONIC)."""
    t0 = time.perf_counter()
    return s.decode_times(ids, 0)[0] - t0


def measure_file(path: Path, build: str, plan: PrefillPlan, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One file: every prompt length, the pipeline (its workers' ``env`` added to the plan's) and llama.cpp's
    ``build`` in turn each round."""
    count = plan.rounds + 1  # the first prompt warms both sides up
    prompts = {n: models.fixed_length_prompts(path, n, count) for n in plan.lengths}
    tok = models.tokenizer(path)
    out: dict[str, Any] = {"build": build, "build_name": peer.build_name(build), "lengths": {}}
    context = max(plan.lengths) + 64
    with pipe.start(path, 2, {**plan.extra_env, **(env or {})}) as p:
        out["ready"] = {k: v for k, v in (p.stages[0].ready or {}).items()
                        if isinstance(v, str | int | float | bool) and k != "pid"}
        s = solo.Solo(str(path), "", context, f"llama.cpp {build}", command=peer.command(path, plan.threads, context,
                                                                                         build))
        try:
            out["peer_info"] = s.ready.get("system_info")
            for n in plan.lengths:
                row: dict[str, list[float]] = {"ours_s": [], "peer_s": []}
                for r, prompt in enumerate(prompts[n]):
                    ours = pipe.time_to_first_token(p, prompt, 1)[0]
                    theirs = ttft_s(s, tok.encode(prompt))
                    if r > 0:
                        say(f"prefill {path.name} pp{n}: round {r} of {plan.rounds}: 2 stages {ours:.2f} s, "
                            f"llama.cpp {theirs:.2f} s")
                        row["ours_s"].append(round(ours, 4))
                        row["peer_s"].append(round(theirs, 4))
                out["lengths"][str(n)] = row
        finally:
            s.close()
    return out


def measure(plan: PrefillPlan, avx2: bool = True) -> dict[str, Any]:
    """The plan's rows on this CPU's llama.cpp build, then (``avx2``) its AVX2 rows."""
    out: dict[str, Any] = {"rounds": plan.rounds, "threads": plan.threads, "files": {}, "rows": {}}
    build = peer.default_build()
    if build is None:
        out["peers_skipped"] = "llama.cpp not built: run make peers"
        return out
    for preset, dt in plan.files:
        key, path = _file(out, preset, dt, "")
        say(f"prefill: {key} ({out['files'][key]['quantizer']}), 2 stages and llama.cpp ({peer.build_name(build)})")
        out["rows"][key] = measure_file(path, build, plan)
    if avx2 and plan.avx2_files and not peer.available("avx2"):
        out["avx2_skipped"] = "llama.cpp's AVX2 build (.venv-peers) not built: run make peers"
    elif avx2 and plan.avx2_files and not memwall.NO_AVX512_CC.exists():
        out["avx2_skipped"] = f"no {memwall.NO_AVX512_CC} (set PP_NO_AVX512_CC to the clang-no-avx512 wrapper)"
    elif avx2:
        for preset, dt in plan.avx2_files:
            key, path = _file(out, preset, dt, " avx2")
            say(f"prefill: {key}: 2 stages compiled without AVX-512 and llama.cpp's AVX2 build")
            with tempfile.TemporaryDirectory(prefix="pp-prefill-avx2-") as cache:
                row = measure_file(path, "avx2", plan, memwall.no_avx512_env(cache))
            out["rows"][key] = row | {"clang": "no-avx512"}
    return out


def _file(out: dict[str, Any], preset: str, dt: str, suffix: str) -> tuple[str, Path]:
    """``preset dt``'s file (made if missing), described in ``out["files"]`` under its row's key ("preset dt" and
    ``suffix``); returns the key and the path."""
    path, maker = memwall.ensure_file(preset, dt)
    key = f"{preset} {dt}{suffix}"
    out["files"][key] = {"name": path.name, "file_bytes": path.stat().st_size, "quantizer": maker}
    return key, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--files", help="comma-separated preset:type (default: the section's)")
    ap.add_argument("--lengths", help="comma-separated prompt lengths (default 128,512)")
    ap.add_argument("--avx2-files", help="comma-separated preset:type of the AVX2 rows (default: the section's)")
    ap.add_argument("--no-avx2", action="store_true", help="leave out the AVX2 rows")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the pipelines' workers")
    args = ap.parse_args(argv)
    changes: dict[str, Any] = {"extra_env": dict(e.split("=", 1) for e in args.env)}
    for name, given in (("files", args.files), ("avx2_files", args.avx2_files)):
        if given is None:
            continue
        changes[name] = tuple(tuple(f.split(":", 1)) for f in given.split(",") if f)  # "": none
        if bad := [f for f in changes[name] if len(f) != 2 or f[1] not in {"F16", *memwall.FTYPES}]:
            ap.error(f"unknown files: {bad} (preset:type, types F16, {', '.join(memwall.FTYPES)})")
    if args.lengths:
        changes["lengths"] = tuple(int(n) for n in args.lengths.split(","))
    if args.rounds:
        changes["rounds"] = args.rounds
    plan = PrefillPlan(**{**PrefillPlan().__dict__, **changes})
    print(json.dumps(measure(plan, avx2=not args.no_avx2), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
