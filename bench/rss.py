"""Section 6 again, on a model whose weights dwarf tinygrad's own idle floor.

On the 27M bench model tinygrad's floor (~137 MiB: import + one kernel) is several times a stage's share of the
weights, so those rows cannot show how a stage's memory scales. Here the "rss" preset (~0.73B parameters, 1.4 GiB
of fp16) is run with a tiny KV cache (MAX_CONTEXT 64): 2 and 4 stages of real workers, one short generation
through the pipeline, then each worker's VmHWM; and one process holding the whole model
(``Transformer.from_gguf(realize=True)`` + 2 tokens, as ``bench.solo`` runs it) for comparison.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import models, pipe, solo


@dataclass(frozen=True)
class RssPlan:
    preset: str = "rss"
    max_context: int = 64  # KV per stage: a few MiB, negligible next to the weights
    tokens: int = 3  # one generation of this many tokens through each pipeline
    prompt_tokens: int = 8
    stages: tuple[int, ...] = (2, 4)


def prepare(plan: RssPlan) -> tuple[Path, dict[str, Any]]:
    """The model (generated once, in a child process so its ~4 GiB of float32 never stays in ours) and what the
    report needs about it: its facts and each stage's (weight bytes, KV bytes) for every stage count."""
    model = models.ensure_model(plan.preset, isolated=True)
    f = models.facts(model)
    shares = {str(n): models.stage_shares(model, n, plan.max_context) for n in plan.stages}
    doc = {"preset": plan.preset, "path": str(model), **dataclasses.asdict(f), "max_context": plan.max_context,
           "kv_whole": f.kv_bytes(f.n_blocks, plan.max_context), "shares": shares}
    return model, doc


def prompt(model: Path, plan: RssPlan) -> str:
    return models.fixed_length_prompts(model, plan.prompt_tokens, 1)[0]


def stage_peaks(model: Path, stages: int, text: str, plan: RssPlan) -> dict[str, Any]:
    """Start ``stages`` real workers, run one ``plan.tokens``-token generation, read each worker's VmHWM."""
    t0 = time.monotonic()
    with pipe.start(model, stages, {"MAX_CONTEXT": str(plan.max_context), "PP_MAX_SESSIONS": "1"}) as p:
        ready = time.monotonic() - t0
        tokens = pipe.run_traced(p, [text], plan.tokens)[1][0]
        return {"ready_s": round(ready, 1), "tokens": len(tokens.times), "peak_rss_mb": pipe.peak_rss(p)}


def one_process(model: Path, text: str, plan: RssPlan) -> dict[str, Any]:
    """tinygrad's own way, in a child: ``from_gguf(realize=True)``, then 2 tokens; its VmHWM."""
    ids = models.tokenizer(model).encode(text)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"warmup": [], "decode": [ids], "ttft": []}, f)
        f.flush()
        res = solo.run_json([str(model), "--prompt-file", f.name, "--decode", "1", "--mode", "realize",
                             "--max-context", str(plan.max_context)])
    return {"load_s": round(res["load_s"], 1), "tokens": len(res["decode_token_times"]),
            "peak_rss_mb": res["peak_rss_mb"]}
