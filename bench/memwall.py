"""Section 15 ("memwall", issue 33): quantized files at the size people run, where the weights stream from DRAM.

The model has TinyLlama-1.1B's shape (dim 2048, 22 blocks, 32 heads, 4 KV heads, ffn 5632, vocab 32000): its F16
file is 2.2 GB, so no type's weights fit in L3 and every decoded token streams a stage's whole share from memory
(sections 9/10 keep the 27M bench model, whose quantized shares fit in this machine's 32 MiB L3). The F16 file comes
from modelgen; the other types from llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, run in a
``make peers`` venv) where a build is there, from modelgen otherwise (its Q5_K_M stand-in is a whole Q5_K file). All
are cached in ``bench/models/``, named by their quantizer, so a second bench builds nothing.

Each row is one file: a 2-stage pipeline and llama.cpp's one process (2 threads) on the same file, live side by
side, decoding in rounds taken in turn (pipeline, then llama.cpp, in every round), so both see the same load; the
ratio is the median of the rounds' ratios. Effective bytes/s is the bytes a token streams (every tensor of the file
but the token embedding, of which a token reads one row) times tokens/s; its ratio to the F16 row's says how close a
type comes to the memory wall (the rate F16 streams at). The rows run one at a time: two 1.1B processes at once is
already most of what this machine should hold.

The AVX2 rows: pp_worker's kernels compiled by ``shared/tools/clang-no-avx512`` (``CC``, with a fresh
``XDG_CACHE_HOME`` so no AVX-512 kernel is read from a cache) against llama.cpp's AVX2 build: an AVX2-only CPU.

    python -m bench.memwall                          # the section alone, JSON on stdout
    python -m bench.memwall --dtypes Q4_K_M --no-avx2 --tree /path/to/other/checkout --label int8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import models, peer, pipe, solo
from bench.quant import say
from pp_worker.worker.gguf.header import read_header

REPO = Path(__file__).resolve().parent.parent
# the AVX2 rows' compiler: beside the checkout (shared/tools), or where PP_NO_AVX512_CC says (a worktree elsewhere)
NO_AVX512_CC = Path(os.environ.get("PP_NO_AVX512_CC") or REPO.parent / "shared" / "tools" / "clang-no-avx512")
# llama.cpp's llama_ftype for each file type (llama.h)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17,
          "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
# modelgen's stand-in where llama.cpp is not built: its own mixes, a whole-file type where it has no mix
MODELGEN_DTYPES = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q8_0": "Q8_0", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q2_K": "Q2_K",
                   "Q3_K_M": "Q3_K_M", "Q4_K_M": "Q4_K_M", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL",
                   "IQ4_XS": "IQ4_XS"}


@dataclass(frozen=True)
class MemwallPlan:
    preset: str = "tinyllama"
    dtypes: tuple[str, ...] = ("F16", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS")
    avx2_dtypes: tuple[str, ...] = ("Q4_K_M", "F16", "Q8_0")  # Q4_K_M first: the row the target is on
    threads: int = 2  # llama.cpp's: every core of this machine
    decode: int = 16  # tokens per generation timed (a 1.1B F16 token is ~0.1-0.3 s here)
    rounds: int = 7
    prompt_tokens: int = 16
    max_context: int = 256  # llama.cpp's context (the pipeline's KV is paged: it holds what it uses)
    tree: str | None = None  # another checkout's pp_worker for the pipelines (PYTHONPATH), e.g. a branch to compare
    label: str = ""  # appended to every row's key, naming that tree
    extra_env: dict[str, str] = field(default_factory=dict)


def quantize_with_llama_cpp(src: Path, dst: Path, dtype: str, build: str) -> None:
    """``dst`` as llama.cpp's quantizer makes it from ``src``, in ``build``'s venv (its own process: llama.cpp
    prints to stdout and may abort)."""
    code = ("import ctypes, sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            "p.ftype = int(sys.argv[3]); p.nthread = 2\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")
    tmp = dst.with_suffix(".tmp")
    r = subprocess.run([str(peer.python(build)), "-c", code, str(src), str(tmp), str(FTYPES[dtype])],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 or not tmp.exists():
        raise RuntimeError(f"llama.cpp's quantizer failed on {dtype} (exit {r.returncode}): {r.stderr[-800:]}")
    tmp.rename(dst)  # a run killed half-way never leaves a truncated file behind


def ensure_file(preset: str, dtype: str) -> tuple[Path, str]:
    """The cached file of ``dtype`` and who made it ("modelgen", or "llama.cpp" and its build)."""
    f16 = models.ensure_model(preset, dtype="F16", isolated=True)
    if dtype == "F16":
        return f16, "modelgen"
    mine = models.CACHE / f"{preset}-s0-{dtype}-llamacpp.gguf"
    if mine.exists():
        return mine, "llama.cpp"
    build = peer.default_build()
    if build is not None:
        say(f"memwall: quantizing {f16.name} to {dtype} with llama.cpp's quantizer ({build} build)")
        quantize_with_llama_cpp(f16, mine, dtype, build)
        return mine, "llama.cpp"
    gen = MODELGEN_DTYPES[dtype]
    say(f"memwall: llama.cpp not built (make peers): {dtype} from modelgen as {gen}")
    return models.ensure_model(preset, dtype=gen, isolated=True), f"modelgen {gen}"


def streamed_bytes(path: Path) -> int:
    """The bytes a decoded token reads from the file's weights: every tensor but the token embedding (one row)."""
    h = read_header(path)
    return sum(t.nbytes or 0 for name, t in h.tensors.items() if name != "token_embd.weight")


