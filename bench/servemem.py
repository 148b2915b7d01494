"""Section 13: pp-serve's memory and start on a 30-block model (issue 35), SmolLM2-135M's shape as Q8_0.

Every start gets empty caches. Measured from before the processes start:
- ``pp-pipeline``'s 2 stages: the first token, cold (no warm-up: the decode forward before ready, a prompt's other
  sizes when they pay);
- pp-serve with 8 slots as a user starts it (PP_WARMUP=background): start to ``/health`` ok, then 8 concurrent
  48-token completions, then each stage's resident memory (VmRSS, and its peak VmHWM) against its weights plus
  tinygrad's idle floor, its KV pages (``/stages``) and the context the server offers;
- the same burst on a server that compiles each size at its first use instead (PP_WARMUP=0): which is faster.
"""

from __future__ import annotations

import io
import json
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import models, pipe, serve, solo
from bench.quant import say
from pp_worker.driver.pipeline import Pipeline
from pp_worker.driver.stage_proc import Launch

PROMPT = "Beautiful is better than"


@dataclass(frozen=True)
class ServeMemPlan:
    preset: str = "smol"
    dtype: str = "Q8_0"
    stages: int = 2
    slots: int = 8
    tokens: int = 48
    on_demand: bool = True  # also the burst on a server compiling at first use (PP_WARMUP=0)


def measure(plan: ServeMemPlan) -> dict[str, Any]:
    model = models.ensure_model(plan.preset, dtype=plan.dtype, isolated=True)
    out: dict[str, Any] = {"model": str(model), "context": models.facts(model).context, "stages": plan.stages,
                           "slots": plan.slots, "tokens": plan.tokens,
                           "floor_mb": solo.run_json(["--idle"])["peak_rss_mb"]}
    with tempfile.TemporaryDirectory(prefix="pp-servemem-") as root:
        say(f"serve memory: pp-pipeline's cold first token, {plan.preset} {plan.dtype}")
        out["pipeline"] = _pipeline(model, plan, Path(root) / "pipeline")
        say("serve memory: pp-serve cold (PP_WARMUP=background), 8 completions at once")
        out["background"] = _serve(model, plan, Path(root) / "background", {})
        if plan.on_demand:
            say("serve memory: pp-serve cold, compiling at first use (PP_WARMUP=0)")
            out["on_demand"] = _serve(model, plan, Path(root) / "on_demand", {"PP_WARMUP": "0"})
    say(f"serve memory: {json.dumps(out)}")  # the raw numbers, whatever becomes of the report
    return out


def _env(cache: Path) -> dict[str, str]:
    cache.mkdir(parents=True, exist_ok=True)
    return {"XDG_CACHE_HOME": str(cache), "PP_CACHE_DIR": str(cache / "pp_worker"), "PP_HEARTBEAT_S": "3600"}


def _pipeline(model: Path, plan: ServeMemPlan, cache: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    with Pipeline(Launch(plan.stages, model=str(model), env=_env(cache)), load_timeout=1800, step_timeout=1200,
                  log=io.StringIO()) as p:
        ready_s = time.monotonic() - t0
        _, (tokens,) = pipe.run_traced(p, [PROMPT], 2)
    return {"ready_s": ready_s, "ttft_s": tokens.times[0] - t0}


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.loads(r.read())


def _serve(model: Path, plan: ServeMemPlan, cache: Path, env: dict[str, str]) -> dict[str, Any]:
    t0 = time.monotonic()
    e = serve.Endpoint(plan.stages, plan.slots, env={**_env(cache), **env}, warm=False, model=str(model))
    out: dict[str, Any] = {"ok_s": time.monotonic() - t0, "health": _get(f"{e.url}/health")["status"]}
    try:
        threads = [threading.Thread(target=e.complete, args=(serve.PROMPTS[i % len(serve.PROMPTS)], plan.tokens))
                   for i in range(plan.slots)]
        t1 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["burst_s"] = time.monotonic() - t1
        stages = _get(f"{e.url}/stages")["stages"]
        out["stages"] = [{"rss_mb": _vm(s["pid"], "VmRSS"), "hwm_mb": _vm(s["pid"], "VmHWM"),
                          **{k: s.get(k) for k in ("weight_bytes", "max_context", "kv_dtype", "kv_bytes",
                                                   "kv_page_bytes", "kv_pages_used", "kv_pages_free",
                                                   "kv_pages_touched", "jits_compiled", "jits_cached",
                                                   "jits_pending")}} for s in stages]
    finally:
        e.close()
    return out


def _vm(pid: int, field: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None
