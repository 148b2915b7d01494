"""Section 14 (``moe``): a qwen3moe file on 2 stages against a dense model of the same dims and the same total
parameters, and against llama.cpp's one process on the same file.

The MoE model (``qwen3moe-bench``: 8 blocks, dim 512, 16 experts of 512, top-2) and the dense one
(``qwen3moe-bench-dense``: the same blocks with one feed-forward of 16 x 512) hold the same parameters; a token of
the MoE reads its attention, its router and 2 of the 16 experts of each block, so if only the routed experts' rows
are read it decodes several times faster (target >= 2.5x). Both Q8_0, both 2-stage pipelines, decode in rounds taken
in turn (each round: the MoE pipeline, the dense one, then llama.cpp on the MoE file where ``make peers`` built it),
the ratio taken within each round and the median of the rounds reported (this loaded machine's speed swings).
Beside it, the last stage's decode call of each model timed inside one process (``calls``), rounds in turn: the
same comparison without the driver, the wire and the other stage, so the loaded machine moves it less.

    python -m bench.run --sections moe    # the section alone (its models are generated into bench/models/ once)
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench import gemma3_peer, models, peer, pipe, solo
from bench.quant import decode_rounds, median_ratio, say


@dataclass(frozen=True)
class MoePlan:
    preset: str = "qwen3moe-bench"
    dense: str = "qwen3moe-bench-dense"
    dtype: str = "Q8_0"
    stages: int = 2
    prompt_tokens: int = 16
    decode: int = 32
    rounds: int = 15
    threads: int = 2  # llama.cpp's: the machine's 2 cores
    max_context: int = 1024
    call_rounds: int = 9  # rounds of the in-stage comparison
    calls: int = 24  # decode calls timed per round and model


def active_bytes(path: Any) -> tuple[int, int]:
    """(bytes in the file, bytes a decode token reads: every tensor but the unrouted experts and the embedding,
    whose one row is read)."""
    from pp_worker.worker.gguf.header import read_header

    h = read_header(path)
    arch = h.kv["general.architecture"]
    n, k = h.kv.get(f"{arch}.expert_count", 0), h.kv.get(f"{arch}.expert_used_count", 0)
    total = sum(t.nbytes or 0 for t in h.tensors.values())
    read = sum((t.nbytes or 0) * (k / n if "_exps." in name else 1) for name, t in h.tensors.items()
               if name != "token_embd.weight" or "output.weight" not in h.tensors)
    return total, int(read)


def measure(plan: MoePlan) -> dict[str, Any]:
    moe = models.ensure_model(plan.preset, dtype=plan.dtype, isolated=True)
    dense = models.ensure_model(plan.dense, dtype=plan.dtype, isolated=True)
    facts = {name: models.facts(f) for name, f in (("moe", moe), ("dense", dense))}
    warm, prompt = models.fixed_length_prompts(moe, plan.prompt_tokens, 2)
    ids = models.tokenizer(moe).encode(prompt)
    out: dict[str, Any] = {"model": moe.name, "dense_model": dense.name, "stages": plan.stages,
                           "params": {n: f.params for n, f in facts.items()},
                           "bytes": {n: dict(zip(("file", "read_per_token"), active_bytes(f), strict=True))
                                     for n, f in (("moe", moe), ("dense", dense))}}
    with contextlib.ExitStack() as stack:
        pipes = {name: stack.enter_context(pipe.start(f, plan.stages)) for name, f in (("moe", moe), ("dense", dense))}
        peers: dict[str, solo.Solo] = {}
        if peer.available():
            say(f"llama.cpp ({plan.threads} threads) on the {moe.name} file")
            s = solo.Solo(str(moe), "", plan.max_context, "llama.cpp moe",
                          command=peer.command(moe, plan.threads, plan.max_context))
            stack.callback(s.close)
            peers["moe"] = s
            out["peer_info"] = s.ready.get("system_info")
        out["peers_skipped"] = None if peers else "llama.cpp not built: run make peers"
        for name, p in pipes.items():
            say(f"moe: {name}, {plan.stages} stages, warm-up generation")
            pipe.run_traced(p, [warm], 8)
        if "moe" in peers:
            out["peer_check"] = _peer_check(pipes["moe"], peers["moe"], prompt, ids, plan.decode)
        rounds = decode_rounds(pipes, peers, prompt, ids, plan.rounds, plan.decode, "moe", plan.stages)
        out["rounds"] = rounds
        out["peak_rss_mb"] = {name: pipe.peak_rss(p) for name, p in pipes.items()}
    key = f"pp{plan.stages}"
    out["moe_over_dense"] = median_ratio(rounds, f"{key} moe", f"{key} dense")
    out["moe_over_llama_cpp"] = median_ratio(rounds, f"{key} moe", "llama.cpp moe")
    out["tps"] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} if rounds else {}
    say(f"moe: the last stage's decode call, in one process, {plan.call_rounds} rounds in turn")
    run = subprocess.run([sys.executable, "-m", "bench.moe", "--calls", str(moe), str(dense), str(plan.stages),
                          str(plan.call_rounds), str(plan.calls)], capture_output=True, text=True, check=True,
                         timeout=1800)
    calls = json.loads(run.stdout)
    out["call_ms"] = calls
    out["call_ratio"] = statistics.median(d / m for m, d in zip(calls["moe"], calls["dense"], strict=True))
    if peer.available():  # the other family of issue 34 against llama.cpp on the same generated files
        say("moe: gemma3 against llama.cpp (tokenizer, logits against float64, greedy tokens)")
        out["gemma3_peer"] = gemma3_peer.checks(gemma3_peer.DTYPES)
    return out


def _peer_check(p: Any, s: solo.Solo, prompt: str, ids: list[int], n: int) -> dict[str, Any]:
    """Tokens against llama.cpp's on the same file: the prompt's ids by each tokenizer, and the greedy tokens of
    each (how many agree before the first divergence: fp16 activations against llama.cpp's own rounding may swap a
    close pick, after which the texts differ)."""
    stats, _ = pipe.run_traced(p, [prompt], n + 1)
    ours = stats.generations[0].tokens
    s.decode_times(ids, n)
    theirs = s.last_tokens or []
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return {"prompt_ids_equal": s.tokenize(prompt) == ids, "tokens": len(ours), "agree_before_divergence": agree}


def stage_calls(moe: str, dense: str, num_stages: int, rounds: int, calls: int) -> dict[str, list[float]]:
    """The last stage of each model in this process; per round and model, the median of ``calls`` decode calls
    (one session, positions from 0), in ms."""
    import numpy as np

    from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

    engines = {name: TinygradEngine(path, num_stages - 1, num_stages, max_context=256, max_sessions=1)
               for name, path in (("moe", moe), ("dense", dense))}
    for e in engines.values():
        e.warmup(full=False)
    hidden = np.random.default_rng(0).standard_normal(engines["moe"].info.hidden_dim).astype(np.float16).tobytes()
    out: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, e in engines.items():
            times = []
            for pos in range(calls):
                t0 = time.perf_counter()
                e.forward_logits(7, hidden, pos, 1)
                times.append(time.perf_counter() - t0)
            e.release(7)
            out[name].append(round(statistics.median(times) * 1000, 4))
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--calls"]:
        print(json.dumps(stage_calls(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))))
    else:
        print(json.dumps(measure(MoePlan()), indent=1))