def _tree_env(plan: MemwallPlan) -> dict[str, str]:
    env = dict(plan.extra_env)
    if plan.tree:  # its pp_worker first on the workers' path (ahead of this checkout's editable install), and
        # PYTHONSAFEPATH so `python -m pp_worker` does not put the directory it starts in (this checkout) before it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (plan.tree, os.environ.get("PYTHONPATH")) if p)
        env["PYTHONSAFEPATH"] = "1"
    return env


def measure_row(path: Path, build: str, env: dict[str, str], plan: MemwallPlan, prompt: str,
                ids: list[int]) -> dict[str, Any]:
    """One file: a 2-stage pipeline (``env`` for its workers) and llama.cpp's ``build`` decoding in rounds taken
    in turn."""
    out: dict[str, Any] = {"build": build, "build_name": peer.build_name(build), "pp2_tps": [], "peer_tps": [],
                           "ratios": [], "worker_env": {k: v for k, v in env.items() if k in ("CC", "PYTHONPATH")}}
    with pipe.start(path, 2, env) as p:
        ready = p.stages[0].ready or {}
        # the ready line's scalars: what the stage runs (its kernels, threads, numerics where it says)
        out["ready"] = {k: v for k, v in ready.items() if isinstance(v, str | int | float | bool) and k != "pid"}
        pipe.run_traced(p, [prompt], 4)
        s = solo.Solo(str(path), "", plan.max_context, f"llama.cpp {build}",
                      command=peer.command(path, plan.threads, plan.max_context, build))
        try:
            out["peer_info"] = s.ready.get("system_info")
            for r in range(plan.rounds):
                say(f"memwall {path.name}: round {r + 1} of {plan.rounds}, 2 stages then llama.cpp ({build})")
                ours = pipe.decode_rate(p, prompt, plan.decode).tps
                theirs = pipe.Tokens(s.decode_times(ids, plan.decode)).tps
                out["pp2_tps"].append(round(ours, 3))
                out["peer_tps"].append(round(theirs, 3))
                out["ratios"].append(round(ours / theirs, 4) if theirs else None)
        finally:
            s.close()
    return out


