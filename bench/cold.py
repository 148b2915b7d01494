"""Section 11: a cold start, as a new user meets it, against tinygrad's own (issue 18).

Every start gets an empty cache directory (``XDG_CACHE_HOME``: tinygrad's kernel cache and pp_worker's compiled
forwards), except the restart, which keeps the pipeline's. Measured from before the processes start:
- tinygrad's one-process generate (``bench.solo --cold``, as its CLI loads): the first token, the first
  generation's decode rate, and a second generation's (steady);
- ``pp-pipeline``'s pipeline of 3 stages as ``make demo`` runs it (no warm-up): the first token and the first
  generation's decode rate; then the same restarted with its caches kept;
- pp-serve as a user starts it: start to listening, then 32 streamed completions at once (the first burst, with
  whatever compiles on first use), then the same 32 again (warm).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import models, pipe, serve, solo
from bench.quant import say
from pp_worker import DEFAULT_MODEL
from pp_worker.driver.pipeline import Pipeline
from pp_worker.driver.stage_proc import Launch

PROMPT = "Beautiful is better than"


@dataclass(frozen=True)
class ColdPlan:
    stages: int = 3
    decode: int = 48
    streams: int = 32
    stream_tokens: int = 16


def measure(plan: ColdPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"model": DEFAULT_MODEL.name, "stages": plan.stages, "decode": plan.decode}
    with tempfile.TemporaryDirectory(prefix="pp-cold-") as root:
        say("cold start: tinygrad's one-process generate, empty kernel cache")
        out["tinygrad"] = _tinygrad(plan, Path(root) / "tinygrad")
        for run in ("cold", "restart"):  # the restart keeps the cold run's caches
            say(f"cold start: pp-pipeline's {plan.stages} stages ({run})")
            out[run] = _pipeline(plan, Path(root) / "pipeline")
        say(f"cold start: pp-serve, {plan.streams} streams at once, twice")
        out["serve"] = _serve(plan, Path(root) / "serve")
    return out


def _env(cache: Path) -> dict[str, str]:
    cache.mkdir(parents=True, exist_ok=True)
    return {"XDG_CACHE_HOME": str(cache), "PP_CACHE_DIR": str(cache / "pp_worker"), "PP_HEARTBEAT_S": "3600"}


def _tinygrad(plan: ColdPlan, cache: Path) -> dict[str, Any]:
    ids = models.tokenizer(DEFAULT_MODEL).encode(PROMPT)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"warmup": [], "decode": [ids], "ttft": []}, f)
        f.flush()
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "bench.solo", str(DEFAULT_MODEL), "--cold", "--prompt-file",
                               f.name, "--decode", str(plan.decode), "--mode", "lazy", "--max-context", "512"],
                              capture_output=True, text=True, timeout=900, cwd=solo.REPO,
                              env={**os.environ, **_env(cache)})
    if proc.returncode:
        raise RuntimeError(f"bench.solo --cold exited {proc.returncode}: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    first, steady = pipe.Tokens(res["first_times"]), pipe.Tokens(res["steady_times"])
    return {"ttft_s": res["first_times"][0] - t0, "first_tps": first.tps, "steady_tps": steady.tps}


def _pipeline(plan: ColdPlan, cache: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    with Pipeline(Launch(plan.stages, model=str(DEFAULT_MODEL), env=_env(cache)), load_timeout=900,
                  step_timeout=600, log=io.StringIO()) as p:
        ready_s = time.monotonic() - t0
        _, (tokens,) = pipe.run_traced(p, [PROMPT], plan.decode + 1)
    return {"ready_s": ready_s, "ttft_s": tokens.times[0] - t0, "first_tps": tokens.tps}


def _serve(plan: ColdPlan, cache: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    e = serve.Endpoint(2, plan.streams, env=_env(cache), warm=False)
    out: dict[str, Any] = {"listening_s": time.monotonic() - t0}
    try:
        for burst in ("first", "warm"):
            out[f"{burst}_burst_s"] = _burst(e, plan)
    finally:
        e.close()
    return out


def _burst(e: serve.Endpoint, plan: ColdPlan) -> float:
    """Wall time of ``plan.streams`` streamed completions sent at once, each read to its end."""
    threads = [threading.Thread(target=e.stream, args=(serve.PROMPTS[i % len(serve.PROMPTS)], plan.stream_tokens))
               for i in range(plan.streams)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0