def measure(plan: MemwallPlan, avx2: bool = True) -> dict[str, Any]:
    f16 = models.ensure_model(plan.preset, dtype="F16", isolated=True)
    prompt = models.fixed_length_prompts(f16, plan.prompt_tokens, 1)[0]
    ids = models.tokenizer(f16).encode(prompt)
    out: dict[str, Any] = {"model": f16.name, "decode": plan.decode, "rounds": plan.rounds, "threads": plan.threads,
                           "label": plan.label, "files": {}, "rows": {}}
    build = peer.default_build()
    if build is None:
        out["peers_skipped"] = "llama.cpp not built: run make peers"
        return out
    env = _tree_env(plan)
    for dt in plan.dtypes:
        path, maker = ensure_file(plan.preset, dt)
        out["files"][dt] = {"name": path.name, "file_bytes": path.stat().st_size, "streamed_bytes":
                            streamed_bytes(path), "quantizer": maker}
        say(f"memwall: {dt} ({maker}), 2 stages and llama.cpp ({peer.build_name(build)})")
        out["rows"][_key(dt, build, plan.label)] = measure_row(path, build, env, plan, prompt, ids) | {"dtype": dt,
                                                                                                  "label": plan.label}
    if avx2 and plan.avx2_dtypes and peer.available("avx2"):
        for dt in plan.avx2_dtypes:
            path, maker = ensure_file(plan.preset, dt)
            out["files"].setdefault(dt, {"name": path.name, "file_bytes": path.stat().st_size,
                                         "streamed_bytes": streamed_bytes(path), "quantizer": maker})
            with tempfile.TemporaryDirectory(prefix="pp-memwall-avx2-") as cache:
                env2 = env | no_avx512_env(cache)
                say(f"memwall: {dt}, 2 stages compiled without AVX-512 and llama.cpp's AVX2 build")
                out["rows"][_key(dt, "avx2", plan.label)] = (measure_row(path, "avx2", env2, plan, prompt, ids)
                                                            | {"dtype": dt, "clang": "no-avx512",
                                                                                 "label": plan.label})
    elif avx2 and plan.avx2_dtypes:
        out["avx2_skipped"] = "llama.cpp's AVX2 build (.venv-peers) not built: run make peers"
    return out


def no_avx512_env(cache: str) -> dict[str, str]:
    """A pipeline's environment for kernels compiled as on an AVX2-only CPU, with ``cache`` (a fresh folder) as its
    caches: tinygrad's compiled kernels and pp_worker's forwards are keyed by source, not flags."""
    return {"CC": str(NO_AVX512_CC), "XDG_CACHE_HOME": cache, "PP_CACHE_DIR": f"{cache}/pp_worker"}


def _key(dtype: str, build: str, label: str) -> str:
    """A row's key: the file's type, the build it ran against, and the tree's label if any: "Q4_K_M avx512"."""
    return " ".join(x for x in (dtype, build, label) if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memwall", description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", help="comma-separated file types (default: all of the section's)")
    ap.add_argument("--avx2-dtypes", help="comma-separated file types of the AVX2 rows")
    ap.add_argument("--no-avx2", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--decode", type=int)
    ap.add_argument("--tree", help="another checkout whose pp_worker the pipelines run (PYTHONPATH)")
    ap.add_argument("--label", default="", help="appended to every row's key (e.g. the tree's branch)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the pipelines' workers")
    args = ap.parse_args(argv)
    plan = MemwallPlan()
    changes: dict[str, Any] = {"tree": args.tree, "label": args.label,
                               "extra_env": dict(e.split("=", 1) for e in args.env)}
    if args.dtypes is not None:  # "": no row on the default build (e.g. the AVX2 rows alone)
        changes["dtypes"] = tuple(d for d in args.dtypes.split(",") if d)
    if args.avx2_dtypes is not None:
        changes["avx2_dtypes"] = tuple(d for d in args.avx2_dtypes.split(",") if d)
    if args.rounds:
        changes["rounds"] = args.rounds
    if args.decode:
        changes["decode"] = args.decode
    if unknown := (set(changes.get("dtypes", ())) | set(changes.get("avx2_dtypes", ()))) - {"F16", *FTYPES}:
        ap.error(f"unknown file types: {', '.join(sorted(unknown))} (known: F16, {', '.join(FTYPES)})")
    plan = MemwallPlan(**{**plan.__dict__, **changes})
    print(json.dumps(measure(plan, avx2=not args.no_avx2), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
